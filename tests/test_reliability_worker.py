"""Worker-level reliability with real NIXL between real processes (issue 5).

Same setting as tests/test_worker_nixl.py (whose harness this reuses: ``PeerProc``,
``Decode``, ``harness_fixtures``, ``replay_logs``): the decode ``WorkerHalf`` runs in this process, the prefill
workers in ``tests/worker_peer.py`` subprocesses, NIXL (UCX) moves real bytes
between them and the side channel is real ZMQ on loopback. What is proven:

1c  a prefill engine SIGKILLed before any handshake, after the handshake but
    before the reads, and while a read is in flight: the request fails within
    its timeout (never ``done`` with wrong bytes), its blocks are reported
    invalid, the peer is known dead so the next request fails fast, a healthy
    peer is served meanwhile, and the restarted engine is used again;
3   unreachable peers (nothing listening, a TCP port that never answers, a
    ZMQ peer that never replies) fail within the handshake timeout and do not
    delay a healthy peer's request;
6   a read that lands after the prefill's lease expired and its blocks were
    reused for another request is not delivered;
7   an exception injected into each loop handler (decode: recv effects, RecvStart
    handling, claim flush, claim replies, claim retry, read posting, settling
    and polling reads, heartbeats, handshake deadlines; prefill: the side
    channel's claims handler and metadata provider, send effects, lease expiry,
    notification polling) fails only the request it concerns (``internal_error``
    naming the handler, blocks invalid), or where no request can be blamed,
    leaves nothing stuck; other requests are served; the loop lives on.

The scenarios replay their event logs with ``kvsm.replay.analyse`` and check what it finds.

Processes (spawned once per module, in parallel): ``main`` (workers H and HB:
healthy, lease 30 s, HB with 1 MiB blocks; F and Z: targets of prefill-side
faults, lease 1 s, Z for a fault that cannot be undone; R: lease 0.6 s, for
block reuse) and, per kill scenario, a chain of incarnations of one prefill
engine on one port (each a fresh process, same engine id and agent name, its
own byte pattern), started one after another as "restarts".

Timeouts are short (handshake 0.5 s, transfer 1 s, back-off 1 s) and every bound
asserted has slack for a loaded 2-core machine; the module takes ~45 s alone.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("nixl._api")
torch = require("torch")

import zmq

from test_worker_nixl import (
    HOST,
    Decode,
    PeerProc,
    PrefillPeers,
    coords_of,
    free_port,
    harness_fixtures,
    replay_logs,
)
from worker_peer import inject_fault

from kvsm.vllm.metadata import HeartbeatTarget, RecvStart

# Blocks of 1 MiB (two layers of 8 heads x 16 tokens x 2 x 512 float32): a read of
# 48 permuted blocks is 96 descriptors and 48 MiB, which UCX's cma copies inside
# transfer() in ~10 ms here, long enough to kill the peer during the copy.
BIG = {"kv_heads": 8, "head_size": 512}
SEEDS = {"H": 301, "HB": 302, "F": 303, "Z": 304, "R": 305, "R-reused": 315}
ENGINES = {w: f"prefill-{w}" for w in ("H", "HB", "F", "Z", "R")}
LEASES = {"H": 30.0, "HB": 30.0, "F": 1.0, "Z": 1.0, "R": 0.6}
GEOMS: dict[str, dict[str, int] | None] = {"HB": BIG}
# The decode workers of the kill, unreachable-peer and fault scenarios. (A back-off
# of 1 s, twice the handshake timeout, so that "the next request fails fast" is seen
# inside the dead window even on a busy machine.)
FAST = {"handshake_timeout_s": 0.5, "peer_backoff_s": 1.0, "transfer_timeout_s": 1.0}


# ----------------------------------------------------------------------------- processes


class Chain:
    """Incarnations of one prefill engine on one port: ``current`` is live; a
    ``restart`` starts the next one, like an engine that crashed and came back
    with the same engine id and agent name but another NIXL agent and other
    bytes. ``incarnations`` processes are spawned at once (all but the first
    built but not bound); a restart past them spawns one then (slower, and it
    costs CPU while other scenarios run, so size ``incarnations`` to the need)."""

    def __init__(self, name: str, log_dir: Path, *, incarnations: int, geom: dict[str, int] | None = None,
                 lease_s: float = 30.0, seed0: int = 400) -> None:
        self.name = name
        self.engine = f"prefill-{name}"
        self.port = free_port()
        self.geom = geom
        self.lease_s = lease_s
        self.seed0 = seed0
        self.log_dir = log_dir
        self.procs: list[PeerProc] = []
        self.logs: list[Path] = []
        self.seeds: list[int] = []
        self.live = 0
        for i in range(incarnations):
            self._spawn(defer=i > 0)

    def _spawn(self, *, defer: bool) -> None:
        i = len(self.procs)
        log = self.log_dir / f"{self.engine}-{i}.jsonl"
        seed = self.seed0 + i
        spec = {"name": self.name, "engine_id": self.engine, "port": self.port, "lease_s": self.lease_s,
                "seed": seed, "log": str(log), "geometry": self.geom}
        self.procs.append(PeerProc(f"{self.name}{i}", [spec], self.log_dir, defer_start=defer))
        self.logs.append(log)
        self.seeds.append(seed)

    def ready(self) -> None:
        for p in self.procs:
            if not p.hello:
                p.ready()

    @property
    def current(self) -> PeerProc:
        return self.procs[self.live]

    @property
    def seed(self) -> int:
        return self.seeds[self.live]

    def coords(self) -> dict[str, Any]:
        return coords_of(self.engine, self.port)

    def peer_key(self) -> str:
        return f"{self.engine}@tcp://{HOST}:{self.port}"

    def kill(self) -> None:
        """SIGKILL the live incarnation (its event log flushed first, so replay sees it)."""
        self.current.call("flush")
        self.current.kill()

    def ensure_live(self) -> None:
        """A scenario that failed half-way may have left the engine dead: restart it."""
        if self.current.proc.poll() is not None:
            self.restart()

    @property
    def started_logs(self) -> list[Path]:
        """The event logs of every incarnation started so far."""
        return self.logs[: self.live + 1]

    def restart(self) -> PeerProc:
        """Start the next incarnation (bind its side channel)."""
        assert self.current.proc.poll() is not None, "restart of a live engine"
        self.live += 1
        if self.live == len(self.procs):
            self._spawn(defer=True)
        if not self.current.hello:
            self.current.ready()
        self.current.call("start")
        return self.current

    def close(self) -> None:
        for p in self.procs:
            p.close()


class Peers(PrefillPeers):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, ENGINES)
        self.chains: dict[str, Chain] = {}
        self.main: PeerProc | None = None
        try:
            self.main = PeerProc("main", [
                {"name": w, "engine_id": ENGINES[w], "port": self.port[w], "lease_s": LEASES[w], "seed": SEEDS[w],
                 "log": str(self.log[w]), "geometry": GEOMS.get(w)} for w in ENGINES], log_dir)
            # Killed before any handshake, restarted, killed before the reads, restarted.
            self.chains["A"] = Chain("KA", log_dir, incarnations=3, seed0=410)
            # Killed during a read (again if the copy beat the kill), restarted.
            self.chains["C"] = Chain("KC", log_dir, incarnations=2, geom=BIG, seed0=420)
            self.main.ready()
            for c in self.chains.values():
                c.ready()
        except BaseException:
            self.close()
            raise

    def flush(self) -> None:
        assert self.main is not None
        self.main.call("flush")
        for c in self.chains.values():
            if c.current.proc.poll() is None and c.current.hello:
                c.current.call("flush")

    def close(self) -> None:
        if self.main is not None:
            self.main.close()
        for c in self.chains.values():
            c.close()


# ----------------------------------------------------------------------------- decode


class GDecode(Decode):
    """test_worker_nixl's ``Decode`` whose blocks are given out again (zeroed), so
    that one worker serves a scenario of any length."""

    def __init__(self, name: str, log_dir: Path, **kw: Any) -> None:
        super().__init__(name, log_dir, **kw)
        self.reserved = 0  # blocks 0..reserved-1 are the scenario's own

    def blocks(self, n: int) -> tuple[int, ...]:
        """``n`` zeroed local blocks from ``reserved`` on, wrapping around: a block is
        given out again only after every block after it (a scenario checks each
        request's bytes before it has used the whole cache)."""
        span = range(self.reserved, self.geom["num_blocks"])
        assert n <= len(span), "test bug: out of decode blocks"
        if self._next_block < self.reserved or self._next_block + n > span.stop:
            self._next_block = self.reserved
        out = tuple(range(self._next_block, self._next_block + n))
        self._next_block += n
        for i in range(self.geom["layers"]):
            self.layer(i)[list(out)] = 0
        return out

    def untouched(self, local: tuple[int, ...]) -> bool:
        return all(not self.layer(i)[list(local)].any() for i in range(self.geom["layers"]))

    def alive(self) -> bool:
        t = self.half.loop.thread
        return t is not None and t.is_alive()

    def failure(self, req: str) -> list[tuple[str, dict[str, Any]]]:
        """The event and inputs of the transition(s) that failed ``req``."""
        return [(ev, inp) for ev, src, dst, inp in self.transitions(req)
                if dst in ("failed", "failing") and src not in ("failed", "failing")]


log_dir, peers, decode = harness_fixtures(Peers, GDecode, "reliability-worker-logs")


def replay(peers: Peers, decodes: list[Decode], reqs: set[str], prefill: list[Path]):
    """``replay_logs`` over those of these prefill logs that exist (an incarnation
    killed before it wrote any has none)."""
    return replay_logs(peers, decodes, reqs, [p for p in prefill if p.exists()])


def pick(rng: random.Random, n: int, num_blocks: int = 64) -> list[int]:
    return rng.sample(range(num_blocks), n)


def _peer_state(d: GDecode, key: str) -> dict[str, Any]:
    return d.half.debug_state()["peers"][key]


def _at_once(d: GDecode, took: float) -> bool:
    """Failed (or served) at once: well inside the handshake timeout it must beat
    (0.3 s of FAST's 0.5 s), so not at that timeout."""
    return took < 0.6 * d.cfg.handshake_timeout_s


def _wait_until_usable(d: GDecode, key: str, since: float) -> None:
    """Past the back-off of a dead peer, and past the abandon its failure sent there
    (answered or timed out, whatever that does to the peer's state)."""
    deadline = since + d.cfg.handshake_timeout_s + 5.0
    while d.half.debug_state()["io"]["oneway"]:
        assert time.monotonic() < deadline, "the abandon never settled"
        time.sleep(0.01)
    deadline = time.monotonic() + 5.0
    while (until := _peer_state(d, key)["dead_until_ns"]) > time.monotonic_ns():
        assert time.monotonic() < deadline, "the peer stayed dead"
        time.sleep(max(0.005, (until - time.monotonic_ns()) / 1e9 + 0.01))


def _next_request_fails_fast(d: GDecode, chain: Chain, req: str, rng: random.Random) -> None:
    start = d.start(req, chain.coords(), f"p-{req}", pick(rng, 2, d.geom["num_blocks"]))
    d.submit(recv_start=[start])
    d.wait([req], timeout=1.0)  # before any timeout could (at once: test_worker_virtual, on virtual time)
    assert req in d.failed and set(start.local_block_ids) <= d.invalid and d.untouched(start.local_block_ids)
    assert d.failure(req) == [("peer_dead", {"peer": chain.peer_key(), "reason": "known_dead"})]


def _restart_is_used(d: GDecode, chain: Chain, req: str, rng: random.Random, failed_at: float) -> None:
    """The engine comes back (same port, engine id and agent name; a new NIXL agent
    and new bytes): once the back-off is over, its blocks are read."""
    chain.restart()
    blocks = pick(rng, 3, d.geom["num_blocks"])
    chain.current.finish(chain.name, {f"p-{req}": blocks})
    _wait_until_usable(d, chain.peer_key(), failed_at)
    start = d.start(req, chain.coords(), f"p-{req}", blocks)
    d.submit(recv_start=[start])
    d.wait([req], timeout=3.0)
    assert req not in d.failed, d.failure(req)
    assert d.holds(start.local_block_ids, blocks, chain.seed), "not the restarted engine's bytes"
    assert not d.holds(start.local_block_ids, blocks, chain.seeds[chain.live - 1])
    chain.current.wait_sent(chain.name, [f"p-{req}"])
    assert _peer_state(d, chain.peer_key())["failures"] == 0


def _pin_and_flush(proc: PeerProc, w: str, req: str) -> None:
    """Wait until worker ``w`` has pinned ``req`` (``submit`` only posts it to its
    loop), then write its log out: what replay sees of an engine about to be killed."""
    deadline = time.monotonic() + 3.0
    while proc.state(w)["send"].get(req) != "awaiting_pull":
        assert time.monotonic() < deadline, f"{w} never pinned {req}"
        time.sleep(0.005)
    proc.call("flush")


def _healthy(peers: Peers, d: GDecode, w: str, req: str, rng: random.Random) -> RecvStart:
    """A request to healthy worker ``w`` whose blocks are pinned there."""
    blocks = pick(rng, 2, d.geom["num_blocks"])
    peers.main.finish(w, {f"p-{req}": blocks})
    return d.start(req, peers.coords(w), f"p-{req}", blocks)


# ============================================================================ 1c: kill -9


def test_kill_before_any_handshake(peers: Peers, decode) -> None:
    """The prefill engine dies before this decode worker ever talked to it: its port
    refuses the claim's connection, so the request fails at once (not at the handshake
    timeout), and the next one too, without trying."""
    chain = peers.chains["A"]
    chain.ensure_live()
    d = decode("kill-a", **FAST)
    rng = random.Random(21)
    chain.kill()
    victim = d.start("ka-1", chain.coords(), "p-ka-1", pick(rng, 3))
    healthy = _healthy(peers, d, "H", "ka-h", rng)
    t0 = d.submit(recv_start=[victim, healthy])
    d.wait(["ka-h"], timeout=1.0)
    assert _at_once(d, d.recving["ka-h"] - t0) and "ka-h" not in d.failed
    assert d.holds(healthy.local_block_ids, healthy.remote_block_ids, SEEDS["H"])
    d.wait(["ka-1"], timeout=3.0)
    took = d.recving["ka-1"] - t0
    assert _at_once(d, took), f"the dead peer's request failed after {took:.3f} s"
    assert "ka-1" in d.failed and set(victim.local_block_ids) <= d.invalid and d.untouched(victim.local_block_ids)
    state = _peer_state(d, chain.peer_key())
    assert state["agent"] is None and state["failures"] == 1, state
    _next_request_fails_fast(d, chain, "ka-2", rng)
    _restart_is_used(d, chain, "ka-3", rng, d.recving["ka-1"])
    peers.main.wait_sent("H", ["p-ka-h"])
    reqs = {"ka-1", "ka-2", "ka-3", "ka-h", "p-ka-3", "p-ka-h"}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["H"], *chain.started_logs])
    assert findings == []
    assert finals == {("recv", "ka-1"): "failed", ("recv", "ka-2"): "failed", ("recv", "ka-3"): "done",
                      ("recv", "ka-h"): "done", ("send", "p-ka-3"): "released", ("send", "p-ka-h"): "released"}
    # The refusal fails it, and says so.
    assert d.failure("ka-1") == [("peer_dead", {"peer": chain.peer_key(), "reason": "refused"})], d.failure("ka-1")


