"""Push mode at the worker level, with real NIXL between real processes.

The harness of tests/test_worker_nixl.py and tests/test_reliability_worker.py
(``PeerProc``, ``Chain``, ``GDecode``, ``harness_fixtures``, ``replay_logs``):
the decode ``WorkerHalf`` runs in this process, the prefill workers in
``tests/worker_peer.py`` subprocesses, the side channel is real ZMQ on
loopback and NIXL (UCX) moves real bytes. A request is in push mode when its
``RecvStart`` says ``push=True``: the decode worker claims the prefill's blocks
as for a read, then sends each prefill worker a ``WriteAsk``, which posts a NIXL
WRITE of its pinned blocks into the decode blocks; the write's notification
tells the decode worker it landed. What is proven:

1  a healthy push delivers exactly the prefill's bytes through
   ``writes_asked -> being_written``, ``writes_landed -> done``, and the
   prefill worker frees its pin as its write completes (``write_done``), not
   at its lease's end;
2  a prefill engine SIGKILLed after its claim was granted, before or right
   after the write was asked: the request fails (blocks invalid and untouched,
   never done with wrong bytes) as its side channel refuses, well inside the
   declared bound (``transfer_timeout + 0.5 s``); a healthy peer is served;
3  a prefill engine that goes silent (SIGSTOP) as the write is asked: the
   decode blocks come back at the deadline bound, not later (upstream vLLM
   #46283 leaks them) and not earlier (the write could still land); replay
   names the cause; resumed, the prefill writes nothing into them;
4  the decode side gives up (an abort, a transfer timeout) while it is being
   written: nothing is reported to vLLM before the write settled (its landing
   notification is held back here); the prefill frees its blocks as its
   write is over;
5  the decode worker's process dies (SIGKILL) with its write asked: the prefill
   worker, resumed, stops and frees its blocks at once (``write_done`` with
   ``ok=False``), not at its lease's end. The decode worker of this scenario
   is this very file run as a script (``_decode_process``), since
   ``worker_peer.py`` only runs prefill workers;
6  a write that will never come (the ask of a decode worker already gone, whose
   agent cannot be loaded; an ask that arrives past its deadline) frees the
   prefill's blocks at once too. These two FAIL against the code as it stands
   (the blocks stay pinned until the 30 s lease ends): see their docstrings.

The last test replays every log of the module with ``kvsm.replay.analyse``: no
violation, only what the crashes left mid-lifecycle.

Processes (spawned once per module, in parallel): ``main`` (workers P and H,
healthy, lease 30 s), ``stop`` (workers T and G, lease 30 s: SIGSTOPped by
scenarios 3, 5 and 6, SIGCONTed at their end), a chain of two incarnations of
prefill engine KP for scenario 2's two kills, and, in scenario 5, one decode
process.
"""

from __future__ import annotations

if __name__ == "__main__":  # the decode worker process of scenario 5: no vLLM import
    import worker_peer

    worker_peer._stub_vllm()

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from conftest import require

require("nixl._api")
torch = require("torch")

from test_reliability_worker import FAST, Chain, GDecode

from test_worker_nixl import HOST, REPO, PeerProc, PrefillPeers, harness_fixtures, replay_logs
from worker_peer import agent_name, compat_fields, config_fields, make_caches

from kvsm.handshake.messages import WriteAsk
from kvsm.replay import analyse
from kvsm.vllm.metadata import RecvAbort, RecvStart
from kvsm_testing.peer_process import PeerProcess
from kvsm_testing.reliability import stop_process

SEEDS = {"P": 501, "H": 502, "T": 503, "G": 504}
ENGINES = {w: f"prefill-{w}" for w in SEEDS}
# The deadline a decode worker sets its writes: transfer_timeout + LEASE_MARGIN_NS (0.5 s).
MARGIN_S = 0.5
SLACK_S = 0.5  # a loaded 2-core machine


# ----------------------------------------------------------------------------- processes


