"""A deterministic prefill/decode simulation on virtual time.

Two simulated engines (a prefill engine running the ``send`` lifecycle, a
decode engine running ``recv``) move real bytes through the in-memory
transport. The harness plays every outside party: vLLM's scheduler (new
requests, allocation, finishes, aborts), the worker (handshake replies,
transfer completions), the timers and the router, with faults drawn from a
seeded RNG. It executes the lifecycle *effects* the way the real connector
must (pin and free blocks, arm and cancel timers, post and release reads,
notify the peer), so it exercises the table exactly as the runtime will.

Same seed, same run, byte for byte: the agenda is a timer heap on a
``VirtualClock`` and all randomness comes from one ``random.Random``.

Checked at the end (``SimResult.violations``):
* every request of both engines is in a terminal state;
* every block is back in its engine's pool, and the connector's block
  ledger saw no double free, reuse while held, or block never freed;
* no read wrote into a decode block its request no longer held, nor read a
  prefill block its request no longer pinned;
* every delivered block holds exactly the bytes the prefill engine computed.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.invariants import BlockLedger, InvariantViolation
from kvsm.lifecycle.machine import IllegalEventPolicy, LifecycleTracker, Outcome
from kvsm.lifecycle.table import RECV, SEND, LifecycleSpec
from kvsm.lifecycle.timers import TimerHandle, TimerHeap
from kvsm.transport.base import TransferState, XferHandle
from kvsm.transport.memory import Fault, InMemoryAgent, InMemoryFabric

MS = 1_000_000
S = 1_000_000_000


@dataclass(frozen=True)
class Faults:
    """Per-request probabilities of each fault (0 = never)."""

    prefill_abort: float = 0.0  # the client goes away while prefilling
    prefill_abnormal: float = 0.0  # prefill ends by error/length: nothing to pin
    decode_never: float = 0.0  # the decode request never comes: the lease expires
    decode_late: float = 0.0  # it comes after the lease expired
    decode_abort: float = 0.0  # the client aborts the decode request at a random time
    nothing_to_read: float = 0.0  # full local prefix hit on the decode engine
    handshake_error: float = 0.0  # the peer rejects the handshake
    handshake_silent: float = 0.0  # the peer never answers: handshake timeout
    peer_dead: float = 0.0  # the peer is found dead mid-way
    transfer_error: float = 0.0
    transfer_hang: float = 0.0  # never completes: transfer timeout, then cancel
    transfer_stuck: float = 0.0  # completes late and cannot be cancelled meanwhile
    transfer_corrupt: float = 0.0  # one byte flipped on the wire (must be detected)

    @classmethod
    def mixed(cls, p: float = 0.05) -> Faults:
        """Every fault that a correct connector survives, each with probability ``p``."""
        return cls(**{name: p for name in cls.__dataclass_fields__ if name != "transfer_corrupt"})


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    num_requests: int = 50
    faults: Faults = Faults()
    block_bytes: int = 32
    num_blocks: int = 2048
    max_blocks_per_request: int = 6
    arrival_gap_ns: int = 1 * MS
    lease_ns: int = 30 * S
    handshake_timeout_ns: int = 2 * S
    transfer_timeout_ns: int = 5 * S
    heartbeat_ns: int = 5 * S
    wire_latency_ns: int = 300_000
    log_dir: Path | None = None
    strict: bool = False  # raise at the first illegal event instead of recording it
    # The lifecycles to run; tests swap in a deliberately broken table to show
    # that the checks catch what it gets wrong.
    recv_spec: LifecycleSpec = RECV
    send_spec: LifecycleSpec = SEND


@dataclass
class SimResult:
    final_states: dict[tuple[str, str, str], str]  # (engine_id, lifecycle, req) -> state
    violations: list[InvariantViolation]
    illegal_events: list[Outcome]
    log_paths: list[Path]
    end_ns: int
    steps: int

    def count(self, lifecycle: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, lc, _), state in self.final_states.items():
            if lc == lifecycle:
                out[state] = out.get(state, 0) + 1
        return dict(sorted(out.items()))


class BlockPool:
    """vLLM's block allocator, reduced to what the simulation needs."""

    def __init__(self, name: str, num_blocks: int, rng: random.Random) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
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


