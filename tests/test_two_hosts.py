"""Two hosts over a real network: the prefill server and the decode server in
network namespaces of their own, joined by veth links, the router beside the
decode server, UCX forced onto TCP over the KV link (``kvsm_testing.netns``,
``kvsm_testing.two_host_pair``), and the network faults of
``kvsm_testing.net_faults`` injected on that link while requests flow.

kvsm's goals, asserted here for each fault: every request is answered right
(the decode engine recomputes what it could not load) within 6 s (at most one
handshake timeout of 5 s, then fast failures while the peer is unreachable; a
read stalled by a partition is detected by a liveness probe, its blocks
quiesced and the request failed and recomputed); after the heal the peer is
used again (the requests' KV comes by transfer); nothing is left pinned on the
prefill side (the leases free what the decode side could not release) or
held on the decode side; the event logs replay clean and name each failure's
cause. Push mode (the prefill worker writes into the decode engine's blocks)
meets a partition mid-write too: the decode engine's blocks come back at the
writes' deadline, the prefill's pin then too, and pushes land after the heal.
Upstream ``NixlConnector`` runs the same scenarios on its own pair in ``python
tools/net_faults.py`` (the comparison is a benchmark, not a CI test).

Where network namespaces cannot be created the module is skipped with the
reason (failed instead when ``KVSM_REQUIRE_ALL``/``CI`` is set: CI runs it).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require, require_netns

require("vllm")
require("nixl")

from kvsm.replay import analyse
from kvsm_testing import build_tiny_model
from kvsm_testing.net_faults import ScenarioResult, run_scenario
from kvsm_testing.netns import TwoHosts
from kvsm_testing.reliability import live_kvsm_requests, metric, read_records, wait_until
from kvsm_testing.two_host_pair import TwoHostPair, read_transports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_netns()

GOAL_S = 6.0
LEASE_S = 10.0
# A back-off of 2 s: the handshake scenario's clients send their next request
# about 1 s after the first handshake timeout (the recompute, then 0.5 s), which a
# 1 s back-off made a race on a slower machine (the peer probed again instead of
# failing fast).
# transfer_timeout 6 s: a push whose writes a partition cut off is given back at
# its deadline (that plus 0.5 s) rather than after the default 30 s; the reads
# here take 3 s at most (2 s of 400 tokens at 2 Mbit/s), and a stalled read is
# caught by the 2 s liveness probe well before.
TRANSFER_TIMEOUT_S = 6.0
KVSM_CONFIG = {"kv_lease_duration": LEASE_S, "handshake_timeout": 5, "stall_timeout": 2,
               "peer_backoff": 2, "peer_backoff_max": 4, "transfer_timeout": TRANSFER_TIMEOUT_S}


class Bed:
    def __init__(self, hosts: TwoHosts, pair: TwoHostPair) -> None:
        self.hosts = hosts
        self.pair = pair
        self.results: list[ScenarioResult] = []

    def records(self, role: str) -> list[dict[str, Any]]:
        return read_records(sorted(self.pair.logs.glob(f"{role}.*.jsonl")))

    def ended_recv(self, rid: str) -> list[dict[str, Any]]:
        """``recv_of(rid)`` once that machine has ended (done or failed; 10 s at most)."""
        return wait_until(lambda: (r := self.recv_of(rid)) and _final(r) in ("done", "failed") and r,
                          10, f"the decode log's machine of {rid}")

    def recv_of(self, rid: str) -> list[dict[str, Any]]:
        """The decode worker's recv-machine records of the request the router sent as ``rid``."""
        return [r for r in self.records("decode.worker")
                if r.get("lifecycle") == "recv" and rid in (r.get("req") or "")]


def _bed(tmp: Path, connector: str, extra: dict[str, Any] | None) -> Iterator[Bed]:
    model = str(build_tiny_model())
    hosts = TwoHosts()
    try:
        pair = TwoHostPair(hosts, model, tmp, connector=connector, extra_config=extra)
        try:
            pair.start()
            yield Bed(hosts, pair)
        finally:
            pair.close()
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def kvsm_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    yield from _bed(tmp_path_factory.mktemp("kvsm2h"), "KVSMConnector", KVSM_CONFIG)


def _read_under_grant(bed: Bed) -> Callable[[str], bool]:
    """``in_flight`` for :func:`run_scenario`: whether the request the router sent
    as ``rid`` has its reads in flight under a granted claim (``transferring``)."""
    return lambda rid: any(r.get("dst") == "transferring" for r in bed.recv_of(rid))