class SpawnedPeers(PrefillPeers):
    """A module's prefill processes (``_spawn``) and its chain of incarnations to
    kill: flushed and closed together (a stopped one resumed first)."""

    def __init__(self, log_dir: Path, engines: dict[str, str]) -> None:
        super().__init__(log_dir, engines)
        self.procs: list[PeerProc] = []
        self.chain: Chain | None = None

    def _spawn(self, label: str, workers: list[dict[str, Any]]) -> PeerProc:
        self.procs.append(PeerProc(label, workers, self.log_dir))
        return self.procs[-1]

    def _start(self, spawn: Callable[[], Chain]) -> None:
        """Run ``spawn`` (it spawns the module's processes and returns its chain), then
        wait until every one is ready; on any failure, close what was started."""
        try:
            self.chain = spawn()
            for p in self.procs:
                p.ready()
            self.chain.ready()
        except BaseException:
            self.close()
            raise

    def flush(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.call("flush")
        c = self.chain
        if c is not None and c.current.proc.poll() is None and c.current.hello:
            c.current.call("flush")

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)  # (a scenario that failed half-way)
            p.close()
        if self.chain is not None:
            self.chain.close()


class Peers(SpawnedPeers):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, ENGINES)

        def spec(w: str) -> dict[str, Any]:
            return {"name": w, "engine_id": ENGINES[w], "port": self.port[w], "lease_s": 30.0, "seed": SEEDS[w],
                    "log": str(self.log[w])}

        def spawn() -> Chain:
            self.main = self._spawn("main", [spec("P"), spec("H")])
            self.stop = self._spawn("stop", [spec("T"), spec("G")])
            return Chain("KP", log_dir, incarnations=2, seed0=510)

        self._start(spawn)

    def proc_of(self, w: str) -> PeerProc:
        return self.main if w in ("P", "H") else self.stop


log_dir, peers, decode = harness_fixtures(Peers, GDecode, "push-worker-logs")


# ----------------------------------------------------------------------------- helpers


def pick(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(64), n)


def push(start: RecvStart) -> RecvStart:
    return msgspec.structs.replace(start, push=True)


def _pushed(peers: Peers, d: GDecode, w: str, req: str, rng: random.Random, n: int = 2) -> RecvStart:
    """A push request to worker ``w`` (of ``main`` or ``stop``), its blocks pinned there."""
    blocks = pick(rng, n)
    peers.proc_of(w).finish(w, {f"p-{req}": blocks})
    return push(d.start(req, peers.coords(w), f"p-{req}", blocks))


def _records(path: Path, req: str | None = None) -> list[dict[str, Any]]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if req is None or r.get("req") == req]


def _send_path(peers: Peers, log: Path, req: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(event, dst, input) of every transition of the prefill's send machine ``req``
    but its claims (a heartbeat each)."""
    peers.flush()
    return [(r["event"], r["dst"], r.get("input", {})) for r in _records(log, req)
            if r["kind"] == "transition" and r["event"] != "heartbeat"]


def _path(d: GDecode, req: str) -> list[tuple[str, str]]:
    return [(ev, dst) for ev, _, dst, _ in d.transitions(req)]


HEAD = [("matched", "awaiting_blocks"), ("allocated", "pending_handshake"), ("handshake_ok", "remote_known"),
        ("writes_asked", "being_written")]


def _on_ask(d: GDecode, victim: str, before: Any = None, after: Any = None) -> dict[str, float]:
    """Run ``before()`` / ``after()`` around the decode worker's side-channel send of
    ``victim``'s write ask (on its loop thread, once); ``seen["t"]``: when it was sent."""
    client = d.half.ctx.client
    assert client is not None
    real = client.send
    seen: dict[str, float] = {}

    def send(peer: str, request: Any, deadline_ns: int, **kw: Any) -> int:
        if not (isinstance(request, WriteAsk) and any(w.dst_req == victim for w in request.writes)):
            return real(peer, request, deadline_ns, **kw)
        client.send = real  # once
        if before is not None:
            before()
        rid = real(peer, request, deadline_ns, **kw)
        seen["t"] = time.monotonic()
        if after is not None:
            after()
        return rid

    client.send = send  # the loop calls it through the instance
    return seen


def _sigkill(proc: PeerProc) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(timeout=5)


@contextmanager
def _stopped(proc: PeerProc) -> Iterator[None]:
    """``proc`` is SIGCONTed on the way out, whatever happened (SIGSTOPped by the scenario)."""
    try:
        yield
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)