def _kill_inside_post_read(d: GDecode, chain: Chain, victim: str, *, delay_s: float | None) -> dict[str, Any]:
    """SIGKILL the chain's live engine as the decode loop posts ``victim``'s read:
    ``delay_s=None`` before the read is handed to NIXL (and the process reaped),
    else from another thread ``delay_s`` into the post (UCX's cma copies inside
    ``transfer()``, so the kill lands during the copy)."""
    real = d.transport.post_read
    proc = chain.current.proc
    seen: dict[str, Any] = {}

    def post_read(peer: str, local: Any, remote: Any, notif: bytes, tag: str = "", **kw: Any) -> Any:
        if tag != victim:
            return real(peer, local, remote, notif, tag=tag, **kw)
        d.transport.post_read = real  # once
        t0 = time.perf_counter()
        if delay_s is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=5)
            h = real(peer, local, remote, notif, tag=tag, **kw)
        else:
            killer = threading.Timer(delay_s, proc.send_signal, args=(signal.SIGKILL,))
            killer.start()
            h = real(peer, local, remote, notif, tag=tag, **kw)
            killer.join()
        seen.update(post_s=time.perf_counter() - t0, state=h.state.value, error=h.error)
        return h

    d.transport.post_read = post_read
    return seen


def test_kill_after_the_handshake_before_the_reads(peers: Peers, decode) -> None:
    """The engine answered the claim and dies before the read is posted: NIXL reports
    the disconnect at once, the request fails, the peer is known dead."""
    chain = peers.chains["A"]
    chain.ensure_live()
    d = decode("kill-b", **FAST)
    rng = random.Random(22)
    warm = pick(rng, 2)
    chain.current.finish("KA", {"p-kb-warm": warm})
    s_warm = d.start("kb-warm", chain.coords(), "p-kb-warm", warm)
    d.submit(recv_start=[s_warm])
    d.wait(["kb-warm"])
    assert "kb-warm" not in d.failed and d.holds(s_warm.local_block_ids, warm, chain.seed)
    chain.current.wait_sent("KA", ["p-kb-warm"])
    blocks = pick(rng, 4)
    chain.current.finish("KA", {"p-kb-1": blocks})
    _pin_and_flush(chain.current, "KA", "p-kb-1")
    seen = _kill_inside_post_read(d, chain, "kb-1", delay_s=None)
    victim = d.start("kb-1", chain.coords(), "p-kb-1", blocks)
    healthy = _healthy(peers, d, "H", "kb-h", rng)
    t0 = d.submit(recv_start=[victim, healthy])
    d.wait(["kb-1", "kb-h"], timeout=3.0)
    assert seen["state"] == "error" and "Disconnect" in seen["error"], seen
    took = d.recving["kb-1"] - t0
    assert took < d.cfg.handshake_timeout_s, f"failed after {took:.3f} s"
    assert "kb-1" in d.failed and set(victim.local_block_ids) <= d.invalid and d.untouched(victim.local_block_ids)
    assert "kb-h" not in d.failed and d.holds(healthy.local_block_ids, healthy.remote_block_ids, SEEDS["H"])
    assert [(ev, inp["kind"]) for ev, inp in d.failure("kb-1")] == [("error", "transfer")]
    state = _peer_state(d, chain.peer_key())
    assert state["agent"] is None and state["failures"] >= 1 and "Disconnect" in state["last_error"], state
    _next_request_fails_fast(d, chain, "kb-2", rng)
    _restart_is_used(d, chain, "kb-3", rng, d.recving["kb-1"])
    peers.main.wait_sent("H", ["p-kb-h"])
    reqs = {"kb-warm", "kb-1", "kb-2", "kb-3", "kb-h", "p-kb-warm", "p-kb-1", "p-kb-3", "p-kb-h"}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["H"], *chain.started_logs])
    # The crash, as replay tells it: the dead engine's pinned request never ended.
    assert findings == [("not_terminal_at_end", "p-kb-1")], findings
    assert finals == {("recv", "kb-warm"): "done", ("recv", "kb-1"): "failed", ("recv", "kb-2"): "failed",
                      ("recv", "kb-3"): "done", ("recv", "kb-h"): "done", ("send", "p-kb-warm"): "released",
                      ("send", "p-kb-1"): "awaiting_pull", ("send", "p-kb-3"): "released",
                      ("send", "p-kb-h"): "released"}