def block_pattern(req_index: int, block_index: int, size: int) -> bytes:
    """The bytes the prefill engine 'computes' for one block of one request."""
    unit = struct.pack("<II", req_index, block_index)
    return (unit * (size // len(unit) + 1))[:size]


class _Engine:
    """One simulated engine process: its lifecycle tracker, pool, agent, timers and log."""

    def __init__(self, sim: Simulation, engine_id: str, spec: Any) -> None:
        cfg = sim.config
        self.sim = sim
        self.engine_id = engine_id
        self.pool = BlockPool(engine_id, cfg.num_blocks, sim.rng)
        self.agent = InMemoryAgent(sim.fabric, engine_id, cfg.num_blocks, cfg.block_bytes)
        self.ledger = BlockLedger(engine_id)
        self.timers: dict[str, dict[str, TimerHandle]] = {}
        self.log = None
        if cfg.log_dir is not None:
            from kvsm.eventlog import EventLog

            path = Path(cfg.log_dir) / f"{engine_id}.scheduler.jsonl"
            self.log = EventLog(path, role="scheduler", engine_id=engine_id, rank=0, clock=sim.clock)
            sim.log_paths.append(path)
        policy = IllegalEventPolicy.RAISE if cfg.strict else IllegalEventPolicy.RECORD
        self.tracker = LifecycleTracker(spec, sim.clock, listener=self._on_outcome, policy=policy)
        self.effects: Callable[[Outcome], None] = lambda o: None

    def _on_outcome(self, o: Outcome) -> None:
        if self.log is not None:
            self.log.record_outcome(o)
        if o.violation:
            self.sim.illegal.append(o)
            return
        where = {"engine": self.engine_id, "t_ns": o.t_ns, "event": o.trigger}
        if o.trigger == "create":
            self.ledger.hold(o.req, o.block_ids, where)
            return
        self.ledger.apply_effects(o.req, o.effects, o.block_ids, where)
        if o.dst in self.tracker.spec.terminal:
            self.ledger.finish(o.req, o.dst, where)
            self.sim.final_states[(self.engine_id, self.tracker.spec.name, o.req)] = o.dst  # type: ignore[index]

    def apply(self, event: ev.Event) -> Outcome:
        outcome = self.tracker.apply(event)
        if outcome.ok:
            self.effects(outcome)
        return outcome

    def arm(self, req: str, name: str, delay_ns: int, fn: Callable[[], None]) -> None:
        """(Re)arm the request's timer ``name``."""
        timers = self.timers.setdefault(req, {})
        self.sim.agenda.cancel(timers.get(name))
        timers[name] = self.sim.at(delay_ns, fn)

    def cancel_timer(self, req: str, name: str) -> None:
        self.sim.agenda.cancel(self.timers.get(req, {}).pop(name, None))

    def cancel_timers(self, req: str) -> None:
        for h in self.timers.pop(req, {}).values():
            self.sim.agenda.cancel(h)

    def note(self, event: str, req: str, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)


@dataclass
class _DecodeReq:
    index: int
    req: str
    remote_req: str
    blocks_needed: int
    handles: list[XferHandle] = field(default_factory=list)
    fault: str = ""


class Simulation:
    """Runs ``config.num_requests`` requests through both engines to the end."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.clock = VirtualClock()
        self.agenda: TimerHeap[Callable[[], None]] = TimerHeap()
        self.log_paths: list[Path] = []
        self.final_states: dict[tuple[str, str, str], str] = {}
        self.illegal: list[Outcome] = []
        self.violations: list[InvariantViolation] = []
        self._transfer_faults: dict[str, Fault] = {}
        self.fabric = InMemoryFabric(self.clock, latency_ns=config.wire_latency_ns,
                                     fault_for=lambda h: self._transfer_faults.get(h.tag, Fault.NONE))
        self.prefill = _Engine(self, "prefill-0", config.send_spec)
        self.decode = _Engine(self, "decode-0", config.recv_spec)
        self.prefill.effects = self._prefill_effects
        self.decode.effects = self._decode_effects
        self.decode.agent.on_write = self._check_write
        self.prefill.agent.on_read = self._check_read
        self._dreqs: dict[str, _DecodeReq] = {}
        self._reading: dict[str, None] = {}  # decode requests with handles, in posting order
        self._prefill_blocks: dict[str, tuple[int, ...]] = {}
        self._steps = 0

    # -- agenda ---------------------------------------------------------------

    def at(self, delay_ns: int, fn: Callable[[], None]) -> TimerHandle:
        return self.agenda.schedule(self.clock.monotonic_ns() + delay_ns, None, fn)

    def _chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    def run(self, max_steps: int = 10_000_000) -> SimResult:
        cfg = self.config
        for i in range(cfg.num_requests):
            self.at(i * cfg.arrival_gap_ns, lambda i=i: self._prefill_arrive(i))
        while self._steps < max_steps:
            nxt = [t for t in (self.agenda.next_deadline_ns(), self.fabric.next_completion_ns()) if t is not None]
            if not nxt:
                break
            now = max(min(nxt), self.clock.monotonic_ns())
            self.clock.set(now)
            self.fabric.step()
            self._poll_transfers()
            self._poll_notifs()
            for h in self.agenda.pop_due(now):
                h.payload()
                self._steps += 1
            self._steps += 1
        return self._finish()

    # -- prefill engine -------------------------------------------------------

    def _prefill_arrive(self, i: int) -> None:
        f = self.config.faults
        p = self.prefill
        req = f"p-{i}"
        n = self.rng.randint(1, self.config.max_blocks_per_request)
        p.tracker.create(req)
        blocks = p.pool.allocate(req, n)
        self._prefill_blocks[req] = blocks
        for j, b in enumerate(blocks):
            p.agent.write_block(b, block_pattern(i, j, self.config.block_bytes))
        prefill_ns = self.rng.randint(100_000, 2 * MS)
        if self._chance(f.prefill_abort):
            self.at(self.rng.randint(0, prefill_ns), lambda: self._prefill_end(i, "abort"))
        elif self._chance(f.prefill_abnormal):
            self.at(prefill_ns, lambda: self._prefill_end(i, "abnormal"))
        else:
            self.at(prefill_ns, lambda: self._prefill_end(i, "ok"))

    def _prefill_end(self, i: int, how: str) -> None:
        req = f"p-{i}"
        blocks = self._prefill_blocks[req]
        p = self.prefill
        if how != "ok":
            event = ev.Abort(req=req) if how == "abort" else ev.FinishedAbnormally(req=req, reason="length")
            p.apply(event)
            self._prefill_free(req)  # request_finished said "not delayed": vLLM frees now
            return
        p.apply(ev.FinishedOk(req=req, block_ids=blocks, expected_reads=1, lease_ns=self.config.lease_ns))
        f = self.config.faults
        if self._chance(f.decode_never):
            return
        delay = self.config.lease_ns + S if self._chance(f.decode_late) else self.rng.randint(50_000, MS)
        self.at(delay, lambda: self._decode_arrive(i, len(blocks)))

    def _prefill_free(self, req: str) -> None:
        """vLLM frees a prefill request's blocks (at once, or when the connector says so)."""
        self.prefill.pool.free(req, self._prefill_blocks.pop(req))

    def _prefill_effects(self, o: Outcome) -> None:
        p = self.prefill
        for effect in o.effects:
            if effect in ("arm_lease", "extend_lease"):
                m = p.tracker.get(o.req)
                assert m is not None
                req = o.req
                p.arm(req, "lease", m.lease_deadline_ns - self.clock.monotonic_ns(),
                      lambda req=req: p.apply(ev.LeaseExpired(req=req)))
            elif effect == "cancel_lease":
                p.cancel_timer(o.req, "lease")
            elif effect == "free_blocks":
                p.cancel_timers(o.req)
                self._prefill_free(o.req)
            elif effect == "pin_blocks":
                pass  # the blocks simply stay allocated until free_blocks
            else:
                raise NotImplementedError(f"the simulation does not execute prefill effect {effect!r}")

    def _prefill_claim(self, remote_req: str) -> str:
        """The prefill side's answer to a decode handshake that names a request."""
        m = self.prefill.tracker.get(remote_req)
        if m is None or m.state != "awaiting_pull":
            return "expired"
        self.prefill.apply(ev.Heartbeat(req=remote_req, lease_ns=self.config.lease_ns))
        return "ok"

    def _poll_notifs(self) -> None:
        for _peer, msg in self.prefill.agent.get_notifs():
            kind, _, req = msg.decode().partition(":")
            m = self.prefill.tracker.get(req)
            if kind == "read":
                # A read of a request that is no longer pinned is applied anyway:
                # the tracker records it as a violation (read after lease expiry).
                self.prefill.apply(ev.ReadNotif(req=req, reader="decode-0"))
            elif kind == "abandon" and m is not None and m.state == "awaiting_pull":
                self.prefill.apply(ev.RemoteAbandoned(req=req, reason="decode gave up"))
            elif kind == "heartbeat" and m is not None and m.state == "awaiting_pull":
                self.prefill.apply(ev.Heartbeat(req=req, lease_ns=self.config.lease_ns))

    # -- decode engine --------------------------------------------------------

    def _decode_arrive(self, i: int, n: int) -> None:
        f = self.config.faults
        d = self.decode
        req, remote_req = f"d-{i}", f"p-{i}"
        dr = _DecodeReq(i, req, remote_req, n)
        for name in ("handshake_error", "handshake_silent", "peer_dead", "transfer_error", "transfer_hang",
                     "transfer_stuck", "transfer_corrupt", "nothing_to_read"):
            if self._chance(getattr(f, name)):
                dr.fault = name
                break
        self._dreqs[req] = dr
        d.tracker.create(req)
        d.apply(ev.Matched(req=req, num_tokens=n * 16, remote_engine="prefill-0", remote_req=remote_req,
                           remote_blocks=n))
        self.at(self.rng.randint(10_000, 200_000), lambda: self._decode_allocate(req))
        if self._chance(f.decode_abort):
            self.at(self.rng.randint(0, 3 * MS), lambda: self._decode_abort(req))
        self._heartbeat(req)

    def _decode_abort(self, req: str) -> None:
        if req in self.decode.tracker:
            self.decode.apply(ev.Abort(req=req))

    def _heartbeat(self, req: str) -> None:
        m = self.decode.tracker.get(req)
        if m is None or m.state in ("failing", "aborting"):
            return
        if m.state in ("pending_handshake", "remote_known", "transferring"):
            self.decode.agent.send_notif("prefill-0", f"heartbeat:{self._dreqs[req].remote_req}".encode())
        self.at(self.config.heartbeat_ns, lambda: self._heartbeat(req))

    def _decode_allocate(self, req: str) -> None:
        d = self.decode
        m = d.tracker.get(req)
        if m is None or m.state != "awaiting_blocks":
            return  # aborted before vLLM allocated
        dr = self._dreqs[req]
        blocks = d.pool.allocate(req, dr.blocks_needed)
        d.apply(ev.Allocated(req=req, block_ids=blocks, num_external_tokens=dr.blocks_needed * 16))

    def _handshake_reply(self, req: str) -> None:
        d = self.decode
        m = d.tracker.get(req)
        if m is None or m.state != "pending_handshake":
            d.note("stale_handshake_reply", req, state=m.state if m else d.tracker.final_state(req))
            return
        dr = self._dreqs[req]
        if dr.fault == "handshake_error":
            d.apply(ev.Error(req=req, kind="handshake", detail="compatibility hash mismatch: block_size"))
        elif dr.fault == "peer_dead" and self.rng.random() < 0.5:
            d.apply(ev.PeerDead(req=req, peer="prefill-0"))
        elif self._prefill_claim(dr.remote_req) != "ok":
            d.apply(ev.Error(req=req, kind="lease_expired", detail=f"{dr.remote_req} no longer pinned"))
        else:
            d.agent.add_peer(b"prefill-0")
            d.apply(ev.HandshakeOk(req=req, remote_engine="prefill-0"))

    def _post_reads(self, req: str) -> None:
        d = self.decode
        dr = self._dreqs[req]
        m = d.tracker.get(req)
        assert m is not None
        if dr.fault == "nothing_to_read":
            d.apply(ev.NothingToRead(req=req))
            return
        remote = self._prefill_blocks[dr.remote_req]
        fault = {"transfer_error": Fault.ERROR, "transfer_hang": Fault.HANG, "transfer_stuck": Fault.STUCK,
                 "transfer_corrupt": Fault.CORRUPT}.get(dr.fault, Fault.NONE)
        self._transfer_faults[req] = fault
        self._reading[req] = None
        dr.handles.append(d.agent.post_read("prefill-0", m.block_ids, remote, f"read:{dr.remote_req}".encode(),
                                            tag=req))
        d.apply(ev.ReadsPosted(req=req, num_blocks=len(remote), num_descs=len(remote)))
        if dr.fault == "peer_dead":
            self.at(self.rng.randint(0, 2 * self.config.wire_latency_ns),
                    lambda: d.apply(ev.PeerDead(req=req, peer="prefill-0")) if req in d.tracker else None)

    def _poll_transfers(self) -> None:
        d = self.decode
        for req in list(self._reading):
            dr = self._dreqs[req]
            if not dr.handles:
                del self._reading[req]
                continue
            m = d.tracker.get(req)
            states = [d.agent.check(h) for h in dr.handles]
            if any(s is TransferState.PENDING for s in states):
                continue
            if m is None:
                self._release_reads(req)  # a late landing after the request ended
                continue
            if any(s is TransferState.ERROR for s in states):
                d.apply(ev.Error(req=req, kind="transfer", detail="NIXL transfer state ERR"))
            else:
                d.apply(ev.AllReadsDone(req=req, num_bytes=sum(len(h.local_blocks) for h in dr.handles)
                                        * self.config.block_bytes))

    def _release_reads(self, req: str) -> bool:
        """Release every handle; True when none can write any more."""
        dr = self._dreqs[req]
        keep = [h for h in dr.handles if not self.decode.agent.release(h)]
        dr.handles = keep
        return not keep

    def _decode_effects(self, o: Outcome) -> None:
        d = self.decode
        req = o.req
        dr = self._dreqs[req]
        for effect in o.effects:
            if effect == "arm_handshake_timer":
                d.arm(req, "handshake", self.config.handshake_timeout_ns,
                      lambda: d.apply(ev.Timeout(req=req, what="handshake")) if req in d.tracker else None)
            elif effect == "start_handshake":
                if dr.fault != "handshake_silent":
                    self.at(self.rng.randint(100_000, MS), lambda: self._handshake_reply(req))
            elif effect == "cancel_handshake_timer":
                d.cancel_timer(req, "handshake")
            elif effect == "arm_transfer_timer":
                d.arm(req, "transfer", self.config.transfer_timeout_ns,
                      lambda: d.apply(ev.Timeout(req=req, what="transfer")) if req in d.tracker else None)
            elif effect == "cancel_timers":
                d.cancel_timers(req)
            elif effect == "post_reads":
                self.at(0, lambda: self._post_reads(req) if req in d.tracker else None)
            elif effect == "send_notif":
                if not dr.handles:  # a read carries its notification; nothing_to_read does not
                    d.agent.send_notif("prefill-0", f"read:{dr.remote_req}".encode())
            elif effect == "notify_abandon":
                d.agent.send_notif("prefill-0", f"abandon:{dr.remote_req}".encode())
            elif effect == "release_reads":
                if self._release_reads(req) and o.dst in ("failing", "aborting"):
                    self.at(0, lambda: d.apply(ev.ReadsQuiesced(req=req)) if req in d.tracker else None)
            elif effect == "deliver_blocks":
                if dr.fault != "nothing_to_read":
                    self._verify_delivery(o, dr)
                self._later_free(req, o.block_ids)
            elif effect in ("report_invalid", "release_blocks"):
                self._later_free(req, o.block_ids)
            elif effect == "take_blocks":
                pass  # vLLM allocated them; the ledger records that they are ours now
            else:
                raise NotImplementedError(f"the simulation does not execute decode effect {effect!r}")

    def _later_free(self, req: str, blocks: Sequence[int]) -> None:
        """vLLM frees a decode request's blocks when it is done with them."""
        self.at(self.rng.randint(0, MS), lambda: self.decode.pool.free(req, blocks))

    # -- safety checks on the wire --------------------------------------------

    def _check_write(self, blocks: Sequence[int], tag: str) -> None:
        owners = {self.decode.pool.owner.get(b) for b in blocks}
        m = self.decode.tracker.get(tag)
        if owners != {tag} or m is None or m.state not in ("transferring", "failing", "aborting"):
            self.violations.append(InvariantViolation(
                "write_into_released_block", tag,
                f"a read wrote decode blocks {list(blocks)} (owners {sorted(map(str, owners))}) "
                f"while the request was {m.state if m else 'finished'}"))

    def _check_read(self, blocks: Sequence[int], tag: str) -> None:
        remote_req = self._dreqs[tag].remote_req
        owners = {self.prefill.pool.owner.get(b) for b in blocks}
        m = self.prefill.tracker.get(remote_req)
        if owners != {remote_req} or m is None or m.state != "awaiting_pull":
            self.violations.append(InvariantViolation(
                "read_of_unpinned_block", tag,
                f"read prefill blocks {list(blocks)} of {remote_req} while it was "
                f"{m.state if m else self.prefill.tracker.final_state(remote_req)}"))

    def _verify_delivery(self, o: Outcome, dr: _DecodeReq) -> None:
        for j, b in enumerate(o.block_ids):
            want = block_pattern(dr.index, j, self.config.block_bytes)
            if self.decode.agent.read_block(b) != want:
                self.violations.append(InvariantViolation(
                    "corrupt_delivery", o.req, f"block {j} (local {b}) differs from what prefill computed"))
                return

    # -- the end --------------------------------------------------------------

    def _finish(self) -> SimResult:
        for engine in (self.prefill, self.decode):
            for m in engine.tracker.live():
                self.final_states[(engine.engine_id, m.lifecycle, m.req)] = m.state
                self.violations.append(InvariantViolation(
                    "not_terminal_at_end", m.req, f"{engine.engine_id} {m.lifecycle} request left in {m.state!r}"))
            self.violations.extend(engine.ledger.violations)
            if engine.pool.free_count != engine.pool.num_blocks:
                leaked = sorted(engine.pool.owner.items())[:10]
                self.violations.append(InvariantViolation(
                    "blocks_leaked", None,
                    f"{engine.engine_id}: {engine.pool.num_blocks - engine.pool.free_count} blocks never "
                    f"returned to the pool, e.g. {leaked}"))
            if engine.log is not None:
                engine.log.close()
        if self.fabric.in_flight():
            self.violations.append(InvariantViolation(
                "transfers_in_flight_at_end", None, f"{self.fabric.in_flight()} transfers never ended"))
        return SimResult(dict(self.final_states), list(self.violations), list(self.illegal),
                         list(self.log_paths), self.clock.monotonic_ns(), self._steps)


def run_simulation(config: SimConfig) -> SimResult:
    return Simulation(config).run()