def _hold_notifs(d: GDecode) -> threading.Event:
    """NIXL notifications reach the decode worker's loop only once the returned event
    is set (they still arrive: its agent progresses): a landing the decode side has
    not heard of yet."""
    real = d.transport.get_notifs
    gate = threading.Event()
    held: list[Any] = []

    def get_notifs() -> list[Any]:
        got = real()
        if not gate.is_set():
            held.extend(got)
            return []
        out = held + got
        held.clear()
        return out

    d.transport.get_notifs = get_notifs  # the loop calls it through the instance
    return gate


def replay(peers: Peers, decodes: list[GDecode], reqs: set[str], prefill: list[Path]):
    return replay_logs(peers, decodes, reqs, [p for p in prefill if p.exists()])


# ============================================================================ 1: healthy


def test_healthy_push_writes_the_exact_bytes_and_frees_the_pin_at_once(peers: Peers, decode) -> None:
    d = decode("push-ok", **FAST)
    rng = random.Random(1)
    sizes = {"ok-one": 1, "ok-three": 3, "ok-eight": 8, "ok-perm": 4}
    remote = {r: pick(rng, n) for r, n in sizes.items()}
    t0 = time.monotonic()
    peers.main.finish("P", {f"p-{r}": b for r, b in remote.items()})
    # ok-perm asks for the prefill's blocks in another order than they were pinned.
    asked = dict(remote, **{"ok-perm": remote["ok-perm"][1:] + remote["ok-perm"][:1]})
    starts = {r: push(d.start(r, peers.coords("P"), f"p-{r}", asked[r])) for r in sizes}
    d.submit(recv_start=starts.values())
    d.wait(list(sizes), timeout=3.0)
    assert not d.failed and not d.invalid
    assert all(d.reports[r] == 1 for r in sizes)
    for r, s in starts.items():
        assert d.holds(s.local_block_ids, s.remote_block_ids, SEEDS["P"]), f"{r}: wrong bytes"
    assert d.zero_except({b for s in starts.values() for b in s.local_block_ids}), "a write outside its blocks"
    # The comparison can fail: not the pinned order, not another engine's bytes.
    assert not d.holds(starts["ok-perm"].local_block_ids, tuple(remote["ok-perm"]), SEEDS["P"])
    assert not d.holds(starts["ok-eight"].local_block_ids, starts["ok-eight"].remote_block_ids, SEEDS["H"])
    for r in sizes:
        assert _path(d, r) == [*HEAD, ("writes_landed", "done")], (r, d.transitions(r))
    # The pin goes with the write (lease 30 s), by write_done: no read notification comes in push mode.
    sent = peers.main.wait_sent("P", [f"p-{r}" for r in sizes], timeout=3.0)
    assert max(sent[f"p-{r}"] for r in sizes) - t0 < 3.0
    for r in sizes:
        path = _send_path(peers, peers.log["P"], f"p-{r}")
        assert [(ev, dst) for ev, dst, _ in path] == [("finished_ok", "awaiting_pull"), ("write_asked", "writing"),
                                                      ("write_done", "released")], path
        assert path[-1][2].get("ok", True) is True, path
    findings, finals, _ = replay(peers, [d], set(sizes) | {f"p-{r}" for r in sizes}, [peers.log["P"]])
    assert findings == []
    assert finals == {**{("recv", r): "done" for r in sizes}, **{("send", f"p-{r}"): "released" for r in sizes}}


# ============================================================================ 2: prefill SIGKILLed


