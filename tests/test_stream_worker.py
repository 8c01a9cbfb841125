"""Streamed push at the worker level, with real NIXL between real processes.

The harness of tests/test_push_worker.py (``PeerProc``, ``Chain``, ``GDecode``,
``harness_fixtures``, ``replay_logs``, ``DecodeProc``): the decode ``WorkerHalf``
runs in this process, the prefill workers in ``tests/worker_peer.py``
subprocesses, the side channel is real ZMQ on loopback and NIXL (UCX) moves
real bytes. A request is streamed when its ``RecvStart`` says ``stream=True``:
the decode worker claims it by its join key (answered "unknown", and asked
again, until the prefill worker has its ``SendStart``), then asks for the
writes; the prefill worker writes each layer of each step's blocks as vLLM's
model thread reports the layer done (``layer_saved``), the last write carrying
the landing's notification. worker_peer's ``stream_step`` plays that model
thread: the step's tokens are first overwritten with other bytes (not computed
yet), then each layer is computed (``pattern(fill_seed)``) and saved in turn.

A request here is 4 blocks (64 tokens) computed in 3 steps (24, 24, 16
tokens: blocks 1 and 2 are computed by two steps each, and written once whole).
What is proven:

1  healthy: the decode's ask first (its claims wait for the key), the
   prefill's first (the ask catches up mid-stream) or the whole prefill over
   and pinned before the ask: the decode blocks hold exactly the computed
   bytes (a comparison that fails against the bytes before the computation,
   the cache's first bytes or another block order), the send machine goes
   ``stream_claimed``, ``stream_asked -> streaming``, ``write_done`` and
   frees the pin at the finish (not at the lease's end); the prefill records
   ``worker.stream_written`` with more writes than steps; a step's first layer
   is written before its last one is computed, a block partly computed is not;
2  a planted fault (``layer_saved`` before the layer is computed) delivers the
   stale bytes, and the comparison says so;
3  the prefill engine SIGKILLed after its first step: the request fails (blocks
   invalid, never done) within the deadline bound (``transfer_timeout + 0.5 s``
   from the ask);
4  the prefill engine SIGSTOPped in the middle of a step: the decode blocks come
   back at the deadline bound, not before (a write could still land) and not
   after; resumed, it writes nothing more into them and frees its pin at the
   finish;
5  the decode worker's process SIGKILLed mid-stream: the prefill's next layer
   write fails, its stream ends (``write_done``, ``ok=False``) and its blocks go
   at the finish, not at the 30 s lease's end;
6  an abort on either side mid-stream: the prefill request aborted (its writes
   cancelled; the decode request fails, never done with partial bytes); the
   decode request aborted while being written (the prefill worker told at once,
   it stops writing and says when nothing is in flight: reported in
   milliseconds, nothing written into the blocks after; the prefill side ends
   clean); a prefill preempted by vLLM with every write over (the rest streams
   from its new blocks) and under its writes (written again whole from the new
   blocks once those writes are over).

Then every log of the module is replayed with ``kvsm.replay.analyse``: no
violation, only what the crashes left mid-lifecycle.

7  (after the replay) the decode request given up while its claims wait for the
   key (aborted before the prefill engine scheduled its leg): the abandon, named
   by the key, reaches the prefill request once its SendStart tells the key, and
   the finish frees the blocks at once, not at the lease's end.

Processes (spawned once per module, in parallel): ``main`` (worker P, lease
30 s), ``stop`` (workers T, SIGSTOPped by scenario 4, and G, whose decode
process dies in scenario 5; G keeps worker_peer's default geometry, the one
test_push_worker's decode process uses), the prefill engine KS that scenario 3
kills, and, in scenario 5, one decode process.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from conftest import require

require("nixl._api")
torch = require("torch")

from test_push_worker import (
    HEAD,
    MARGIN_S,
    SLACK_S,
    DecodeProc,
    SpawnedPeers,
    _on_ask,
    _path,
    _records,
    _send_path,
    _stopped,
)
from test_reliability_worker import FAST, Chain, GDecode

from test_worker_nixl import PeerProc, harness_fixtures, replay_logs
from worker_peer import GEOMETRY

from kvsm.replay import analyse
from kvsm.vllm.metadata import RecvAbort, RecvStart
from kvsm_testing.reliability import stop_process

GEOM = {"layers": 4}  # every worker but G (and the decode workers of this process)
SEEDS = {"P": 601, "T": 602, "G": 603}  # each prefill cache's bytes before any step
ENGINES = {w: f"prefill-stream-{w}" for w in SEEDS}
TOKENS = 4 * GEOMETRY["block_size"]  # a request's prompt: 4 blocks
STEPS = [(0, 24), (24, 48), (48, TOKENS)]  # what each step computes of it
# A block is written once it is whole (the prompt's last one at the last step): after
# the first step, the first block only.
WHOLE = STEPS[0][1] // GEOMETRY["block_size"] * GEOMETRY["block_size"]
LAYER_DELAY_S = 0.01
# A streamed request's writes must be over by its deadline less the 0.5 s margin, from
# the ask (the prefill worker's own deadline): FAST's 1 s transfer timeout leaves the
# prefill 0.5 s for all its steps, too little on a loaded machine. Every scenario but
# the kill (FAST, as test_push_worker's) gives it 1.5 s.
STREAM_CFG = {**FAST, "transfer_timeout_s": 2.0}
_step_numbers = itertools.count(1)  # (a worker ignores a step number it was given already)


# ----------------------------------------------------------------------------- processes


class Peers(SpawnedPeers):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, ENGINES)

        def spec(w: str, geom: dict[str, int] | None) -> dict[str, Any]:
            return {"name": w, "engine_id": ENGINES[w], "port": self.port[w], "lease_s": 30.0, "seed": SEEDS[w],
                    "log": str(self.log[w]), "geometry": geom}

        def spawn() -> Chain:
            self.main = self._spawn("main", [spec("P", GEOM)])
            self.stop = self._spawn("stop", [spec("T", GEOM), spec("G", None)])
            return Chain("KS", log_dir, incarnations=1, geom=GEOM, seed0=610)

        self._start(spawn)



def _decode(name: str, log_dir: Path, **kw: Any) -> GDecode:
    return GDecode(name, log_dir, geom=GEOM, **kw)


log_dir, peers, decode = harness_fixtures(Peers, _decode, "stream-worker-logs")


# ----------------------------------------------------------------------------- helpers


class Stream:
    """One streamed prefill request of worker ``w`` (of process ``proc``): 4 blocks,
    computed in ``STEPS``, each step's tokens taking ``pattern(seed)``."""

    def __init__(self, proc: PeerProc, w: str, name: str, rng: random.Random, seed: int) -> None:
        self.proc, self.w = proc, w
        self.req, self.key = f"p-{name}", f"key-{name}"
        self.blocks = rng.sample(range(GEOMETRY["num_blocks"]), 4)
        self.seed = seed
        self.stale = seed + 1000  # what the step's tokens hold before it computes them
        self.done = 0  # steps run
        self.resumed = False  # preempted and computed again: the scheduler tells no key again

    def step(self, *, wait: bool = True, saved_first: bool = False, delay: float = LAYER_DELAY_S) -> dict[str, Any]:
        """Run the next step (the first one carries the SendStart with the join key)."""
        start, end = STEPS[self.done]
        size = GEOMETRY["block_size"]
        self.done += 1
        return self.proc.call("stream_step", w=self.w, step=next(_step_numbers),
                              send_start=[[self.req, self.key]] if start == 0 and not self.resumed else [],
                              stream_steps=[[self.req, self.blocks[:-(-end // size)], start, end, end >= TOKENS]],
                              fill_seed=self.seed, fill_first_seed=self.stale, layer_delay_s=delay,
                              saved_first=saved_first, wait=wait)

    def step_wait(self) -> dict[str, Any]:
        return self.proc.call("step_wait", w=self.w)

    def run(self, n: int | None = None, **kw: Any) -> list[dict[str, Any]]:
        """Run ``n`` more steps (all that are left by default)."""
        left = len(STEPS) - self.done
        return [self.step(**kw) for _ in range(left if n is None else n)]

    def finish(self) -> float:
        """The scheduler's finish (a pin of the request's blocks); when it was sent."""
        t = time.monotonic()
        self.proc.call("submit", w=self.w, step=next(_step_numbers), send_finish=[[self.req, self.blocks]])
        return t

    def preempt(self, at_ns: int, new_blocks: list[int]) -> None:
        """vLLM preempted the request at ``at_ns`` (its blocks freed); it is computed
        again from its first token into ``new_blocks``."""
        self.proc.call("submit", w=self.w, step=next(_step_numbers), stream_preempted=[[self.req, at_ns]])
        self.blocks, self.done, self.resumed = new_blocks, 0, True

    def abort(self) -> float:
        t = time.monotonic()
        self.proc.call("submit", w=self.w, step=next(_step_numbers), send_abort=[self.req])
        return t

    def coords(self, peers: Peers) -> dict[str, Any]:
        return peers.coords(self.w)


def stream_start(d: GDecode, req: str, coords: dict[str, Any], key: str) -> RecvStart:
    """The decode side's RecvStart of a streamed request: claimed by its join key, no
    remote blocks, our 4 blocks from position 0."""
    local = d.blocks(4)
    d.local_of[req] = local
    return RecvStart(req=req, remote_req=key, remote_block_ids=(), local_block_ids=local, num_tokens=TOKENS,
                     awaited=True, push=True, stream=True, first_position=0, **coords)


def _send_state(proc: PeerProc, w: str, req: str) -> str | None:
    return proc.state(w)["send"].get(req)


def _wait_send_state(proc: PeerProc, w: str, req: str, states: set[str], timeout: float = 3.0) -> str:
    deadline = time.monotonic() + timeout
    while (got := _send_state(proc, w, req)) not in states:
        assert time.monotonic() < deadline, f"{req} on {w} is in {got!r}, never reached {states}"
        time.sleep(0.005)
    assert got is not None
    return got


def _handles(proc: PeerProc, w: str) -> int:
    """NIXL transfers the worker holds (every write of an ended stream is released)."""
    return proc.state(w)["resources"]["transport_handles"]


def _streams_written(peers: Peers, log: Path, req: str) -> list[dict[str, Any]]:
    peers.flush()
    return [r for r in _records(log, req) if r.get("event") == "worker.stream_written"]


def _waited_for_the_key(d: GDecode, req: str) -> int:
    """How many of ``req``'s claims were answered "unknown" (its join key not known yet)."""
    return sum(r.get("unknown", {}).get(req, 0) for r in d.records() if r.get("event") == "worker.claims_answered")


def _holds_tokens(d: GDecode, local: tuple[int, ...], blocks: list[int], seed: int, upto: int, *,
                  since: int = 0, layers: range | None = None) -> bool:
    """Tokens ``since..upto`` of our blocks (every layer, or ``layers``) are the prefill
    blocks' ``pattern(seed)``."""
    size, want = d.geom["block_size"], d.pattern(seed)
    for pos in range(since // size, (upto - 1) // size + 1):
        lo, hi = max(since, pos * size) - pos * size, min(upto, (pos + 1) * size) - pos * size
        for i in layers if layers is not None else range(d.geom["layers"]):
            if not (d.layer(i)[local[pos], :, lo:hi] == want[i][blocks[pos], :, lo:hi]).all():
                return False
    return True


def _wait_tokens(d: GDecode, start: RecvStart, s: Stream, upto: int, timeout: float = 1.0, **kw: Any) -> float:
    """Wait until tokens (``since``) to ``upto``, computed, are written into our blocks; when they were seen."""
    deadline = time.monotonic() + timeout
    while not _holds_tokens(d, start.local_block_ids, s.blocks, s.seed, upto, **kw):
        assert time.monotonic() < deadline, f"tokens to {upto} ({kw}), computed, were not written within {timeout} s"
        time.sleep(0.002)
    return time.monotonic()


def _stream_poll_threads() -> list[str]:
    """The decode workers' stream-poll tickers alive in this process (one per worker
    while a streamed request's writes are awaited)."""
    return [t.name for t in threading.enumerate() if t.name.endswith("-stream-poll") and t.is_alive()]


def _given_back(d: GDecode, start: RecvStart) -> None:
    """vLLM has the request's blocks back (another request's now): zeroed, so that
    ``d.untouched`` shows any write that lands in them afterwards."""
    for i in range(d.geom["layers"]):
        d.layer(i)[list(start.local_block_ids)] = 0


def _first_step_streamed(peers: Peers, decode: Any, name: str, rng: random.Random,
                         seed: int) -> tuple[GDecode, Stream, RecvStart]:
    """A streamed request on worker P, the decode's RecvStart first: its first step
    run, and its decode request being written."""
    d = decode(f"stream-{name}", **STREAM_CFG)
    s = Stream(peers.main, "P", name, rng, seed=seed)
    start = stream_start(d, name, s.coords(peers), s.key)
    d.submit(recv_start=[start])
    d.wait_state(start.req, "pending_handshake")
    s.run(1)
    d.wait_state(start.req, "being_written")
    return d, s, start


def _deadline_s(d: GDecode) -> float:
    """The bound a decode worker sets every write of a request: transfer_timeout + 0.5 s from its ask."""
    return d.cfg.transfer_timeout_s + MARGIN_S


# ============================================================================ 1: healthy


@pytest.mark.parametrize("order", ["decode_first", "mid_stream", "after_finish"])
def test_healthy_stream_writes_the_computed_bytes_and_frees_the_pin_at_the_finish(
        peers: Peers, decode, order: str) -> None:
    """``decode_first``: the decode's RecvStart goes first, its claims answered
    "unknown" until the prefill's first step tells the key. ``mid_stream``: the
    prefill's first step is over before the ask, which first writes what is
    computed, and the finish comes right behind the last step (before or after
    the last write is over). ``after_finish``: the prompt computed and pinned
    before the ask, written at once."""
    d = decode(f"stream-ok-{order}", **STREAM_CFG)
    rng = random.Random(order)
    s = Stream(peers.main, "P", f"ok-{order}", rng, seed=700 + len(order))
    start = stream_start(d, f"ok-{order}", s.coords(peers), s.key)
    finished_at = 0.0
    if order == "decode_first":
        d.submit(recv_start=[start])
        d.wait_state(start.req, "pending_handshake")
        time.sleep(0.05)  # claims out, answered "unknown"
        s.run(1)
        _wait_tokens(d, start, s, WHOLE)  # written as computed, before the next step
        # Its writes awaited, the decode worker polls their notifications every 250 us.
        assert _stream_poll_threads() == [f"{d.half.loop.name}-stream-poll"], _stream_poll_threads()
        # A block partly computed is not written yet (written again whole, the two
        # unordered writes could land stale bytes last).
        assert not _holds_tokens(d, start.local_block_ids, s.blocks, s.seed, STEPS[0][1], since=WHOLE)
        # Layer by layer: the second step's first layer is written while its last one is not
        # saved yet (0.1 s a layer).
        s.step(wait=False, delay=0.1)
        seen = _wait_tokens(d, start, s, STEPS[1][1], since=STEPS[1][0], layers=range(1))
        assert seen < s.step_wait()["saving"][-1], "the step's first layer was written only after its last"
        s.run()
        _wait_send_state(peers.main, "P", s.req, {"streamed"})
        finished_at = s.finish()
    elif order == "mid_stream":
        s.run(1)
        d.submit(recv_start=[start])
        d.wait_state(start.req, "being_written")
        _wait_send_state(peers.main, "P", s.req, {"streaming"})
        _wait_tokens(d, start, s, WHOLE)  # the ask's catch-up: what was computed before it
        s.run()
        finished_at = s.finish()
    else:
        s.run()
        finished_at = s.finish()
        _wait_send_state(peers.main, "P", s.req, {"awaiting_pull"})
        d.submit(recv_start=[start])
    d.wait([start.req], timeout=3.0)
    assert not d.failed and not d.invalid and d.reports[start.req] == 1
    deadline = time.monotonic() + 1.0
    while _stream_poll_threads():  # nothing awaited: the ticker ends at its next wake
        assert time.monotonic() < deadline, _stream_poll_threads()
        time.sleep(0.001)
    local = start.local_block_ids
    assert d.holds(local, s.blocks, s.seed), "not the computed bytes"
    assert d.zero_except(set(local)), "a write outside the request's blocks"
    # The comparison can fail: not the bytes before the steps computed them, not the
    # cache's first bytes, not another block order.
    assert not d.holds(local, s.blocks, s.stale)
    assert not d.holds(local, s.blocks, SEEDS["P"])
    assert not d.holds(local, s.blocks[1:] + s.blocks[:1], s.seed)
    assert _path(d, start.req) == [*HEAD, ("writes_landed", "done")], d.transitions(start.req)
    if order == "decode_first":
        assert _waited_for_the_key(d, start.req) >= 1, "the claims never waited for the prefill's SendStart"
    # The pin goes at the finish, or as the write is over after it (lease 30 s).
    sent = peers.main.wait_sent("P", [s.req], timeout=3.0)
    assert sent[s.req] - finished_at < 1.0, "the pin outlived the finish"
    path = [(ev, dst) for ev, dst, _ in _send_path(peers, peers.log["P"], s.req)]
    if order == "decode_first":
        assert path == [("stream_claimed", "prefilling"), ("stream_asked", "streaming"), ("write_done", "streamed"),
                        ("finished_ok", "released")], path
    elif order == "mid_stream":
        assert path in ([("stream_claimed", "prefilling"), ("stream_asked", "streaming"),
                         ("write_done", "streamed"), ("finished_ok", "released")],
                        [("stream_claimed", "prefilling"), ("stream_asked", "streaming"),
                         ("finished_ok", "writing"), ("write_done", "released")]), path
    else:
        assert path == [("finished_ok", "awaiting_pull"), ("stream_claimed", "awaiting_pull"),
                        ("stream_asked", "writing"), ("write_done", "released")], path
    done = [inp for ev, _, inp in _send_path(peers, peers.log["P"], s.req) if ev == "write_done"]
    assert done and done[0].get("ok", True) is True, done
    written = _streams_written(peers, peers.log["P"], s.req)
    assert len(written) == 1 and written[0]["key"] == s.key and written[0]["steps"] == len(STEPS), written
    assert written[0]["writes"] > len(STEPS), written  # layer by layer
    assert _handles(peers.main, "P") == 0, "a write of the ended stream was never released"
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "done", ("send", s.req): "released"}


# ============================================================================ 2: a planted fault


def test_a_layer_saved_before_it_is_computed_delivers_stale_bytes(peers: Peers, decode) -> None:
    """The model thread calls ``layer_saved`` before the layer is computed (and
    computes it a moment later): each layer's write carries the bytes the step's
    tokens held before. Nothing on either side can tell, but the delivered bytes
    are not the computed ones; those of the last step's block in the first layer
    (written once, by a write posted before its computation) are exactly the
    stale ones."""
    d = decode("stream-stale", **STREAM_CFG)
    s = Stream(peers.main, "P", "stale", random.Random(2), seed=720)
    start = stream_start(d, "stale", s.coords(peers), s.key)
    d.submit(recv_start=[start])
    d.wait_state(start.req, "pending_handshake")
    s.run(saved_first=True, delay=0.05)
    s.finish()
    d.wait([start.req], timeout=3.0)
    assert start.req not in d.failed, "the stale write failed (it should land: only its bytes are wrong)"
    local = start.local_block_ids
    assert not d.holds(local, s.blocks, s.seed), "the planted fault did not show in the bytes"
    stale = d.pattern(s.stale)[0][s.blocks[3]]
    assert (d.layer(0)[local[3]] == stale).all(), "the last block's first layer is not the stale bytes"
    peers.main.wait_sent("P", [s.req], timeout=3.0)


# ============================================================================ 3: prefill SIGKILLed


def test_prefill_killed_mid_stream_fails_within_the_deadline(peers: Peers, decode) -> None:
    """The prefill engine KS is SIGKILLed after its first step, the write asked and
    under way. The request fails (its blocks invalid, never done), at the latest at
    the deadline its writes were bound by (transfer_timeout + 0.5 s from the ask)."""
    chain = peers.chain
    assert chain is not None
    d = decode("stream-kill", **FAST)
    s = Stream(chain.current, "KS", "kill", random.Random(3), seed=730)
    start = stream_start(d, "kill", chain.coords(), s.key)
    seen = _on_ask(d, start.req)
    d.submit(recv_start=[start])
    d.wait_state(start.req, "pending_handshake")
    s.run(1)
    d.wait_state(start.req, "being_written")
    _wait_send_state(chain.current, "KS", s.req, {"streaming"})
    chain.kill()  # (its log flushed first)
    d.wait([start.req], timeout=_deadline_s(d) + 2 * SLACK_S)
    took = d.recving[start.req] - seen["t"]
    print(f"prefill killed: failed {took:.3f} s after the ask (deadline {_deadline_s(d)} s)")
    assert start.req in d.failed, "done although its prefill engine died mid-stream"
    assert set(start.local_block_ids) <= d.invalid and d.reports[start.req] == 1
    assert took <= _deadline_s(d) + SLACK_S, f"failed {took:.3f} s after the ask (bound {_deadline_s(d)} s)"
    path = _path(d, start.req)
    assert path[:4] == HEAD and path[-1][1] == "failed" and "done" not in [dst for _, dst in path], path
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [chain.logs[chain.live]])
    # The crash, as replay tells it: at most the dead engine's request never ended.
    assert set(findings) <= {("not_terminal_at_end", s.req)}, findings
    assert finals[("recv", start.req)] == "failed"


# ============================================================================ 4: prefill SIGSTOPped


def test_prefill_stopped_mid_step_gives_the_blocks_back_at_the_deadline(peers: Peers, decode) -> None:
    """Prefill worker T's process is SIGSTOPped in the middle of its second step.
    The decode blocks come back (failed, invalid) at the deadline every write is
    bound by: not before (a write could still land) and not after. vLLM then reuses
    them (zeroed here); T, resumed, finishes its step and the next one and writes
    nothing more into them; its stream ends failed and the finish frees its pin."""
    d = decode("stream-stop", **STREAM_CFG)
    s = Stream(peers.stop, "T", "stop", random.Random(4), seed=740)
    start = stream_start(d, "stop", s.coords(peers), s.key)
    seen = _on_ask(d, start.req)
    d.submit(recv_start=[start])
    d.wait_state(start.req, "pending_handshake")
    s.run(1)
    d.wait_state(start.req, "being_written")
    _wait_send_state(peers.stop, "T", s.req, {"streaming"})
    peers.stop.call("flush")
    deadline_s = _deadline_s(d)
    with _stopped(peers.stop):
        s.step(wait=False, delay=0.05)
        time.sleep(0.07)  # a layer or two into the step
        stop_process(peers.stop.proc.pid)
        d.wait([start.req], timeout=deadline_s + 2 * SLACK_S)
        took = d.recving[start.req] - seen["t"]
        print(f"stopped prefill: blocks back {took:.3f} s after the ask (deadline {deadline_s} s)")
        assert start.req in d.failed and set(start.local_block_ids) <= d.invalid
        assert took >= deadline_s - 0.05, f"blocks handed back {took:.3f} s after the ask: a write could still land"
        assert took <= deadline_s + SLACK_S, f"blocks handed back only {took:.3f} s after the ask"
        # The transfer timeout (1 s) hands nothing back; at the deadline the silent
        # writer's agent is dropped (peer_dead: unsettled), then no write can land.
        assert _path(d, start.req) == [*HEAD, ("timeout", "stopping_writes"), ("peer_dead", "stopping_writes"),
                                       ("writes_stopped", "failed")], d.transitions(start.req)
        why = [inp["why"] for ev, _, _, inp in d.transitions(start.req) if ev == "writes_stopped"]
        assert why == ["the deadline every write was bound by passed"], why
        _given_back(d, start)
    s.step_wait()
    s.run()
    finished_at = s.finish()
    sent = peers.stop.wait_sent("T", [s.req], timeout=3.0)
    d.quiet(0.2)
    assert d.untouched(start.local_block_ids), "the resumed prefill wrote into blocks handed back"
    assert d.reports[start.req] == 1
    assert sent[s.req] - finished_at < 1.0, "the pin outlived the finish"
    path = _send_path(peers, peers.log["T"], s.req)
    # Resumed, it finds its write's deadline passed, or first hears the decode's
    # abandon (sent as the decode gave up, at its transfer timeout).
    assert [(ev, dst) for ev, dst, _ in path] in (
        [("stream_claimed", "prefilling"), ("stream_asked", "streaming"), ("write_done", "streamed"),
         ("remote_abandoned", "streamed"), ("finished_ok", "released")],
        [("stream_claimed", "prefilling"), ("stream_asked", "streaming"), ("remote_abandoned", "abandoned_early"),
         ("finished_ok", "released")]), path
    assert path[2][0] != "write_done" or path[2][2].get("ok") is False, path
    assert not _streams_written(peers, peers.log["T"], s.req)
    assert _handles(peers.stop, "T") == 0
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [peers.log["T"]])
    assert findings == []
    assert finals == {("recv", start.req): "failed", ("send", s.req): "released"}


# ============================================================================ 5: the decode worker dies


def test_decode_killed_mid_stream_ends_the_stream_and_frees_at_the_finish(peers: Peers, log_dir: Path) -> None:
    """A decode process (test_push_worker's) asks prefill worker G for a streamed
    request after G's first step, and dies (SIGKILL) once G streams it. G's next
    step writes to a process that is gone: the write fails, the stream ends
    (``write_done``, ``ok=False``) before its deadline, and the finish frees the
    blocks at once, not at the 30 s lease's end."""
    transfer_timeout_s = 3.0
    dec = DecodeProc("stream-gone", log_dir, {"transfer_timeout_s": transfer_timeout_s, "handshake_timeout_s": 0.5})
    try:
        dec.ready()
        s = Stream(peers.stop, "G", "gone", random.Random(5), seed=750)
        s.run(1)
        start = RecvStart(req="gone", remote_req=s.key, remote_block_ids=(), local_block_ids=(2, 3, 4, 5),
                          num_tokens=TOKENS, awaited=True, push=True, stream=True, **s.coords(peers))
        dec.call("submit", start=msgspec.to_builtins(start))
        _wait_send_state(peers.stop, "G", s.req, {"streaming"})
        asked = time.monotonic()
        dec.call("flush")
        dec.proc.send_signal(signal.SIGKILL)
        dec.proc.wait(timeout=5)
        s.step()
        # The stream ends before its deadline (transfer_timeout - 0.5 s from the ask, on G's side).
        deadline = asked + transfer_timeout_s - MARGIN_S
        while (state := _send_state(peers.stop, "G", s.req)) == "streaming":
            assert time.monotonic() < deadline, "the stream to a dead decode worker outlived its failed writes"
            time.sleep(0.005)
        ended = time.monotonic()
        s.run()
        finished_at = s.finish()
        sent = peers.stop.wait_sent("G", [s.req], timeout=3.0)
        path = _send_path(peers, peers.log["G"], s.req)
        print(f"decode gone: stream ended {ended - asked:.3f} s after the ask ({state}); "
              f"pin freed {sent[s.req] - finished_at:.3f} s after the finish; {path}")
        assert [(ev, dst) for ev, dst, _ in path] == [("stream_claimed", "prefilling"), ("stream_asked", "streaming"),
                                                      ("write_done", "streamed"), ("finished_ok", "released")], path
        assert path[2][2].get("ok") is False and "deadline" not in path[2][2].get("detail", ""), path
        assert sent[s.req] - finished_at < 1.0, "the pin outlived the finish"
        assert _handles(peers.stop, "G") == 0
        findings, finals, _ = replay_logs(peers, [], {"gone", s.req}, [dec.log, peers.log["G"]])
        assert finals[("send", s.req)] == "released"
        # The killed decode worker's machine never ended: all that replay reports.
        assert set(findings) <= {("not_terminal_at_end", "gone")}, findings
    finally:
        dec.close()


# ============================================================================ 6: aborts


def test_prefill_aborted_mid_stream_cancels_its_writes(peers: Peers, decode) -> None:
    """vLLM aborts the prefill request after its first step (SendFinish ok=False,
    FINISHED_ABORTED): its writes are cancelled and the send machine ends released.
    The decode request fails: at once when nothing was in flight (told ``failed``),
    at the deadline when a write was (told ``cancelled``); never done with the
    partial bytes."""
    d = decode("stream-pabort", **STREAM_CFG)
    s = Stream(peers.main, "P", "pabort", random.Random(6), seed=760)
    start = stream_start(d, "pabort", s.coords(peers), s.key)
    seen = _on_ask(d, start.req)
    d.submit(recv_start=[start])
    d.wait_state(start.req, "pending_handshake")
    s.run(1)
    d.wait_state(start.req, "being_written")
    _wait_send_state(peers.main, "P", s.req, {"streaming"})
    s.abort()
    d.wait([start.req], timeout=_deadline_s(d) + 2 * SLACK_S)
    took = d.recving[start.req] - seen["t"]
    assert start.req in d.failed and set(start.local_block_ids) <= d.invalid and d.reports[start.req] == 1
    errors = [inp for ev, _, _, inp in d.transitions(start.req) if ev == "error"]
    assert [e["kind"] for e in errors] == ["write_failed"], errors
    how = "cancelled" if "cancelled" in errors[0]["detail"] else "failed"
    print(f"prefill aborted: the decode was told {how!r}; failed {took:.3f} s after the ask")
    why = [inp["why"] for ev, _, _, inp in d.transitions(start.req) if ev == "writes_stopped"]
    path = _path(d, start.req)
    assert path[:5] == [*HEAD, ("error", "stopping_writes")] and path[-1] == ("writes_stopped", "failed"), path
    if how == "failed":  # nothing in flight: settled at once
        assert why == ["every write settled: failed"] and len(path) == 6, d.transitions(start.req)
    else:  # bytes may still land: the deadline
        assert why == ["the deadline every write was bound by passed"], why
        assert took >= _deadline_s(d) - 0.05, f"blocks handed back {took:.3f} s after the ask"
    assert took <= _deadline_s(d) + SLACK_S
    sent_path = [(ev, dst) for ev, dst, _ in _send_path(peers, peers.log["P"], s.req)]
    assert sent_path == [("stream_claimed", "prefilling"), ("stream_asked", "streaming"), ("abort", "released")], \
        sent_path
    assert _send_state(peers.main, "P", s.req) is None and _handles(peers.main, "P") == 0
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "failed", ("send", s.req): "released"}


def test_decode_aborted_while_being_written_stops_the_stream_at_once(peers: Peers, decode) -> None:
    """vLLM aborts the decode request in the middle of the prefill's second step.
    The decode worker tells the prefill worker at once; it stops writing, lets the
    write in flight finish and then says nothing is in flight (``failed``), so the
    decode request is reported finished (aborted, not failed) within milliseconds,
    long before the stream would have ended, and nothing is written into its
    blocks afterwards. The prefill request computes on, and its finish frees the
    pin at once."""
    d, s, start = _first_step_streamed(peers, decode, "dabort", random.Random(7), 770)
    _wait_send_state(peers.main, "P", s.req, {"streaming"})
    s.step(wait=False, delay=0.03)
    time.sleep(0.04)
    aborted_at = d.submit(recv_abort=[RecvAbort(req=start.req, awaited=True)])
    d.wait([start.req], timeout=_deadline_s(d))
    took = d.recving[start.req] - aborted_at
    print(f"decode aborted mid-stream: reported {took * 1000:.1f} ms after the abort")
    assert took < 0.5, f"reported {took:.3f} s after the abort (the deadline is {_deadline_s(d)} s)"
    assert start.req not in d.failed and not d.invalid
    path = _path(d, start.req)
    assert path[:len(HEAD) + 1] == [*HEAD, ("abort", "aborting_writes")], d.transitions(start.req)
    assert path[-1] == ("writes_stopped", "aborted"), d.transitions(start.req)
    why = [inp["why"] for ev, _, _, inp in d.transitions(start.req) if ev == "writes_stopped"]
    assert why == ["every write settled: failed"], why
    _given_back(d, start)
    s.step_wait()
    s.run()
    finished_at = s.finish()
    sent = peers.main.wait_sent("P", [s.req], timeout=3.0)
    d.quiet(0.1)
    assert d.untouched(start.local_block_ids), "the prefill wrote into blocks handed back"
    assert sent[s.req] - finished_at < 1.0, "the pin outlived the finish"
    path = [(ev, dst) for ev, dst, _ in _send_path(peers, peers.log["P"], s.req)]
    assert path == [("stream_claimed", "prefilling"), ("stream_asked", "streaming"),
                    ("remote_abandoned", "abandoned_early"), ("finished_ok", "released")], path
    assert _handles(peers.main, "P") == 0
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "aborted", ("send", s.req): "released"}