def test_kill_while_the_read_is_in_flight(peers: Peers, decode) -> None:
    """SIGKILL 3 ms into a 48 MiB read (~10 ms of copying). Each attempt ends either
    failed (blocks invalid) or, if the copy beat the kill, done with exactly the
    right bytes; never done with wrong ones. The failure must happen in at least
    one of three attempts (each on a fresh incarnation: a restart)."""
    chain = peers.chains["C"]
    chain.ensure_live()
    d = decode("kill-c", geom=BIG, **FAST)
    d.reserved = 48  # blocks 0..47: the victim's, in every attempt
    n = d.geom["num_blocks"]
    rng = random.Random(23)
    outcomes: list[dict[str, Any]] = []
    for attempt in range(3):
        # The live incarnation serves (after a restart: the restart is picked up).
        warm = pick(rng, 2, n)
        chain.current.finish("KC", {f"p-kc{attempt}-warm": warm})
        s_warm = d.start(f"kc{attempt}-warm", chain.coords(), f"p-kc{attempt}-warm", warm)
        d.submit(recv_start=[s_warm])
        d.wait([f"kc{attempt}-warm"], timeout=3.0)
        assert f"kc{attempt}-warm" not in d.failed, d.failure(f"kc{attempt}-warm")
        assert d.holds(s_warm.local_block_ids, warm, chain.seed)
        chain.current.wait_sent("KC", [f"p-kc{attempt}-warm"])
        victim_req = f"kc{attempt}"
        blocks = pick(rng, 48, n)
        chain.current.finish("KC", {f"p-{victim_req}": blocks})
        _pin_and_flush(chain.current, "KC", f"p-{victim_req}")
        local = tuple(range(48))
        for i in range(d.geom["layers"]):
            d.layer(i)[list(local)] = 0
        seen = _kill_inside_post_read(d, chain, victim_req, delay_s=0.003)
        victim = d.start(victim_req, chain.coords(), f"p-{victim_req}", blocks, local=local)
        healthy = _healthy(peers, d, "HB", f"kc{attempt}-h", rng)
        t0 = d.submit(recv_start=[victim, healthy])
        d.wait([victim_req, healthy.req], timeout=3.0)
        failed = victim_req in d.failed
        print(f"attempt {attempt}: {'failed' if failed else 'done'}, post {seen}, "
              f"failure {d.failure(victim_req)}")  # shown if an assertion below fails
        if failed:  # known dead now (checked first: the dead window is short)
            _next_request_fails_fast(d, chain, f"kc{attempt}-next", rng)
        chain.current.proc.wait(timeout=5)
        assert healthy.req not in d.failed
        assert d.holds(healthy.local_block_ids, healthy.remote_block_ids, SEEDS["HB"])
        peers.main.wait_sent("HB", [healthy.remote_req])
        intact = sum(d.holds((lb,), (rb,), chain.seed) for lb, rb in zip(local, blocks, strict=True))
        written = sum(bool(d.layer(0)[lb].any() or d.layer(1)[lb].any()) for lb in local)
        outcomes.append({**seen, "failed": failed, "intact_blocks": intact, "written_blocks": written,
                         "took_s": d.recving[victim_req] - t0})
        if failed:
            assert set(local) <= d.invalid, "a failed read's blocks were not reported invalid"
            assert d.recving[victim_req] - t0 < d.cfg.transfer_timeout_s + 0.5
            state = _peer_state(d, chain.peer_key())
            assert state["agent"] is None and state["failures"] >= 1, state
            failed_at = d.recving[victim_req]
        else:
            assert intact == len(blocks), f"done with wrong bytes: {outcomes[-1]}"
            # The decode side has not noticed the death yet: the next request does.
            probe = d.start(f"kc{attempt}-probe", chain.coords(), f"p-kc{attempt}-probe", pick(rng, 1, n))
            d.submit(recv_start=[probe])
            d.wait([probe.req], timeout=3.0)
            assert probe.req in d.failed
            failed_at = d.recving[probe.req]
        _restart_is_used(d, chain, f"kc{attempt}-restart", rng, failed_at)
        if failed:
            break
    print("kill during the read:", json.dumps(outcomes))
    assert any(o["failed"] for o in outcomes), f"the kill never landed before the copy ended: {outcomes}"
    reqs = set(d.recving) | {f"p-{r}" for r in d.recving}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["HB"], *chain.started_logs])
    # What replay says of the crash: the killed engine's pinned request never ended
    # (its blocks died with it; a read that beat the kill may have released it);
    # nothing else is wrong, and every decode request ended.
    failed_reads = {f"p-kc{i}" for i, o in enumerate(outcomes) if o["failed"]}
    killed = {f"p-kc{i}" for i in range(len(outcomes))}
    # A failed read's pinned request is left open in the killed engine's log, unless its
    # notification reached the prefill side before the kill (UCX completed the copy and
    # delivered the notif; only the decode side's completion check saw the disconnect):
    # then the prefill released it, though that record may die with the engine (the log
    # writer flushes every 50 ms). Either way nothing else is reported.
    open_at_end = {r for k, r in findings if k == "not_terminal_at_end"}
    for r in failed_reads:
        assert r in open_at_end or finals.get(("send", r)) in ("released", None), (r, findings, finals.get(("send", r)))
    assert set(findings) <= {("not_terminal_at_end", r) for r in killed}, findings
    assert all(finals[("recv", r)] in ("done", "failed") for r in d.recving)
    assert {r for r in d.recving if finals[("recv", r)] == "failed"} == (
        {f"kc{i}" for i, o in enumerate(outcomes) if o["failed"]}
        | {r for r in d.recving if r.endswith(("-next", "-probe"))})