@pytest.mark.parametrize("when", ["before_the_ask", "after_the_ask"])
def test_prefill_killed_at_the_write_ask_fails_in_bound(peers: Peers, decode, when: str) -> None:
    """The claim is granted; the prefill engine is SIGKILLed (and reaped) just
    before the decode worker sends its write ask, or right after it sent it. The
    request fails, its blocks invalid and untouched, as the side channel's
    reconnect is refused (~0.1 s), well before the deadline bound; a push from
    a healthy engine in the same step is served."""
    chain = peers.chain
    assert chain is not None
    chain.ensure_live()
    d = decode(f"push-kill-{when}", **FAST)
    rng = random.Random(when)
    victim_req = f"kill-{when}"
    blocks = pick(rng, 3)
    chain.current.finish("KP", {f"p-{victim_req}": blocks})
    deadline_s = d.cfg.transfer_timeout_s + MARGIN_S
    proc = chain.current
    chain.current.call("flush")
    if when == "before_the_ask":
        seen = _on_ask(d, victim_req, before=lambda: (proc.call("flush"), _sigkill(proc)))
    else:
        seen = _on_ask(d, victim_req, after=lambda: _sigkill(proc))
    victim = push(d.start(victim_req, chain.coords(), f"p-{victim_req}", blocks))
    healthy = _pushed(peers, d, "H", f"kill-{when}-h", rng)
    t0 = d.submit(recv_start=[victim, healthy])
    d.wait([healthy.req, victim_req], timeout=deadline_s + 2 * SLACK_S)
    assert "t" in seen, "the write was never asked"
    assert healthy.req not in d.failed and d.holds(healthy.local_block_ids, healthy.remote_block_ids, SEEDS["H"])
    took = d.recving[victim_req] - seen["t"]
    print(f"{when}: failed {took:.3f} s after the ask, {d.recving[victim_req] - t0:.3f} s after the step")
    assert victim_req in d.failed, "done although its prefill engine died before it could write"
    assert set(victim.local_block_ids) <= d.invalid and d.untouched(victim.local_block_ids)
    assert took < deadline_s + SLACK_S, f"failed {took:.3f} s after the ask (bound {deadline_s} s)"
    # Faster than the deadline: the side channel refused (the process is gone).
    assert took < 0.5 * deadline_s, f"failed only after {took:.3f} s: the refusal was not used"
    path = _path(d, victim_req)
    assert path[:4] == HEAD and path[-1][1] == "failed", path
    stopped = [inp for ev, _, _, inp in d.transitions(victim_req) if ev == "writes_stopped"]
    assert stopped and "gone" in stopped[0]["why"], d.transitions(victim_req)
    peer = d.half.debug_state()["peers"][chain.peer_key()]
    assert peer["agent"] is None and peer["failures"] >= 1, peer
    peers.main.wait_sent("H", [healthy.remote_req])
    reqs = {victim_req, healthy.req, f"p-{victim_req}", healthy.remote_req}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["H"], chain.logs[chain.live]])
    # The crash, as replay tells it: at most the dead engine's pinned request never ended.
    assert set(findings) <= {("not_terminal_at_end", f"p-{victim_req}")}, findings
    assert finals[("recv", victim_req)] == "failed" and finals[("recv", healthy.req)] == "done"
    assert finals[("send", healthy.remote_req)] == "released"
    chain.restart()  # the next scenario's engine


# ============================================================================ 3: prefill silent