def _new_blocks(rng: random.Random, old: list[int]) -> list[int]:
    return rng.sample([b for b in range(GEOMETRY["num_blocks"]) if b not in old], len(old))


def test_a_preempted_prefill_streams_on_from_its_new_blocks(peers: Peers, decode) -> None:
    """vLLM preempts the prefill after its first step, every write of it seen over
    before: the tokens written stay (the same KV), and the request, computed again
    into other blocks, streams the rest from them. The decode blocks hold the first
    block's bytes from the old blocks and the others' from the new ones."""
    rng = random.Random(8)
    d, s, start = _first_step_streamed(peers, decode, "preempt", rng, 780)
    _wait_tokens(d, start, s, WHOLE)
    deadline = time.monotonic() + 2.0
    while _handles(peers.main, "P"):  # every write of the first step seen over
        assert time.monotonic() < deadline, "the first step's writes were never seen over"
        time.sleep(0.002)
    old = s.blocks
    s.preempt(time.monotonic_ns(), _new_blocks(rng, old))
    s.run()
    finished_at = s.finish()
    d.wait([start.req], timeout=3.0)
    assert not d.failed and not d.invalid and d.reports[start.req] == 1, [
        (r.get("event"), r.get("input"), r.get("failed")) for r in _records(peers.log["P"], s.req)]
    local = start.local_block_ids
    assert d.holds(local[:1], old[:1], s.seed) and d.holds(local[1:], s.blocks[1:], s.seed)
    assert not d.holds(local[1:], old[1:], s.seed)  # (the comparison can fail)
    assert _path(d, start.req) == [*HEAD, ("writes_landed", "done")], d.transitions(start.req)
    sent = peers.main.wait_sent("P", [s.req], timeout=3.0)
    assert sent[s.req] - finished_at < 1.0, "the pin outlived the finish"
    said = [inp for ev, _, inp in _send_path(peers, peers.log["P"], s.req) if ev == "stream_preempted"]
    assert [x["unsure"] for x in said] == [[]], said
    assert _handles(peers.main, "P") == 0
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "done", ("send", s.req): "released"}


