"""Real worker loops under load: the harness of ``tests/test_load.py`` (a) and
of ``tools/bench.py`` section 8, so that the test and the bench run the same rounds.

A prefill and a decode ``kvsm.worker.WorkerHalf`` in this process, each with
its own event-loop thread and event log, claiming over the real ZMQ side
channel on 127.0.0.1 and reading real bytes through the in-memory transport
(``kvsm.transport.memory``), fed ``KVSMConnectorMetadata`` steps of 256
requests as vLLM's scheduler half would. A gate (``GatedAgent``) holds every
read until all of them are posted, so at the peak every request of a round is
live at once. ``run_round`` plays one round and checks every outcome and every
byte; ``RoundSizes`` says how many requests of each kind it has.
"""

from __future__ import annotations

import gc
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handshake import CompatInfo
from kvsm.lifecycle.clock import SYSTEM_CLOCK
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import LIFECYCLES
from kvsm.transport.base import Heads, TransferState, XferHandle
from kvsm.transport.layout import Segments
from kvsm.transport.memory import InMemoryAgent, InMemoryFabric, MemoryXferHandle
from kvsm.vllm.metadata import KVSMConnectorMetadata, RecvAbandon, RecvAbort, RecvStart, SendFinish
from kvsm.worker import WorkerHalf
from kvsm_testing.ports import free_port

STEP = 256  # requests per scheduler step (vLLM's default max_num_seqs)
BLOCK_BYTES = 64
BLOCKS_PER_REQUEST = 2
COMPAT = CompatInfo(model="kvsm-load", dtype="float32", num_layers=1, num_kv_heads=1, head_size=8, block_size=16,
                    kv_layout="test")


@dataclass(frozen=True)
class RoundSizes:
    """Per-request kinds of one round. READ requests are the ones that are all
    transferring at once; ABORT ones are read requests too, aborted while their
    reads are held; NOTHING ones have nothing to read (a full local prefix hit);
    ABANDON ones are abandoned before allocation; ABNORMAL ones end their prefill
    abnormally (nothing pinned, no decode request)."""

    reads: int = 10_000
    aborts: int = 500
    nothing: int = 250
    abandons: int = 250
    abnormal: int = 250

    @property
    def total(self) -> int:
        return self.reads + self.aborts + self.nothing + self.abandons + self.abnormal

    @classmethod
    def scaled(cls, reads: int) -> RoundSizes:
        """The default round's mix around ``reads`` read requests (each other kind
        at least one, so that every path runs at any size)."""
        d = cls()
        return cls(reads, *(max(1, round(k * reads / d.reads)) for k in (d.aborts, d.nothing, d.abandons,
                                                                          d.abnormal)))


ROUND = RoundSizes()  # 11,250 requests, 10,500 of them transferring at once