# ============================================================================ 3: unreachable peers


class SilentZmqPeer:
    """A ZMQ ROUTER on the peer's port that takes every message and answers none:
    the ZMTP handshake completes, the claim arrives, no reply ever comes."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port(f"tcp://{HOST}")
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silent-zmq", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(50):
                self.sock.recv_multipart()
                self.received += 1
        self.sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.term()


class MuteTcpPeer:
    """A TCP listener that accepts every connection and never reads or writes a byte."""

    def __init__(self) -> None:
        self.srv = socket.socket()
        self.srv.bind((HOST, 0))
        self.srv.listen(64)
        self.srv.settimeout(0.05)
        self.port = self.srv.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mute-tcp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except OSError:
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for c in self.accepted:
            c.close()
        self.srv.close()


@pytest.fixture
def unreachable(request: pytest.FixtureRequest):
    """(kind, port, evidence) of one kind of unreachable peer; evidence() counts what
    it saw (connections, messages)."""
    kind = request.param
    if kind == "closed":
        port = free_port()  # bound and closed again: nothing listens there
        yield kind, port, lambda: 0
    elif kind == "mute":
        mute = MuteTcpPeer()
        try:
            yield kind, mute.port, lambda: len(mute.accepted)
        finally:
            mute.close()
    else:
        silent = SilentZmqPeer()
        try:
            yield kind, silent.port, lambda: silent.received
        finally:
            silent.close()


def _latency(d: GDecode, start: RecvStart, *also: RecvStart) -> float:
    """Submit ``start`` (after ``also``, in one step) and return how long it took
    to be reported done."""
    t0 = d.submit(recv_start=[*also, start])
    d.wait([start.req], timeout=2.0)
    assert start.req not in d.failed, d.failure(start.req)
    return d.recving[start.req] - t0


@pytest.mark.parametrize("unreachable", ["closed", "mute", "silent"], indirect=True)
def test_unreachable_peer_fails_in_time_and_delays_nobody(peers: Peers, decode, unreachable) -> None:
    """closed: nothing listens on the port (the connection is refused: the request fails
    at once); mute: a TCP listener that never reads or writes (the ZMTP greeting never
    completes); silent: a ZMQ peer that receives the claim and never answers (both fail
    at the handshake timeout)."""
    kind, port, evidence = unreachable
    d = decode(f"unreach-{kind}", **FAST)
    rng = random.Random(port)
    # The healthy peer, warm (its agent loaded), alone: the baseline.
    warm = _healthy(peers, d, "H", f"u-{kind}-warm", rng)
    _latency(d, warm)
    baseline = [_latency(d, _healthy(peers, d, "H", f"u-{kind}-base{i}", rng)) for i in range(3)]
    # The same with a request to the unreachable peer in flight (asked first).
    coords = {"remote_engine": f"unreachable-{kind}", "remote_host": HOST, "remote_port": port, "remote_tp_size": 1}
    bad = d.start(f"u-{kind}-bad", coords, f"p-u-{kind}-bad", pick(rng, 3))
    first = _healthy(peers, d, "H", f"u-{kind}-with0", rng)
    t_bad = time.monotonic()
    with_bad = [_latency(d, first, bad)]
    with_bad += [_latency(d, _healthy(peers, d, "H", f"u-{kind}-with{i}", rng)) for i in (1, 2)]
    if kind != "closed":
        assert bad.req not in d.recving, "the unreachable peer's request ended before the healthy ones"
    assert max(with_bad) < max(baseline) + 0.1, f"healthy latencies {with_bad} vs {baseline} alone"
    d.wait([bad.req], timeout=3.0)
    took = d.recving[bad.req] - t_bad
    print(f"unreachable {kind}: healthy latencies alone {baseline}, with it {with_bad}; failed after {took:.3f} s")
    timeout = d.cfg.handshake_timeout_s
    key = f"unreachable-{kind}@tcp://{HOST}:{port}"
    state = _peer_state(d, key)
    assert bad.req in d.failed and set(bad.local_block_ids) <= d.invalid and d.untouched(bad.local_block_ids)
    assert state["failures"] == 1, state
    if kind == "closed":
        assert _at_once(d, took), f"a refused connection failed its request after {took:.3f} s"
        assert d.failure(bad.req) == [("peer_dead", {"peer": key, "reason": "refused"})], d.failure(bad.req)
        assert "connection refused" in state["last_error"], state
    else:
        assert timeout - 0.05 <= took <= timeout + 0.5, f"failed after {took:.3f} s (handshake timeout {timeout} s)"
        assert d.failure(bad.req) in ([("timeout", {"what": "handshake"})],
                                      [("peer_dead", {"peer": key, "reason": "silent"})]), d.failure(bad.req)
        assert "no reply" in state["last_error"], state
    # Known dead now: the next request to it fails at once.
    nxt = d.start(f"u-{kind}-next", coords, f"p-u-{kind}-next", pick(rng, 1))
    d.submit(recv_start=[nxt])
    d.wait([nxt.req], timeout=1.0)  # before any timeout could (at once: test_worker_virtual)
    assert nxt.req in d.failed and [ev for ev, _ in d.failure(nxt.req)] == ["peer_dead"], d.failure(nxt.req)
    if kind != "closed":
        assert evidence() >= 1, f"the {kind} peer never saw the connection or the claim"
    served = [r for r in d.recving if r not in d.failed]
    peers.main.wait_sent("H", [f"p-{r}" for r in served])
    reqs = set(d.recving) | {f"p-{r}" for r in served}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["H"]])
    assert findings == []
    assert {r: s for (lc, r), s in finals.items() if lc == "recv" and s != "done"} == {
        bad.req: "failed", nxt.req: "failed"}


# ============================================================================ 6: late read of reused blocks


def test_late_read_of_reused_blocks_is_not_delivered(peers: Peers, decode) -> None:
    """Worker R grants 0.6 s leases. The decode loop stalls between the claim and the
    read; meanwhile R's lease expires, vLLM frees the blocks and reuses them for
    another request (new bytes, pinned again). The late read then brings back the
    new request's bytes: it must fail (lease_expired) and report its blocks invalid,
    while the blocks' new owner reads them fine."""
    d = decode("reuse")
    blocks = pick(random.Random(60), 3)
    peers.main.finish("R", {"p-reuse-old": blocks})
    entered, gate = threading.Event(), threading.Event()
    real = d.transport.post_read

    def stalled(peer: str, local: Any, remote: Any, notif: bytes, tag: str = "", **kw: Any) -> Any:
        if tag == "reuse-late":
            d.transport.post_read = real
            entered.set()
            assert gate.wait(5.0), "the test never released the stalled read"
        return real(peer, local, remote, notif, tag=tag, **kw)

    d.transport.post_read = stalled
    late = d.start("reuse-late", peers.coords("R"), "p-reuse-old", blocks)
    t0 = d.submit(recv_start=[late])
    try:
        assert entered.wait(3.0), "the claim was never granted"
        sent = peers.main.wait_sent("R", ["p-reuse-old"], timeout=3.0)["p-reuse-old"]
        assert 0.5 <= sent - t0 <= 2.0, f"lease expired after {sent - t0:.3f} s"
        # vLLM reuses the freed blocks: another request's KV, pinned for another reader.
        peers.main.call("fill", w="R", blocks=blocks, seed=SEEDS["R-reused"])
        peers.main.finish("R", {"p-reuse-new": blocks})
    finally:
        gate.set()
    d.wait(["reuse-late"], timeout=3.0)
    assert d.holds(late.local_block_ids, blocks, SEEDS["R-reused"]), \
        "the late read did not bring back the reused bytes (the scenario did not happen)"
    assert "reuse-late" in d.failed, "a read of reused blocks was delivered as the request's KV"
    assert d.invalid == set(late.local_block_ids)
    # The table's verdict on the completed reads: too late in the lease the claim granted.
    assert [ev for ev, _ in d.failure("reuse-late")] == ["all_reads_done"]
    # The blocks' new owner gets them.
    new = d.start("reuse-new", peers.coords("R"), "p-reuse-new", blocks)
    d.submit(recv_start=[new])
    d.wait(["reuse-new"])
    assert "reuse-new" not in d.failed and d.holds(new.local_block_ids, blocks, SEEDS["R-reused"])
    peers.main.wait_sent("R", ["p-reuse-new"])
    reqs = {"reuse-late", "reuse-new", "p-reuse-old", "p-reuse-new"}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["R"]])
    # Replay names the fault on both sides: the prefill side saw a read of p-reuse-old
    # after its expiry, and the decode side posted it after that expiry.
    assert sorted(findings) == [("read_after_lease_expiry", "p-reuse-old"), ("read_after_lease_expiry", "reuse-late")]
    assert finals == {("recv", "reuse-late"): "failed", ("recv", "reuse-new"): "done",
                      ("send", "p-reuse-old"): "expired", ("send", "p-reuse-new"): "released"}


