"""Scripted scenarios of the real workers on virtual time (tests of timing logic).

``VirtualPair`` runs real ``WorkerHalf``s, prefill workers by name and one
decode worker, as ``kvsm_testing.sim`` does: every loop a driven loop of one
``DrivenLoops`` group on one ``VirtualClock``, side channels over inproc ZMQ,
reads over ``InMemoryAgent``s of one ``InMemoryFabric`` that move real
bytes. A test plays vLLM on both sides by hand (``finish``, ``start``,
``abort``, ``abandon``, ``heartbeat``), moves time with ``run`` and reads
what vLLM would have seen, stamped with the virtual time it was first
reported (``recving``, ``failed``, ``sent``). A window such as "the lease
expires 0.3 s after the pin" is then asserted exactly, on any machine and
under any load: nothing in a scenario depends on how fast the host runs.

Faults: ``kill`` stops a prefill worker as ``kill -9`` would (no goodbye on
the side channel, its agent dead on the fabric, its log left as a crash
leaves it), ``restart`` brings its engine back with new memory, ``silent``
gives an address nobody listens on, and ``fault_of``/``delay_of`` choose
what the fabric does to each decode request's reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import orjson
import zmq

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import HeartbeatTarget, RecvAbandon, RecvAbort, RecvStart, SendFinish, SendStart, StepFacts
from kvsm.handshake import CompatInfo
from kvsm.lifecycle.clock import VirtualClock
from kvsm.runtime.group import DrivenLoops
from kvsm.transport.base import XferHandle
from kvsm.transport.memory import Fault, InMemoryAgent, InMemoryFabric
from kvsm.worker import WorkerHalf

MS = 1_000_000
S = 1_000_000_000
PORT = 5600
BLOCK_TOKENS = 16
SILENT_HOST = "inproc:nobody-listens"
DECODE = "decode-0"


def pattern(engine: str, generation: int, block: int, size: int) -> bytes:
    """What prefill block ``block`` of ``engine`` (its ``generation``-th start) holds."""
    seed = f"{engine}/{generation}/{block}/".encode()
    return (seed * (size // len(seed) + 1))[:size]


class _Prefill:
    """One prefill engine: its worker, agent and what vLLM saw it report."""

    def __init__(self, name: str, lease_s: float) -> None:
        self.name = name
        self.engine_id = f"prefill-{name}"
        self.lease_s = lease_s
        self.generation = 0
        self.worker: WorkerHalf | None = None
        self.agent: InMemoryAgent | None = None
        self.sent: dict[str, int] = {}  # req -> virtual ns of its first finished_sending


class VirtualTime:
    """Driving real workers' loops and an in-memory fabric on one virtual clock.

    A scenario class sets ``clock``, ``loops`` (``DrivenLoops``) and ``fabric``,
    and implements ``_collect`` (take what the workers reported) and
    ``_stuck`` (their state, for the message when ``run(until=...)`` fails)."""

    clock: VirtualClock
    loops: DrivenLoops
    fabric: InMemoryFabric

    @property
    def now_ns(self) -> int:
        return self.clock.monotonic_ns()

    def run(self, for_s: float = 0.0, *, until: Callable[[], bool] | None = None, limit_s: float = 120.0) -> int:
        """Let everything happen for ``for_s`` seconds of virtual time, or (with
        ``until``) until it holds, failing after ``limit_s``; returns the time."""
        end = self.now_ns + int((limit_s if until is not None else for_s) * S)
        while True:
            self._settle()
            if until is not None and until():
                return self.now_ns
            due = [t for t in (self.loops.next_deadline_ns(), self.fabric.next_completion_ns()) if t is not None]
            if not due or min(due) > end:
                if until is not None:
                    raise AssertionError(f"not reached within {limit_s} s of virtual time; {self._stuck()}")
                self.clock.jump_to(max(end, self.now_ns))
                self._settle()
                return self.now_ns
            self.clock.jump_to(max(min(due), self.now_ns))
            self.fabric.step()

    def _settle(self) -> None:
        while self.loops.run_until_idle():
            self._collect()
        self._collect()

    def _collect(self) -> None:
        raise NotImplementedError

    def _stuck(self) -> str:
        raise NotImplementedError


class VirtualPair(VirtualTime):
    """Prefill workers (name -> lease in s) and one decode worker, on virtual time.

    ``log_dir``: where each worker writes its event log (None: no logs).
    ``decode_cfg``/``prefill_cfg``: KVSMConfig fields over the defaults below;
    ``decode_compat``: CompatInfo fields of the decode worker over the prefill's.
    """

    def __init__(self, prefill: dict[str, float], *, log_dir: Path | None = None, num_blocks: int = 64,
                 block_bytes: int = 64, decode_cfg: dict[str, Any] | None = None,
                 prefill_cfg: dict[str, Any] | None = None, decode_compat: dict[str, Any] | None = None) -> None:
        self.clock = VirtualClock()
        self.loops = DrivenLoops(self.clock, zmq.Context())
        self.fabric = InMemoryFabric(self.clock, latency_ns=200_000, fault_for=self._fault_for,
                                     delay_for=self._delay_for)
        self.log_dir = log_dir
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.decode_cfg = dict(decode_cfg or {})
        self.prefill_cfg = dict(prefill_cfg or {})
        self.compat = CompatInfo(model="kvsm-virtual", dtype="uint8", num_layers=1, num_kv_heads=1,
                                 head_size=block_bytes, block_size=BLOCK_TOKENS, kv_layout="in-memory")
        self.decode_compat = CompatInfo(**{**{f: getattr(self.compat, f) for f in self.compat.__struct_fields__},
                                           **(decode_compat or {})})
        self.log_paths: list[Path] = []
        self.prefills = {name: _Prefill(name, lease) for name, lease in prefill.items()}
        self.fault_of: dict[str, Fault] = {}  # decode req -> what the fabric does to its reads
        self.delay_of: dict[str, int] = {}  # decode req -> how long its reads take (ns)
        self.recving: dict[str, int] = {}  # decode req -> virtual ns it was first in finished_recving
        self.failed: dict[str, int] = {}
        self.invalid: set[int] = set()
        self.local_of: dict[str, tuple[int, ...]] = {}
        self.remote_of: dict[str, tuple[str, tuple[int, ...], int]] = {}  # req -> (prefill, blocks, generation)
        self._steps: dict[str, int] = {}
        self._next_block = 0
        self._closed = False
        self.decode_agent = InMemoryAgent(self.fabric, DECODE, num_blocks, block_bytes)
        self.decode = self._worker(DECODE, "kv_consumer", f"inproc:{DECODE}", self.decode_cfg)
        self.decode.start(self.decode_agent, self.decode_compat)
        for p in self.prefills.values():
            self._start_prefill(p)
        self.run()

    def _stuck(self) -> str:
        return f"decode worker state: {self.decode.debug_state()}"

    def _collect(self) -> None:
        now = self.now_ns
        sent, recving, failed = self.decode.take_results()
        self.invalid |= self.decode.take_invalid_blocks()
        assert not sent, f"the decode worker reported sends {sorted(sent)}"
        # What vLLM relies on: a failure is finished in the same step, its blocks already invalid.
        assert failed <= recving, f"failed_recving {sorted(failed - recving)} without finished_recving"
        for req in failed:
            assert set(self.local_of.get(req, ())) <= self.invalid, f"{req} failed before its blocks were invalid"
            self.failed.setdefault(req, now)
        for req in recving:
            self.recving.setdefault(req, now)
        for p in self.prefills.values():
            if p.worker is None:
                continue
            sent, recving, failed = p.worker.take_results()
            assert not recving and not failed, f"{p.engine_id} reported receptions"
            for req in sent:
                p.sent.setdefault(req, now)

    # -- workers ----------------------------------------------------------------

    def _worker(self, engine_id: str, role: str, host: str, overrides: dict[str, Any]) -> WorkerHalf:
        fields: dict[str, Any] = {
            "engine_id": engine_id, "kv_role": role, "kv_buffer_device": "cpu", "side_channel_host": host,
            "side_channel_port": PORT, "lease_s": 30.0, "heartbeat_interval_s": 5.0, "handshake_timeout_s": 1.0,
            "transfer_timeout_s": 2.0, "peer_backoff_s": 1.0, "peer_backoff_max_s": 16.0,
            "notif_poll_interval_s": 0.001, "event_log_dir": None, "backends": ("memory",), "tp_size": 1,
            "dp_rank": 0, "pp_size": 1, "dcp_size": 1, "block_size": BLOCK_TOKENS, "kv_load_failure_policy": "fail",
            **overrides}
        log = None
        if self.log_dir is not None:
            path = self.log_dir / f"{engine_id}.jsonl"
            n = sum(1 for p in self.log_paths if p.name.startswith(engine_id))
            if n:  # a restarted engine writes a log of its own, as a new process does
                path = self.log_dir / f"{engine_id}.restart{n}.jsonl"
            path.unlink(missing_ok=True)
            self.log_paths.append(path)
            # Each incarnation its own pid, as a restarted process has.
            log = EventLog(path, role="worker", engine_id=engine_id, rank=0, clock=self.clock,
                           pid=1_000_000 + len(self.log_paths))
        return WorkerHalf(KVSMConfig(**fields), 0, event_log=log, clock=self.clock,
                          loop_options=self.loops.loop_options())

    def _start_prefill(self, p: _Prefill) -> None:
        p.generation += 1
        agent_name = f"{p.engine_id}#{p.generation}"
        p.agent = InMemoryAgent(self.fabric, agent_name, self.num_blocks, self.block_bytes)
        for b in range(self.num_blocks):
            p.agent.write_block(b, pattern(p.engine_id, p.generation, b, self.block_bytes))
        p.worker = self._worker(p.engine_id, "kv_producer", f"inproc:{p.engine_id}",
                                {"lease_s": p.lease_s, **self.prefill_cfg})
        p.worker.start(p.agent, self.compat)

    def kill(self, w: str) -> None:
        """``kill -9`` of prefill engine ``w``: its loop stops where it is (sockets
        closed without a word), its agent dies on the fabric, its log keeps what
        reached the writer and gets no shutdown record."""
        p = self.prefills[w]
        assert p.worker is not None and p.agent is not None
        p.worker.loop.stop()
        self.fabric.kill(p.agent.name)
        if p.worker.log is not None:
            p.worker.log.close()
        p.worker = None

    def freeze(self, w: str, frozen: bool = True) -> None:
        """Prefill engine ``w`` cut off by a partition (``frozen=False``: healed): its
        loop stops running, its sockets stay open (what is sent to it waits), its
        agent stays on the fabric (reads from it go on as the fabric says)."""
        loop = self.prefills[w].worker
        assert loop is not None
        (self.loops.frozen.add if frozen else self.loops.frozen.discard)(id(loop.loop))
        if not frozen:
            self._settle()

    def restart(self, w: str) -> None:
        """Engine ``w`` starts again on the same address (new memory, a new agent)."""
        assert self.prefills[w].worker is None, f"prefill {w} is still running"
        self._start_prefill(self.prefills[w])
        self._settle()

    def coords(self, w: str) -> dict[str, Any]:
        """The RecvStart fields that say where prefill engine ``w`` is (``silent``: nobody)."""
        if w == "silent":
            return {"remote_engine": "prefill-silent", "remote_host": SILENT_HOST, "remote_port": PORT,
                    "remote_tp_size": 1}
        return {"remote_engine": self.prefills[w].engine_id, "remote_host": f"inproc:{self.prefills[w].engine_id}",
                "remote_port": PORT, "remote_tp_size": 1}

    # -- vLLM's part ------------------------------------------------------------

    def _submit(self, worker: WorkerHalf, engine_id: str, **facts: list[Any]) -> None:
        step = self._steps[engine_id] = self._steps.get(engine_id, 0) + 1
        meta = StepFacts(step)
        for name, items in facts.items():
            getattr(meta, name).extend(items)
        worker.submit(meta)
        self._settle()

    def finish(self, w: str, reqs: dict[str, tuple[int, ...]], *, start: bool = True) -> None:
        """Prefill requests finished (pinned from now) in one engine step."""
        p = self.prefills[w]
        assert p.worker is not None
        now = self.now_ns
        self._submit(p.worker, p.engine_id, send_start=[SendStart(r) for r in reqs] if start else [],
                     send_finish=[SendFinish(req=r, ok=True, block_ids=tuple(b), pinned_ns=now)
                                  for r, b in reqs.items()])

    def blocks(self, n: int) -> tuple[int, ...]:
        """``n`` decode blocks no other request was given."""
        out = tuple(range(self._next_block, self._next_block + n))
        self._next_block += n
        assert self._next_block <= self.num_blocks, "test bug: out of decode blocks"
        return out

    def start(self, req: str, w: str, remote_req: str, remote_blocks: tuple[int, ...], *,
              local: tuple[int, ...] | None = None, expiry_s: float = 0.0) -> None:
        """vLLM allocated blocks for a remote prefill (none: a full local prefix hit).
        ``expiry_s``: the params' ``remote_blocks_expiry_time`` (virtual wall clock)."""
        local = self.blocks(len(remote_blocks)) if local is None else local
        self.local_of[req] = local
        if w in self.prefills:
            self.remote_of[req] = (w, remote_blocks, self.prefills[w].generation)
        self._submit(self.decode, DECODE, recv_start=[RecvStart(
            req=req, remote_req=remote_req, remote_block_ids=remote_blocks, local_block_ids=local,
            num_tokens=max(1, len(remote_blocks)) * BLOCK_TOKENS, awaited=bool(local), remote_expiry_s=expiry_s,
            **self.coords(w))])

    def abort(self, req: str) -> None:
        self._submit(self.decode, DECODE, recv_abort=[RecvAbort(req=req, awaited=bool(self.local_of.get(req)))])

    def abandon(self, req: str, w: str, remote_req: str) -> None:
        """The decode request ended before vLLM allocated anything."""
        self._submit(self.decode, DECODE, recv_abandon=[RecvAbandon(req=req, remote_req=remote_req,
                                                                    **self.coords(w))])

    def heartbeat(self, w: str, claims: tuple[str, ...]) -> None:
        c = self.coords(w)
        self._submit(self.decode, DECODE, heartbeats=[HeartbeatTarget(
            remote_engine=c["remote_engine"], remote_host=c["remote_host"], remote_port=PORT, remote_tp_size=1,
            claims=claims)])

    # -- what arrived -----------------------------------------------------------

    def holds(self, req: str) -> bool:
        """Every local block of ``req`` holds its prefill block's bytes."""
        w, remote, generation = self.remote_of[req]
        engine = self.prefills[w].engine_id
        return all(self.decode_agent.read_block(b) == pattern(engine, generation, rb, self.block_bytes)
                   for b, rb in zip(self.local_of[req], remote, strict=True))

    def sent(self, w: str) -> dict[str, int]:
        return self.prefills[w].sent

    def state(self, req: str) -> str | None:
        return self.decode.debug_state()["recv"].get(req)

    def records(self, engine_id: str = DECODE) -> list[dict[str, Any]]:
        path = next(p for p in self.log_paths if p.name == f"{engine_id}.jsonl")
        for p in (self.decode, *(q.worker for q in self.prefills.values())):
            if p is not None and p.log is not None:
                p.log.flush()
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    def _fault_for(self, handle: XferHandle) -> Fault:
        return self.fault_of.get(handle.tag, Fault.NONE)

    def _delay_for(self, handle: XferHandle, fault: Fault) -> int:
        return self.delay_of.get(handle.tag, self.fabric.latency_ns * (5 if fault is Fault.STUCK else 1))

    # -- the end ----------------------------------------------------------------

    def close(self) -> None:
        """Shut every live worker down cleanly (the end of every log), then the loops."""
        if self._closed:
            return
        self._closed = True
        for worker in (self.decode, *(p.worker for p in self.prefills.values())):
            if worker is not None:
                worker.shutdown()
        self.loops.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