def _final(recs: list[dict[str, Any]]) -> str | None:
    states = [r.get("dst") for r in recs if r.get("kind") in ("create", "transition")]
    return states[-1] if states else None


def _check_common(bed: Bed, result: ScenarioResult) -> None:
    print(result.line())
    bed.results.append(result)
    wrong = [o for o in result.outcomes if not o.right]
    assert not wrong, [(o.rid, o.phase, round(o.seconds, 2), o.error) for o in wrong]
    slow = [(o.rid, round(o.seconds, 2)) for o in result.outcomes if o.seconds > GOAL_S]
    assert not slow, f"requests over {GOAL_S} s: {slow}"
    heal = result.of("heal")
    assert heal, "no request after the heal"
    # The peer is used again after the heal: every judged request's KV came by transfer.
    for o in heal:
        recs = bed.ended_recv(o.rid)
        assert _final(recs) == "done" and any(r.get("event") == "all_reads_done" for r in recs), \
            (o.rid, [(r.get("event"), r.get("dst"), r.get("input")) for r in recs])


def _failed_with(bed: Bed, result: ScenarioResult) -> dict[str, list[dict[str, Any]]]:
    """The fault-phase requests whose transfer failed (recomputed), by rid."""
    out = {}
    for o in result.of("fault"):
        recs = bed.recv_of(o.rid)
        if _final(recs) == "failed":
            out[o.rid] = recs
    return out


def test_a_partition_during_the_first_handshake(kvsm_bed: Bed) -> None:
    """Partitioned before the first request to the prefill peer: the first waits
    one handshake timeout, the next fail fast while the peer is known dead, each
    is recomputed right; after the heal the peer is used again."""
    # The module's first test: no request reached the prefill peer before.
    result = run_scenario("partition_during_handshake", kvsm_bed.hosts, kvsm_bed.pair, "KVSMConnector", seed=2)
    _check_common(kvsm_bed, result)
    failed = _failed_with(kvsm_bed, result)
    assert failed, "no request was failed by the partition"
    fast = [o.seconds for o in result.of("fault") if o.rid in failed and o.seconds < 1.5]
    assert fast, f"no request failed fast during the partition: {[o.seconds for o in result.of('fault')]}"
    # The first requests wait out the handshake timeout; the later ones fail at once as
    # the peer is known dead: both causes are in the logs.
    causes = {e.get("event") for recs in failed.values() for e in recs}
    assert {"peer_dead", "timeout"} <= causes, causes