# ============================================================================ 7: exceptions in loop handlers
# Each scenario makes one handler raise InjectedFault (worker_peer.inject_fault): on
# this process's decode worker (a bound method or an effect-table entry replaced on
# the instance), or on prefill worker F / Z through the peer process's "inject".
# The victim is one request; "other" is in flight at the same time; "after" comes
# once the fault has fired.


def _loop_errors(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "worker.loop_error"]


def _prefill_records(peers: Peers, w: str) -> list[dict[str, Any]]:
    peers.flush()
    return [json.loads(line) for line in peers.log[w].read_text().splitlines() if line.strip()]


def _internal_errors(d: GDecode, req: str) -> list[dict[str, Any]]:
    return [inp for ev, _, _, inp in d.transitions(req) if ev == "internal_error"]


def _settled(d: GDecode, timeout: float = 3.0) -> dict[str, int]:
    """Wait until the decode worker holds no per-request I/O state any more."""
    deadline = time.monotonic() + timeout
    while True:
        io = d.half.debug_state()["io"]
        if io["recv"] == 0 and io["polling"] == 0 and io["claims"] == 0:
            return io
        assert time.monotonic() < deadline, f"per-request state left behind: {io}"
        time.sleep(0.02)


def _check_only_the_victim_failed(peers: Peers, d: GDecode, victim: RecvStart, others: list[RecvStart],
                                  w: str = "H") -> None:
    """(a) the victim failed with its blocks invalid, (b) the others hold their bytes,
    (c) the loop lives, nothing is left behind, every prefill request is released."""
    assert victim.req in d.failed, f"{victim.req} did not fail: {d.transitions(victim.req)}"
    assert set(victim.local_block_ids) <= d.invalid
    for o in others:
        assert o.req not in d.failed, (o.req, d.failure(o.req))
        assert d.holds(o.local_block_ids, o.remote_block_ids, SEEDS[w]), f"{o.req}: wrong bytes"
    assert d.invalid == set(victim.local_block_ids)
    assert d.alive()
    _settled(d)
    peers.main.wait_sent(w, [s.remote_req for s in (victim, *others)], timeout=3.0)


def _replay_clean(peers: Peers, d: GDecode, starts: list[RecvStart], w: str = "H") -> dict[tuple[str, str], str]:
    """Replay finds nothing wrong once every prefill request of ``starts`` is released."""
    peers.main.wait_sent(w, [s.remote_req for s in starts], timeout=3.0)
    reqs = {s.req for s in starts} | {s.remote_req for s in starts}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log[w]])
    assert findings == [], findings
    return finals