def test_silent_prefill_gives_the_blocks_back_at_the_deadline(peers: Peers, decode) -> None:
    """The claim is granted; the prefill process is SIGSTOPped as the write ask
    goes out, so it is neither answered nor written. The decode blocks come back
    (failed, invalid) at the deadline every write is bound by (transfer_timeout
    + 0.5 s after the ask): not before (the write could still land until then),
    not later (upstream vLLM #46283: never). A healthy push is served meanwhile.
    Resumed, the prefill worker finds the ask past its deadline and writes nothing."""
    d = decode("push-silent", **FAST)
    rng = random.Random(3)
    victim = _pushed(peers, d, "T", "silent", rng, 3)
    healthy = _pushed(peers, d, "P", "silent-h", rng)
    peers.stop.call("flush")
    deadline_s = d.cfg.transfer_timeout_s + MARGIN_S
    with _stopped(peers.stop):
        seen = _on_ask(d, victim.req, before=lambda: stop_process(peers.stop.proc.pid))
        d.submit(recv_start=[victim, healthy])
        d.wait([healthy.req], timeout=1.0)
        assert healthy.req not in d.failed and d.holds(healthy.local_block_ids, healthy.remote_block_ids, SEEDS["P"])
        d.wait_state(victim.req, "being_written")
        d.wait([victim.req], timeout=deadline_s + 2 * SLACK_S)
        took = d.recving[victim.req] - seen["t"]
        print(f"silent prefill: blocks back {took:.3f} s after the ask (deadline {deadline_s} s)")
        assert victim.req in d.failed and set(victim.local_block_ids) <= d.invalid
        assert d.untouched(victim.local_block_ids)
        assert took >= deadline_s - 0.05, f"blocks handed back {took:.3f} s after the ask: a write could still land"
        assert took <= deadline_s + SLACK_S, f"blocks handed back only {took:.3f} s after the ask"
        # The unanswered ask (handshake timeout, 0.5 s) and the transfer timeout (1 s)
        # hand nothing back: only the deadline does.
        assert _path(d, victim.req) == [*HEAD, ("peer_dead", "stopping_writes"), ("timeout", "stopping_writes"),
                                        ("writes_stopped", "failed")], d.transitions(victim.req)
        why = [inp["why"] for ev, _, _, inp in d.transitions(victim.req) if ev == "writes_stopped"]
        assert why == ["the deadline every write was bound by passed"], why
        key = f"{ENGINES['T']}@tcp://{HOST}:{peers.port['T']}"
        assert d.half.debug_state()["peers"][key]["agent"] is None, "the silent writer's agent was not dropped"
    # Resumed: the late ask writes nothing into the blocks vLLM has back.
    deadline = time.monotonic() + 3.0
    while not [r for r in _records(peers.log["T"], victim.remote_req) if r.get("event") == "remote_abandoned"
               and "past its deadline" in str((r.get("input") or {}).get("reason"))]:
        assert time.monotonic() < deadline, "the resumed prefill worker never took the late ask"
        peers.stop.call("flush")
        time.sleep(0.02)
    d.quiet(0.2)
    assert d.untouched(victim.local_block_ids), "the resumed prefill wrote into blocks handed back"
    assert d.reports[victim.req] == 1
    assert "write_asked" not in [ev for ev, _, _ in _send_path(peers, peers.log["T"], victim.remote_req)]
    peers.main.wait_sent("P", [healthy.remote_req])
    findings, finals, report = replay(peers, [d], {victim.req, healthy.req, healthy.remote_req},
                                      [peers.log["T"], peers.log["P"]])
    assert findings == []
    assert finals == {("recv", victim.req): "failed", ("recv", healthy.req): "done",
                      ("send", healthy.remote_req): "released"}
    causes = [c for c in report.causes if c.lifecycle == "recv" and c.req == victim.req]
    print("replay's cause:", causes)
    assert len(causes) == 1 and causes[0].rule == "peer_dead" and "no answer to a write ask" in causes[0].line, \
        causes


# ============================================================================ 4: the decode side gives up


