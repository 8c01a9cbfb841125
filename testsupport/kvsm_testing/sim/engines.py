"""vLLM, as the simulation plays it around each real worker.

Each side is one engine: its block pool and its scheduler (vLLM's, together
with kvsm's scheduler half). They do what vLLM and ``kvsm.scheduler`` do, in
their terms: allocate and free blocks, turn decisions into the facts of
``kvsm.handoff.facts`` (a step's ``StepFacts``, or a pin straight through the pin
channel), and read the worker's ``take_results()`` / ``take_invalid_blocks()``
as vLLM's model runner does every step, freeing blocks only when vLLM would.

What the worker reports is checked against what vLLM expects (vLLM asserts on
a ``finished_recving`` it does not wait for), and every block the decode side
is told it received is compared with what the prefill side computed.
"""

from __future__ import annotations

import functools
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvsm.handoff.facts import (
    HeartbeatTarget,
    RecvAbandon,
    RecvAbort,
    RecvStart,
    SendFinish,
    SendStart,
    StepFacts,
)
from kvsm.handoff.pins import PinChannelClient
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.invariants import InvariantViolation
from kvsm.lifecycle.timers import TimerHandle
from kvsm.scheduler.block_pairing import pair_segments
from kvsm.transport.layout import TokenPlanes
from kvsm.transport.memory import Fault, InMemoryAgent, InMemoryFabric, token_layout_of
from kvsm_testing.sim.config import DECODE_FAULTS, MS, SimConfig
from kvsm_testing.sim.observe import EngineObserver
from kvsm_testing.sim.stream import PREFIX_HIT, ForwardPasses, check_streamed, stream_block

if TYPE_CHECKING:  # pragma: no cover
    from kvsm.worker import WorkerHalf

BLOCK_TOKENS = 16
SIDE_CHANNEL_PORT = 5600
PREFILL_HOST = "inproc:prefill-0"
# Nothing is bound there: every message to it waits for an answer that never comes.
SILENT_HOST = "inproc:nobody-listens"
# The engine id a restarted prefill engine had: the server answers as prefill-0.
STALE_ENGINE = "prefill-0-before-restart"

# How a simulated block keeps its tokens when the engines' block sizes differ:
# like vLLM-CPU's vec kernel, per head a K plane of 4 rows of 2 bytes per token
# (transposed) and a V plane of 1 row of 8 bytes per token; two heads.
SIM_PLANES = TokenPlanes(((4, 2), (1, 8)))
SIM_HEADS = 2
SIM_TOKEN_LAYOUT = "sim:4x2,1x8/1"

TRANSFER_FAULTS = {"transfer_error": Fault.ERROR, "transfer_hang": Fault.HANG, "transfer_stuck": Fault.STUCK,
                   "transfer_corrupt": Fault.CORRUPT, "peer_dead": Fault.DISCONNECT}