def _then_only_the_victim_failed(peers: Peers, d: GDecode, victim: RecvStart, others: list[RecvStart],
                                 after: RecvStart) -> dict[tuple[str, str], str]:
    """Once the fault fired: ``after`` is served, only the victim failed (see
    ``_check_only_the_victim_failed``) and replay is clean; the final states."""
    d.submit(recv_start=[after])
    d.wait([after.req])
    _check_only_the_victim_failed(peers, d, victim, [*others, after])
    return _replay_clean(peers, d, [victim, *others, after])


DECODE_FAULTS = [
    # (path on the WorkerHalf, the loop callback the error surfaces in)
    pytest.param("receiver.effects.start_handshake", "effect start_handshake", id="recv-effect-start_handshake"),
    pytest.param("receiver.effects.arm_transfer_timer", "effect arm_transfer_timer",
                 id="recv-effect-arm_transfer_timer"),
    pytest.param("receiver.effects.post_reads", "effect post_reads", id="post_reads"),
    pytest.param("receiver.reads._settle", "_settle", id="settle"),
    pytest.param("receiver.effects.deliver_blocks", None, id="recv-effect-deliver_blocks"),
    pytest.param("receiver._on_recv_start", "_on_recv_start", id="metadata-recv_start"),
]


@pytest.mark.parametrize(("path", "where"), DECODE_FAULTS)
def test_exception_in_a_decode_handler_fails_only_its_request(peers: Peers, decode, path: str,
                                                              where: str | None) -> None:
    name = path.rsplit(".", 1)[-1].strip("_")
    d = decode(f"fault-{name}", **FAST)
    rng = random.Random(name)
    victim, other, after = (_healthy(peers, d, "H", f"{name}-{r}", rng) for r in ("victim", "other", "after"))
    fault = inject_fault(d.half, path, victim=victim.req, times=1)
    d.submit(recv_start=[victim, other])
    d.wait([victim.req, other.req], timeout=3.0)
    assert fault.fired >= 1, "the fault never fired"
    d.submit(recv_start=[after])
    d.wait([after.req], timeout=3.0)
    _check_only_the_victim_failed(peers, d, victim, [other, after])
    detail = f"InjectedFault: injected into {path} for {victim.req}"
    errors = _loop_errors(d.records(victim.req))
    assert errors and errors[0]["error"] == detail, errors
    if where is not None:
        assert _internal_errors(d, victim.req) == [{"where": where, "detail": detail}]
    finals = _replay_clean(peers, d, [victim, other, after])
    # An effect of the transition to done that raised: the machine is done, vLLM was told "failed".
    assert finals[("recv", victim.req)] == ("failed" if where is not None else "done")
    assert finals[("recv", other.req)] == finals[("recv", after.req)] == "done"


def test_exception_in_the_claim_flush(peers: Peers, decode) -> None:
    """Sending the victim's claim to H raises (inside ``_flush_claims``). The victim
    fails at once, naming it; a request to another peer (F) in the same step, whose
    claim goes out in the same flush, and one of the next step are served."""
    d = decode("fault-flush", **FAST)
    rng = random.Random(71)
    warm, victim, after = (_healthy(peers, d, "H", f"flush-{r}", rng) for r in ("warm", "victim", "after"))
    same_step = _healthy(peers, d, "F", "flush-same-step", rng)
    _latency(d, warm)  # H's agent is loaded: claims to H go as heartbeats from now on
    fault = inject_fault(d.half, "client.heartbeat", victim=victim.remote_req, times=1)
    d.submit(recv_start=[victim, same_step])  # H's claim is sent first
    d.wait([victim.req, same_step.req], timeout=3.0)  # (at once, on virtual time: test_reliability_virtual)
    assert fault.fired == 1
    detail = f"InjectedFault: injected into client.heartbeat for {victim.remote_req}"
    assert _internal_errors(d, victim.req) == [{"where": "claim flush", "detail": detail}]
    assert same_step.req not in d.failed, d.failure(same_step.req)
    assert d.holds(same_step.local_block_ids, same_step.remote_block_ids, SEEDS["F"])
    d.submit(recv_start=[after])
    d.wait([after.req])
    _check_only_the_victim_failed(peers, d, victim, [warm, after])
    peers.main.wait_sent("F", [same_step.remote_req])
    _replay_clean(peers, d, [warm, victim, after])


def test_exception_in_a_claim_result(peers: Peers, decode) -> None:
    """Handling the reply to the victim's claim raises (in the side-channel reader,
    which blames no request). The victim fails at once, naming it; the other request,
    whose reply may come in the same read of the socket, is served."""
    d = decode("fault-claim-result", **FAST)
    rng = random.Random(72)
    victim, other, after = (_healthy(peers, d, "H", f"claimres-{r}", rng) for r in ("victim", "other", "after"))
    fault = inject_fault(d.half, "peers_and_claims._on_claim_result", victim=victim.req, times=1)
    d.submit(recv_start=[victim])
    d.submit(recv_start=[other])
    d.wait([victim.req, other.req], timeout=3.0)
    assert fault.fired == 1
    assert other.req not in d.failed, d.failure(other.req)  # (the victim at once: test_reliability_virtual)
    detail = f"InjectedFault: injected into peers_and_claims._on_claim_result for {victim.req}"
    assert _internal_errors(d, victim.req) == [{"where": "claim result", "detail": detail}]
    _then_only_the_victim_failed(peers, d, victim, [other], after)


def test_exception_in_a_claim_retry(peers: Peers, decode) -> None:
    """The victim's claim is answered "unknown" (the prefill has not finished it) and
    its retry timer raises: internal_error for the victim alone. Its abandon reaches
    the prefill first, which releases the blocks the moment they are pinned."""
    d = decode("fault-retry", **FAST)
    rng = random.Random(73)
    other, after = (_healthy(peers, d, "H", f"retry-{r}", rng) for r in ("other", "after"))
    vblocks = pick(rng, 2)
    victim = d.start("retry-victim", peers.coords("H"), "p-retry-victim", vblocks)
    fault = inject_fault(d.half, "peers_and_claims._retry_claim", victim=victim.req)
    d.submit(recv_start=[victim, other])
    d.wait([victim.req, other.req], timeout=3.0)
    assert fault.fired == 1
    detail = f"InjectedFault: injected into peers_and_claims._retry_claim for {victim.req}"
    assert _internal_errors(d, victim.req) == [{"where": "claim retry", "detail": detail}]
    peers.main.finish("H", {victim.remote_req: vblocks})
    finals = _then_only_the_victim_failed(peers, d, victim, [other], after)
    assert finals[("send", victim.remote_req)] == "released"


def _slow_reads(d: GDecode, reqs: dict[str, int]) -> None:
    """``transport.check`` reports these requests' reads in flight for their first
    ``n`` checks (a read the loop has to poll, as a slow copy or a fresh connection
    gives), then asks NIXL."""
    from kvsm.transport.base import TransferState

    real = d.transport.check

    def check(h: Any) -> Any:
        if reqs.get(h.tag, 0) > 0:
            reqs[h.tag] -= 1
            return TransferState.PENDING
        return real(h)

    d.transport.check = check


