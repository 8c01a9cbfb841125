"""A deterministic prefill/decode simulation of the real workers on virtual time.

Two real ``WorkerHalf``s — a prefill worker (``kv_producer``) and a decode
worker (``kv_consumer``) — run their own lifecycles, side channel, pin channel
and timers, exactly the code that runs under vLLM. They talk over inproc ZMQ
on one context (the side channel binds ``inproc:prefill-0``) and move real
bytes over ``InMemoryAgent``s on one ``InMemoryFabric``. Around them the
simulation plays vLLM on each side (``kvsm_testing.sim.engines``): requests arrive,
blocks are allocated and freed, steps carry the facts, aborts and finishes
happen, and faults come from a seeded RNG through the workers' real inputs.
A share of requests is streamed (``SimConfig.stream``): the router sends both
legs at once and the prefill engine computes the prompt step by step, layer by
layer, as the worker writes it (``kvsm_testing.sim.stream``).

Time: one ``VirtualClock``. Both workers' loops are ``mode="driven"`` loops
of one ``DrivenLoops`` group: no loop thread; this thread runs every loop
until none has work (inproc delivery is immediate, so a message sent is
readable at once), lets the engines step, and only then moves the clock to
the earliest of the loops' timers, the fabric's next completion and its own
agenda. Same seed, same run: all randomness comes from one ``random.Random``.

Checked at the end (``SimResult.violations``):
* every request of both workers is in a terminal state, and what the workers
  still hold per request (machines, I/O state, claims, transfer handles) is
  back to zero;
* every block is back in its engine's pool, and the block ledger (fed by the
  effects the workers' machines emitted) saw no double free, reuse while
  held, or block never freed;
* no read wrote into a decode block its request no longer held, and no read
  of a prefill block its request no longer pinned was served (the decode
  side must fail a read that may have overlapped the lease's end);
* what the workers reported is what vLLM expects (``finished_recving`` only for
  requests it waits for, failures with their blocks among the load errors),
  and every delivered block holds exactly the bytes the prefill side computed.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from kvsm.config import KVSMConfig
from kvsm.handshake import CompatInfo
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.invariants import InvariantViolation
from kvsm.lifecycle.machine import IllegalTransition
from kvsm.lifecycle.timers import TimerHandle, TimerHeap
from kvsm.runtime.group import DrivenLoops
from kvsm.transport.base import XferHandle
from kvsm.transport.memory import Fault, InMemoryFabric, MemoryXferHandle
from kvsm.worker import WorkerHalf
from kvsm_testing.sim.config import MS, Faults, S, SimConfig, SimResult
from kvsm_testing.sim.engines import (
    BLOCK_TOKENS,
    PREFILL_HOST,
    SIDE_CHANNEL_PORT,
    SIM_HEADS,
    SIM_TOKEN_LAYOUT,
    BlockPool,
    DecodeEngine,
    PrefillEngine,
    block_pattern,
)
from kvsm_testing.sim.observe import EngineObserver, ObservedLog, ObserverSink, OutcomeHook
from kvsm_testing.sim.stream import LEG_SPREAD_NS

__all__ = ["BlockPool", "Faults", "SimConfig", "SimResult", "Simulation", "block_pattern", "run_simulation"]

# What a worker holds per request: back to 0 once every request ended
# (WorkerHalf.resources(); peers, sockets and periodic timers stay).
PER_REQUEST_RESOURCES = ("recv_machines", "send_machines", "recv_io", "send_io", "claims", "claim_queue",
                         "oneway", "polling", "client_pending", "transport_handles")

_DECODE_LIVE = ("reading_unclaimed", "transferring", "failing", "aborting", "being_written", "stopping_writes",
                "aborting_writes")
# The prefill worker's states in which a read of the request's blocks is sound if
# the blocks are still the request's: pinned, or not yet heard of (vLLM holds the
# blocks of a finished request until finished_sending; a read posted ahead of its
# claim may reach them before the worker hears of the finish).
# A streamed request's layers are written as they are computed (streaming).
_PREFILL_READABLE = (None, "prefilling", "streaming", "read_early", "awaiting_pull", "writing")


class Simulation:
    """Runs ``config.num_requests`` requests through both workers to the end.

    ``observers``: hooks called with (engine_id, outcome) for every outcome of
    either worker's machines, as it happens (tests watch and steer through
    them, e.g. ``abort_decode``). ``fabric``: the wire (``cancel_lies`` plants
    a transport bug). Workers are built and started by ``run``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.clock = VirtualClock()
        self.agenda: TimerHeap[Callable[[], None]] = TimerHeap()
        self.observers: list[OutcomeHook] = []
        self.log_paths: list[Path] = []
        self.violations: list[InvariantViolation] = []
        self.fabric = InMemoryFabric(self.clock, latency_ns=config.wire_latency_ns, fault_for=self._fault_for,
                                     delay_for=self._delay_for)
        self.prefill: PrefillEngine = PrefillEngine(self)
        self.decode: DecodeEngine = DecodeEngine(self)
        self.prefill_observer = EngineObserver(self.prefill.engine_id, self.observers)
        self.decode_observer = EngineObserver(self.decode.engine_id, self.observers)
        self.decode.agent.on_write = self._check_write
        self.prefill.agent.on_read = self._check_read
        self.loops: DrivenLoops | None = None
        self._steps = 0
        self._unpinned_reads: dict[str, str] = {}  # decode request -> what its read found

    # -- agenda ---------------------------------------------------------------

    def at(self, delay_ns: int, fn: Callable[[], None]) -> TimerHandle:
        return self.agenda.schedule(self.clock.monotonic_ns() + delay_ns, None, fn)

    def chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def abort_decode(self, req: str) -> None:
        """vLLM aborts decode request ``req`` now (its client went away): the abort
        goes to the worker with a step taken at once."""
        self.decode.abort(req)
        if self.decode.worker is not None:
            self.decode.flush()

    # -- the run --------------------------------------------------------------

    def run(self, max_steps: int = 10_000_000) -> SimResult:
        cfg = self.config
        self._start()
        try:
            for i in range(cfg.num_requests):
                self.at(i * cfg.arrival_gap_ns, functools.partial(self.prefill.arrive, i, self._router))
            horizon = cfg.horizon_ns()
            jumped = False
            while self._steps < max_steps:
                self._settle(after_jump=jumped)
                jumped = True
                if self._done():
                    break
                nxt = [t for t in (self.agenda.next_deadline_ns(), self.fabric.next_completion_ns(),
                                   self.loops.next_deadline_ns()) if t is not None]  # type: ignore[union-attr]
                if not nxt or min(nxt) > horizon:
                    break
                self.clock.jump_to(min(nxt))
                self.fabric.step()
                for h in self.agenda.pop_due(self.clock.monotonic_ns()):
                    h.payload()
                    self._steps += 1
                self._steps += 1
            self._settle()
            self._check_workers()
        finally:
            self._stop()
        return self._finish()

    def _router(self, i: int, remote_blocks: tuple[int, ...]) -> None:
        """The prefill's kv_transfer_params came back: send the decode request on."""
        f = self.config.faults
        if self.chance(f.decode_never):
            return
        delay = self.config.lease_ns + S if self.chance(f.decode_late) else self.rng.randint(50_000, MS)
        self.at(delay, lambda: self.decode.arrive(i, remote_blocks))

    def route_stream(self, i: int, num_blocks: int, num_tokens: int) -> None:
        """A streamed request: the router sends its decode leg now, with the prefill
        leg (it reaches its engine a little before or after the prefill's)."""
        f = self.config.faults
        if self.chance(f.decode_never):
            return
        delay = self.config.lease_ns + S if self.chance(f.decode_late) else self.rng.randint(0, LEG_SPREAD_NS)
        self.at(delay, lambda: self.decode.arrive_stream(i, num_blocks, num_tokens))

    def _settle(self, after_jump: bool = False) -> None:
        """Run everything that can run at this instant: every loop until idle, then
        the engines' steps (results in, facts out), again while a step carried facts.
        ``after_jump``: only the clock moved (and the agenda ran) since the last settle."""
        loops = self.loops
        assert loops is not None
        while True:
            work = loops.run_until_idle(after_jump=after_jump)
            after_jump = False
            if work:  # only loop work can change what the workers report
                self.prefill.collect()
                self.decode.collect()
            if self.config.strict:
                illegal = self.prefill_observer.illegal + self.decode_observer.illegal
                if illegal:
                    raise IllegalTransition(illegal[0])
            if not self.prefill.flush() + self.decode.flush():
                return

    def _done(self) -> bool:
        """Nothing left to happen: no request live anywhere, no block held for one,
        and the workers' per-request state drained (a message in flight to a
        silent peer waits for its deadline)."""
        return (not self.agenda and not self.decode.busy() and not self.prefill.busy() and not self.prefill.pinned
                and not self.prefill_observer.requests_live() and not self.decode_observer.requests_live()
                and self.fabric.next_completion_ns() is None and not self._held_by_workers())

    def _held_by_workers(self) -> dict[str, dict[str, int]]:
        """Per-request state each worker still holds (``WorkerHalf.resources``)."""
        out = {}
        for engine in (self.prefill, self.decode):
            assert engine.worker is not None
            held = engine.worker.debug_state()["resources"]
            left = {k: held[k] for k in PER_REQUEST_RESOURCES if held.get(k)}
            if left:
                out[engine.engine_id] = left
        return out

    # -- workers --------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        self.loops = DrivenLoops(self.clock, zmq.Context())
        compat = CompatInfo(model="kvsm-sim", dtype="uint8", num_layers=cfg.stream_layers if cfg.stream else 1,
                            num_kv_heads=1,
                            head_size=cfg.block_bytes, block_size=BLOCK_TOKENS, kv_layout="in-memory")
        for engine, observer, role in ((self.prefill, self.prefill_observer, "kv_producer"),
                                       (self.decode, self.decode_observer, "kv_consumer")):
            if cfg.block_tokens is not None:  # each side its block size, one token layout named
                compat = CompatInfo(model="kvsm-sim", dtype="uint8", num_layers=1, num_kv_heads=SIM_HEADS,
                                    head_size=8, block_size=engine.block_tokens, kv_layout="in-memory",
                                    token_layout=SIM_TOKEN_LAYOUT)
            worker_cfg = self._worker_config(engine.engine_id, role, engine.block_tokens)
            engine.worker = WorkerHalf(worker_cfg, 0, event_log=self._log(engine.engine_id, observer),
                                       clock=self.clock, loop_options=self.loops.loop_options())
            engine.worker.start(engine.agent, compat)
        self.prefill.connect()

    def _worker_config(self, engine_id: str, kv_role: str, block_tokens: int = BLOCK_TOKENS) -> KVSMConfig:
        cfg = self.config
        return KVSMConfig(
            engine_id=engine_id, kv_role=kv_role, kv_buffer_device="cpu",
            side_channel_host=PREFILL_HOST if kv_role == "kv_producer" else f"inproc:{engine_id}",
            side_channel_port=SIDE_CHANNEL_PORT, lease_s=cfg.lease_ns / S, heartbeat_interval_s=cfg.heartbeat_ns / S,
            handshake_timeout_s=cfg.handshake_timeout_ns / S, transfer_timeout_s=cfg.transfer_timeout_ns / S,
            peer_backoff_s=cfg.peer_backoff_ns / S, peer_backoff_max_s=16 * cfg.peer_backoff_ns / S,
            notif_poll_interval_s=cfg.notif_poll_ns / S, event_log_dir=None, backends=("memory",), tp_size=1,
            dp_rank=0, pp_size=1, dcp_size=1, block_size=block_tokens, kv_load_failure_policy="fail")

    def _log(self, engine_id: str, observer: EngineObserver) -> Any:
        if self.config.log_dir is None:
            return ObserverSink(observer, role="worker", engine_id=engine_id)
        path = Path(self.config.log_dir) / f"{engine_id}.worker.rank0.jsonl"
        path.unlink(missing_ok=True)
        self.log_paths.append(path)
        return ObservedLog(path, observer, role="worker", engine_id=engine_id, rank=0, clock=self.clock,
                           capacity=1 << 20)

    def _check_workers(self) -> None:
        for engine_id, left in self._held_by_workers().items():
            self.violations.append(InvariantViolation(
                "worker_state_leaked", None, f"{engine_id}: per-request state left after every request ended: "
                                             f"{left}", {"t_ns": self.clock.monotonic_ns()}))

    def _stop(self) -> None:
        self.prefill.close()
        for engine in (self.prefill, self.decode):
            if engine.worker is not None:
                engine.worker.shutdown()
        if self.loops is not None:
            self.loops.close()

    # -- safety checks on the wire --------------------------------------------

    def _fault_for(self, handle: XferHandle) -> Any:
        return self.decode.fault_of(handle.tag)

    def _delay_for(self, handle: XferHandle, fault: Fault) -> int:
        """How long a transfer takes: its decode request's latency (a streamed layer
        write up to ``stream_reorder`` times that longer, so writes overtake others)."""
        delay = self.decode.delay_of(handle.tag)
        reorder = self.config.stream_reorder
        if reorder and isinstance(handle, MemoryXferHandle) and handle.span is not None:
            delay += self.rng.randint(0, int(reorder * delay))
        return delay

    def _check_write(self, blocks: Sequence[int], tag: str) -> None:
        owners = {self.decode.pool.owner.get(b) for b in blocks}
        state = self.decode_observer.state("recv", tag)
        if owners != {tag} or state not in _DECODE_LIVE:
            self.violations.append(InvariantViolation(
                "write_into_released_block", tag,
                f"a read wrote decode blocks {list(blocks)} (owners {sorted(map(str, owners))}) "
                f"while the request was {state}"))

    def _check_read(self, blocks: Sequence[int], tag: str) -> None:
        remote_req = self.decode.prefill_req_of(tag) or "?"
        owners = {self.prefill.pool.owner.get(b) for b in blocks}
        state = self.prefill_observer.state("send", remote_req)
        if owners != {remote_req} or state not in _PREFILL_READABLE:  # a violation if it is served (_finish)
            self._unpinned_reads[tag] = (f"read prefill blocks {list(blocks)} of {remote_req} (owners "
                                         f"{sorted(map(str, owners))}) while it was {state}, and served it")

    # -- the end --------------------------------------------------------------

    def _finish(self) -> SimResult:
        for req, detail in sorted(self._unpinned_reads.items()):
            if self.decode_observer.state("recv", req) == "done":
                self.violations.append(InvariantViolation("read_of_unpinned_block", req, detail))
        final: dict[tuple[str, str, str], str] = {}
        for observer in (self.prefill_observer, self.decode_observer):
            final.update(observer.final_states())
            self.violations.extend(observer.violations())
        for engine in (self.prefill, self.decode):
            engine.leaked()
        if self.fabric.in_flight():
            self.violations.append(InvariantViolation(
                "transfers_in_flight_at_end", None, f"{self.fabric.in_flight()} transfers never ended"))
        illegal = self.prefill_observer.illegal + self.decode_observer.illegal
        return SimResult(final, list(self.violations), illegal, list(self.log_paths), self.clock.monotonic_ns(),
                         self._steps)


def run_simulation(config: SimConfig) -> SimResult:
    return Simulation(config).run()