def test_abort_while_being_written_waits_for_the_landing(peers: Peers, decode) -> None:
    """The prefill wrote (and freed its pin), the landing's notification is held
    back on the decode side. vLLM aborts the request: the prefill worker is told at
    once (nothing to stop there any more), and nothing is reported until the
    landing is heard, then it is reported finished (aborted, not failed)."""
    d = decode("push-abort", **FAST)
    rng = random.Random(4)
    gate = _hold_notifs(d)
    start = _pushed(peers, d, "P", "abort", rng, 3)
    t0 = d.submit(recv_start=[start])
    d.wait_state(start.req, "being_written")
    # The write is over on the prefill side: its pin goes at once (lease 30 s).
    sent = peers.main.wait_sent("P", [start.remote_req], timeout=2.0)
    assert sent[start.remote_req] - t0 < 2.0
    d.submit(recv_abort=[RecvAbort(req=start.req, awaited=True)])
    d.wait_state(start.req, "aborting_writes")
    d.quiet(0.3)
    assert start.req not in d.recving, "reported to vLLM before the write settled"
    released = time.monotonic()
    gate.set()
    d.wait([start.req], timeout=2.0)
    assert d.recving[start.req] >= released
    assert start.req not in d.failed and not d.invalid
    assert _path(d, start.req) == [*HEAD, ("abort", "aborting_writes"), ("writes_landed", "aborted")], \
        d.transitions(start.req)
    path = [(ev, dst) for ev, dst, _ in _send_path(peers, peers.log["P"], start.remote_req)]
    # The abort told the prefill worker at once (it had written already: a stale input there).
    assert path[-2:] == [("write_done", "released"), ("remote_abandoned", "released")], path
    findings, finals, _ = replay(peers, [d], {start.req, start.remote_req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "aborted", ("send", start.remote_req): "released"}


def test_transfer_timeout_while_being_written_waits_for_the_landing(peers: Peers, decode) -> None:
    """The landing's notification is held back past the transfer timeout (1 s),
    inside the deadline (1.5 s): the timeout hands nothing back; the landing, when
    heard, fails the request (too late) and only then are its blocks reported."""
    d = decode("push-timeout", **FAST)
    rng = random.Random(5)
    gate = _hold_notifs(d)
    start = _pushed(peers, d, "P", "timeout", rng, 2)
    t0 = d.submit(recv_start=[start])
    sent = peers.main.wait_sent("P", [start.remote_req], timeout=2.0)
    assert sent[start.remote_req] - t0 < 0.8 * d.cfg.transfer_timeout_s, "the prefill's pin outlived its write"
    d.wait_state(start.req, "stopping_writes", timeout=d.cfg.transfer_timeout_s + SLACK_S)
    d.quiet(0.1)
    assert start.req not in d.recving, "reported to vLLM before the write settled"
    released = time.monotonic()
    assert released - t0 < d.cfg.transfer_timeout_s + MARGIN_S - 0.1, "too slow to test inside the deadline"
    gate.set()
    d.wait([start.req], timeout=2.0)
    assert d.recving[start.req] >= released
    assert start.req in d.failed and d.invalid == set(start.local_block_ids)
    assert _path(d, start.req) == [*HEAD, ("timeout", "stopping_writes"), ("writes_landed", "failed")], \
        d.transitions(start.req)
    findings, finals, _ = replay(peers, [d], {start.req, start.remote_req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "failed", ("send", start.remote_req): "released"}


# ============================================================================ 5: the decode worker dies


class DecodeProc(PeerProcess):
    """This file run as a script: a decode worker in its own process (``_decode_process``)."""

    def __init__(self, name: str, log_dir: Path, config: dict[str, Any]) -> None:
        self.engine_id = f"decode-{name}"
        self.log = log_dir / f"{self.engine_id}.jsonl"
        super().__init__(name, Path(__file__), {"engine_id": self.engine_id, "log": str(self.log),
                                                "config": config}, log_dir, root=REPO)


def _decode_dies_with_its_write_asked(peers: Peers, log_dir: Path, name: str, *, warm: bool):
    """A decode process asks prefill worker G (SIGSTOPped meanwhile) to write request
    ``name``, then dies (SIGKILL) before G resumes. ``warm``: a push from G served
    first, so G has the decode worker's agent loaded when the ask comes.
    (seconds from G's resumption to its finished_sending or None, G's send path, the decode log)."""
    dec = DecodeProc(name, log_dir, {"transfer_timeout_s": 3.0, "handshake_timeout_s": 0.5})
    try:
        dec.ready()
        rng = random.Random(name)
        coords = peers.coords("G")

        def start(req: str, local: tuple[int, ...]) -> RecvStart:
            blocks = pick(rng, len(local))
            peers.stop.finish("G", {f"p-{req}": blocks})
            return push(RecvStart(req=req, remote_req=f"p-{req}", remote_block_ids=tuple(blocks),
                                  local_block_ids=local, num_tokens=16 * len(local), awaited=True, **coords))

        if warm:
            w = start(f"{name}-warm", (0, 1))
            dec.call("submit", start=msgspec.to_builtins(w))
            assert dec.call("wait_recv", req=w.req, within=3.0)["ok_recv"], "the warm-up push failed"
            peers.stop.wait_sent("G", [w.remote_req], timeout=2.0)
        victim = start(name, (2, 3, 4))
        dec.call("submit", start=msgspec.to_builtins(victim), gate=True)
        assert dec.call("wait_asking", timeout=5.0)["asking"], "the decode worker never asked for the write"
        peers.stop.call("flush")
        with _stopped(peers.stop):
            stop_process(peers.stop.proc.pid)
            assert dec.call("ask")["asked"]  # on the wire to G, which cannot take it yet
            time.sleep(0.2)
            dec.call("flush")
            dec.proc.send_signal(signal.SIGKILL)
            dec.proc.wait(timeout=5)
            resumed = time.monotonic()
        sent = peers.stop.call("wait_sent", timeout=2.0, w="G", reqs=[victim.remote_req], within=2.0)["sent"]
        took = sent[victim.remote_req] - resumed if victim.remote_req in sent else None
        path = _send_path(peers, peers.log["G"], victim.remote_req)
        print(f"decode gone ({'warm' if warm else 'first contact'}): pin freed after {took} s; {path}")
        return took, path, dec.log
    finally:
        dec.close()


def test_decode_killed_with_its_write_asked_frees_the_prefill_at_once(peers: Peers, log_dir: Path) -> None:
    """G has the decode worker's agent loaded (a push served first); the decode
    process dies with its next write asked. Resumed, G posts the write to a process
    that is gone: it cannot complete, and G frees the pin at once (write_done,
    ok=False), not at its 30 s lease's end."""
    took, path, log = _decode_dies_with_its_write_asked(peers, log_dir, "push-gone", warm=True)
    assert [(ev, dst) for ev, dst, _ in path] == [("finished_ok", "awaiting_pull"), ("write_asked", "writing"),
                                                  ("write_done", "released")], path
    assert path[-1][2].get("ok") is False, path
    assert took is not None and took < 1.0, f"the pin went {took} s after G resumed"
    findings, finals, _ = replay_logs(peers, [], {"push-gone", "p-push-gone"}, [log, peers.log["G"]])
    assert finals[("send", "p-push-gone")] == "released"
    # The killed decode worker's machine never ended: all that replay reports.
    assert set(findings) <= {("not_terminal_at_end", "push-gone")}, findings


# ============================================================================ a write that never comes
# Both fail against the code as it stands: see each docstring.


def test_decode_killed_before_its_first_write_frees_the_prefill_at_once(peers: Peers, log_dir: Path) -> None:
    """As test_decode_killed_with_its_write_asked_frees_the_prefill_at_once, but the
    ask is the first G hears from that decode worker (no push served first): G cannot
    reach the agent of a process that is gone, so nothing can be written; the asker
    counts through (as by an abandon) and the pin goes at once, not at its 30 s
    lease's end."""
    took, path, _ = _decode_dies_with_its_write_asked(peers, log_dir, "push-gone-cold", warm=False)
    assert took is not None and took < 1.0, (
        f"G kept the pin of a write it refused (the decode worker's agent could not be loaded) until its "
        f"lease's end: send path {[(ev, dst) for ev, dst, _ in path]}")


def test_a_late_write_ask_frees_the_prefill_at_once(peers: Peers, decode) -> None:
    """Prefill worker T's process stalls 0.7 s (SIGSTOP, SIGCONT) as the write ask
    goes out: T takes it past the deadline it carries (transfer_timeout 1 s less the
    0.5 s margin) and rightly writes nothing, answering "expired"; the decode request
    fails at that answer, and T's blocks go at once (the late asker counts through,
    and the failed push tells every prefill worker not through), not at the lease's
    end."""
    d = decode("push-late", handshake_timeout_s=2.0, transfer_timeout_s=1.0, peer_backoff_s=1.0)
    rng = random.Random(7)
    start = _pushed(peers, d, "T", "late", rng, 2)
    pid = peers.stop.proc.pid

    def stall() -> None:
        stop_process(pid)
        threading.Timer(0.7, os.kill, args=(pid, signal.SIGCONT)).start()

    with _stopped(peers.stop):
        seen = _on_ask(d, start.req, before=stall)
        d.submit(recv_start=[start])
        d.wait([start.req], timeout=3.0)
    assert start.req in d.failed and d.untouched(start.local_block_ids)
    took = d.recving[start.req] - seen["t"]
    assert took < d.cfg.transfer_timeout_s, f"failed {took:.3f} s after the ask, not at the answer"
    errors = [inp for ev, _, _, inp in d.transitions(start.req) if ev == "error"]
    assert [e["kind"] for e in errors] == ["push_refused"] and "expired" in errors[0]["detail"], errors
    failed_at = d.recving[start.req]
    sent = peers.stop.call("wait_sent", timeout=2.0, w="T", reqs=[start.remote_req], within=2.0)["sent"]
    path = [(ev, dst) for ev, dst, _ in _send_path(peers, peers.log["T"], start.remote_req)]
    assert start.remote_req in sent and sent[start.remote_req] - failed_at < 1.0, (
        f"the prefill kept the pin of a push that failed (its ask came too late) until its lease's end: "
        f"send path {path}")


# ============================================================================ replay of everything


def test_replay_of_every_log_finds_only_the_crashes(peers: Peers, log_dir: Path) -> None:
    """Every decode log and prefill log of the module, together: replay finds no
    violation, only what the crashes left mid-lifecycle."""
    peers.flush()
    report = analyse(sorted(log_dir.glob("*.jsonl")))
    kinds = {f.kind for f in report.findings}
    assert kinds <= {"not_terminal_at_end"}, "\n".join(map(str, report.findings))


# ============================================================================ the decode process


def _decode_process(spec: dict[str, Any]) -> int:
    """A decode worker driven by JSON lines, as worker_peer.py drives prefill workers:
    ``submit`` start (a RecvStart's fields) [gate: its write ask waits for ``ask``],
    ``wait_recv`` req, within, ``wait_asking``, ``ask``, ``flush``, ``quit``."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from kvsm.config import KVSMConfig
    from kvsm.eventlog.log import EventLog
    from kvsm.handshake import CompatInfo
    from kvsm.transport.layout import describe_kv_caches
    from kvsm.transport.nixl import NixlTransport
    from kvsm.vllm.metadata import KVSMConnectorMetadata
    from kvsm.worker import WorkerHalf

    engine = spec["engine_id"]
    caches = make_caches(None)
    transport = NixlTransport(agent_name(engine), describe_kv_caches(caches))
    cfg = KVSMConfig(**config_fields(engine, "kv_consumer", 1, **spec.get("config", {})))
    log = EventLog(spec["log"], role="worker", engine_id=engine)
    half = WorkerHalf(cfg, 0, event_log=log)
    half.start(transport, CompatInfo(**compat_fields()))
    asking, go = threading.Event(), threading.Event()
    seen: dict[str, float] = {}
    recving: set[str] = set()
    failed: set[str] = set()
    step = 0

    def reply(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg, default=str) + "\n")
        proto.flush()

    def gate() -> None:
        asking.set()
        go.wait(10.0)

    reply({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict[str, Any] = {"ok": True}
        if op == "submit":
            start = msgspec.convert(cmd["start"], RecvStart)
            if cmd.get("gate"):
                seen = _on_ask(type("D", (), {"half": half})(), start.req, before=gate)  # type: ignore[arg-type]
            step += 1
            meta = KVSMConnectorMetadata(step)
            meta.recv_start = [start]
            half.submit(meta)
        elif op == "wait_recv":
            deadline = time.monotonic() + cmd["within"]
            while cmd["req"] not in recving and time.monotonic() < deadline:
                _, got, bad = half.take_results()
                recving |= got
                failed |= bad
                time.sleep(0.002)
            out["ok_recv"] = cmd["req"] in recving and cmd["req"] not in failed
        elif op == "wait_asking":
            out["asking"] = asking.wait(5.0)
        elif op == "ask":  # returns once the ask is handed to the side channel
            go.set()
            deadline = time.monotonic() + 5.0
            while "t" not in seen and time.monotonic() < deadline:
                time.sleep(0.001)
            out["asked"] = "t" in seen
        elif op == "flush":
            log.flush()
        elif op == "quit":
            reply(out)
            half.shutdown()
            return 0
        reply(out)
    half.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_decode_process(json.loads(sys.argv[1])))