def test_exception_in_settle_while_polling(peers: Peers, decode) -> None:
    """The victim's read is polled (in flight after posting) and ``_settle`` raises in
    the poll timer: internal_error for the victim; the other read, polled by the same
    timer, completes."""
    d = decode("fault-settle-poll", **FAST)
    rng = random.Random(74)
    victim, other, after = (_healthy(peers, d, "H", f"settlepoll-{r}", rng) for r in ("victim", "other", "after"))
    _slow_reads(d, {victim.req: 3, other.req: 3})
    # (skip=1: the check in _post_reads)
    fault = inject_fault(d.half, "receiver.reads._settle", victim=victim.req, times=1, skip=1)
    d.submit(recv_start=[victim, other])
    d.wait([victim.req, other.req], timeout=3.0)
    assert fault.fired >= 1
    detail = f"InjectedFault: injected into receiver.reads._settle for {victim.req}"
    assert _internal_errors(d, victim.req) == [{"where": "_settle", "detail": detail}]
    _then_only_the_victim_failed(peers, d, victim, [other], after)


def test_exception_in_the_read_poll_timer(peers: Peers, decode) -> None:
    """``_poll_reads`` raises once (it blames no request). Reads in flight must still
    complete: the timer has to come back."""
    d = decode("fault-poll-reads", **FAST)
    rng = random.Random(75)
    first, second = (_healthy(peers, d, "H", f"pollreads-{r}", rng) for r in ("first", "second"))
    _slow_reads(d, {first.req: 3, second.req: 3})
    fault = inject_fault(d.half, "receiver.reads._poll_reads", times=1)
    d.submit(recv_start=[first])
    d.wait([first.req], timeout=3.0)  # (when exactly, on virtual time: test_reliability_virtual)
    assert fault.fired == 1
    assert _loop_errors(d.records())[0]["label"] == "poll reads"
    assert first.req not in d.failed, d.failure(first.req)
    d.submit(recv_start=[second])
    d.wait([second.req], timeout=3.0)
    assert second.req not in d.failed, d.failure(second.req)
    _settled(d)
    _replay_clean(peers, d, [first, second])


def test_exception_in_a_heartbeat(peers: Peers, decode) -> None:
    """One heartbeat raises (blamed on no request): it is lost, the loop lives, the
    next heartbeats keep worker F's 1 s lease alive and the request is read later."""
    d = decode("fault-heartbeat", **FAST)
    rng = random.Random(76)
    blocks = pick(rng, 2)
    t0 = time.monotonic()
    peers.main.finish("F", {"p-hb-pinned": blocks})
    other = _healthy(peers, d, "H", "hb-other", rng)
    fault = inject_fault(d.half, "peers_and_claims._send_heartbeat", times=1)
    target = HeartbeatTarget(claims=("p-hb-pinned",), **peers.coords("F"))
    d.submit(recv_start=[other], heartbeats=[target])
    d.wait([other.req])
    assert fault.fired == 1
    assert [(e["req"], e["label"]) for e in _loop_errors(d.records())] == [(None, "_send_heartbeat")]
    while time.monotonic() < t0 + 1.6:  # real time past F's 1 s lease, heartbeats every 0.15 s
        d.submit(heartbeats=[target])
        time.sleep(0.15)
    assert "p-hb-pinned" not in peers.main.sent("F"), "the lease expired despite the later heartbeats"
    start = d.start("hb-pinned", peers.coords("F"), "p-hb-pinned", blocks)
    d.submit(recv_start=[start])
    d.wait([start.req])
    assert start.req not in d.failed and d.holds(start.local_block_ids, blocks, SEEDS["F"])
    assert other.req not in d.failed and d.holds(other.local_block_ids, other.remote_block_ids, SEEDS["H"])
    assert d.alive()
    peers.main.wait_sent("F", ["p-hb-pinned"])
    peers.main.wait_sent("H", [other.remote_req])
    reqs = {"hb-pinned", "p-hb-pinned", other.req, other.remote_req}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["F"], peers.log["H"]])
    assert findings == []
    assert set(finals.values()) == {"done", "released"}


def test_exception_in_the_handshake_deadline_timer(peers: Peers, decode) -> None:
    """``_expire_client`` raises once when the victim's claim (to a ZMQ peer that
    never answers) falls due. The victim still fails at its handshake timeout, the
    other request is served; the expired claim must not stay pending."""
    silent = SilentZmqPeer()
    try:
        d = decode("fault-expiry", **FAST)
        rng = random.Random(77)
        coords = {"remote_engine": "silent", "remote_host": HOST, "remote_port": silent.port, "remote_tp_size": 1}
        victim = d.start("expiry-victim", coords, "p-expiry-victim", pick(rng, 2))
        other = _healthy(peers, d, "H", "expiry-other", rng)
        fault = inject_fault(d.half, "peers_and_claims._expire_client", times=1)
        t0 = d.submit(recv_start=[victim, other])
        d.wait([victim.req, other.req], timeout=3.0)
        # Not before its timeout (exactly at it: test_reliability_virtual).
        assert victim.req in d.failed and d.recving[victim.req] - t0 >= d.cfg.handshake_timeout_s - 0.05
        assert other.req not in d.failed
        # Nothing stays pending past the deadline of the abandon the failure sent.
        deadline = d.recving[victim.req] + d.cfg.handshake_timeout_s + 0.2
        while (io := d.half.debug_state()["io"])["claims"] or io["oneway"]:
            assert time.monotonic() < deadline, f"handshakes left pending: {io}"
            time.sleep(0.01)
        assert fault.fired == 1 and d.alive()
    finally:
        silent.close()


# -- the prefill side (worker F, lease 1 s; worker Z for what cannot be undone)


@pytest.fixture
def prefill_faults(peers: Peers):
    """Injects into prefill workers; every fault is removed after the test."""
    used: set[str] = set()

    def inject(w: str, path: str, **kw: Any) -> None:
        used.add(w)
        peers.main.call("inject", w=w, path=path, **kw)

    def fired(w: str) -> dict[str, int]:
        return peers.main.call("faults", w=w)["faults"]

    inject.fired = fired  # type: ignore[attr-defined]
    try:
        yield inject
    finally:
        for w in used:
            peers.main.call("clear_faults", w=w)


def _read_from(peers: Peers, d: GDecode, w: str, reqs: list[str], rng: random.Random) -> list[RecvStart]:
    starts = [_healthy(peers, d, w, r, rng) for r in reqs]
    d.submit(recv_start=starts)
    d.wait([s.req for s in starts], timeout=3.0)
    for s in starts:
        assert s.req not in d.failed, (s.req, d.failure(s.req))
        assert d.holds(s.local_block_ids, s.remote_block_ids, SEEDS[w])
    peers.main.wait_sent(w, [s.remote_req for s in starts], timeout=2.0)
    return starts


def test_exception_in_the_prefill_claims_handler(peers: Peers, decode, prefill_faults) -> None:
    """F's claims handler raises for the victim's claim: the side channel answers an
    "internal" refusal, the decode request fails at once naming it, the other
    request (its own claim) is read, and the victim's blocks are freed by F's lease."""
    d = decode("fault-on-claims", **FAST)
    rng = random.Random(81)
    victim = _healthy(peers, d, "F", "onclaims-victim", rng)
    prefill_faults("F", "server._on_claims", victim=victim.remote_req)
    t0 = d.submit(recv_start=[victim])
    starts = _read_from(peers, d, "F", ["onclaims-other"], rng)
    d.wait([victim.req])
    assert victim.req in d.failed  # (at once, and freed at its lease's end: test_reliability_virtual)
    [(ev, inp)] = d.failure(victim.req)
    assert (ev, inp["kind"]) == ("error", "handshake") and "injected into server._on_claims" in inp["detail"], inp
    sent = peers.main.wait_sent("F", [victim.remote_req], timeout=3.0)
    assert sent[victim.remote_req] - t0 < LEASES["F"] + 0.5
    starts += _read_from(peers, d, "F", ["onclaims-after"], rng)
    assert prefill_faults.fired("F")["server._on_claims"] >= 1
    assert d.alive()
    reqs = {victim.req, victim.remote_req} | {s.req for s in starts} | {s.remote_req for s in starts}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["F"]])
    assert findings == []
    assert finals[("send", victim.remote_req)] == "expired" and finals[("recv", victim.req)] == "failed"