def test_a_prefill_preempted_under_its_writes_is_written_again_whole(peers: Peers, decode) -> None:
    """vLLM (scheduling one step ahead) preempts the prefill while its step runs:
    the step's writes were posted after the free, so what they carried is not sure.
    The send table has that rank written again whole: nothing is posted before those
    writes are over, then every token goes again from the new blocks. The decode
    request is done, every block holding the new blocks' bytes (none the old ones');
    the prefill request ends with its finish and frees its pin."""
    rng = random.Random(9)
    d, s, start = _first_step_streamed(peers, decode, "preempt-unsure", rng, 790)
    old = s.blocks
    freed = s.step()["saving"][0]  # the second step: preempted as its first layer was saved
    s.preempt(int(freed * 1e9), _new_blocks(rng, old))
    s.run()
    finished_at = s.finish()
    d.wait([start.req], timeout=3.0)
    assert not d.failed and not d.invalid and d.reports[start.req] == 1, [
        (r.get("event"), r.get("input"), r.get("failed")) for r in _records(peers.log["P"], s.req)]
    local = start.local_block_ids
    assert d.holds(local, s.blocks, s.seed) and not d.holds(local[:1], old[:1], s.seed)
    assert _path(d, start.req) == [*HEAD, ("writes_landed", "done")], d.transitions(start.req)
    said = [inp for ev, _, inp in _send_path(peers, peers.log["P"], s.req) if ev == "stream_preempted"]
    assert [(len(x["unsure"]), x["notified"]) for x in said] == [(1, [])], said
    rewrites = [r for r in _records(peers.log["P"], s.req) if r.get("event") == "worker.stream_rewrite"]
    assert len(rewrites) == 1, rewrites
    sent = peers.main.wait_sent("P", [s.req], timeout=3.0)
    assert sent[s.req] - finished_at < 1.0, "the pin outlived the finish"
    assert _handles(peers.main, "P") == 0
    findings, finals, _ = replay_logs(peers, [d], {start.req, s.req}, [peers.log["P"]])
    assert findings == []
    assert finals == {("recv", start.req): "done", ("send", s.req): "released"}


