"""WorkerHalf end to end: real NIXL (UCX, DRAM), real side channel, two processes.

The decode side runs in this process: a ``WorkerHalf`` (kv_consumer) over its
own zeroed KV caches, fed ``KVSMConnectorMetadata`` built by hand exactly as
the scheduler half would. The prefill side runs in ``tests/worker_peer.py``
subprocesses: ``WorkerHalf`` (kv_producer) workers over caches filled with a
seeded pattern, driven by JSON lines. Every wait has a deadline; results are
accumulated across ``take_results`` calls, as vLLM's model runner does.

Processes (started once per module, in parallel):

* ``main``: workers A (lease 30 s), S (lease 0.3 s), N (lease 30 s, polling its
  NIXL notifications every 0.5 s), and X (lease 0.3 s) and Y (lease 2 s), which
  only the regression tests use, so that what they leave behind (late reads,
  requests still pinned) stays out of the clean replay;
* ``k``: worker K, which scenario 5 kills with SIGKILL;
* ``k2``: worker K again (same engine id, same agent name, another pattern),
  built but not bound until scenario 5 "restarts" the engine with it.

The last test replays every clean log with ``kvsm.replay.analyse``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import require

require("nixl._api")
torch = require("torch")

import zmq

from worker_peer import (
    GEOMETRY,
    agent_name,
    compat_fields,
    config_fields,
    geometry,
    make_caches,
    pattern,
)

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handshake import PROTOCOL_VERSION, CompatInfo, MetadataRequest, encode
from kvsm.replay import analyse
from kvsm.transport.layout import describe_kv_caches
from kvsm.transport.nixl import NixlTransport
from kvsm.vllm.metadata import (
    HeartbeatTarget,
    KVSMConnectorMetadata,
    RecvAbandon,
    RecvAbort,
    RecvStart,
)
from kvsm.worker import WorkerHalf
from kvsm_testing.peer_process import PeerProcess
from kvsm_testing.ports import free_port
from kvsm_testing.reliability import stop_process

PEER_SCRIPT = Path(__file__).with_name("worker_peer.py")
REPO = PEER_SCRIPT.parent.parent
HOST = "127.0.0.1"
NUM_BLOCKS = GEOMETRY["num_blocks"]
BLOCK_TOKENS = GEOMETRY["block_size"]
SEEDS = {"A": 101, "S": 102, "X": 103, "Y": 104, "N": 105, "K": 201, "K2": 202}
ENGINES = {"A": "prefill-A", "S": "prefill-S", "X": "prefill-X", "Y": "prefill-Y", "N": "prefill-N",
           "K": "prefill-K"}
SLOW_POLL_S = 0.5  # worker N's notification poll (and its decode side's read poll)
POLL_S = 0.002

# Decode logs of the clean scenarios (the regression tests keep theirs apart).
CLEAN_DECODE_LOGS: list[Path] = []


# ----------------------------------------------------------------------------- prefill


class PeerProc(PeerProcess):
    """A worker_peer.py process: spawn now, ``ready()`` later (so several start at once)."""

    def __init__(self, label: str, workers: list[dict[str, Any]], log_dir: Path, defer_start: bool = False) -> None:
        super().__init__(label, PEER_SCRIPT, {"defer_start": defer_start, "workers": workers}, log_dir, root=REPO)

    def call(self, op: str, timeout: float = 10.0, **kw: Any) -> dict[str, Any]:
        """``timeout`` is what the command itself may take: the reply gets 5 s more."""
        return super().call(op, timeout + 5.0, **kw)

    # Conveniences.
    def finish(self, w: str, reqs: dict[str, list[int]], start: tuple[str, ...] = ()) -> None:
        """The scheduler's SendStart (optional) and SendFinish(ok) for ``reqs`` in one step."""
        self.call("submit", w=w, send_start=list(start), send_finish=[[r, b] for r, b in reqs.items()])

    def wait_sent(self, w: str, reqs: list[str], timeout: float = 5.0) -> dict[str, float]:
        sent = self.call("wait_sent", timeout=timeout, w=w, reqs=reqs, within=timeout)["sent"]
        missing = [r for r in reqs if r not in sent]
        assert not missing, f"worker {w} never reported finished_sending for {missing} within {timeout} s"
        return sent

    def sent(self, w: str) -> dict[str, float]:
        return self.call("sent")["sent"][w]

    def state(self, w: str) -> dict[str, Any]:
        return self.call("state", w=w)["state"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def coords_of(engine: str, port: int) -> dict[str, Any]:
    """The RecvStart fields that say where a prefill engine is."""
    return {"remote_engine": engine, "remote_host": HOST, "remote_port": port, "remote_tp_size": 1}


class PrefillPeers:
    """A module's prefill engines (worker name -> engine id), each on its own port with
    its own event log; subclasses start the worker_peer.py processes that serve them."""

    def __init__(self, log_dir: Path, engines: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.engines = engines
        self.port = {w: free_port() for w in engines}
        self.log = {w: log_dir / f"{engines[w]}.jsonl" for w in engines}

    def coords(self, w: str) -> dict[str, Any]:
        """The RecvStart fields that say where worker ``w`` is."""
        return coords_of(self.engines[w], self.port[w])

    def flush(self) -> None:
        """Every live peer writes out its event logs."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class Peers(PrefillPeers):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir, ENGINES)
        self.log["K2"] = log_dir / "prefill-K-restarted.jsonl"

        def spec(w: str, lease_s: float, seed_key: str | None = None, log_key: str | None = None,
                 **config: Any) -> dict[str, Any]:
            return {"name": w, "engine_id": ENGINES[w], "port": self.port[w], "lease_s": lease_s,
                    "seed": SEEDS[seed_key or w], "log": str(self.log[log_key or w]), "config": config}

        self.procs: list[PeerProc] = []
        try:
            self.main = self._spawn("main", [spec("A", 30.0), spec("S", 0.3), spec("X", 0.3), spec("Y", 2.0),
                                             spec("N", 30.0, notif_poll_interval_s=SLOW_POLL_S)])
            self.k = self._spawn("k", [spec("K", 30.0)])
            self.k2 = self._spawn("k2", [spec("K", 30.0, seed_key="K2", log_key="K2")], defer_start=True)
            for p in self.procs:
                p.ready()
        except BaseException:
            self.close()
            raise

    def _spawn(self, label: str, workers: list[dict[str, Any]], defer_start: bool = False) -> PeerProc:
        self.procs.append(PeerProc(label, workers, self.log_dir, defer_start))
        return self.procs[-1]

    def flush(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.call("flush")

    def close(self) -> None:
        for p in self.procs:
            p.close()


@pytest.fixture(scope="module")
def silent_port():
    """A TCP listener that accepts connections and never says a word."""
    srv = socket.socket()
    srv.bind((HOST, 0))
    srv.listen(64)
    srv.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)

    t = threading.Thread(target=accept, name="silent-listener", daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(timeout=2)
        for c in held:
            c.close()
        srv.close()


# ----------------------------------------------------------------------------- decode


class Decode:
    """A decode-side WorkerHalf over zeroed caches, with vLLM's view of its results."""

    def __init__(self, name: str, log_dir: Path, *, geom: dict[str, int] | None = None,
                 compat: dict[str, Any] | None = None, **cfg: Any) -> None:
        self.geom = geometry(geom)  # ``GEOMETRY`` unless overridden (the prefill worker's must match)
        self.engine_id = f"decode-{name}"
        self.caches = make_caches(None, geom)
        self.transport = NixlTransport(agent_name(self.engine_id), describe_kv_caches(self.caches))
        self.cfg = KVSMConfig(**config_fields(self.engine_id, "kv_consumer", 1, geom, **cfg))
        self.log_path = log_dir / f"{self.engine_id}.jsonl"
        self.log = EventLog(self.log_path, role="worker", engine_id=self.engine_id)
        self.half = WorkerHalf(self.cfg, 0, event_log=self.log)
        self.half.start(self.transport, CompatInfo(**compat_fields(geom, **(compat or {}))))
        self.recving: dict[str, float] = {}  # req -> when first seen in finished_recving
        self.failed: dict[str, float] = {}
        self.invalid: set[int] = set()
        self.reports: Counter[str] = Counter()  # times each req appeared in finished_recving
        self.sending: set[str] = set()
        self.local_of: dict[str, tuple[int, ...]] = {}
        self._step = 0
        self._next_block = 0
        self._closed = False
        self._patterns: dict[int, np.ndarray] = {}

    # -- inputs
    def blocks(self, n: int) -> tuple[int, ...]:
        """``n`` local blocks no other request of this worker was given."""
        out = tuple(range(self._next_block, self._next_block + n))
        self._next_block += n
        assert self._next_block <= self.geom["num_blocks"], "test bug: out of decode blocks"
        return out

    def start(self, req: str, coords: dict[str, Any], remote_req: str, remote_blocks: tuple[int, ...] | list[int],
              *, local: tuple[int, ...] | None = None, awaited: bool = True) -> RecvStart:
        remote_blocks = tuple(remote_blocks)
        local = self.blocks(len(remote_blocks)) if local is None else local
        self.local_of[req] = local
        return RecvStart(req=req, remote_req=remote_req, remote_block_ids=remote_blocks, local_block_ids=local,
                         num_tokens=max(1, len(remote_blocks)) * self.geom["block_size"], awaited=awaited, **coords)

    def submit(self, *, recv_start=(), recv_abort=(), recv_abandon=(), heartbeats=()) -> float:
        self._step += 1
        meta = KVSMConnectorMetadata(self._step)
        meta.recv_start = list(recv_start)
        meta.recv_abort = list(recv_abort)
        meta.recv_abandon = list(recv_abandon)
        meta.heartbeats = list(heartbeats)
        t = time.monotonic()
        self.half.submit(meta)
        return t

    # -- outputs
    def poll(self) -> None:
        sending, recving, failed = self.half.take_results()
        invalid = self.half.take_invalid_blocks()
        now = time.monotonic()
        # What vLLM relies on: a failed request is also finished in the same step,
        # and its blocks are reported invalid no later than that step.
        assert failed <= recving, f"failed_recving {failed - recving} without finished_recving"
        self.invalid |= invalid
        for r in failed:
            assert set(self.local_of.get(r, ())) <= self.invalid, f"{r} failed before its blocks were invalid"
        self.failed.update((r, now) for r in failed if r not in self.failed)
        for r in recving:
            self.reports[r] += 1
            self.recving.setdefault(r, now)
        self.sending |= sending

    def wait(self, reqs: list[str], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            missing = [r for r in reqs if r not in self.recving]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.engine_id}: {missing} not in finished_recving within {timeout} s; "
                                     f"state {self.half.debug_state()}")
            time.sleep(POLL_S)

    def quiet(self, seconds: float) -> None:
        """Keep polling for ``seconds`` (to see that nothing more arrives)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)

    def wait_state(self, req: str, state: str, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while (got := self.half.debug_state()["recv"].get(req)) != state:
            assert time.monotonic() < deadline, f"{req} is in {got!r}, never reached {state!r}"
            time.sleep(0.005)

    # -- the bytes
    def layer(self, i: int) -> np.ndarray:
        return self.caches[f"model.layers.{i}.self_attn.attn"].view(torch.int32).numpy()

    def pattern(self, seed: int) -> np.ndarray:
        """The bytes of a prefill worker filled with ``seed`` (computed once per seed)."""
        if seed not in self._patterns:
            self._patterns[seed] = pattern(seed, self.geom)
        return self._patterns[seed]

    def holds(self, local: tuple[int, ...], remote: tuple[int, ...] | list[int], seed: int) -> bool:
        """Every layer's local blocks equal the prefill's ``remote`` blocks, pairwise."""
        want = self.pattern(seed)
        return all(np.array_equal(self.layer(i)[list(local)], want[i][list(remote)])
                   for i in range(self.geom["layers"]))

    def zero_except(self, written: set[int]) -> bool:
        others = [b for b in range(self.geom["num_blocks"]) if b not in written]
        return all(not self.layer(i)[others].any() for i in range(self.geom["layers"]))

    # -- the log
    def records(self, req: str | None = None) -> list[dict[str, Any]]:
        self.log.flush()
        recs = [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]
        return [r for r in recs if req is None or r.get("req") == req]

    def transitions(self, req: str) -> list[tuple[str, str, str, dict[str, Any]]]:
        return [(r["event"], r["src"], r["dst"], r.get("input", {})) for r in self.records(req)
                if r["kind"] == "transition"]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.half.shutdown()


def harness_fixtures(make_peers: Callable[[Path], PrefillPeers], make_decode: Callable[..., Decode],
                     logs: str) -> tuple[Any, Any, Any]:
    """A module's fixtures: ``log_dir`` (one temp directory ``logs`` for every log),
    ``peers`` (``make_peers(log_dir)``: started once, closed at the end of the module)
    and ``decode``, a factory of decode workers (``make_decode(name, log_dir, **kw)``)
    that closes each at the end of the test."""

    @pytest.fixture(scope="module")
    def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp(logs)

    @pytest.fixture(scope="module")
    def peers(log_dir: Path) -> Iterator[PrefillPeers]:
        p = make_peers(log_dir)
        try:
            yield p
        finally:
            p.close()

    @pytest.fixture
    def decode(log_dir: Path) -> Iterator[Callable[..., Decode]]:
        made: list[Decode] = []

        def make(name: str, **kw: Any) -> Decode:
            made.append(make_decode(name, log_dir, **kw))
            return made[-1]

        try:
            yield make
        finally:
            for d in made:
                d.close()

    return log_dir, peers, decode


def _decode(name: str, log_dir: Path, *, clean: bool = True, **kw: Any) -> Decode:
    """A decode worker; ``clean=False`` keeps its log out of the final replay."""
    d = Decode(name, log_dir, **kw)
    if clean:
        CLEAN_DECODE_LOGS.append(d.log_path)
    return d


log_dir, peers, decode = harness_fixtures(Peers, _decode, "worker-nixl-logs")


def replay_logs(peers: PrefillPeers, decodes: list[Decode], reqs: set[str], prefill_logs: list[Path]):
    """analyse() over these decode logs and these prefill logs: the findings about
    ``reqs`` (and any that name no request), every machine's final state, the report."""
    peers.flush()
    for d in decodes:
        d.log.flush()
    report = analyse([d.log_path for d in decodes] + prefill_logs)
    findings = [(f.kind, f.req) for f in report.findings if f.req is None or f.req in reqs]
    finals = {(m.lifecycle, m.req): m.final_state for m in report.machines if m.req in reqs}
    return findings, finals, report


def replay(peers: Peers, decodes: list[Decode], reqs: set[str], prefill: tuple[str, ...] = ("A",)):
    """``replay_logs`` over the logs of prefill workers ``prefill``: (findings, finals)."""
    findings, finals, _ = replay_logs(peers, decodes, reqs, [peers.log[w] for w in prefill])
    return findings, finals


def pick(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(NUM_BLOCKS), n)


# ============================================================================ scenarios


def test_happy_path_moves_the_exact_bytes(peers: Peers, decode) -> None:
    """Several requests in one step (one of a single block) arrive intact; a permuted
    mapping is caught by the byte comparison."""
    d = decode("s1")
    rng = random.Random(1)
    sizes = {"s1-one": 1, "s1-three": 3, "s1-eight": 8, "s1-perm": 4}
    remote = {r: pick(rng, n) for r, n in sizes.items()}
    peers.main.finish("A", {f"p-{r}": b for r, b in remote.items()})
    # s1-perm asks for the prefill's blocks in another order than they were pinned.
    asked = dict(remote, **{"s1-perm": remote["s1-perm"][1:] + remote["s1-perm"][:1]})
    starts = {r: d.start(r, peers.coords("A"), f"p-{r}", asked[r]) for r in sizes}
    d.submit(recv_start=starts.values())
    d.wait(list(sizes))
    assert not d.failed and not d.invalid
    assert all(d.reports[r] == 1 for r in sizes)
    for r, s in starts.items():
        assert d.holds(s.local_block_ids, s.remote_block_ids, SEEDS["A"]), f"{r}: wrong bytes"
    written = {b for s in starts.values() for b in s.local_block_ids}
    assert d.zero_except(written), "a read wrote outside its local blocks"
    # The comparison can fail: s1-perm's blocks do not hold the blocks in pinned order,
    # and no request's blocks hold another engine's pattern.
    perm = starts["s1-perm"]
    assert not d.holds(perm.local_block_ids, tuple(remote["s1-perm"]), SEEDS["A"])
    assert not d.holds(starts["s1-eight"].local_block_ids, starts["s1-eight"].remote_block_ids, SEEDS["S"])
    peers.main.wait_sent("A", [f"p-{r}" for r in sizes])
    findings, finals = replay(peers, [d], set(sizes) | {f"p-{r}" for r in sizes})
    assert findings == []
    assert finals == {**{("recv", r): "done" for r in sizes}, **{("send", f"p-{r}"): "released" for r in sizes}}


def test_a_known_peer_is_read_right_behind_the_claim(peers: Peers, decode) -> None:
    """Once a prefill worker's agent is known, a request's read goes out with its
    claim. With the prefill process stopped (SIGSTOP: its loop cannot answer),
    nothing is reported: the read may land (UCX reads the other process's memory
    without it) but waits for the grant. Resumed, the claim is granted, the bytes
    are exact, and the prefill worker counts the read the notification says was
    posted early."""
    d = decode("s1e")
    rng = random.Random(11)
    first = pick(rng, 2)
    peers.main.finish("A", {"p-s1e-first": first})
    s0 = d.start("s1e-first", peers.coords("A"), "p-s1e-first", first)
    d.submit(recv_start=[s0])
    d.wait(["s1e-first"])  # its claim fetched A's agent: reads waited for it
    assert [dst for _, _, dst, _ in d.transitions("s1e-first")][1] == "pending_handshake"
    blocks = pick(rng, 3)
    peers.main.finish("A", {"p-s1e": blocks})
    s1 = d.start("s1e", peers.coords("A"), "p-s1e", blocks)
    stop_process(peers.main.proc.pid)
    try:
        d.submit(recv_start=[s1])
        d.quiet(0.3)
        assert "s1e" not in d.recving
        held = d.half.debug_state()["recv"]["s1e"]
        assert held in ("reading_unclaimed", "read_unclaimed"), held
    finally:
        os.kill(peers.main.proc.pid, signal.SIGCONT)
    d.wait(["s1e"])
    assert "s1e" not in d.failed and d.holds(s1.local_block_ids, s1.remote_block_ids, SEEDS["A"])
    path = [dst for _, _, dst, _ in d.transitions("s1e")]
    assert path[:3] == ["awaiting_blocks", "reading_unclaimed", "reading_unclaimed"] and path[-1] == "done"
    peers.main.wait_sent("A", ["p-s1e-first", "p-s1e"])
    findings, finals = replay(peers, [d], {"s1e-first", "s1e", "p-s1e-first", "p-s1e"})
    assert findings == []
    assert finals[("recv", "s1e")] == "done" and finals[("send", "p-s1e")] == "released"
    peers.flush()
    notifs = [json.loads(line)["input"] for line in peers.log["A"].read_text().splitlines()
              if '"p-s1e"' in line and '"read_notif"' in line]
    assert [n["early"] for n in notifs] == [True], notifs


def test_a_small_read_is_done_with_its_grant_not_at_a_poll(peers: Peers, decode) -> None:
    """A read of a block or two over UCX completes only once the prefill worker's
    NIXL agent makes progress, which it does when it polls its notifications. Both
    workers here poll every 0.5 s. The prefill worker makes progress as it answers a
    claim, and the decode worker checks its reads as the grant comes, so a request
    whose peer is known is done in about one claim round trip, not at the next of
    either side's polls."""
    d = decode("s1n", notif_poll_interval_s=SLOW_POLL_S)
    rng = random.Random(13)
    first = pick(rng, 1)
    peers.main.finish("N", {"p-s1n-first": first})
    d.submit(recv_start=[d.start("s1n-first", peers.coords("N"), "p-s1n-first", first)])
    d.wait(["s1n-first"])  # its claim fetched N's agent: the reads below go out behind their claims
    took = []
    for i in range(8):
        blocks = pick(rng, 1 + i % 2)
        peers.main.finish("N", {f"p-s1n-{i}": blocks})
        s = d.start(f"s1n-{i}", peers.coords("N"), f"p-s1n-{i}", blocks)
        t0 = time.monotonic()
        d.submit(recv_start=[s])
        d.wait([f"s1n-{i}"])
        took.append(d.recving[f"s1n-{i}"] - t0)
        assert f"s1n-{i}" not in d.failed and d.holds(s.local_block_ids, s.remote_block_ids, SEEDS["N"])
    # At a poll, each would take a quarter of a second or more (half of SLOW_POLL_S on
    # average on each side); one caught by a race may still wait for one.
    assert sorted(took)[len(took) // 2] < SLOW_POLL_S / 5, [round(t, 3) for t in took]
    peers.main.wait_sent("N", [f"p-s1n-{i}" for i in range(8)], timeout=5.0)
    reqs = {"s1n-first", *(f"s1n-{i}" for i in range(8))}
    findings, finals = replay(peers, [d], reqs | {f"p-{r}" for r in reqs}, prefill=("N",))
    assert findings == []
    assert set(finals.values()) == {"done", "released"}


def test_claim_before_send_finish_is_retried(peers: Peers, decode) -> None:
    """The decode side's claim reaches the prefill ~200 ms before its SendFinish: the
    claim is answered "unknown" and retried until the blocks are pinned."""
    d = decode("s2")
    rng = random.Random(2)
    remote = {"s2-prefilling": pick(rng, 2), "s2-unheard": pick(rng, 3)}
    peers.main.call("submit", w="A", send_start=["p-s2-prefilling"])  # known there, still prefilling
    starts = [d.start(r, peers.coords("A"), f"p-{r}", b) for r, b in remote.items()]
    d.submit(recv_start=starts)
    d.quiet(0.2)  # claims answered "unknown" meanwhile: nothing may finish
    assert not d.recving, "finished before the prefill side had the blocks"
    assert {r: d.half.debug_state()["recv"][r] for r in remote} == dict.fromkeys(remote, "pending_handshake")
    finished_at = time.monotonic()
    peers.main.finish("A", {f"p-{r}": b for r, b in remote.items()})
    d.wait(list(remote), timeout=3.0)
    assert not d.failed and not d.invalid
    assert min(d.recving.values()) >= finished_at, "finished before the prefill side had the blocks"
    for s in starts:
        assert d.holds(s.local_block_ids, s.remote_block_ids, SEEDS["A"])
    assert d.half.debug_state()["client"]["sent"] >= 3, "no claim was retried"
    peers.main.wait_sent("A", [f"p-{r}" for r in remote])
    findings, finals = replay(peers, [d], set(remote) | {f"p-{r}" for r in remote})
    assert findings == []
    assert set(finals.values()) == {"done", "released"}


def test_lease_expiry_fails_the_late_read(peers: Peers, decode) -> None:
    """Prefill lease 0.3 s, the decode's RecvStart once it has expired: the claim is
    answered "expired", the request fails and its blocks are reported invalid."""
    d = decode("s3")
    blocks = pick(random.Random(3), 3)
    t0 = time.monotonic()
    peers.main.finish("S", {"p-s3": blocks})
    sent = peers.main.wait_sent("S", ["p-s3"], timeout=3.0)
    # Not before its lease (the exact instant: test_worker_virtual, on virtual time).
    assert sent["p-s3"] - t0 >= 0.25, f"lease expired after {sent['p-s3'] - t0:.3f} s"
    start = d.start("s3", peers.coords("S"), "p-s3", blocks)
    d.submit(recv_start=[start])
    d.wait(["s3"])
    assert "s3" in d.failed
    assert d.invalid == set(start.local_block_ids)
    assert d.zero_except(set()), "blocks of an expired lease were read"
    errors = [inp for ev, _, dst, inp in d.transitions("s3") if ev == "error"]
    assert [e["kind"] for e in errors] == ["lease_expired"]
    findings, finals = replay(peers, [d], {"s3", "p-s3"}, prefill=("S",))
    # Nothing was read after the expiry, so replay finds nothing wrong: the decode
    # machine failed cleanly and the prefill machine expired.
    assert findings == []
    assert finals == {("recv", "s3"): "failed", ("send", "p-s3"): "expired"}


def test_heartbeats_keep_a_short_lease_alive(peers: Peers, decode) -> None:
    """Prefill lease 0.3 s; the decode side heartbeats every 50 ms for 1 s, then reads."""
    d = decode("s3b")
    blocks = pick(random.Random(33), 2)
    t0 = time.monotonic()
    peers.main.finish("S", {"p-s3b": blocks})
    target = HeartbeatTarget(claims=("p-s3b",), **peers.coords("S"))
    while time.monotonic() < t0 + 1.0:  # real time past the 0.3 s lease, heartbeats every 50 ms
        d.submit(heartbeats=[target])
        time.sleep(0.05)
    assert "p-s3b" not in peers.main.sent("S"), "the lease expired despite the heartbeats"
    start = d.start("s3b", peers.coords("S"), "p-s3b", blocks)
    d.submit(recv_start=[start])
    d.wait(["s3b"])
    assert not d.failed and not d.invalid
    assert d.holds(start.local_block_ids, start.remote_block_ids, SEEDS["S"])
    peers.main.wait_sent("S", ["p-s3b"])
    findings, finals = replay(peers, [d], {"s3b", "p-s3b"}, prefill=("S",))
    assert findings == []
    assert finals == {("recv", "s3b"): "done", ("send", "p-s3b"): "released"}


def test_incompatible_peer_fails_naming_the_field(peers: Peers, decode) -> None:
    d = decode("s4", compat={"block_size": 2 * BLOCK_TOKENS})
    blocks = pick(random.Random(4), 2)
    peers.main.finish("A", {"p-s4": blocks})
    start = d.start("s4", peers.coords("A"), "p-s4", blocks)
    d.submit(recv_start=[start])
    d.wait(["s4"])
    assert "s4" in d.failed and d.invalid == set(start.local_block_ids)
    errors = [inp for ev, _, _, inp in d.transitions("s4") if ev == "error"]
    assert len(errors) == 1 and errors[0]["kind"] == "incompatible"
    assert "block_size: 32 here, 16 on the peer" in errors[0]["detail"], errors[0]
    # The failure tells the prefill side (abandon): released well inside its 30 s lease
    # (at the failure's instant: test_worker_virtual).
    peers.main.wait_sent("A", ["p-s4"], timeout=3.0)
    findings, finals = replay(peers, [d], {"s4", "p-s4"})
    assert findings == []
    assert finals == {("recv", "s4"): "failed", ("send", "p-s4"): "released"}


def test_dead_peer_fails_fast_and_a_restart_is_picked_up(peers: Peers, decode) -> None:
    d = decode("s5", handshake_timeout_s=0.5, peer_backoff_s=1.0)
    rng = random.Random(5)
    coords = peers.coords("K")
    # A first request: the agent of incarnation 1 is loaded.
    b1 = pick(rng, 2)
    peers.k.finish("K", {"p-s5-1": b1})
    s1 = d.start("s5-1", coords, "p-s5-1", b1)
    d.submit(recv_start=[s1])
    d.wait(["s5-1"])
    assert not d.failed and d.holds(s1.local_block_ids, s1.remote_block_ids, SEEDS["K"])
    peers.k.wait_sent("K", ["p-s5-1"])
    peers.k.call("flush")  # its log is complete before the SIGKILL
    peers.k.kill()

    # Nothing listens on its port any more: the claim's connection is refused, and the
    # request fails at once, well before its 0.5 s handshake timeout.
    b2 = pick(rng, 2)
    s2 = d.start("s5-2", coords, "p-s5-2", b2)
    t2 = d.submit(recv_start=[s2])
    d.wait(["s5-2"], timeout=3.0)
    took = d.recving["s5-2"] - t2
    assert took < 0.6 * d.cfg.handshake_timeout_s, f"dead peer detected after {took:.3f} s"
    assert "s5-2" in d.failed and set(s2.local_block_ids) <= d.invalid
    peer = d.half.debug_state()["peers"][f"prefill-K@tcp://{HOST}:{peers.port['K']}"]
    assert peer["agent"] is None and peer["failures"] == 1, peer

    # Known dead: the next request fails without asking (its reason below says so; that
    # it fails at the same instant is asserted on virtual time in test_worker_virtual).
    s3 = d.start("s5-3", coords, "p-s5-3", pick(rng, 1))
    d.submit(recv_start=[s3])
    d.wait(["s5-3"], timeout=1.0)
    assert "s5-3" in d.failed and set(s3.local_block_ids) <= d.invalid
    assert d.zero_except(set(s1.local_block_ids))

    # The engine restarts on the same port (same engine id and agent name, new agent).
    peers.k2.call("start")
    b4 = pick(rng, 3)
    peers.k2.finish("K", {"p-s5-4": b4})
    key = f"prefill-K@tcp://{HOST}:{peers.port['K']}"
    deadline = time.monotonic() + 5.0
    while (until := d.half.debug_state()["peers"][key]["dead_until_ns"]) > time.monotonic_ns():
        assert time.monotonic() < deadline, "the peer's back-off never ended"
        time.sleep(max(0.005, (until - time.monotonic_ns()) / 1e9 + 0.01))  # the back-off runs on the real clock
    s4 = d.start("s5-4", coords, "p-s5-4", b4)
    d.submit(recv_start=[s4])
    d.wait(["s5-4"], timeout=3.0)
    assert "s5-4" not in d.failed
    assert d.holds(s4.local_block_ids, s4.remote_block_ids, SEEDS["K2"]), "not the new incarnation's bytes"
    assert not d.holds(s4.local_block_ids, s4.remote_block_ids, SEEDS["K"])
    peers.k2.wait_sent("K", ["p-s5-4"])
    assert d.half.debug_state()["peers"][f"prefill-K@tcp://{HOST}:{peers.port['K']}"]["failures"] == 0
    reqs = {"s5-1", "s5-2", "s5-3", "s5-4", "p-s5-1", "p-s5-4"}
    findings, finals = replay(peers, [d], reqs, prefill=("K", "K2"))
    assert findings == []
    assert finals == {("recv", "s5-1"): "done", ("recv", "s5-2"): "failed", ("recv", "s5-3"): "failed",
                      ("recv", "s5-4"): "done", ("send", "p-s5-1"): "released", ("send", "p-s5-4"): "released"}
    # What failed each (the first transition into failing or failed).
    fails = {r: [(ev, inp.get("peer") or inp.get("what") or inp.get("kind")) for ev, src, dst, inp
                 in d.transitions(r) if dst in ("failing", "failed") and src != dst][:1] for r in ("s5-2", "s5-3")}
    dead = ("peer_dead", f"prefill-K@tcp://{HOST}:{peers.port['K']}")
    # The refused claim tells; but the dead incarnation's agent was still loaded, so
    # s5-2 posted its read right behind its claim: that read's disconnect may tell
    # first. (Not its handshake timeout: it failed well before that, above.)
    assert fails["s5-2"] in ([dead], [("error", "transfer")]), fails
    assert fails["s5-3"] == [dead]


def test_silent_peer_does_not_delay_a_healthy_one(peers: Peers, decode, silent_port: int) -> None:
    d = decode("s6", handshake_timeout_s=1.0)
    blocks = pick(random.Random(6), 2)
    peers.main.finish("A", {"p-s6-ok": blocks})
    silent = {"remote_engine": "silent", "remote_host": HOST, "remote_port": silent_port, "remote_tp_size": 1}
    s_silent = d.start("s6-silent", silent, "p-s6-silent", [1, 2])
    s_ok = d.start("s6-ok", peers.coords("A"), "p-s6-ok", blocks)
    t0 = d.submit(recv_start=[s_silent, s_ok])  # silent first: it is asked first
    d.wait(["s6-ok"], timeout=1.0)
    healthy = d.recving["s6-ok"] - t0
    # Not held up by the silent peer: done before its timeout, and not waiting for any
    # part of it either (0.3 s of the 1 s timeout).
    assert "s6-silent" not in d.recving
    assert healthy < 0.3 * d.cfg.handshake_timeout_s, f"the healthy peer's request took {healthy:.3f} s"
    d.wait(["s6-silent"], timeout=3.0)
    failed_after = d.recving["s6-silent"] - t0
    # Not before its timeout (exactly at it: test_worker_virtual).
    assert failed_after >= 0.95, f"the silent peer's request failed after {failed_after:.3f} s"
    assert "s6-silent" in d.failed and "s6-ok" not in d.failed
    assert d.invalid == set(s_silent.local_block_ids)
    assert d.holds(s_ok.local_block_ids, s_ok.remote_block_ids, SEEDS["A"])
    peers.main.wait_sent("A", ["p-s6-ok"])
    findings, finals = replay(peers, [d], {"s6-ok", "s6-silent", "p-s6-ok"})
    assert findings == []
    assert finals == {("recv", "s6-ok"): "done", ("recv", "s6-silent"): "failed", ("send", "p-s6-ok"): "released"}


def test_abort_while_pending_handshake(peers: Peers, decode, silent_port: int) -> None:
    """vLLM waits for an aborted request's finished_recving: reported, not as a failure."""
    d = decode("s7a", handshake_timeout_s=0.5)
    silent = {"remote_engine": "silent", "remote_host": HOST, "remote_port": silent_port, "remote_tp_size": 1}
    start = d.start("s7a", silent, "p-s7a", [3, 4, 5])
    d.submit(recv_start=[start])
    d.wait_state("s7a", "pending_handshake")
    d.submit(recv_abort=[RecvAbort(req="s7a", awaited=True)])
    d.wait(["s7a"], timeout=1.0)  # before its 0.5 s timeout would (at once: test_worker_virtual)
    assert not d.failed and not d.invalid
    d.quiet(0.7)  # past the handshake timeout it no longer has
    assert d.reports["s7a"] == 1 and not d.failed and not d.invalid
    assert [(ev, src, dst) for ev, src, dst, _ in d.transitions("s7a")] == [
        ("matched", "new", "awaiting_blocks"), ("allocated", "awaiting_blocks", "pending_handshake"),
        ("abort", "pending_handshake", "aborted")]
    findings, finals = replay(peers, [d], {"s7a"})
    assert findings == [] and finals == {("recv", "s7a"): "aborted"}


def test_abandon_releases_the_prefill_at_once(peers: Peers, decode) -> None:
    """RecvAbandon (aborted before allocation): the prefill side unpins now, not at lease
    expiry (30 s), also when the abandon arrives before its own SendFinish."""
    d = decode("s7b")
    blocks = pick(random.Random(7), 2)
    peers.main.finish("A", {"p-s7b": blocks})
    ab = RecvAbandon(req="s7b", remote_req="p-s7b", **peers.coords("A"))
    # Released well inside its 30 s lease (at the abandon's instant: test_worker_virtual).
    d.submit(recv_abandon=[ab])
    peers.main.wait_sent("A", ["p-s7b"], timeout=3.0)
    # Abandoned before the prefill finished: released as soon as it does.
    early = RecvAbandon(req="s7b-early", remote_req="p-s7b-early", **peers.coords("A"))
    d.submit(recv_abandon=[early])
    deadline = time.monotonic() + 3.0
    while "s7b-early" in d.half.debug_state()["recv"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    peers.main.finish("A", {"p-s7b-early": blocks})
    peers.main.wait_sent("A", ["p-s7b-early"], timeout=3.0)
    d.quiet(0.1)
    assert not d.recving and not d.failed and not d.invalid, "an unallocated request was reported to vLLM"
    reqs = {"s7b", "s7b-early", "p-s7b", "p-s7b-early"}
    findings, finals = replay(peers, [d], reqs)
    assert findings == []
    assert finals == {("recv", "s7b"): "aborted", ("recv", "s7b-early"): "aborted",
                      ("send", "p-s7b"): "released", ("send", "p-s7b-early"): "released"}


def test_abort_after_the_request_finished(peers: Peers, decode) -> None:
    d = decode("s7c")
    blocks = pick(random.Random(77), 2)
    peers.main.finish("A", {"p-s7c": blocks})
    start = d.start("s7c", peers.coords("A"), "p-s7c", blocks)
    d.submit(recv_start=[start])
    d.wait(["s7c"])
    d.submit(recv_abort=[RecvAbort(req="s7c", awaited=True)])
    d.quiet(0.3)
    assert d.reports["s7c"] == 1 and not d.failed and not d.invalid
    # A declared stale input: recorded against the final state, changing nothing.
    assert any(r["event"] == "abort" and r.get("stale") and r["src"] == r["dst"] == "done"
               for r in d.records("s7c"))
    assert not [r for r in d.records() if r["kind"] == "violation"]
    peers.main.wait_sent("A", ["p-s7c"])
    findings, finals = replay(peers, [d], {"s7c", "p-s7c"})
    assert findings == []
    assert finals == {("recv", "s7c"): "done", ("send", "p-s7c"): "released"}


def test_full_local_prefix_hit_releases_the_prefill(peers: Peers, decode) -> None:
    """Nothing to read (awaited=False): nothing is reported to vLLM, and the prefill's
    blocks are released at once, not by the 30 s lease. (The connection is warm:
    see test_full_local_prefix_hit_on_a_fresh_connection for a cold one.)"""
    d = decode("s8")
    warm = pick(random.Random(80), 1)
    peers.main.finish("A", {"p-s8-warm": warm, "p-s8": pick(random.Random(8), 2)})
    s_warm = d.start("s8-warm", peers.coords("A"), "p-s8-warm", warm)
    d.submit(recv_start=[s_warm])
    d.wait(["s8-warm"])
    start = d.start("s8", peers.coords("A"), "p-s8", (), local=(), awaited=False)
    d.submit(recv_start=[start])
    peers.main.wait_sent("A", ["p-s8"], timeout=3.0)  # not by its 30 s lease (at once: test_worker_virtual)
    d.quiet(0.1)
    assert set(d.recving) == {"s8-warm"} and not d.failed and not d.invalid
    assert d.reports["s8-warm"] == 1
    findings, finals = replay(peers, [d], {"s8", "p-s8", "s8-warm", "p-s8-warm"})
    assert findings == []
    assert finals == {("recv", "s8"): "done", ("send", "p-s8"): "released",
                      ("recv", "s8-warm"): "done", ("send", "p-s8-warm"): "released"}


def test_full_local_prefix_hit_on_a_fresh_connection(peers: Peers, decode) -> None:
    """The same as the decode worker's first contact with the peer. (This once left the
    prefill's blocks pinned until its lease ran out: the NIXL notification sat in a
    connection still wiring up, which nothing progressed on the decode side.)"""
    d = decode("s8-fresh")
    peers.main.finish("A", {"p-s8-fresh": pick(random.Random(81), 2)})
    start = d.start("s8-fresh", peers.coords("A"), "p-s8-fresh", (), local=(), awaited=False)
    d.submit(recv_start=[start])
    peers.main.wait_sent("A", ["p-s8-fresh"], timeout=3.0)  # not by its 30 s lease
    d.quiet(0.05)
    assert not d.recving and not d.failed and not d.invalid
    findings, finals = replay(peers, [d], {"s8-fresh", "p-s8-fresh"})
    assert findings == []
    assert finals == {("recv", "s8-fresh"): "done", ("send", "p-s8-fresh"): "released"}


def _storm(port: int, stop: threading.Event, counts: Counter[str]) -> None:
    """Malformed traffic at the side channel: ZMQ garbage, truncated msgpack, bad
    framing, and raw TCP connections spraying random bytes."""
    rng = random.Random(9)
    ctx = zmq.Context()
    valid = encode(MetadataRequest(protocol=PROTOCOL_VERSION, requester="storm", tp_rank=0, compat_hash="x" * 64,
                                   claims=["p-s9-storm"]))
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{HOST}:{port}")
        for i in range(300):
            kind = i % 3
            if kind == 0:
                dealer.send(rng.randbytes(rng.randint(0, 96)))
            elif kind == 1:
                dealer.send(valid[: rng.randint(1, len(valid) - 1)])
            else:
                dealer.send_multipart([b"x", b"y", rng.randbytes(8)])
            counts["zmq"] += 1
            if i % 50 == 0:
                with socket.create_connection((HOST, port), timeout=2) as raw:
                    raw.sendall(rng.randbytes(512))
                counts["raw"] += 1
            if i % 10 == 0:
                time.sleep(0.001)  # the storm's pace, not a wait
        stop.wait(5)
        dealer.close(linger=5000)  # every message counted is delivered (linger 0 dropped the last ones under load)
    finally:
        ctx.term()


def test_hostile_side_channel_during_a_real_handshake(peers: Peers, decode) -> None:
    d = decode("s9")
    rng = random.Random(99)
    before = peers.main.state("A")["server"]
    b1, b2 = pick(rng, 3), pick(rng, 2)
    peers.main.finish("A", {"p-s9-1": b1, "p-s9-2": b2})
    stop, counts = threading.Event(), Counter()
    storm = threading.Thread(target=_storm, args=(peers.port["A"], stop, counts), daemon=True)
    storm.start()
    s1 = d.start("s9-1", peers.coords("A"), "p-s9-1", b1)
    d.submit(recv_start=[s1])
    d.wait(["s9-1"], timeout=5.0)
    assert "s9-1" not in d.failed and d.holds(s1.local_block_ids, s1.remote_block_ids, SEEDS["A"])
    stop.set()
    storm.join(timeout=10)
    assert counts["zmq"] == 300 and counts["raw"] == 6

    def refused(stats: dict[str, Any]) -> int:
        return sum(stats["errors"].values())

    deadline = time.monotonic() + 5.0
    while refused(after := peers.main.state("A")["server"]) - refused(before) < counts["zmq"]:
        assert time.monotonic() < deadline, f"server stats {after}"
        time.sleep(0.02)
    assert after["errors"].get("malformed", 0) - before["errors"].get("malformed", 0) >= counts["zmq"]
    assert after["connections"].get("accepted", 0) - before["connections"].get("accepted", 0) >= 1 + counts["raw"]
    assert after["served"]["MetadataRequest"] > before["served"].get("MetadataRequest", 0)
    # After the storm the side channel still serves.
    s2 = d.start("s9-2", peers.coords("A"), "p-s9-2", b2)
    d.submit(recv_start=[s2])
    d.wait(["s9-2"])
    assert not d.failed and d.holds(s2.local_block_ids, s2.remote_block_ids, SEEDS["A"])
    peers.main.wait_sent("A", ["p-s9-1", "p-s9-2"])
    findings, finals = replay(peers, [d], {"s9-1", "s9-2", "p-s9-1", "p-s9-2"})
    assert findings == []
    assert set(finals.values()) == {"done", "released"}


def test_exception_in_a_loop_handler_fails_only_its_request(peers: Peers, decode) -> None:
    d = decode("s10")
    rng = random.Random(10)
    remote = {"s10-victim": pick(rng, 2), "s10-ok": pick(rng, 3), "s10-after": pick(rng, 2)}
    peers.main.finish("A", {f"p-{r}": b for r, b in remote.items()})
    real = d.transport.post_read

    def post_read(peer, local, remote_blocks, notif, tag="", **kw):
        if tag == "s10-victim":
            raise RuntimeError("injected failure")
        return real(peer, local, remote_blocks, notif, tag=tag, **kw)

    d.transport.post_read = post_read  # the loop calls it through the instance
    starts = {r: d.start(r, peers.coords("A"), f"p-{r}", b) for r, b in remote.items()}
    d.submit(recv_start=[starts["s10-victim"], starts["s10-ok"]])
    d.wait(["s10-victim", "s10-ok"])
    assert set(d.failed) == {"s10-victim"}
    assert d.invalid == set(starts["s10-victim"].local_block_ids)
    assert d.holds(starts["s10-ok"].local_block_ids, starts["s10-ok"].remote_block_ids, SEEDS["A"])
    internal = [inp for ev, _, dst, inp in d.transitions("s10-victim") if ev == "internal_error"]
    assert internal == [{"where": "effect post_reads", "detail": "RuntimeError: injected failure"}]
    # The loop keeps serving.
    d.submit(recv_start=[starts["s10-after"]])
    d.wait(["s10-after"])
    assert set(d.failed) == {"s10-victim"}
    assert d.holds(starts["s10-after"].local_block_ids, starts["s10-after"].remote_block_ids, SEEDS["A"])
    # The victim's prefill request is abandoned (released at once), the others read.
    peers.main.wait_sent("A", [f"p-{r}" for r in remote], timeout=3.0)
    reqs = set(remote) | {f"p-{r}" for r in remote}
    findings, finals = replay(peers, [d], reqs)
    assert findings == []
    assert finals == {("recv", "s10-victim"): "failed", ("recv", "s10-ok"): "done", ("recv", "s10-after"): "done",
                      **{("send", f"p-{r}"): "released" for r in remote}}


# ============================================================================ regressions
# Bugs these tests found (each was a strict xfail until fixed): a fixed lease
# margin that failed every read under short leases; reads judged against the
# decode engine's lease instead of the one the prefill side granted; a prefill
# worker that stopped driving NIXL when nothing was pinned, so a late read never
# settled; and an abandon sent after a read whose notification already released
# the blocks.


def test_short_lease_reads_succeed(peers: Peers, decode) -> None:
    d = decode("bug-margin", clean=False, lease_s=0.4)  # the prefill side (Y) grants 2 s
    blocks = pick(random.Random(11), 2)
    peers.main.finish("Y", {"p-bug-margin": blocks})
    start = d.start("bug-margin", peers.coords("Y"), "p-bug-margin", blocks)
    d.submit(recv_start=[start])
    d.wait(["bug-margin"])
    peers.main.wait_sent("Y", ["p-bug-margin"])
    assert "bug-margin" not in d.failed, [inp for ev, _, _, inp in d.transitions("bug-margin") if ev == "error"]


def _stall_post_read(d: Decode, seconds: float) -> None:
    """The decode loop stalls ``seconds`` (GC, a big copy, a busy core) just before posting its reads."""
    real = d.transport.post_read

    def stalled(*args: Any, **kw: Any) -> Any:
        time.sleep(seconds)
        return real(*args, **kw)

    d.transport.post_read = stalled


def test_read_after_prefill_lease_expired_is_not_delivered(peers: Peers, decode) -> None:
    """Worker Y grants 2 s leases, this decode engine is configured with 30 s. Its loop
    stalls 2.3 s between the claim and the read; meanwhile Y's lease expires (the blocks
    are free for reuse). Another request pinned on Y keeps Y's NIXL agent progressing,
    so the late read completes, and it must not be delivered as good KV."""
    d = decode("bug-lease", clean=False)
    blocks = pick(random.Random(12), 2)
    t0 = time.monotonic()
    peers.main.finish("Y", {"p-bug-lease": blocks})
    _stall_post_read(d, 2.3)
    start = d.start("bug-lease", peers.coords("Y"), "p-bug-lease", blocks)
    d.submit(recv_start=[start])
    # The scenario's timing: a keepalive pinned 1 s in, so pinned until t0 + 3 s, past the stalled read.
    time.sleep(max(0.0, t0 + 1.0 - time.monotonic()))
    peers.main.finish("Y", {"p-bug-lease-keepalive": [7]})
    d.wait(["bug-lease"], timeout=6.0)
    peers.main.wait_sent("Y", ["p-bug-lease"])
    findings, finals = replay(peers, [d], {"bug-lease", "p-bug-lease"}, prefill=("Y",))
    # The lease expired before the read (replay orders the two on Y's side).
    assert finals[("send", "p-bug-lease")] == "expired"
    assert "read_after_lease_expiry" in {k for k, _ in findings}, findings
    assert "bug-lease" in d.failed, f"delivered as done after the prefill's lease expired; replay: {findings}"


def test_late_read_to_an_idle_prefill_ends(peers: Peers, decode) -> None:
    """Worker X (lease 0.3 s, nothing else pinned); the decode loop stalls 0.6 s before
    its read; transfer timeout 0.5 s. The request must end (failed) within a bound."""
    d = decode("bug-hang", clean=False, transfer_timeout_s=0.5)
    blocks = pick(random.Random(14), 2)
    peers.main.finish("X", {"p-bug-hang": blocks})
    _stall_post_read(d, 0.6)
    start = d.start("bug-hang", peers.coords("X"), "p-bug-hang", blocks)
    t0 = d.submit(recv_start=[start])
    deadline = t0 + 3.0
    while "bug-hang" not in d.recving and time.monotonic() < deadline:
        d.poll()
        time.sleep(0.01)
    state = d.half.debug_state()["recv"]
    assert "bug-hang" in d.recving, f"still not reported to vLLM after 3 s: {state}"
    assert "bug-hang" in d.failed and d.invalid == set(start.local_block_ids)


def test_failure_after_the_reads_sends_no_conflicting_abandon(peers: Peers, decode) -> None:
    """Prefill (Y) lease 2 s, so the decode side accepts reads that complete within
    1.5 s of the claim (a quarter of the lease, at most 0.5 s, is kept as margin). Its
    loop stalls 1.6 s before the read: it rightly refuses the bytes after the read, and
    with it its notification, completed. Y sees the notification late (held until
    1.8 s: a notification is not ordered against the side channel), still inside its
    lease, and must see nothing else from the decode side."""
    d = decode("bug-dup", clean=False)
    blocks = pick(random.Random(15), 2)
    t0 = time.monotonic()
    peers.main.finish("Y", {"p-bug-dup": blocks, "p-bug-dup-keepalive": [9]})
    peers.main.call("hold_notifs", w="Y", seconds=1.8)
    _stall_post_read(d, 1.6)
    start = d.start("bug-dup", peers.coords("Y"), "p-bug-dup", blocks)
    d.submit(recv_start=[start])
    d.wait(["bug-dup"], timeout=4.0)
    assert "bug-dup" in d.failed
    # The table's verdict: the reads completed, too late in the lease the claim granted.
    assert [(ev, dst) for ev, _, dst, _ in d.transitions("bug-dup") if dst == "failed"] == [
        ("all_reads_done", "failed")]
    peers.main.wait_sent("Y", ["p-bug-dup"])
    # Released by the held notification (at 1.8 s); a window past it for anything else
    # from the decode side (an abandon) to arrive and show up below.
    time.sleep(max(0.0, t0 + 2.1 - time.monotonic()))
    findings, finals = replay(peers, [d], {"bug-dup", "p-bug-dup"}, prefill=("Y",))
    assert finals == {("recv", "bug-dup"): "failed", ("send", "p-bug-dup"): "released"}
    assert findings == [], "the prefill logged a violation for a request the decode side handled correctly"


# ============================================================================ replay of everything


def test_replay_of_every_clean_log(peers: Peers) -> None:
    """Every request of the clean scenarios is terminal, on both sides, and replay finds
    nothing wrong (the regression scenarios' logs and worker X are left out)."""
    peers.flush()
    logs = [*CLEAN_DECODE_LOGS, *(peers.log[w] for w in ("A", "S", "N", "K", "K2") if peers.log[w].exists())]
    report = analyse(logs)
    assert report.findings == [], "\n".join(map(str, report.findings))
    assert report.exit_code == 0
    not_terminal = [m.label() for m in report.machines if not m.terminal]
    assert not_terminal == []
    # Every machine of the clean scenarios on the prefill side was created by a scenario.
    send = {m.req: m.final_state for m in report.machines if m.lifecycle == "send"}
    assert send.get("p-s3") == "expired"
    assert {s for r, s in send.items() if r != "p-s3"} == {"released"}
