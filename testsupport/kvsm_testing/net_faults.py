"""Network-fault scenarios on a two-host pair (``kvsm_testing.two_host_pair``),
the same for kvsm and upstream ``NixlConnector``: each injects a fault on the
KV network while requests flow through the router, heals it, and returns
what every request saw (seconds, right or wrong, error).

"Right" means equal to the prefill server's own answer for the same prompt
(a single engine, asked directly over its client link). The decode engine
runs ``kv_load_failure_policy: recompute``, so a request whose transfer fails
is computed again locally and must still be right.

Timing is the same for both connectors: the fault is applied at fixed moments
relative to the requests, never on a connector's own log, so the two runs
are comparable. A test that must hit one state of a kvsm request passes
``in_flight`` to :func:`run_scenario` (a read under a granted claim, seen in
kvsm's event log): the fault then waits for that state instead of a fixed
moment. Tests read kvsm's event logs afterwards for the rest.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsm_testing.netns import TwoHosts
from kvsm_testing.two_host_pair import TwoHostPair

__all__ = ["SCENARIOS", "Outcome", "ScenarioResult", "run_scenario"]


@dataclass
class Outcome:
    rid: str
    phase: str  # "fault" (sent while the fault was on) | "heal" (after it) | "before"
    seconds: float
    right: bool
    error: str = ""


@dataclass
class ScenarioResult:
    name: str
    connector: str
    outcomes: list[Outcome] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def of(self, phase: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.phase == phase]

    def line(self) -> str:
        parts = [f"{self.name} [{self.connector}]"]
        for phase in ("before", "fault", "heal"):
            outs = self.of(phase)
            if outs:
                secs = ", ".join(f"{o.seconds:.2f}" for o in outs)
                wrong = sum(not o.right for o in outs)
                parts.append(f"{phase}: {secs} s" + (f" ({wrong} wrong)" if wrong else ""))
        return "; ".join(parts)


class _Run:
    """Requests through the router with their reference answers."""

    def __init__(self, pair: TwoHostPair, result: ScenarioResult, seed: int,
                 in_flight: Callable[[str], bool] | None = None) -> None:
        self.pair = pair
        self.result = result
        self.in_flight = in_flight
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def prompt(self, n: int = 300) -> list[int]:
        with self.lock:
            return [self.rng.randrange(10, 1100) for _ in range(n)]

    def reference(self, prompt: list[int], max_tokens: int) -> str:
        body = {"model": self.pair.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        return str(self.pair.prefill.post("/v1/completions", body, timeout=120)["choices"][0]["text"])

    def one(self, phase: str, *, n: int = 300, max_tokens: int = 8, rid: str = "") -> Outcome:
        prompt = self.prompt(n)
        rid = rid or f"{self.result.name}-{phase}-{uuid.uuid4().hex[:8]}"
        seconds, out = self.pair.complete(prompt, max_tokens, rid=rid)
        if "choices" in out:
            right = out["choices"][0]["text"] == self.reference(prompt, max_tokens)
            outcome = Outcome(rid, phase, seconds, right)
        else:
            outcome = Outcome(rid, phase, seconds, False, str(out.get("error", out))[:300])
        with self.lock:
            self.result.outcomes.append(outcome)
        return outcome

    def victim(self, n: int = 400) -> threading.Thread:
        """The request the fault is aimed at, in the background (its rid in
        ``extra["victim"]``)."""
        rid = f"{self.result.name}-fault-victim-{uuid.uuid4().hex[:8]}"
        self.result.extra["victim"] = rid
        return self.background("fault", n=n, rid=rid)

    def victim_in_flight(self, fixed_s: float, timeout_s: float = 10.0) -> None:
        """Return once the victim's read is in flight: when ``in_flight`` says so
        (polled), else after ``fixed_s`` (the comparable fixed moment)."""
        if self.in_flight is None:
            time.sleep(fixed_s)
            return
        rid = self.result.extra["victim"]
        deadline = time.monotonic() + timeout_s
        while not self.in_flight(rid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.result.name}: the victim {rid}'s read was not in flight "
                                   f"within {timeout_s} s")
            time.sleep(0.02)

    def background(self, phase: str, **kw: Any) -> threading.Thread:
        thread = threading.Thread(target=self.one, args=(phase,), kwargs=kw, daemon=True)
        thread.start()
        return thread

    def after_heal(self, count: int = 3, *, settle_s: float = 0.0) -> None:
        """Requests after the heal: the first may still fail fast (back-off), the
        last ``count`` are judged (``phase`` heal)."""
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            self.one("settle")
            time.sleep(0.5)
        for _ in range(count):
            self.one("heal")


def _clients(run: _Run, count: int, *, until: float, pause_s: float) -> list[threading.Thread]:
    """Start ``count`` clients, each sending requests one after another
    (``pause_s`` apart) until the monotonic moment ``until``; returns their threads."""
    def client() -> None:
        while time.monotonic() < until:
            run.one("fault")
            time.sleep(pause_s)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def _paced(run: _Run, *, until: float, every_s: float) -> list[threading.Thread]:
    """One request every ``every_s`` until ``until``, each in its own thread
    (a request that hangs does not hold back the next, nor the heal)."""
    threads = []
    while time.monotonic() + every_s < until:
        time.sleep(every_s)
        threads.append(run.background("fault"))
    return threads


def _heal_at(hosts: TwoHosts, until: float, threads: list[threading.Thread]) -> None:
    """Heal at ``until`` whatever the requests are doing (the fault lasts as long
    for both connectors), then wait for the requests sent during it."""
    time.sleep(max(0.0, until - time.monotonic()))
    hosts.heal()
    for t in threads:
        t.join(180)


def partition_during_handshake(hosts: TwoHosts, run: _Run) -> None:
    """A fresh peer (no request went to it yet): the KV network partitioned
    both ways before the first request, for 12 s, while two clients each send
    a request, wait for its answer and 0.5 s, and send the next."""
    hosts.partition()
    t0 = time.monotonic()
    threads = _clients(run, 2, until=t0 + 12.0, pause_s=0.5)
    _heal_at(hosts, t0 + 12.0, threads)
    run.after_heal(settle_s=6.0)


def partition_during_reads(hosts: TwoHosts, run: _Run) -> None:
    """The KV link capped at 2 Mbit/s so that a 400-token prompt's read takes
    about 2 s; the link partitioned while that request's read is in flight
    under a granted claim (``in_flight``; without it, 1 s after the request was
    sent), for 12 s, with a new request every 2 s meanwhile.

    Why wait for the grant: with early reads the claim's answer crosses the
    capped link behind the read's own data, where ``tbf`` may drop it and TCP
    resends it after 200 ms or more; a partition before the answer arrives
    tests the claim's deadline, not the stalled-read probe this scenario is
    about. The read itself runs on for about another second."""
    hosts.rate_limit("2mbit")
    run.one("before", n=400)  # the peer's agent known, the connection up
    victim = run.victim()
    run.victim_in_flight(fixed_s=1.0)
    hosts.partition()
    t0 = time.monotonic()
    threads = _paced(run, until=t0 + 12.0, every_s=2.0)
    _heal_at(hosts, t0 + 12.0, [victim, *threads])
    run.after_heal(settle_s=6.0)


def partition_after_reads(hosts: TwoHosts, run: _Run) -> None:
    """Between a read and its release notification: a read of about 1 s (a
    256-token prompt, 2 blocks, over a 2 Mbit/s cap); 0.5 s into it, whatever
    the decode host *says* on the KV link is dropped (its bare TCP
    acknowledgements pass, so the read goes on to the end, but its NIXL
    notification is lost); 3 s in, the link is partitioned both ways until
    12 s; a request every 2 s from then.

    Why 2 blocks: kvsm's stalled-read probe (``stall_timeout`` 2 s in the
    two-host tests) goes out from 0.5 s into a read, and once the decode host's
    words are dropped its answer cannot come, so the peer is found dead 2.5 s
    into the read at the earliest. A 4-block read took 2.4-2.5 s here and was
    sometimes failed by the probe first (then recomputed, right): the scenario
    is about the lost notification, which needs the read to finish."""
    hosts.rate_limit("2mbit")
    run.one("before", n=400)
    victim = run.victim(n=256)
    time.sleep(0.5)
    hosts.drop_data("decode")
    t0 = time.monotonic()
    time.sleep(2.5)
    hosts.partition()
    threads = _paced(run, until=t0 + 12.0, every_s=2.0)
    _heal_at(hosts, t0 + 12.0, [victim, *threads])
    run.after_heal(settle_s=6.0)


def _one_direction(frm: str) -> Callable[[TwoHosts, _Run], None]:
    def scenario(hosts: TwoHosts, run: _Run) -> None:
        run.one("before")  # the peer known
        hosts.drop(frm)
        t0 = time.monotonic()
        threads = [run.background("fault"), *_paced(run, until=t0 + 10.0, every_s=1.5)]
        _heal_at(hosts, t0 + 10.0, threads)
        run.after_heal(settle_s=6.0)

    scenario.__doc__ = (f"Every KV-network packet from the {frm} host dropped for 10 s (one direction lost), "
                        "a request every 1.5 s.")
    return scenario


def link_flapping(hosts: TwoHosts, run: _Run) -> None:
    """The KV link's carrier down 1 s, up 1 s, for 12 s, while two clients send
    requests back to back."""
    run.one("before")
    t0 = time.monotonic()
    threads = _clients(run, 2, until=t0 + 12.0, pause_s=0.0)
    slowest = 0.0  # a change waits for the kernel's rtnl lock: kept, to show a starved machine
    while time.monotonic() - t0 < 12.0:
        for up in (False, True):
            t = time.monotonic()
            hosts.link(up)
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(1.0)
    run.result.extra["slowest_link_change_s"] = round(slowest, 3)
    _heal_at(hosts, t0 + 12.0, threads)
    run.after_heal(settle_s=6.0)


# Each connector's transfer metrics on the decode server's /metrics: time (a
# histogram's sum and count) and bytes.
_TRANSFER_METRICS = {
    "KVSMConnector": ("vllm:kvsm_transfer_time_seconds", "vllm:kvsm_transfer_bytes_total"),
    "NixlConnector": ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred_sum"),
}


def _transfer_totals(run: _Run) -> tuple[float, float, float]:
    """(seconds, transfers, bytes) the decode server's connector has counted so far."""
    from kvsm_testing.reliability import metric

    time_name, bytes_name = _TRANSFER_METRICS[run.result.connector]
    text = run.pair.decode.metrics()
    return metric(text, time_name + "_sum"), metric(text, time_name + "_count"), metric(text, bytes_name)