# ============================================================================ replay of everything


def test_replay_of_every_log_finds_only_the_crashes(peers: Peers, log_dir: Path) -> None:
    """Every decode log and prefill log of the module, together: replay finds no
    violation, only what the crashes left mid-lifecycle (the killed prefill's
    request, the killed decode worker's request)."""
    peers.flush()
    report = analyse(sorted(log_dir.glob("*.jsonl")))
    found = {(f.kind, f.req) for f in report.findings}
    assert found <= {("not_terminal_at_end", "p-kill"), ("not_terminal_at_end", "gone")}, \
        "\n".join(map(str, report.findings))


# ============================================================================ a pin nobody will read
# After the replay: the machine the early abandon made of the key's name waits out
# its lease (it holds no blocks), still live at the replay's time.


def test_decode_gone_before_the_prefill_starts_frees_the_pin_at_the_finish(peers: Peers, decode) -> None:
    """vLLM aborts the decode request while its claims still wait for the join key
    (the prefill engine has not scheduled its leg yet: a queue; a claim phase that
    outlasts handshake_timeout ends the same way). The decode worker tells the
    prefill worker it gives up, by the key. When the prefill leg runs after all,
    nobody will ever read it: its finish must free the blocks at once, not at the
    30 s lease's end."""
    d = decode("stream-early", **STREAM_CFG)
    s = Stream(peers.main, "P", "early", random.Random(8), seed=780)
    start = stream_start(d, "early", s.coords(peers), s.key)
    d.submit(recv_start=[start])
    d.wait_state(start.req, "pending_handshake")
    d.submit(recv_abort=[RecvAbort(req=start.req, awaited=True)])
    d.wait([start.req], timeout=2.0)
    assert start.req not in d.failed and d.untouched(start.local_block_ids)
    assert _path(d, start.req) == [("matched", "awaiting_blocks"), ("allocated", "pending_handshake"),
                                   ("abort", "aborted")], d.transitions(start.req)
    # The abandon has reached the prefill worker (named by the key: all it knows).
    _wait_send_state(peers.main, "P", s.key, {"abandoned_early"})
    s.run()
    finished_at = s.finish()
    sent = peers.main.call("wait_sent", timeout=1.0, w="P", reqs=[s.req], within=1.0)["sent"]
    path = [(ev, dst) for ev, dst, _ in _send_path(peers, peers.log["P"], s.req)]
    assert s.req in sent and sent[s.req] - finished_at < 1.0, (
        f"the prefill pinned a streamed request its decode side gave up before it started, for its whole "
        f"lease: send path {path}")
    assert path == [("remote_abandoned", "abandoned_early"), ("finished_ok", "released")], path
    assert not _streams_written(peers, peers.log["P"], s.req) and _handles(peers.main, "P") == 0