def test_the_reads_cross_the_kv_link_over_tcp(kvsm_bed: Bed) -> None:
    """A healthy pair: outputs right, prompt KV by transfer, and UCX's own
    protocol table shows the reads carried by tcp on the KV link, nothing else."""
    result = run_scenario("bandwidth_cap", kvsm_bed.hosts, kvsm_bed.pair, "KVSMConnector", seed=1)
    _check_common(kvsm_bed, result)
    for o in result.of("before") + result.of("fault"):
        assert _final(kvsm_bed.recv_of(o.rid)) == "done", o.rid
    transports = read_transports(kvsm_bed.pair.decode.tail(10 ** 9))
    assert transports == {"tcp/kv0"}, transports
    # A capped link only slows the reads: the capped requests took longer, none failed.
    before = sorted(o.seconds for o in result.of("before"))
    capped = sorted(o.seconds for o in result.of("fault"))
    assert capped[len(capped) // 2] > before[len(before) // 2], (before, capped)
    # kvsm's own metrics count each read, and the capped ones took longer.
    figures = result.extra
    assert figures["before"]["transfers"] == 4 and figures["fault"]["transfers"] == 8, figures
    assert figures["fault"]["transfer_ms_mean"] > figures["before"]["transfer_ms_mean"], figures


def test_a_partition_while_a_read_is_in_flight(kvsm_bed: Bed) -> None:
    """The partition comes once the victim's claim is granted and its read is in
    flight: the read stalls, the liveness probe goes unanswered for
    ``stall_timeout``, the peer is marked dead, its agent dropped (the read
    settles: it can no longer write), the request fails and is recomputed
    right, within the goal."""
    result = run_scenario("partition_during_reads", kvsm_bed.hosts, kvsm_bed.pair, "KVSMConnector", seed=3,
                          in_flight=_read_under_grant(kvsm_bed))
    _check_common(kvsm_bed, result)
    victim = next(o for o in result.of("fault") if o.rid == result.extra["victim"])
    recs = kvsm_bed.recv_of(victim.rid)
    moves = [(r.get("event"), r.get("src"), r.get("dst")) for r in recs]
    assert _final(recs) == "failed" and any(r.get("event") == "reads_quiesced" for r in recs), moves
    assert any(r.get("event") == "peer_dead" and r.get("src") == "transferring" for r in recs), moves
    deaths = [r for r in kvsm_bed.records("decode.worker")  # (the peer's deaths since the victim came)
              if r.get("lifecycle") == "peer" and r.get("event") == "died" and r.get("dst") == "dead"
              and r["t_mono_ns"] >= recs[0]["t_mono_ns"]]
    assert any("stalled" in str((r.get("input") or {}).get("why")) for r in deaths), \
        f"the peer was not found dead by the stalled-read probe: {deaths}"


# -m extended: the scenario needs its 2-block read (about 1 s) to finish before the
# stalled-read probe can find the peer dead (2.5 s in). On CI's slower machines the
# read took over 2.5 s twice in three runs (the probe then failed it, and the request
# was recomputed right): the lost notification never happened. The lease freeing the
# blocks after a lost notification runs in CI on virtual time
# (tests/test_stall_probe_virtual.py loses the notification outright).
@pytest.mark.extended
def test_a_partition_between_the_read_and_its_notification(kvsm_bed: Bed) -> None:
    """What the decode host says is dropped from the middle of a read (its bare
    acknowledgements pass: the read goes on to the end), then the link is
    partitioned: the request is served by its transfer, and its notification
    never arrives; the prefill worker frees the blocks when the lease ends."""
    result = run_scenario("partition_after_reads", kvsm_bed.hosts, kvsm_bed.pair, "KVSMConnector", seed=7)
    _check_common(kvsm_bed, result)
    victim = next(o for o in result.of("fault") if o.rid == result.extra["victim"])
    recs = kvsm_bed.recv_of(victim.rid)
    assert _final(recs) == "done" and any(r.get("event") == "all_reads_done" for r in recs), \
        [(r.get("event"), r.get("dst")) for r in recs]
    sent = [r for r in kvsm_bed.records("prefill.worker")
            if r.get("lifecycle") == "send" and victim.rid in (r.get("req") or "")]
    events = [(r.get("event"), r.get("dst")) for r in sent if r.get("kind") in ("create", "transition", "violation")]
    # Freed by the lease; the notification, held back by TCP until the heal, comes
    # after it (recorded as a read after the lease: the prefill side cannot tell a
    # late notification from a late read). The read itself completed in the lease.
    expired = next(r for r in sent if r.get("event") == "lease_expired")
    assert _final(sent) == "expired" and all(e != "read_notif" or d == "expired" for e, d in events), events
    done = next(r for r in recs if r.get("event") == "all_reads_done")
    assert done["t_wall_ns"] < expired["t_wall_ns"], (done, expired)
    result.extra["late_notif_req"] = expired["req"]


@pytest.mark.parametrize("frm", ["decode", "prefill"])
def test_one_direction_dropped(kvsm_bed: Bed, frm: str) -> None:
    """Every packet from one host lost: claims (or their answers) time out once,
    later requests fail fast, all are recomputed right; the peer is used again."""
    result = run_scenario(f"drop_{frm}_to_{'prefill' if frm == 'decode' else 'decode'}", kvsm_bed.hosts,
                          kvsm_bed.pair, "KVSMConnector", seed=4 if frm == "decode" else 5)
    _check_common(kvsm_bed, result)
    assert _failed_with(kvsm_bed, result), "no request was failed by the lost direction"


def test_a_flapping_link(kvsm_bed: Bed) -> None:
    """The link's carrier goes down and up every second while two clients send:
    every answer right and within the goal, the peer used again afterwards."""
    result = run_scenario("link_flapping", kvsm_bed.hosts, kvsm_bed.pair, "KVSMConnector", seed=6)
    _check_common(kvsm_bed, result)
    assert len(result.of("fault")) >= 4, result.line()


class _Push:
    """Requests in push mode straight to the two servers: the prefill leg with
    ``transfer_mode: push`` (the key a router sets on it; kvsm's router sends
    pull), the decode leg with the params it answered."""

    def __init__(self, bed: Bed, seed: int) -> None:
        self.bed = bed
        self.rng = random.Random(seed)

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 1100) for _ in range(n)]

    def body(self, prompt: list[int], max_tokens: int, kv: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"model": self.bed.pair.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, **({"kv_transfer_params": kv} if kv is not None else {})}

    def reference(self, prompt: list[int]) -> str:
        return str(self.bed.pair.prefill.post("/v1/completions", self.body(prompt, 8))["choices"][0]["text"])

    def prefill_leg(self, prompt: list[int], rid: str) -> dict[str, Any]:
        out = self.bed.pair.prefill.post("/v1/completions",
                                         self.body(prompt, 1, {"do_remote_decode": True, "transfer_mode": "push"}),
                                         headers={"X-Request-Id": f"{rid}-p"})
        kv: dict[str, Any] = out["kv_transfer_params"]
        assert kv["transfer_mode"] == "push", kv
        kv.pop("remote_prefill_cached_tokens", None)
        return kv

    def decode_leg(self, prompt: list[int], kv: dict[str, Any], rid: str) -> str:
        out = self.bed.pair.decode.post("/v1/completions", self.body(prompt, 8, kv), timeout=60,
                                        headers={"X-Request-Id": rid})
        return str(out["choices"][0]["text"])

    def send_of(self, rid: str) -> list[dict[str, Any]]:
        """The prefill worker's send-machine records of the prefill leg sent as ``rid``."""
        return [r for r in self.bed.records("prefill.worker")
                if r.get("lifecycle") == "send" and f"{rid}-p" in (r.get("req") or "")]

    def landed(self, rid: str) -> None:
        """``rid``'s KV was written by the prefill worker: its machine ends done by writes_landed."""
        recs = self.bed.ended_recv(rid)
        events = [r.get("event") for r in recs if r.get("kind") == "transition"]
        assert _final(recs) == "done" and "writes_landed" in events and "reads_posted" not in events, events