def _transfer_figures(run: _Run, phase: str, before: tuple[float, float, float]) -> None:
    after = _transfer_totals(run)
    secs, count, num_bytes = (a - b for a, b in zip(after, before))
    outs = run.result.of(phase)
    run.result.extra[phase] = {
        "transfers": count, "transfer_ms_mean": 1000 * secs / count if count else None,
        "transfer_MiB_s": num_bytes / secs / 2 ** 20 if secs else None,
        "ttft_ms_median": 1000 * sorted(o.seconds for o in outs)[len(outs) // 2] if outs else None,
    }


def bandwidth_cap(hosts: TwoHosts, run: _Run) -> None:
    """The KV link capped at 50 Mbit/s (``tbf``): eight 1-token requests of 400
    tokens, two at a time, after four uncapped ones; a 1-token request's
    latency through the router is its TTFT. Transfer time and throughput come
    from the connector's own metrics (kvsm's and upstream's histograms)."""
    totals = _transfer_totals(run)
    for _ in range(4):
        run.one("before", n=400, max_tokens=1)
    _transfer_figures(run, "before", totals)
    hosts.rate_limit("50mbit")
    totals = _transfer_totals(run)
    for _ in range(4):
        pair = [run.background("fault", n=400, max_tokens=1) for _ in range(2)]
        for t in pair:
            t.join(120)
    _transfer_figures(run, "fault", totals)
    hosts.heal()
    run.after_heal(1)


SCENARIOS: dict[str, Callable[[TwoHosts, _Run], None]] = {
    "partition_during_handshake": partition_during_handshake,
    "partition_during_reads": partition_during_reads,
    "partition_after_reads": partition_after_reads,
    "drop_decode_to_prefill": _one_direction("decode"),
    "drop_prefill_to_decode": _one_direction("prefill"),
    "link_flapping": link_flapping,
    "bandwidth_cap": bandwidth_cap,
}


def run_scenario(name: str, hosts: TwoHosts, pair: TwoHostPair, connector: str, *, seed: int = 0,
                 in_flight: Callable[[str], bool] | None = None) -> ScenarioResult:
    """Run one scenario of ``SCENARIOS`` on a started pair; the fault is always
    healed on the way out. ``in_flight(rid)``: whether that request's read is in
    flight under a granted claim (a scenario aimed at such a read waits for it)."""
    result = ScenarioResult(name, connector)
    try:
        SCENARIOS[name](hosts, _Run(pair, result, seed, in_flight))
    finally:
        hosts.heal()
    return result