class BlockPool:
    """vLLM's block allocator, reduced to what the simulation needs."""

    def __init__(self, name: str, num_blocks: int, rng: random.Random, null_block: bool = False) -> None:
        self.name = name
        # vLLM never hands out its null block (block 0), which kvsm's pairing reads as "nothing here".
        self.num_blocks = num_blocks - 1 if null_block else num_blocks
        self._free = list(range(1 if null_block else 0, num_blocks))
        self._rng = rng
        self.owner: dict[int, str] = {}

    def allocate(self, req: str, n: int) -> tuple[int, ...]:
        if n > len(self._free):
            raise RuntimeError(f"pool {self.name!r} exhausted")
        # Random picks make freed blocks come back soon: reuse bugs show up.
        picked = []
        for _ in range(n):
            i = self._rng.randrange(len(self._free))
            self._free[i], self._free[-1] = self._free[-1], self._free[i]
            picked.append(self._free.pop())
        for b in picked:
            self.owner[b] = req
        return tuple(picked)

    def free(self, req: str, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.owner.get(b) != req:
                raise RuntimeError(f"pool {self.name!r}: {req!r} frees block {b} owned by {self.owner.get(b)!r}")
            del self.owner[b]
            self._free.append(b)

    @property
    def free_count(self) -> int:
        return len(self._free)


def group_split(n: int, groups: int) -> tuple[int, ...]:
    """How a request's ``n`` blocks fall into ``groups`` KV cache groups: the
    first group (think sliding window) clipped to a third of them, the rest
    spread evenly (a group may get none). One group: ``()``, the plain form."""
    if groups <= 1:
        return ()
    first = n // 3
    rest = n - first
    return (first, *(rest // (groups - 1) + (1 if g < rest % (groups - 1) else 0) for g in range(groups - 1)))


def block_pattern(req_index: int, block_index: int, size: int) -> bytes:
    """The bytes the prefill engine 'computes' for one block of one request."""
    unit = struct.pack("<II", req_index, block_index)
    return (unit * (size // len(unit) + 1))[:size]


def token_block(req_index: int, block_index: int, block_tokens: int) -> bytes:
    """A block of ``block_tokens`` tokens laid out by ``SIM_PLANES``: each token's
    bytes in each head, plane and row say which request, position, head, plane and
    row they are, so a block of any size can be checked token by token."""
    out = bytearray(SIM_HEADS * SIM_PLANES.head_bytes(block_tokens))
    base = 0
    for head in range(SIM_HEADS):
        for plane, (rows, tb) in enumerate(SIM_PLANES.planes):
            for row in range(rows):
                for t in range(block_tokens):
                    unit = struct.pack("<IIBBH", req_index, block_index * block_tokens + t, head, plane, row)
                    at = base + (row * block_tokens + t) * tb
                    out[at:at + tb] = (unit * (tb // len(unit) + 1))[:tb]
            base += rows * block_tokens * tb
    return bytes(out)


@dataclass(frozen=True)
class _Block:
    """A decode block as kvsm.scheduler.block_pairing sees vLLM's: new (no hash), not null."""

    block_id: int
    block_hash: None = None
    is_null: bool = False


class Simulation(Protocol):
    """What the engines use of the simulation that runs them
    (``kvsm_testing.sim.harness.Simulation``): a protocol, so that the harness
    imports the engines and not the other way round."""

    config: SimConfig
    rng: random.Random
    clock: VirtualClock
    fabric: InMemoryFabric
    violations: list[InvariantViolation]
    decode_observer: EngineObserver

    @property
    def prefill(self) -> PrefillEngine: ...

    def at(self, delay_ns: int, fn: Callable[[], None]) -> TimerHandle: ...

    def route_stream(self, i: int, num_blocks: int, num_tokens: int) -> None: ...

    def chance(self, p: float) -> bool: ...


class _Engine:
    """What both sides share: pool, agent, worker, the step being built."""

    def __init__(self, sim: Simulation, engine_id: str, side: int) -> None:
        cfg = sim.config
        self.sim = sim
        self.engine_id = engine_id
        self.pool = BlockPool(engine_id, cfg.num_blocks, sim.rng, null_block=cfg.block_tokens is not None)
        if cfg.block_tokens is None:
            self.block_tokens = BLOCK_TOKENS
            # (layers only where requests stream: a pool without them otherwise, as before)
            self.agent = InMemoryAgent(sim.fabric, engine_id, cfg.num_blocks, cfg.block_bytes, cfg.kv_groups,
                                       layers=cfg.stream_layers if cfg.stream else 0)
        else:  # blocks of this side's size, tokens laid out by SIM_PLANES
            if cfg.kv_groups != 1:
                raise ValueError("block sizes that differ are simulated with one KV cache group only")
            self.block_tokens = cfg.block_tokens[side]
            layout = token_layout_of(engine_id, cfg.num_blocks, self.block_tokens, SIM_PLANES, SIM_HEADS)
            self.agent = InMemoryAgent(sim.fabric, engine_id, cfg.num_blocks, layout.regions[0].block_bytes,
                                       layout=layout)
        self.worker: WorkerHalf | None = None
        self._step = 0
        self.facts = StepFacts(0)

    def flush(self) -> int:
        """The engine steps: this step's facts go to the worker (1 if there were any)."""
        if not self.facts:
            return 0
        facts = self.take_facts()
        assert self.worker is not None
        self.worker.submit(facts)
        return 1

    def take_facts(self) -> StepFacts:
        """This step's facts; the next step's are gathered from now on."""
        facts, self._step = self.facts, self._step + 1
        self.facts = StepFacts(self._step)
        return facts

    def violation(self, kind: str, req: str | None, detail: str) -> None:
        self.sim.violations.append(InvariantViolation(kind, req, f"{self.engine_id}: {detail}",
                                                      {"t_ns": self.sim.clock.monotonic_ns()}))

    def leaked(self) -> None:
        if self.pool.free_count != self.pool.num_blocks:
            self.violation("blocks_leaked", None, f"{self.pool.num_blocks - self.pool.free_count} blocks never "
                                                  f"returned to the pool, e.g. {sorted(self.pool.owner.items())[:10]}")


class PrefillEngine(_Engine):
    """The prefill engine: runs prefills, pins finished ones, frees on finished_sending."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim, "prefill-0", 0)
        self.blocks: dict[str, tuple[int, ...]] = {}  # allocated, by request
        self.pinned: set[str] = set()  # vLLM delays their free until finished_sending
        self.num_tokens: dict[int, int] = {}  # each prompt's tokens (block sizes that differ)
        self.expiry_s: dict[int, float] = {}  # each pin's announced lease end (the params' expiry time)
        self.pins: PinChannelClient | None = None
        self.passes = ForwardPasses(self)  # the steps that compute streamed requests

    def flush(self) -> int:
        """As vLLM: no step's facts go while a forward pass runs (its own went with it)."""
        return 0 if self.passes.current is not None else super().flush()

    def busy(self) -> bool:
        return self.passes.busy()

    def connect(self) -> None:
        """vLLM hands the scheduler its workers' pin targets once they started."""
        assert self.worker is not None
        target = self.worker.pin_target()
        self.pins = PinChannelClient([target]) if target is not None else None

    def arrive(self, i: int, on_finished_ok: Callable[[int, tuple[int, ...]], None]) -> None:
        sim, f = self.sim, self.sim.config.faults
        if sim.chance(sim.config.stream):  # streamed: computed step by step, both legs sent now
            self.passes.arrive(i)
            return
        req = f"p-{i}"
        n = sim.rng.randint(1, sim.config.max_blocks_per_request)
        blocks = self.blocks[req] = self.pool.allocate(req, n)
        if sim.config.block_tokens is None:
            for j, b in enumerate(blocks):
                self.agent.write_block(b, block_pattern(i, j, sim.config.block_bytes))
        else:  # the prompt ends somewhere in its last block
            self.num_tokens[i] = n * self.block_tokens - sim.rng.randrange(self.block_tokens)
            for j, b in enumerate(blocks):
                self.agent.write_block(b, token_block(i, j, self.block_tokens))
        self.facts.send_start.append(SendStart(req))
        prefill_ns = sim.rng.randint(100_000, 2 * MS)
        if sim.chance(f.prefill_abort):
            sim.at(sim.rng.randint(0, prefill_ns), lambda: self._finish(i, "FINISHED_ABORTED", on_finished_ok))
        elif sim.chance(f.prefill_abnormal):
            sim.at(prefill_ns, lambda: self._finish(i, "FINISHED_ERROR", on_finished_ok))
        else:
            sim.at(prefill_ns, lambda: self._finish(i, "FINISHED_STOPPED", on_finished_ok))

    def finish(self, i: int, status: str) -> None:
        """request_finished of a streamed request (its decode leg was sent with it)."""
        self._finish(i, status, lambda i, blocks: None)

    def _finish(self, i: int, status: str, on_finished_ok: Callable[[int, tuple[int, ...]], None]) -> None:
        """request_finished: pin (delay the free) and hand the pin to the worker, or free now."""
        sim = self.sim
        req = f"p-{i}"
        blocks = self.blocks[req]
        if status != "FINISHED_STOPPED":
            self._hand_over(SendFinish(req=req, ok=False, reason=status), late=False)
            self._free(req)
            return
        self.pinned.add(req)
        # The params' remote_blocks_expiry_time, as kvsm's scheduler writes it.
        self.expiry_s[i] = (sim.clock.wall_ns() + sim.config.lease_ns) / 1e9
        self._hand_over(SendFinish(req=req, ok=True, block_ids=blocks, pinned_ns=sim.clock.monotonic_ns()),
                        late=sim.chance(sim.config.faults.pin_late))
        on_finished_ok(i, blocks)  # kv_transfer_params go back to the router

    def _hand_over(self, finish: SendFinish, *, late: bool) -> None:
        """Straight to the worker through the pin channel; a late pin goes with a
        later engine step (an engine that does not step at once, or a failed hand-off)."""
        if late:
            self.sim.at(self.sim.rng.randint(1 * MS, 20 * MS), lambda: self.facts.send_finish.append(finish))
            return
        if self.pins is None or self.pins.send([finish]):
            self.facts.send_finish.append(finish)

    def _free(self, req: str) -> None:
        self.pool.free(req, self.blocks.pop(req))

    def collect(self) -> int:
        """vLLM's step reads the worker's results: finished_sending frees the pins."""
        assert self.worker is not None
        sent, recving, failed = self.worker.take_results()
        invalid = self.worker.take_invalid_blocks()
        if recving or failed or invalid:
            self.violation("unexpected_results", None, f"a producer reported receptions {sorted(recving)[:5]}")
        for req in sorted(sent):
            if req not in self.pinned:
                self.violation("unexpected_finished_sending", req, "reported finished_sending but vLLM did not "
                                                                   "delay its free")
                continue
            self.pinned.discard(req)
            self._free(req)
        return len(sent)

    def close(self) -> None:
        if self.pins is not None:
            self.pins.close()


@dataclass
class _DecodeReq:
    index: int
    req: str
    remote_req: str
    remote_engine: str
    remote_host: str
    remote_blocks: tuple[int, ...]
    fault: str = ""
    blocks: tuple[int, ...] = ()
    delay_ns: int = 0  # how long its read takes (0: the wire latency)
    segments: dict[str, Any] = field(default_factory=dict)  # RecvStart's segment fields (sizes that differ)
    # Streamed push: sent with its prefill leg (remote_req is the join key), the
    # prompt's blocks and tokens known to the router, none of the prefill's blocks.
    stream: bool = False
    num_blocks: int = 0
    num_tokens: int = 0
    cached: int = 0  # its first blocks, a local prefix cache hit (streamed: not asked for)


class DecodeEngine(_Engine):
    """The decode engine: matches remote tokens, allocates, waits for finished_recving."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(sim, "decode-0", 1)
        self.reqs: dict[str, _DecodeReq] = {}
        self.waiting: dict[str, _DecodeReq] = {}  # matched, blocks not allocated yet (heartbeats)
        self.awaited: set[str] = set()  # vLLM holds their blocks until finished_recving
        self.aborted: set[str] = set()
        self.invalid_seen: set[int] = set()
        self.freeing = 0  # frees scheduled, not done
        self._heartbeat_armed = False

    def remote_req_of(self, req: str) -> str | None:
        dr = self.reqs.get(req)
        return dr.remote_req if dr is not None else None

    def prefill_req_of(self, req: str) -> str | None:
        """The prefill request ``req`` gets its KV from (a streamed one's is not its remote_req)."""
        dr = self.reqs.get(req)
        return f"p-{dr.index}" if dr is not None else None

    def fault_of(self, req: str) -> Fault:
        dr = self.reqs.get(req)
        return TRANSFER_FAULTS.get(dr.fault, Fault.NONE) if dr is not None else Fault.NONE

    def delay_of(self, req: str) -> int:
        dr = self.reqs.get(req)
        return dr.delay_ns if dr is not None and dr.delay_ns else self.sim.config.wire_latency_ns

    def arrive(self, i: int, remote_blocks: tuple[int, ...]) -> None:
        """The router sends the request with the prefill's kv_transfer_params."""
        dr = self._request(i, f"p-{i}", remote_blocks)
        self._admit(dr)

    def arrive_stream(self, i: int, num_blocks: int, num_tokens: int) -> None:
        """The router sends the decode leg of a streamed request with its prefill leg:
        the join key, the prompt's size, nothing of the prefill's blocks."""
        dr = self._request(i, f"s-{i}", ())
        dr.stream, dr.num_blocks, dr.num_tokens = True, num_blocks, num_tokens
        self._admit(dr)

    def _request(self, i: int, remote_req: str, remote_blocks: tuple[int, ...]) -> _DecodeReq:
        sim, f = self.sim, self.sim.config.faults
        fault = next((name for name in DECODE_FAULTS if sim.chance(getattr(f, name))), "")
        return _DecodeReq(i, f"d-{i}", remote_req, STALE_ENGINE if fault == "handshake_error" else "prefill-0",
                          SILENT_HOST if fault == "handshake_silent" else PREFILL_HOST, remote_blocks, fault)

    def _admit(self, dr: _DecodeReq) -> None:
        """It waits for blocks (heartbeats meanwhile), then vLLM allocates them."""
        sim, cfg = self.sim, self.sim.config
        f, req, fault = cfg.faults, dr.req, dr.fault
        if fault == "transfer_stuck":  # lands a little late, or seconds late (around the transfer timeout)
            timeout = cfg.transfer_timeout_ns
            dr.delay_ns = (5 * cfg.wire_latency_ns if sim.chance(0.5)
                           else sim.rng.randint(timeout // 2, timeout + timeout // 2))
        self.reqs[req] = self.waiting[req] = dr
        self._arm_heartbeat()
        if sim.chance(f.decode_queued):  # no free blocks for a while: only heartbeats keep the pin
            wait = cfg.lease_ns + cfg.lease_ns // 5 + sim.rng.randint(0, cfg.heartbeat_ns)
        else:
            wait = sim.rng.randint(10_000, 200_000)
        sim.at(wait, lambda: self._allocate(req))
        if sim.chance(f.decode_abort):
            sim.at(sim.rng.randint(0, 3 * MS), lambda: self.abort(req))

    def _allocate(self, req: str) -> None:
        """update_state_after_alloc: the step's RecvStart."""
        dr = self.waiting.pop(req, None)
        if dr is None:
            return  # aborted before vLLM allocated
        if dr.stream:
            self._allocate_stream(dr)
            return
        if dr.fault == "nothing_to_read":  # a full local prefix hit: nothing to read, notify only
            local: tuple[int, ...] = ()
            remote: tuple[int, ...] = ()
        elif self.sim.config.block_tokens is not None:
            self._allocate_segments(dr)
            return
        else:
            local = dr.blocks = self.pool.allocate(req, len(dr.remote_blocks))
            remote = dr.remote_blocks
            self.awaited.add(req)
        self.facts.recv_start.append(RecvStart(
            req=req, remote_engine=dr.remote_engine, remote_req=dr.remote_req, remote_host=dr.remote_host,
            remote_port=SIDE_CHANNEL_PORT, remote_tp_size=1, remote_block_ids=remote, local_block_ids=local,
            num_tokens=len(local) * BLOCK_TOKENS, awaited=bool(local),
            group_sizes=group_split(len(local), self.sim.config.kv_groups) if local else (),
            remote_expiry_s=self.sim.prefill.expiry_s.get(dr.index, 0.0), push=self.sim.chance(self.sim.config.push)))

    def _allocate_stream(self, dr: _DecodeReq) -> None:
        """Blocks for the whole prompt, written by position as the prefill computes it
        (a full local prefix hit: none, notify only)."""
        local: tuple[int, ...] = ()
        sim, size = self.sim, self.block_tokens
        if dr.fault != "nothing_to_read":
            dr.blocks = self.pool.allocate(dr.req, dr.num_blocks)
            if dr.num_blocks > 1 and sim.chance(PREFIX_HIT):  # computed here before: the rest is asked for
                dr.cached = sim.rng.randint(1, dr.num_blocks - 1)
                for j in range(dr.cached):
                    self.agent.write_block(dr.blocks[j], stream_block(dr.index, j, self.agent.block_bytes))
            local = dr.blocks[dr.cached:]
            self.awaited.add(dr.req)
        self.facts.recv_start.append(RecvStart(
            req=dr.req, remote_engine=dr.remote_engine, remote_req=dr.remote_req, remote_host=dr.remote_host,
            remote_port=SIDE_CHANNEL_PORT, remote_tp_size=1, remote_block_ids=(), local_block_ids=local,
            num_tokens=dr.num_tokens - dr.cached * size if local else 0, awaited=bool(local), push=True,
            stream=True, first_position=dr.cached))

    def _allocate_segments(self, dr: _DecodeReq) -> None:
        """Blocks of this engine's size for the prompt's tokens, each filled in
        segments from the prefill blocks holding them (kvsm.scheduler.block_pairing)."""
        p_tokens, d_tokens = self.sim.config.block_tokens or (BLOCK_TOKENS, BLOCK_TOKENS)
        tokens = self.sim.prefill.num_tokens[dr.index]
        dr.blocks = self.pool.allocate(dr.req, -(-tokens // d_tokens))
        self.awaited.add(dr.req)
        local, remote, dr.segments, problem = pair_segments([_Block(b) for b in dr.blocks], dr.remote_blocks,
                                                            d_tokens, p_tokens, tokens)
        self.facts.recv_start.append(RecvStart(
            req=dr.req, remote_engine=dr.remote_engine, remote_req=dr.remote_req, remote_host=dr.remote_host,
            remote_port=SIDE_CHANNEL_PORT, remote_tp_size=1, remote_block_ids=remote, local_block_ids=local,
            num_tokens=tokens, awaited=True, problem=problem,
            remote_expiry_s=self.sim.prefill.expiry_s.get(dr.index, 0.0), push=self.sim.chance(self.sim.config.push),
            **dr.segments))

    def abort(self, req: str) -> None:
        """The client went away: request_finished for a decode request."""
        dr = self.waiting.pop(req, None)
        if dr is not None:  # finished before vLLM allocated anything: the prefill side must unpin
            self.aborted.add(req)
            self.facts.recv_abandon.append(RecvAbandon(
                req=req, remote_engine=dr.remote_engine, remote_req=dr.remote_req, remote_host=dr.remote_host,
                remote_port=SIDE_CHANNEL_PORT, remote_tp_size=1))
        elif req in self.awaited and req not in self.aborted:  # its blocks are being loaded
            self.aborted.add(req)
            self.facts.recv_abort.append(RecvAbort(req=req, awaited=True))

    def _arm_heartbeat(self) -> None:
        if not self._heartbeat_armed:
            self._heartbeat_armed = True
            self.sim.at(self.sim.config.heartbeat_ns, self._heartbeat)

    def _heartbeat(self) -> None:
        """build_connector_meta: the leases of requests still waiting for blocks."""
        self._heartbeat_armed = False
        if not self.waiting:
            return
        groups: dict[tuple[str, str], list[str]] = {}
        for dr in self.waiting.values():
            groups.setdefault((dr.remote_engine, dr.remote_host), []).append(dr.remote_req)
        self.facts.heartbeats.extend(
            HeartbeatTarget(remote_engine=engine, remote_host=host, remote_port=SIDE_CHANNEL_PORT,
                            remote_tp_size=1, claims=tuple(claims))
            for (engine, host), claims in sorted(groups.items()))
        self._arm_heartbeat()

    def collect(self) -> int:
        """vLLM's step: load errors, then finished_recving (blocks back once vLLM is done)."""
        assert self.worker is not None
        self.invalid_seen |= self.worker.take_invalid_blocks()
        sent, recving, failed = self.worker.take_results()
        if sent:
            self.violation("unexpected_results", None, f"a consumer reported sends {sorted(sent)[:5]}")
        for req in sorted(failed - recving):
            self.violation("failed_without_finished", req, "in failed_recving but not in finished_recving")
        for req in sorted(recving):
            if req not in self.awaited:
                self.violation("unexpected_finished_recving", req, "vLLM does not wait for this request")
                continue
            self.awaited.discard(req)
            self._check_report(self.reqs[req], req in failed)
            self.freeing += 1
            self.sim.at(self.sim.rng.randint(0, MS), functools.partial(self._free, req))
        return len(recving)

    def _check_report(self, dr: _DecodeReq, failed: bool) -> None:
        final = self.sim.decode_observer.state("recv", dr.req)
        if failed != (final == "failed"):
            self.violation("report_mismatch", dr.req, f"reported {'failed' if failed else 'received'} but the "
                                                      f"machine is {final!r}")
        if failed:
            missing = set(dr.blocks[dr.cached:]) - self.invalid_seen
            if missing:
                self.violation("load_errors_missing", dr.req, f"failed, but blocks {sorted(missing)} were not "
                                                              "reported by get_block_ids_with_load_errors")
        elif final == "done" and dr.segments:
            self._check_segments(dr)
        elif final == "done" and dr.stream:
            self._check_streamed(dr)
        elif final == "done":
            size = self.sim.config.block_bytes
            for j, b in enumerate(dr.blocks):
                if self.agent.read_block(b) != block_pattern(dr.index, j, size):
                    self.violation("corrupt_delivery", dr.req,
                                   f"block {j} (local {b}) differs from what prefill computed")
                    return

    def _check_streamed(self, dr: _DecodeReq) -> None:
        """Every prompt token of every layer holds what the prefill computed (the
        bytes of positions past the prompt are nobody's)."""
        size, layers = self.block_tokens, len(self.agent.layers() or ())
        for j, b in enumerate(dr.blocks):
            want = stream_block(dr.index, j, self.agent.block_bytes)
            layer = check_streamed(self.agent.read_block(b), want, layers, min(size, dr.num_tokens - j * size), size)
            if layer is not None:
                self.violation("corrupt_delivery", dr.req, f"block {j} (local {b}) layer {layer} differs from what "
                                                           f"prefill computed")
                return

    def _check_segments(self, dr: _DecodeReq) -> None:
        """Every segment read (those holding prompt tokens) holds, byte run by byte
        run, the tokens the prefill computed at those positions."""
        unit, size = dr.segments["segment_tokens"], self.block_tokens
        tokens = self.sim.prefill.num_tokens[dr.index]
        head_bytes = SIM_PLANES.head_bytes(size)
        for j, b in enumerate(dr.blocks):
            want, got = token_block(dr.index, j, size), self.agent.read_block(b)
            for k in range(size // unit):
                if j * size + k * unit >= tokens:
                    break
                for at, n in SIM_PLANES.runs(size, unit, k, head_bytes, range(SIM_HEADS)).tolist():
                    if got[at:at + n] != want[at:at + n]:
                        self.violation("corrupt_delivery", dr.req, f"block {j} (local {b}) segment {k} differs "
                                                                   f"from the prompt's tokens the prefill computed")
                        return

    def _free(self, req: str) -> None:
        self.freeing -= 1
        dr = self.reqs[req]
        self.invalid_seen -= set(dr.blocks)
        self.pool.free(req, dr.blocks)

    def busy(self) -> bool:
        return bool(self.waiting or self.awaited or self.freeing)