def _lands_after_the_heal(push: _Push, victim: str, send: Callable[[list[int], str], str | None]) -> None:
    """After the heal, a write lands again (``send``: one pair, its answer), and
    nothing of ``victim``'s writes, cut off by the partition, lands afterwards:
    its notification (``landed``) would say so. UCX sends what it queued for a
    connection once the connection is back: that landed 10 s after the decode
    engine had given the blocks back, before the prefill worker dropped the
    decode's agent at the deadline (its ``cancelled`` word may still come late:
    a word, not bytes). Allowed: the dead peer's back-off (4 s at most), a probe, and an
    attempt cut off meanwhile waiting out its deadline (6.5 s); each failed
    attempt is named if none lands."""
    tries: list[tuple[str, Any]] = []

    def again() -> str | None:
        prompt = push.prompt(128)
        rid = f"{victim.split('-')[0]}-heal-{uuid.uuid4().hex[:8]}"
        if send(prompt, rid) != push.reference(prompt):
            raise AssertionError(f"{rid} answered wrong")
        recs = push.bed.ended_recv(rid)
        if _final(recs) == "done":
            return rid
        tries.append((rid, [(r.get("event"), r.get("dst"), r.get("input")) for r in recs][-2:]))
        return None

    try:
        rid = wait_until(again, 45, "a write landing after the heal", interval=1.0)
    except AssertionError as e:
        raise AssertionError(f"{e}; the attempts: {tries}") from None
    push.landed(rid)
    late = [r for r in push.bed.records("decode.worker")
            if r.get("event") == "worker.write_notif_unmatched" and victim in (r.get("req") or "")
            and r.get("how") == "landed"]
    assert not late, f"a write of {victim} landed after the heal: {late}"


def _blocks_back_at_the_deadline(bed: Bed, rid: str) -> None:
    """``rid``'s decode request failed by writes_stopped at the writes' deadline
    (transfer timeout + 0.5 s after the ask): not before (a write may land until
    then), and promptly at it."""
    recs = bed.recv_of(rid)
    moves = [(r.get("event"), r.get("dst")) for r in recs if r.get("kind") == "transition"]
    assert _final(recs) == "failed" and ("writes_stopped", "failed") in moves, moves
    asked = next(r for r in recs if r.get("event") == "writes_asked")
    stopped = next(r for r in recs if r.get("event") == "writes_stopped")
    held_s = (stopped["t_mono_ns"] - asked["t_mono_ns"]) / 1e9
    assert TRANSFER_TIMEOUT_S + 0.5 - 0.05 <= held_s <= TRANSFER_TIMEOUT_S + 2.0, held_s