def test_exception_in_the_prefill_metadata_provider(peers: Peers, decode, prefill_faults) -> None:
    """F's metadata provider raises once: the first claim (which fetches F's agent)
    is refused, its request fails at once and its abandon frees F's blocks; the
    next request fetches the agent again and is read."""
    d = decode("fault-provide", **FAST)
    rng = random.Random(82)
    victim = _healthy(peers, d, "F", "provide-victim", rng)
    other = _healthy(peers, d, "H", "provide-other", rng)
    prefill_faults("F", "server._provide", times=1)
    t0 = d.submit(recv_start=[victim, other])
    d.wait([victim.req, other.req])
    assert victim.req in d.failed and _at_once(d, d.recving[victim.req] - t0)
    assert other.req not in d.failed
    [(ev, inp)] = d.failure(victim.req)
    assert (ev, inp["kind"]) == ("error", "handshake") and "injected into server._provide" in inp["detail"], inp
    # Freed by the abandon: "released" in replay below (F's lease would make it "expired").
    peers.main.wait_sent("F", [victim.remote_req], timeout=2.0)
    starts = _read_from(peers, d, "F", ["provide-after"], rng)
    peers.main.wait_sent("H", [other.remote_req])
    assert prefill_faults.fired("F") == {"server._provide": 1}
    reqs = {victim.req, victim.remote_req, other.req, other.remote_req} | {s.req for s in starts} | {
        s.remote_req for s in starts}
    findings, finals, _ = replay(peers, [d], reqs, [peers.log["F"], peers.log["H"]])
    assert findings == []
    assert finals[("send", victim.remote_req)] == "released", "the abandon did not free the blocks"


PREFILL_LEAKS = [
    pytest.param("sender.effects.arm_lease", False, id="send-effect-arm_lease"),
    pytest.param("sender._lease_expired", False, id="lease_expiry"),
    pytest.param("sender.effects.free_blocks", True, id="send-effect-free_blocks"),
]


@pytest.mark.parametrize(("path", "read"), PREFILL_LEAKS)
def test_exception_in_a_prefill_handler_leaks_nothing(peers: Peers, decode, prefill_faults, path: str,
                                                      read: bool) -> None:
    """A send-side handler raises for the victim (arming its lease, its lease expiry,
    freeing its blocks after the read). Whatever happens, its blocks must come back
    in finished_sending by the end of its lease, the other requests are served, and
    F's loop lives."""
    name = path.rsplit(".", 1)[-1].strip("_")
    d = decode(f"fault-p-{name}", **FAST)
    rng = random.Random(name)
    vblocks = pick(rng, 2)
    victim_remote = f"p-{name}-victim"
    prefill_faults("F", path, victim=victim_remote, times=1)
    t0 = time.monotonic()
    peers.main.finish("F", {victim_remote: vblocks})
    if read:
        victim = d.start(f"{name}-victim", peers.coords("F"), victim_remote, vblocks)
        d.submit(recv_start=[victim])
    starts = _read_from(peers, d, "F", [f"{name}-other"], rng)
    if read:
        d.wait([victim.req])
        assert victim.req not in d.failed and d.holds(victim.local_block_ids, vblocks, SEEDS["F"])
    deadline = time.monotonic() + LEASES["F"] + 1.0
    while prefill_faults.fired("F")[path] < 1:  # the lease expiry fires a lease later
        assert time.monotonic() < deadline, "the fault never fired"
        time.sleep(0.02)
    deadline = time.monotonic() + 5.0  # (the record follows the raise: the log is written by its own thread)
    while not (errors := [e for e in _loop_errors(_prefill_records(peers, "F")) if e["req"] == victim_remote]):
        assert time.monotonic() < deadline, "the fault's loop error was never logged"
        time.sleep(0.02)
    assert "injected into" in errors[0]["error"]
    starts += _read_from(peers, d, "F", [f"{name}-after"], rng)
    sent = peers.main.wait_sent("F", [victim_remote], timeout=LEASES["F"] + 1.0)
    assert sent[victim_remote] - t0 < LEASES["F"] + 1.0


def test_exception_in_the_prefill_notification_poll(peers: Peers, decode, prefill_faults) -> None:
    """NIXL's get_notifs raises on worker F right after taking the victim's read
    notification off the wire (kept for the next call, none lost). The poll must
    come back: the victim and the other request, read in the same step, are released
    by their notifications within a fraction of F's 1 s lease."""
    d = decode("fault-notifs", **FAST)
    rng = random.Random(83)
    victim, other = (_healthy(peers, d, "F", f"notifs-{r}", rng) for r in ("victim", "other"))
    prefill_faults("F", "transport.get_notifs", victim=victim.remote_req, times=1, hold=True)
    t0 = d.submit(recv_start=[victim, other])
    d.wait([victim.req, other.req])
    assert not d.failed
    sent = peers.main.wait_sent("F", [victim.remote_req, other.remote_req], timeout=2.0)
    assert prefill_faults.fired("F") == {"transport.get_notifs": 1}
    late = {r: round(t - t0, 3) for r, t in sent.items() if r in (victim.remote_req, other.remote_req)}
    # Before the lease would have (a poll interval after the read, on virtual time:
    # test_reliability_virtual).
    assert max(late.values()) < LEASES["F"], f"released only after {late} s (lease {LEASES['F']} s)"
    findings, finals, _ = replay(peers, [d], {victim.req, other.req, victim.remote_req, other.remote_req},
                                 [peers.log["F"]])
    assert findings == []
    assert finals[("send", victim.remote_req)] == finals[("send", other.remote_req)] == "released"


def test_exception_in_the_prefill_notification_timer(peers: Peers, decode, prefill_faults) -> None:
    """Worker Z's ``_poll_notifs`` raises once (blamed on no request). Later reads
    must still be released by their notifications, not by the lease."""
    d = decode("fault-notif-timer", **FAST)
    rng = random.Random(84)
    _read_from(peers, d, "Z", ["notiftimer-warm"], rng)  # Z has a reader: it polls
    peers.main.wait_sent("Z", ["p-notiftimer-warm"], timeout=2.0)
    prefill_faults("Z", "sender._poll_notifs", times=1)
    deadline = time.monotonic() + 2.0
    while prefill_faults.fired("Z").get("sender._poll_notifs", 0) < 1:
        assert time.monotonic() < deadline, "Z never polled"
        time.sleep(0.02)
    starts = _read_from(peers, d, "Z", ["notiftimer-after"], rng)
    remote = starts[0].remote_req
    peers.main.wait_sent("Z", [remote], timeout=2.0)
    # Released by the read's notification: a lease expiry would end it "expired".
    _, finals, _ = replay(peers, [d], {remote}, [peers.log["Z"]])
    assert finals[("send", remote)] == "released", "released by the lease, not by the read"