class GatedAgent(InMemoryAgent):
    """The in-memory transport driven by two real loop threads: every call under one
    lock, a read lands when its reader checks it once it is due, and no read lands
    while the gate is closed (so every read of a round can be in flight at once).
    ``posted`` counts reads posted (a cheap "all in flight" probe, no snapshot)."""

    lock = threading.Lock()
    gate = threading.Event()
    posted = 0

    def post_read(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int], notif: bytes,
                  tag: str = "", group_sizes: Sequence[int] = (), local_heads: Heads | None = None,
                  remote_heads: Heads | None = None, segments: Segments | None = None) -> MemoryXferHandle:
        with self.lock:
            handle = super().post_read(peer, local_blocks, remote_blocks, notif, tag, group_sizes, local_heads,
                                       remote_heads, segments)
            self.posted += 1
            return handle

    def check(self, handle: XferHandle) -> TransferState:
        with self.lock:
            t = self.fabric._find(handle)
            if (t.state is TransferState.PENDING and self.gate.is_set()
                    and t.complete_at_ns <= self.fabric.clock.monotonic_ns()):
                self.fabric._land(t)
            return t.state

    def release(self, handle: XferHandle, *, force: bool = False) -> bool:
        with self.lock:
            return super().release(handle, force=force)

    def send_notif(self, peer: str, msg: bytes) -> bool:
        with self.lock:
            return super().send_notif(peer, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with self.lock:
            return super().get_notifs()

    def resources(self) -> dict[str, int]:
        with self.lock:
            return super().resources()


def worker_config(engine_id: str, kv_role: str, port: int) -> KVSMConfig:
    # Timeouts and the lease far beyond a round's length: nothing here may end by a timer.
    return KVSMConfig(engine_id=engine_id, kv_role=kv_role, kv_buffer_device="cpu", side_channel_host="127.0.0.1",
                      side_channel_port=port, lease_s=900.0, heartbeat_interval_s=150.0, handshake_timeout_s=300.0,
                      transfer_timeout_s=600.0, peer_backoff_s=1.0, peer_backoff_max_s=4.0,
                      notif_poll_interval_s=0.001, event_log_dir=None, backends=("memory",), tp_size=1, dp_rank=0,
                      pp_size=1, dcp_size=1, block_size=16, kv_load_failure_policy="fail")


def round_pattern(round_no: int, block: int) -> bytes:
    """What prefill block ``block`` holds in round ``round_no``."""
    unit = f"r{round_no}b{block};".encode()
    return (unit * (BLOCK_BYTES // len(unit) + 1))[:BLOCK_BYTES]


@dataclass
class Workers:
    """A prefill and a decode WorkerHalf joined by the side channel and the gated
    fabric; their pools hold one round of ``sizes`` (smaller rounds fit too)."""

    log_dir: Path
    sizes: RoundSizes = ROUND
    prefill: WorkerHalf = field(init=False)
    decode: WorkerHalf = field(init=False)
    finals: dict[tuple[str, str, str], str] = field(default_factory=dict)  # (engine, lifecycle, req) -> state
    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    step: int = 0

    def __post_init__(self) -> None:
        pool = self.sizes.total
        fabric = InMemoryFabric(SYSTEM_CLOCK, latency_ns=50_000)
        self.prefill_agent = GatedAgent(fabric, "prefill-agent", pool * BLOCKS_PER_REQUEST, BLOCK_BYTES)
        self.decode_agent = GatedAgent(fabric, "decode-agent", pool * BLOCKS_PER_REQUEST, BLOCK_BYTES)
        self.port = free_port()
        self.logs = {name: EventLog(self.log_dir / f"{name}.worker.jsonl", role="worker", engine_id=name)
                     for name in ("prefill", "decode")}
        self.prefill = WorkerHalf(worker_config("prefill", "kv_producer", self.port), 0,
                                  event_log=self.logs["prefill"])
        self.decode = WorkerHalf(worker_config("decode", "kv_consumer", free_port()), 0,
                                 event_log=self.logs["decode"])
        for name, half in (("prefill", self.prefill), ("decode", self.decode)):
            for tracker in (half.recv, half.send):
                tracker.listener = self._recorder(name, tracker.listener)
        self.prefill.start(self.prefill_agent, COMPAT)
        self.decode.start(self.decode_agent, COMPAT)

    def _recorder(self, engine: str, inner: Any) -> Any:
        """The worker's own listener, plus a note of every terminal state reached."""

        def listener(o: Outcome) -> None:
            inner(o)
            if o.violation is None and o.dst in LIFECYCLES[o.lifecycle].terminal:
                self.finals[(engine, o.lifecycle, o.req)] = o.dst

        return listener

    def submit(self, half: WorkerHalf, **lists: list[Any]) -> None:
        self.step += 1
        meta = KVSMConnectorMetadata(self.step)
        for name, items in lists.items():
            setattr(meta, name, items)
        half.submit(meta)

    def drain(self) -> None:
        """What vLLM's model runner does every step: take the finished sets and the
        stats (get_kv_connector_stats; an interval keeps at most MAX_SAMPLES samples)."""
        for half in (self.prefill, self.decode):
            half.stats.take()
        sent, _, _ = self.prefill.take_results()
        self.sent |= sent
        _, received, failed = self.decode.take_results()
        self.received |= received
        self.failed |= failed

    def wait(self, what: str, done: Any, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            self.drain()
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s; decode {self.debug('decode')['io']}, "
                                     f"prefill {self.debug('prefill')['io']}")
            time.sleep(0.02)
        self.drain()

    def debug(self, side: str) -> dict[str, Any]:
        """A side's debug snapshot. With 10k requests live (and tracemalloc on) one
        takes the loop a while, and waits behind its work: a generous timeout."""
        half = self.decode if side == "decode" else self.prefill
        return half.debug_state(timeout_s=60.0)

    def loop_cpu_s(self) -> float:
        """CPU seconds both workers' loop threads have used so far (each read on its own thread)."""
        return sum(half.loop.call(time.thread_time, timeout=60.0, label="cpu time")
                   for half in (self.prefill, self.decode))

    def archive(self) -> None:
        """Move a finished round's books to disk, so that the harness itself holds
        nothing per request between rounds (the memory check measures the workers)."""
        with open(self.log_dir / "finals.jsonl", "a") as f:
            f.writelines(json.dumps([*key, state]) + "\n" for key, state in self.finals.items())
        self.finals, self.sent, self.received, self.failed = {}, set(), set(), set()

    def archived_finals(self) -> dict[tuple[str, str, str], str]:
        rows = [json.loads(line) for line in (self.log_dir / "finals.jsonl").read_text().splitlines()]
        return {(engine, lifecycle, req): state for engine, lifecycle, req, state in rows}

    def close(self) -> None:
        GatedAgent.gate.set()
        self.decode.shutdown()
        self.prefill.shutdown()


def remote_params(port: int, req: str, remote_req: str) -> dict[str, Any]:
    """The decode side's fields naming the prefill request ``remote_req``."""
    return {"req": req, "remote_engine": "prefill", "remote_req": remote_req, "remote_host": "127.0.0.1",
            "remote_port": port, "remote_tp_size": 1}


def run_round(w: Workers, round_no: int, sizes: RoundSizes | None = None) -> dict[str, float]:
    """One round: every kind of request submitted, every read held until all are
    in flight, the aborts applied, then the gate opened. Returns timings.

    ``sizes``: the round's mix (default: the workers' own). "Every read in
    flight" is waited for by counting posted reads, which costs the loops nothing
    (polled snapshots of every live request were work for the loops they watched:
    under load one took over 10 s); one snapshot of each side then checks it."""
    s = w.sizes if sizes is None else sizes
    assert s.total <= w.sizes.total, f"a round of {s.total} requests does not fit pools of {w.sizes.total}"
    t0 = time.monotonic()
    total = s.total
    names = [f"r{round_no}-{i}" for i in range(total)]
    blocks = {n: tuple(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i, n in enumerate(names)}
    with GatedAgent.lock:
        for i in range(total * BLOCKS_PER_REQUEST):
            w.prefill_agent.write_block(i, round_pattern(round_no, i))
            w.decode_agent.write_block(i, b"\x00" * BLOCK_BYTES)
    reads = names[:s.reads + s.aborts]
    nothing = names[s.reads + s.aborts:s.reads + s.aborts + s.nothing]
    abandons = names[s.reads + s.aborts + s.nothing:total - s.abnormal]
    abnormal = names[total - s.abnormal:]
    aborted = set(random.Random(round_no).sample(reads, s.aborts))
    GatedAgent.gate.clear()
    posted0 = w.decode_agent.posted

    # Prefill: every request finishes its prefill (a few abnormally), in steps.
    finishes = [SendFinish(req=f"p-{n}", ok=n not in abnormal, block_ids=blocks[n] if n not in abnormal else (),
                           reason="" if n not in abnormal else "FINISHED_LENGTH_CAPPED") for n in names]
    for k in range(0, total, STEP):
        w.submit(w.prefill, send_finish=finishes[k:k + STEP])
    w.wait("prefill pinned", lambda: len(w.prefill.send) == total - s.abnormal)

    # Decode: reads (local blocks shifted, so a misdirected read shows), full local
    # prefix hits (nothing to read) and requests abandoned before allocation.
    pool = total * BLOCKS_PER_REQUEST
    starts: list[Any] = []
    for n in reads:
        local = tuple((b + 7919) % pool for b in blocks[n])
        starts.append(RecvStart(**remote_params(w.port, f"d-{n}", f"p-{n}"), remote_block_ids=blocks[n],
                                local_block_ids=local, num_tokens=32, awaited=True))
    for n in nothing:
        starts.append(RecvStart(**remote_params(w.port, f"d-{n}", f"p-{n}"), remote_block_ids=(),
                                local_block_ids=(), num_tokens=0, awaited=False))
    for k in range(0, len(starts), STEP):
        w.submit(w.decode, recv_start=starts[k:k + STEP])
    for k in range(0, len(abandons), STEP):
        w.submit(w.decode, recv_abandon=[RecvAbandon(**remote_params(w.port, f"d-{n}", f"p-{n}"))
                                         for n in abandons[k:k + STEP]])

    # (the prefill side has released the others by then: nothing to read, abandoned)
    w.wait("every read in flight", lambda: w.decode_agent.posted - posted0 >= len(reads)
           and len(w.prefill.send) == len(reads))
    peak = w.debug("decode")
    peak_prefill = w.debug("prefill")
    # Every read posted and held: transferring, or reading_unclaimed where it went out
    # right behind a claim whose answer had not come back yet.
    in_flight = Counter(peak["recv"].values())
    assert sum(in_flight.values()) == len(reads) and set(in_flight) <= {"transferring", "reading_unclaimed"}, in_flight
    assert Counter(peak_prefill["send"].values()) == {"awaiting_pull": len(reads)}
    t1 = time.monotonic()

    w.submit(w.decode, recv_abort=[RecvAbort(req=f"d-{n}", awaited=True) for n in sorted(aborted)])
    w.wait("aborts settled", lambda: len(w.decode.recv) == len(reads) - s.aborts)
    GatedAgent.gate.set()
    expect_received = {f"d-{n}" for n in reads}  # aborted ones too: vLLM waits for their blocks
    expect_sent = {f"p-{n}" for n in names if n not in abnormal}  # vLLM freed those at once
    w.wait("every request finished on both sides", lambda: expect_received <= w.received and expect_sent <= w.sent)
    assert not w.received & {f"d-{n}" for n in nothing + abandons} and not w.sent & {f"p-{n}" for n in abnormal}
    t2 = time.monotonic()

    # Outcomes, request by request, and the bytes every read delivered.
    finals = dict(w.finals)
    want: dict[tuple[str, str, str], str] = {}
    for n in names:
        want[("prefill", "send", f"p-{n}")] = "released"
        if n in abnormal:
            continue
        want[("decode", "recv", f"d-{n}")] = "aborted" if n in aborted or n in abandons else "done"
    assert finals == want
    assert not w.failed
    with GatedAgent.lock:
        for n in reads:
            if n in aborted:
                continue
            for b in blocks[n]:
                got = w.decode_agent.read_block((b + 7919) % pool)
                assert got == round_pattern(round_no, b), f"{n}: block {b} arrived as {got!r}"
    del finals, want
    w.archive()
    return {"submit_to_peak_s": t1 - t0, "peak_to_done_s": t2 - t1, "requests": total}


def idle_resources(w: Workers) -> dict[str, dict[str, int]]:
    """Each worker's resources once everything ended (and the lost-event counters)."""
    out = {}
    for name, half in (("prefill", w.prefill), ("decode", w.decode)):
        res = half.debug_state()["resources"]
        out[name] = {k: v for k, v in res.items() if v and k not in ("peers", "transport_peers", "loop_readers",
                                                                     "client_sockets")}
    return out


# What idle_resources shows once a round ended: the prefill's notification poll (the
# decode's claim-answers record is written within 100 ms of the last answer, its timer gone then).
IDLE = {"prefill": {"loop_timers": 1}, "decode": {}}


def wait_idle(w: Workers, timeout: float = 30) -> None:
    """Until both workers hold nothing but their idle timers."""
    w.wait("idle", lambda: idle_resources(w) == IDLE, timeout=timeout)


PER_REQUEST_CLASSES = frozenset({"RequestMachine", "Outcome", "_RecvIO", "_SendIO", "_Claim", "XferHandle",
                                 "_Transfer", "TimerHandle", "_Pending", "RecvStart", "SendFinish", "RecvAbandon",
                                 "RecvAbort"})


def kvsm_objects(wanted: frozenset[str] = PER_REQUEST_CLASSES) -> Counter[str]:
    """Live instances of kvsm's per-request classes (gc-tracked objects only)."""
    return Counter(type(o).__name__ for o in gc.get_objects() if type(o).__name__ in wanted)


# A TimerHeap compacts its cancelled entries only once it holds more than 64: in
# small rounds a cancelled deadline (a claim's, 300 s away) stays until then, in each
# of the two loops' heaps.
TIMER_SLACK = 2 * 64 + 8


def objects_grown(before: Counter[str], slack: int = 8, timer_slack: int = TIMER_SLACK) -> dict[str, int]:
    """Per-request classes with more than ``slack`` instances over ``before`` (a few
    timer handles come and go with the loops' own polling timers; ``timer_slack``
    of them)."""
    return {k: n - before[k] for k, n in kvsm_objects().items()
            if n > before[k] + (timer_slack if k == "TimerHandle" else slack)}