def test_a_partition_while_the_prefill_writes(kvsm_bed: Bed) -> None:
    """Push mode across the KV link, capped so that a 400-token prompt's write
    takes about 1.6 s, partitioned once the prefill worker is writing. The
    decode engine gets its blocks back at the writes' deadline (transfer
    timeout + 0.5 s after the ask), not before, having dropped the writer's
    agent, and recomputes the request right; the prefill worker frees its pin
    at that deadline too (its write cancelled in flight), not at its lease's
    end; after the heal a push lands again."""
    bed, hosts = kvsm_bed, kvsm_bed.hosts
    push = _Push(bed, seed=33)
    hosts.rate_limit("2mbit")
    try:
        warm = push.prompt(128)
        rid = f"push-before-{uuid.uuid4().hex[:8]}"
        assert push.decode_leg(warm, push.prefill_leg(warm, rid), rid) == push.reference(warm)
        push.landed(rid)

        victim = push.prompt(400)
        vrid = f"push-victim-{uuid.uuid4().hex[:8]}"
        reference = push.reference(victim)
        kv = push.prefill_leg(victim, vrid)
        answer: dict[str, str] = {}
        thread = threading.Thread(target=lambda: answer.update(text=push.decode_leg(victim, kv, vrid)), daemon=True)
        thread.start()
        wait_until(lambda: any(r.get("dst") == "writing" for r in push.send_of(vrid)), 10,
                   f"the prefill worker writing {vrid}")
        hosts.partition()
        thread.join(TRANSFER_TIMEOUT_S + 30)
        assert answer.get("text") == reference, "the victim was not answered right (recomputed)"
    finally:
        hosts.heal()

    _blocks_back_at_the_deadline(bed, vrid)
    sent = push.send_of(vrid)
    ended = [r for r in sent if r.get("kind") == "transition" and r.get("dst") == "released"]
    assert ended and ended[-1]["event"] == "write_done", [(r.get("event"), r.get("dst")) for r in sent]
    write_asked = next(r for r in sent if r.get("event") == "write_asked")
    freed_s = (ended[-1]["t_wall_ns"] - write_asked["t_wall_ns"]) / 1e9
    assert freed_s <= TRANSFER_TIMEOUT_S + 2.0 < LEASE_S, freed_s

    _lands_after_the_heal(push, vrid, lambda prompt, rid: push.decode_leg(prompt, push.prefill_leg(prompt, rid), rid))


class _Stream(_Push):
    """Streamed pairs straight to the two servers, as kvsm's router sends them: both
    legs at once with a join key, the decode leg carrying the prefill server's
    side channel (learned from a push answer, as the router learns it)."""

    def __init__(self, bed: Bed, seed: int) -> None:
        super().__init__(bed, seed)
        warm = self.prompt(64)
        rid = f"stream-learn-{uuid.uuid4().hex[:8]}"
        kv = self.prefill_leg(warm, rid)
        assert self.decode_leg(warm, kv, rid) == self.reference(warm)
        self.coordinates = {k: kv[k] for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size",
                                               "dcp_size", "pp_size", "kvsm_protocol", "remote_block_size")}

    def pair(self, prompt: list[int], rid: str) -> tuple[threading.Thread, dict[str, str]]:
        """Both legs of ``prompt`` sent now (threads); the decode's answer lands in the dict."""
        key = f"kvsm-stream-{uuid.uuid4().hex}"
        answer: dict[str, str] = {}
        decode_kv = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "stream",
                     "kvsm_stream": key, "remote_request_id": key, "remote_block_ids": [[]], **self.coordinates}
        prefill_kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "stream",
                      "kvsm_stream": key}

        def decode() -> None:
            answer["text"] = self.decode_leg(prompt, decode_kv, rid)

        def prefill() -> None:
            self.bed.pair.prefill.post("/v1/completions", self.body(prompt, 1, prefill_kv), timeout=60,
                                       headers={"X-Request-Id": f"{rid}-p"})

        threads = [threading.Thread(target=fn, daemon=True) for fn in (decode, prefill)]
        for t in threads:
            t.start()
        return threads[0], answer


def test_a_partition_mid_stream(kvsm_bed: Bed) -> None:
    """Streamed push across the KV link (capped, as above), partitioned once the
    prefill worker streams the request's layers into the decode engine's blocks.
    The decode engine gets its blocks back at the writes' deadline (transfer timeout
    + 0.5 s after the ask), not before, and recomputes the request right; the
    prefill worker stops writing at that deadline and frees its blocks then, not at
    its lease's end; after the heal a streamed pair lands again."""
    bed, hosts = kvsm_bed, kvsm_bed.hosts
    stream = _Stream(bed, seed=44)
    hosts.rate_limit("2mbit")
    try:
        victim = stream.prompt(400)
        vrid = f"stream-victim-{uuid.uuid4().hex[:8]}"
        reference = stream.reference(victim)
        thread, answer = stream.pair(victim, vrid)
        wait_until(lambda: any(r.get("event") == "stream_asked" for r in stream.send_of(vrid)), 10,
                   f"the prefill worker streaming {vrid}")
        hosts.partition()
        thread.join(TRANSFER_TIMEOUT_S + 30)
        assert answer.get("text") == reference, "the victim was not answered right (recomputed)"
    finally:
        hosts.heal()

    _blocks_back_at_the_deadline(bed, vrid)
    sent = wait_until(lambda: (lambda rs: rs if any(r.get("dst") == "released" for r in rs) else None)(
        stream.send_of(vrid)), 10, f"{vrid} released on the prefill side")
    ended = [r for r in sent if r.get("kind") == "transition" and r.get("dst") == "released"]
    done = [r for r in sent if r.get("event") == "write_done"]
    assert done and done[0]["input"]["ok"] is False, [(r.get("event"), r.get("dst")) for r in sent]
    stream_asked = next(r for r in sent if r.get("event") == "stream_asked")
    freed_s = (ended[-1]["t_wall_ns"] - stream_asked["t_wall_ns"]) / 1e9
    assert freed_s <= TRANSFER_TIMEOUT_S + 2.0 < LEASE_S, freed_s

    def streamed(prompt: list[int], rid: str) -> str | None:
        thread, answer = stream.pair(prompt, rid)
        thread.join(60)
        return answer.get("text")

    _lands_after_the_heal(stream, vrid, streamed)


def test_nothing_is_left_held_and_the_logs_replay_clean(kvsm_bed: Bed) -> None:
    """After every scenario (runs last): once a lease has passed, no request is
    live on either side (the prefill worker freed every block the decode side
    could not release, at the latest when its lease ran out), and after a clean
    stop both engines' logs are gap-free, replay clean, and name the cause of
    every failed request."""
    bed = kvsm_bed
    assert len(bed.results) >= 6, "run the whole module: this test checks what the scenarios left"
    time.sleep(LEASE_S + 1.0)
    # No block held by either engine (vLLM's own gauge; the servers are idle).
    for server in (bed.pair.prefill, bed.pair.decode):
        text = wait_until(lambda s=server: (t := s.metrics()) and metric(t, "vllm:kv_cache_usage_perc") == 0 and t,
                          10, f"{server.spec.name}'s blocks all free")
        assert not live_kvsm_requests(text), live_kvsm_requests(text)
    bed.pair.close()
    files = sorted(bed.pair.logs.glob("*.jsonl"))
    report = analyse(files)
    # The one finding expected: the notification the partition held back reached
    # the prefill side after its lease (test_a_partition_between_the_read_and_its_notification).
    # (That scenario runs with -m extended only.)
    late = next((r.extra.get("late_notif_req") for r in bed.results if r.name == "partition_after_reads"), None)
    findings = [(f.kind, f.req) for f in report.findings]
    assert findings in ([], [("read_after_lease_expiry", late)]), [str(f) for f in report.findings][:20]
    assert report.shutdowns, "no clean-stop record"
    for key, rec in report.shutdowns.items():
        live = rec.get("live") or {}
        assert not live.get("recv") and not live.get("send"), (key, live)
    send_states = report.summary().get("send", {})
    assert set(send_states) <= {"released", "expired"}, send_states
    failed = [c for c in report.causes if c.lifecycle == "recv"]
    assert failed and all(c.line for c in failed), report.causes[:5]
    assert any("peer" in c.line or "timeout" in c.line for c in failed), [c.line for c in failed][:5]
    # The read caught by the partition: replay names the stalled-read probe.
    stalled = next(r for r in bed.results if r.name == "partition_during_reads").extra["victim"]
    (line,) = [c.line for c in failed if stalled in c.req]
    assert "stalled" in line, line
