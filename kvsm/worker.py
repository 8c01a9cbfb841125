"""The worker half of KVSMConnector: the lifecycle machines and all their I/O.

One ``WorkerHalf`` per worker process (one per tensor-parallel rank). It owns
the request machines of both lifecycles and one event-loop thread
(``kvsm.loop``) that does everything else: the side channel (a handshake
server when this engine prefills for others, a handshake client when it
decodes), every NIXL call after registration, and every timer.

vLLM's model-runner thread only does two things here: ``start_load_kv``
posts the step's metadata to the loop, and ``get_transfer_results`` /
``get_block_ids_with_load_errors`` take what the loop has put in a small
locked results box. Nothing it calls waits for I/O.

How one request moves (the table in ``kvsm.lifecycle.table`` decides; this
module only carries out the effects it names):

decode   RecvStart -> matched, allocated -> start_handshake: claim the remote
         request over the side channel (fetching the peer's NIXL agent the
         first time) -> handshake_ok -> post_reads: one NIXL READ carrying a
         notification -> all_reads_done -> deliver_blocks: finished_recving.
prefill  SendFinish(ok), straight from the scheduler (``kvsm.pin_channel``,
         not with a later step) -> finished_ok: pin, arm the lease from the
         scheduler's decision -> the decode
         side's read notification -> read_notif: free_blocks, i.e.
         finished_sending. Heartbeats and claims extend the lease; expiry
         frees the blocks, and a claim after it is answered "expired".

Why a claim before every read: the prefill side may have freed (and reused)
the blocks when its lease ran out. The claim extends the lease and says
whether the blocks are still pinned; the decode side then checks, when the
read completes, that it completed within one lease of the claim. A read
that may have overlapped an expiry fails the request instead of serving
reused blocks.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handshake import (
    MAX_CLAIMS,
    ClaimsReply,
    CompatInfo,
    HandshakeClient,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeRefused,
    HandshakeResult,
    HandshakeServer,
    HandshakeTimeout,
    MetadataReply,
    peer_address,
)
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.lifecycle.machine import LifecycleTracker, Outcome
from kvsm.lifecycle.table import RECV, SEND
from kvsm.loop import EventLoop, LoopError, TimerHandle
from kvsm.metadata import (
    HeartbeatTarget,
    KVSMConnectorMetadata,
    RecvAbandon,
    RecvAbort,
    RecvStart,
    SendFinish,
)
from kvsm.pin_channel import PinChannelServer, PinTarget
from kvsm.stats import StatsRecorder
from kvsm.transport.base import TransferState, Transport, XferHandle

log = logging.getLogger("kvsm.worker")

_MS = 1_000_000
_S = 1_000_000_000
# How soon a claim answered "unknown" is asked again. The prefill worker learns
# of a finished request with its engine's next step, which may start after the
# decode side's claim arrived: measured under load, a quarter of the claims came
# 2-18 ms early. Retries due together go out as one message per peer, so a
# short interval costs at most one message per peer every few ms.
CLAIM_RETRY_NS = 4 * _MS
# A read must complete this much inside the lease its claim granted.
LEASE_MARGIN_NS = 500 * _MS
_MAX_EARLY_ABANDONS = 4096
# Slowest notification polling while blocks are pinned and no read is announced.
NOTIF_POLL_MAX_NS = 50 * _MS
# How long after a claim the prefill side polls at full speed.
NOTIF_FAST_WINDOW_NS = 200 * _MS


class _Results:
    """What the loop hands to vLLM's model-runner thread, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid_blocks: set[int] = set()

    def sent(self, req: str) -> None:
        with self._lock:
            self.finished_sending.add(req)

    def received(self, req: str) -> None:
        with self._lock:
            self.finished_recving.add(req)

    def failed(self, req: str, blocks: tuple[int, ...]) -> None:
        # Both in the same pass, as vLLM requires: the failed blocks no later
        # than the finished_recving that releases the request.
        with self._lock:
            self.invalid_blocks.update(blocks)
            self.failed_recving.add(req)
            self.finished_recving.add(req)

    def take(self) -> tuple[set[str], set[str], set[str]]:
        with self._lock:
            out = (self.finished_sending, self.finished_recving, self.failed_recving)
            self.finished_sending, self.finished_recving, self.failed_recving = set(), set(), set()
        return out

    def take_invalid(self) -> set[int]:
        with self._lock:
            out, self.invalid_blocks = self.invalid_blocks, set()
        return out


@dataclass(slots=True)
class _Peer:
    """One prefill worker this decode worker reads from."""

    engine: str
    address: str
    agent: str | None = None  # NIXL agent name once its metadata is loaded
    # A read failed: fetch its metadata again with the next claim, in case it
    # re-registered its memory (add_peer replaces a changed incarnation).
    stale: bool = False
    dead_until_ns: int = 0
    backoff_ns: int = 0
    failures: int = 0
    last_error: str = ""
    # When we last learned whether it is alive (marked dead, or it answered a claim): a
    # message sent before then that times out tells nothing new about it.
    news_ns: int = 0


@dataclass(slots=True)
class _RecvIO:
    """The I/O side of one decode request: what its effects need."""

    start: RecvStart
    peer: _Peer
    handles: list[XferHandle] = field(default_factory=list)
    handshake_timer: TimerHandle | None = None
    transfer_timer: TimerHandle | None = None
    retry_timer: TimerHandle | None = None
    claim_sent_ns: int = 0
    claim_granted_ns: int = 0  # when the claim that granted the read was sent
    lease_window_ns: int = 0  # how long the prefill side said that claim pins the blocks
    notif_sent: bool = False  # a read completed: its notification went to the prefill side
    settle_timer: TimerHandle | None = None
    posted_ns: int = 0
    reads_posted: bool = False
    reported: bool = False  # vLLM was told (finished_recving) about this request
    answers: dict[str, int] = field(default_factory=dict)  # claim answers so far, by status


@dataclass(slots=True)
class _SendIO:
    lease_timer: TimerHandle | None = None


@dataclass(slots=True)
class _Claim:
    """A claim request in flight: which local requests wait on its answer."""

    peer: _Peer
    sent_ns: int
    reqs: list[tuple[str, str]]  # (local req, remote req)
    fetch: bool


class WorkerHalf:
    """Worker-side state of one engine's connector (one tensor-parallel rank)."""

    def __init__(self, cfg: KVSMConfig, tp_rank: int, *, event_log: EventLog | None = None,
                 stats: StatsRecorder | None = None, clock: Clock = SYSTEM_CLOCK,
                 loop_options: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.log = event_log
        self.stats = stats or StatsRecorder()
        self.results = _Results()
        # ``clock``/``loop_options`` let the simulation run the real worker on virtual time.
        self.loop = EventLoop(f"{cfg.engine_id}-tp{tp_rank}", on_error=self._on_loop_error, clock=clock,
                              **(loop_options or {}))
        listener = self._on_outcome
        self.recv = LifecycleTracker(RECV, self.loop.clock, listener=listener)
        self.send = LifecycleTracker(SEND, self.loop.clock, listener=listener)
        self.state_counts: dict[str, dict[str, int]] = {
            spec.name: dict.fromkeys(spec.states, 0) for spec in (RECV, SEND)}
        self.transport: Transport | None = None
        self.server: HandshakeServer | None = None
        self.client: HandshakeClient | None = None
        self.pins: PinChannelServer | None = None
        self.compat: CompatInfo | None = None
        self.agent_name = ""
        # Loop-thread state.
        self._recv_io: dict[str, _RecvIO] = {}
        self._send_io: dict[str, _SendIO] = {}
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._claims: dict[int, _Claim] = {}
        self._claim_queue: dict[tuple[str, str], list[str]] = {}
        self._retry_flush_posted = False
        # Heartbeats and abandons in flight (peer, when sent): only failures matter.
        self._oneway: dict[int, tuple[_Peer, int]] = {}
        self._polling: set[str] = set()
        self._poll_timer: TimerHandle | None = None
        self._notif_timer: TimerHandle | None = None
        self._expiry_timer: TimerHandle | None = None
        self._early_abandons: OrderedDict[str, None] = OrderedDict()
        self._side_channel_seen: dict[str, int] = {}
        # Set once a decode worker fetched our agent: from then on NIXL is driven
        # (slowly when idle), since a peer's read completes only as we progress.
        self._has_readers = False
        self._notif_min_ns = max(1, int(cfg.notif_poll_interval_s * _S))
        self._notif_interval_ns = self._notif_min_ns
        self._notif_fast_until_ns = 0
        self._recv_effects: Mapping[str, Callable[[str, _RecvIO | None, Outcome], None]] = {
            "take_blocks": self._nothing,
            "arm_handshake_timer": self._arm_handshake_timer,
            "start_handshake": self._start_handshake,
            "cancel_handshake_timer": self._cancel_handshake_timer,
            "post_reads": self._post_reads_soon,
            "arm_transfer_timer": self._arm_transfer_timer,
            "send_notif": self._send_notif,
            "release_reads": self._release_reads,
            "deliver_blocks": self._deliver_blocks,
            "report_invalid": self._report_invalid,
            "release_blocks": self._release_blocks,
            "notify_abandon": self._notify_abandon,
            "cancel_timers": self._cancel_recv_timers,
        }
        self._send_effects: Mapping[str, Callable[[str, Outcome], None]] = {
            "pin_blocks": self._nothing_send,
            "arm_lease": self._arm_lease,
            "extend_lease": self._arm_lease,
            "cancel_lease": self._cancel_lease,
            "free_blocks": self._free_blocks,
        }
        self._started = False

    # ================================================================ any thread

    def start(self, transport: Transport, compat: CompatInfo) -> None:
        """Take over the registered transport and start the loop and side channel."""
        self.transport = transport
        self.compat = compat
        self.agent_name = transport.name
        self.loop.start()
        self._started = True
        self.loop.call(self._open_side_channel, timeout=30.0, label="open side channel")
        self._note("worker.started", None, agent=self.agent_name, kv_role=self.cfg.kv_role,
                   side_channel=self.server.address if self.server else None,
                   pin_channel=self.pins.endpoint if self.pins else None)

    def submit(self, meta: KVSMConnectorMetadata) -> None:
        """Hand one step's metadata to the loop (never blocks)."""
        if not meta:
            return
        if not self._started:
            raise RuntimeError("KVSMConnector worker: metadata arrived before register_kv_caches")
        if not self.loop.post(lambda: self._on_metadata(meta), label=f"metadata step {meta.step}"):
            # The loop is stopped or drowning: say so loudly; the requests in it
            # would otherwise wait forever.
            log.error("kvsm worker %s: could not post step %d's metadata to the loop (%s)",
                      self.loop.name, meta.step, self.loop.stats())

    def pin_target(self) -> PinTarget | None:
        """How this engine's scheduler reaches this worker's pin channel (None: it
        serves no prefills, or has not started)."""
        return self.pins.target(self.tp_rank) if self.pins is not None else None

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        return self.results.take()

    def take_invalid_blocks(self) -> set[int]:
        return self.results.take_invalid()

    def shutdown(self) -> None:
        if self._started:
            try:
                self.loop.call(self._close_on_loop, timeout=10.0, label="shutdown")
            except Exception as e:  # noqa: BLE001 - shutting down regardless
                log.warning("kvsm worker %s: closing on the loop failed: %s", self.loop.name, e)
            self.loop.stop(timeout=10.0)
            self._started = False
        if self.log is not None:
            self.log.close()

    # ================================================================ loop thread

    def _open_side_channel(self) -> None:
        assert self.compat is not None
        if self.cfg.produces:
            self.server = HandshakeServer(
                self.cfg.engine_id, self.compat, self._provide, self._on_claims,
                host=self._bind_host(), port=self.cfg.port_of_rank(self.tp_rank),
                context=self.loop.context, lease_ms=int(self.cfg.lease_s * 1000))
            for sock in self.server.sockets():
                self.loop.add_reader(sock, self._on_side_channel, label="handshake server")
            self.pins = PinChannelServer(self.loop.context, self._on_pins,
                                         lambda fn, label: self.loop.post(fn, label=label))
            for sock in self.pins.sockets():
                self.loop.add_reader(sock, self.pins.on_readable, label="pin channel")
        if self.cfg.consumes:
            self.client = HandshakeClient(
                self.compat, requester=f"{self.cfg.engine_id}/tp{self.tp_rank}", context=self.loop.context,
                on_socket_added=self._watch_client_socket, on_socket_removed=self.loop.remove_reader)

    def _on_side_channel(self) -> None:
        """Serve what arrived, then count it by outcome for the stats (a few dict
        operations per batch of messages, not per message)."""
        assert self.server is not None
        self.server.on_readable()
        now = _side_channel_outcomes(self.server.stats())
        last = self._side_channel_seen
        delta = {k: n - last.get(k, 0) for k, n in now.items() if n != last.get(k, 0)}
        if delta:
            self._side_channel_seen = now
            self.stats.side_channel(delta)

    def _bind_host(self) -> str:
        host = self.cfg.side_channel_host
        return "127.0.0.1" if host == "localhost" else host

    def _close_on_loop(self) -> None:
        # The log's last record says what was still live and what was still held, so
        # replay can tell a clean stop from a crash and a leak check has its figures.
        self._note("worker.shutdown", None, clean=True,
                   live={"recv": {m.req: m.state for m in self.recv.live()},
                         "send": {m.req: m.state for m in self.send.live()}},
                   resources=self.resources(),
                   side_channel=self.server.stats() if self.server else None,
                   pin_channel=self.pins.stats() if self.pins else None,
                   client=self.client.stats() if self.client else None)
        for h in self._timers():
            self.loop.cancel(h)
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            for sock in self.server.sockets():
                self.loop.remove_reader(sock)
            self.server.close()
        if self.pins is not None:
            for sock in self.pins.sockets():
                self.loop.remove_reader(sock)
            self.pins.close()
        if self.transport is not None:
            close = getattr(self.transport, "close", None)
            if close is not None:
                close()

    def resources(self) -> dict[str, int]:
        """How much per-request state this worker holds (loop thread): every count
        but ``peers``/``transport_peers`` and the loop's ``readers`` returns to 0 once
        the requests it served have ended, so a growing count is a leak."""
        out = {
            "recv_machines": len(self.recv),
            "send_machines": len(self.send),
            "recv_io": len(self._recv_io),
            "send_io": len(self._send_io),
            "claims": len(self._claims),
            "claim_queue": sum(len(q) for q in self._claim_queue.values()),
            "oneway": len(self._oneway),
            "polling": len(self._polling),
            "early_abandons": len(self._early_abandons),
            "peers": len(self._peers),
        }
        if self.transport is not None:
            out.update({f"transport_{k}": v for k, v in self.transport.resources().items()})
        if self.client is not None:
            out["client_pending"] = self.client.pending_count()
            out["client_sockets"] = self.client.socket_count()
        loop = self.loop.stats()
        out["loop_timers"] = loop["timers_pending"]
        out["loop_readers"] = loop["readers"]
        return out

    def _timers(self) -> list[TimerHandle | None]:
        out: list[TimerHandle | None] = [self._poll_timer, self._notif_timer, self._expiry_timer]
        for io in self._recv_io.values():
            out += [io.handshake_timer, io.transfer_timer, io.retry_timer, io.settle_timer]
        out += [s.lease_timer for s in self._send_io.values()]
        return out

    # -- outcomes and errors -----------------------------------------------------

    def _on_outcome(self, o: Outcome) -> None:
        if self.log is not None:
            self.log.record_outcome(o)
        if o.violation is None:
            counts = self.state_counts[o.lifecycle]
            if o.src is not None:
                counts[o.src] -= 1
            counts[o.dst] += 1  # type: ignore[index]
        else:
            log.warning("kvsm worker %s: %s", self.loop.name, o.describe())

    def _on_loop_error(self, err: LoopError) -> None:
        """An exception in a loop callback: fail exactly the request it was for."""
        log.error("kvsm worker %s: %s", self.loop.name, err, exc_info=err.exc)
        self.stats.failure("internal")
        self._note("worker.loop_error", err.req, where=err.where, label=err.label,
                   error=f"{type(err.exc).__name__}: {err.exc}")
        try:
            if err.req is not None and err.req in self.recv:
                self._apply_recv(ev.InternalError(req=err.req, where=err.label or err.where,
                                                  detail=f"{type(err.exc).__name__}: {err.exc}"))
            elif err.req is not None and err.req in self._recv_io:
                self._recv_cut_short(err.req)
            if err.req is not None and (err.req in self.send or err.req in self._send_io):
                self._recover_send(err.req)
            if err.where == "timer":
                self._rearm_periodic(err.label)
        except Exception:
            log.exception("kvsm worker %s: recovering from an error of request %s also failed",
                          self.loop.name, err.req)

    def _recv_cut_short(self, req: str) -> None:
        """A recv machine ended but the effects of its last transition were cut
        short by an exception: vLLM must still hear of the request (as failed,
        unless it was told already), and its timers, reads and I/O state go."""
        io = self._recv_io.pop(req)
        self._polling.discard(req)
        if not self._recv_io:
            self._compact_recv()
        for h in (io.handshake_timer, io.transfer_timer, io.retry_timer, io.settle_timer):
            self.loop.cancel(h)
        if self.transport is not None:
            for h in io.handles:  # terminal: every read has settled
                self.transport.release(h)
        if io.start.awaited and not io.reported:
            io.reported = True
            self.results.failed(req, io.start.local_block_ids)
        self._note("worker.effects_cut_short", req, final=self.recv.final_state(req),
                   reported="failed" if io.start.awaited else None)

    def _recover_send(self, req: str) -> None:
        """A send-side handler raised for ``req``. Its blocks must come back to vLLM
        by the end of its lease at the latest (and not before: a decode worker that
        claimed them may read until then)."""
        m = self.send.get(req)
        io = self._send_io.get(req)
        if m is None:
            if io is not None:  # ended, but free_blocks (always the last effect) did not finish
                self._send_io.pop(req)
                self.loop.cancel(io.lease_timer)
                self.results.sent(req)
                self._note("worker.effects_cut_short", req, final=self.send.final_state(req), reported="sent")
            return
        if m.state != "awaiting_pull":
            return
        io = self._send_io.setdefault(req, _SendIO())
        if io.lease_timer is not None and not io.lease_timer.cancelled:
            return  # its lease timer is still armed
        if m.lease_deadline_ns <= self.loop.now_ns():
            self._apply_send(ev.LeaseExpired(req=req))
        else:
            io.lease_timer = self.loop.call_at(m.lease_deadline_ns, lambda: self._lease_expired(req), req=req,
                                               label="lease expiry")

    def _rearm_periodic(self, label: str) -> None:
        """A periodic timer whose callback raised did not re-arm itself: do it here,
        or polling of reads, of NIXL notifications or of handshake deadlines would
        stop for good."""
        if label == "poll reads":
            self._poll_timer = None
            self._arm_poll()
        elif label == "poll notifications":
            self._notif_timer = None
            self._arm_notif_poll()
        elif label == "handshake deadlines" and self.client is not None:
            self._expiry_timer = None
            self._arm_client_expiry()

    def _note(self, event: str, req: str | None, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)

    # -- the step's metadata -----------------------------------------------------

    def _on_metadata(self, meta: KVSMConnectorMetadata) -> None:
        for start in meta.recv_start:
            exc = self._guard(start.req, self._on_recv_start, start)
            if exc is not None and start.req not in self.recv and self.recv.final_state(start.req) is None:
                self._guard(start.req, self._fail_untracked, (start, exc))
        for abandon in meta.recv_abandon:
            self._guard(abandon.req, self._on_recv_abandon, abandon)
        for abort in meta.recv_abort:
            self._guard(abort.req, self._on_recv_abort, abort)
        for s in meta.send_start:
            if s.req in self.send or self.send.final_state(s.req) is not None:
                continue  # its finish came first, straight from the scheduler
            self.send.create(s.req)
        for finish in meta.send_finish:
            self._guard(finish.req, self._on_send_finish, (finish, "next_step"))
        for target in meta.heartbeats:
            self._guard(None, self._send_heartbeat, target)
        self._flush_claims()

    def _guard(self, req: str | None, fn: Callable[[Any], None], arg: Any) -> Exception | None:
        """Run one request's handler; an exception fails that request only (and is returned)."""
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001
            self._on_loop_error(LoopError(e, req, getattr(fn, "__name__", "handler"), "post"))
            return e
        return None

    def _fail_untracked(self, args: tuple[RecvStart, Exception]) -> None:
        """A RecvStart whose handling raised before its machine existed: vLLM waits
        for the request all the same. Track it just to fail it (and tell the prefill
        side to unpin)."""
        start, exc = args
        req = start.req
        if req not in self._recv_io:
            self._recv_io[req] = _RecvIO(start, self._peer(start.remote_engine, start.remote_host,
                                                           start.remote_port))
        self.recv.create(req)
        self._apply_recv(ev.InternalError(req=req, where="_on_recv_start", detail=f"{type(exc).__name__}: {exc}"))

    # ======================================================== decode (receiving)

    def _peer(self, engine: str, host: str, port: int) -> _Peer:
        address = peer_address(host, port + self.tp_rank)
        key = (engine, address)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(engine, address, backoff_ns=int(self.cfg.peer_backoff_s * _S))
        return peer

    def _on_recv_start(self, start: RecvStart) -> None:
        req = start.req
        if req in self.recv:
            self._note("worker.duplicate_recv_start", req)
            return
        peer = self._peer(start.remote_engine, start.remote_host, start.remote_port)
        self._recv_io[req] = _RecvIO(start, peer)
        self.recv.create(req)
        self._apply_recv(ev.Matched(req=req, num_tokens=start.num_tokens, remote_engine=start.remote_engine,
                                    remote_req=start.remote_req, remote_host=start.remote_host,
                                    remote_port=start.remote_port, remote_blocks=len(start.remote_block_ids)))
        problem = self._unreadable(start)
        if problem is not None:
            kind, detail = problem
            self._apply_recv(ev.Error(req=req, kind=kind, detail=detail))
            return
        self._apply_recv(ev.Allocated(req=req, block_ids=start.local_block_ids,
                                      num_external_tokens=start.num_tokens))

    def _unreadable(self, start: RecvStart) -> tuple[str, str] | None:
        """Why this request cannot be read at all, before any I/O."""
        if start.remote_tp_size != self.cfg.tp_size:
            return ("tp_mismatch", (f"the prefill engine runs tensor parallel {start.remote_tp_size}, this "
                                    f"engine {self.cfg.tp_size}; kvsm needs equal sizes"))
        if len(start.remote_block_ids) != len(start.local_block_ids):
            return ("bad_params", (f"{len(start.local_block_ids)} local blocks to fill but the prefill side "
                                   f"offers {len(start.remote_block_ids)} (remote_block_ids too short?)"))
        return None

    def _on_recv_abandon(self, abandon: RecvAbandon) -> None:
        req = abandon.req
        if req in self.recv:
            self._apply_recv(ev.Abort(req=req))
            return
        start = RecvStart(req=req, remote_engine=abandon.remote_engine, remote_req=abandon.remote_req,
                          remote_host=abandon.remote_host, remote_port=abandon.remote_port,
                          remote_tp_size=abandon.remote_tp_size, remote_block_ids=(), local_block_ids=(),
                          num_tokens=0, awaited=False)
        self._recv_io[req] = _RecvIO(start, self._peer(abandon.remote_engine, abandon.remote_host,
                                                       abandon.remote_port))
        self.recv.create(req)
        self._apply_recv(ev.Matched(req=req, num_tokens=0, remote_engine=abandon.remote_engine,
                                    remote_req=abandon.remote_req, remote_host=abandon.remote_host,
                                    remote_port=abandon.remote_port))
        self._apply_recv(ev.Abort(req=req))

    def _on_recv_abort(self, abort: RecvAbort) -> None:
        if abort.req in self.recv:
            self._apply_recv(ev.Abort(req=abort.req))
        else:
            # The transfer ended (and was reported) before vLLM's abort reached us.
            self._note("worker.abort_after_end", abort.req, final=self.recv.final_state(abort.req))

    def _apply_recv(self, event: ev.Event) -> Outcome:
        o = self.recv.apply(event)
        if o.violation is not None:
            return o
        io = self._recv_io.get(o.req)
        if o.src == "pending_handshake" and io is not None and io.answers and self.log is not None:
            # Its claims are over: one record of how each was answered (not one per reply:
            # thousands of requests retried every few ms starved the loop under load).
            self.log.emit("log", "worker.claims_answered", None, peer=io.peer.address, engine=io.peer.engine,
                          **{status: {o.req: n} for status, n in io.answers.items()})
        effects = self._recv_effects
        for name in o.effects:
            effects[name](o.req, io, o)
        if o.dst in RECV.terminal:
            self._recv_io.pop(o.req, None)
            self._polling.discard(o.req)
            if not self._recv_io:
                self._compact_recv()
        return o

    def _compact_recv(self) -> None:
        """Nothing is receiving: rebuild the per-request tables, so memory returns to
        its baseline after a burst (dicts and sets keep the capacity of their peak)."""
        self._recv_io = {}
        self._polling = set()
        self.recv.compact()

    def _post_event(self, event: ev.Event, label: str) -> None:
        """Apply ``event`` on the next loop turn, not inside the current transition."""
        req = event.req

        def apply() -> None:
            if req in self.recv:
                self._apply_recv(event)

        self.loop.post(apply, req=req, label=label)

    @staticmethod
    def _nothing(req: str, io: _RecvIO | None, o: Outcome) -> None:
        return None

    # -- handshake and claims ----------------------------------------------------

    def _arm_handshake_timer(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        assert io is not None
        io.handshake_timer = self.loop.call_later(
            int(self.cfg.handshake_timeout_s * _S),
            lambda: self._timeout(req, "handshake"), req=req, label="handshake timeout")

    def _cancel_handshake_timer(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        if io is not None:
            self.loop.cancel(io.handshake_timer)
            self.loop.cancel(io.retry_timer)
            io.handshake_timer = io.retry_timer = None

    def _timeout(self, req: str, what: str) -> None:
        if req in self.recv:
            self.stats.failure(f"{what}_timeout")
            self._apply_recv(ev.Timeout(req=req, what=what))

    def _start_handshake(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        assert io is not None
        peer = io.peer
        if peer.dead_until_ns > self.loop.now_ns():
            # Known dead: fail now rather than wait out another timeout.
            self.stats.failure("peer_dead")
            self._post_event(ev.PeerDead(req=req, peer=f"{peer.engine}@{peer.address}", reason="known_dead"),
                             "peer known dead")
            return
        self._claim_queue.setdefault((peer.engine, peer.address), []).append(req)

    def _flush_claims(self) -> None:
        """One claim message per peer for every request queued this turn."""
        queue, self._claim_queue = self._claim_queue, {}
        if not queue:
            return
        assert self.client is not None
        now = self.loop.now_ns()
        deadline = now + int(self.cfg.handshake_timeout_s * _S)
        for key, reqs in queue.items():
            try:
                self._send_claim(key, reqs, now, deadline)
            except Exception as e:  # noqa: BLE001 - one peer's claim must not drop the others'
                for req in reqs:
                    self._on_loop_error(LoopError(e, req, "claim flush", "post"))
        self._on_client_results(self.client.poll_results())
        self._arm_client_expiry()

    def _send_claim(self, key: tuple[str, str], reqs: list[str], now: int, deadline: int) -> None:
        """Claim messages to one peer for ``reqs``: one per MAX_CLAIMS of them (the
        server refuses longer ones; a step may start more requests than that)."""
        assert self.client is not None
        peer = self._peers[key]
        pairs = []
        for req in reqs:
            io = self._recv_io.get(req)
            m = self.recv.get(req)
            if io is None or m is None or m.state != "pending_handshake":
                continue
            io.claim_sent_ns = now
            pairs.append((req, io.start.remote_req))
        fetch = peer.agent is None or peer.stale
        for at in range(0, len(pairs), MAX_CLAIMS):
            chunk = pairs[at:at + MAX_CLAIMS]
            claims = [remote for _, remote in chunk]
            if fetch:  # every chunk asks: whichever reply comes first adds the agent
                rid = self.client.fetch_metadata(peer.address, self.tp_rank, 0, claims, deadline_ns=deadline,
                                                 expected_engine_id=peer.engine)
            else:
                rid = self.client.heartbeat(peer.address, claims, deadline_ns=deadline)
            self._claims[rid] = _Claim(peer, now, chunk, fetch)

    def _retry_claim(self, req: str) -> None:
        io = self._recv_io.get(req)
        m = self.recv.get(req)
        if io is None or m is None or m.state != "pending_handshake":
            return
        io.retry_timer = None
        self._claim_queue.setdefault((io.peer.engine, io.peer.address), []).append(req)
        if not self._retry_flush_posted:  # one flush for every retry due in this loop turn
            self._retry_flush_posted = True
            self.loop.post(self._flush_retries, label="claim retry flush")

    def _flush_retries(self) -> None:
        self._retry_flush_posted = False
        self._flush_claims()

    def _watch_client_socket(self, sock: Any) -> None:
        def readable() -> None:
            assert self.client is not None
            self._on_client_results(self.client.on_readable(sock))
            self._arm_client_expiry()

        self.loop.add_reader(sock, readable, label="handshake client")

    def _arm_client_expiry(self) -> None:
        assert self.client is not None
        deadline = self.client.next_deadline_ns()
        timer = self._expiry_timer
        if timer is not None and not timer.cancelled and deadline is not None and timer.deadline_ns <= deadline:
            return
        self.loop.cancel(timer)
        self._expiry_timer = None
        if deadline is not None:
            self._expiry_timer = self.loop.call_at(deadline, self._expire_client, label="handshake deadlines")

    def _expire_client(self) -> None:
        assert self.client is not None
        self._expiry_timer = None
        self._on_client_results(self.client.expire(self.loop.now_ns()))
        self._arm_client_expiry()

    def _on_client_results(self, results: list[HandshakeResult]) -> None:
        for result in results:
            claim = self._claims.pop(result.request_id, None)
            if claim is not None:
                try:
                    self._on_claim_result(claim, result)
                except Exception as e:  # noqa: BLE001 - one bad reply must not drop the others
                    for req, _ in claim.reqs:
                        self._on_loop_error(LoopError(e, req, "claim result", "reader"))
                continue
            entry = self._oneway.pop(result.request_id, None)
            if entry is not None and isinstance(result.outcome, HandshakeRefused):
                self._mark_dead(entry[0], str(result.outcome), reason="refused")
            elif entry is not None and isinstance(result.outcome, HandshakeTimeout):
                peer, sent_ns = entry
                if sent_ns >= peer.news_ns:  # else: part of an outage already handled, or outdated
                    self._mark_dead(peer, f"no answer to a heartbeat/abandon: {result.outcome}", reason="silent")

    def _on_claim_result(self, claim: _Claim, result: HandshakeResult) -> None:
        peer = claim.peer
        outcome = result.outcome
        if isinstance(outcome, HandshakeError):
            self._note("worker.claim_failed", None, peer=peer.address, engine=peer.engine, fetch=claim.fetch,
                       error=f"{outcome.code}: {outcome}"[:300], reqs=[req for req, _ in claim.reqs])
            if isinstance(outcome, HandshakeRefused):
                # Nobody listens there any more (the process is gone): known at once,
                # no need to wait for a timeout. A silent peer still times out.
                self._mark_dead(peer, str(outcome), reason="refused")
                return
            if isinstance(outcome, HandshakeTimeout):
                if claim.sent_ns >= peer.news_ns:
                    self._mark_dead(peer, str(outcome), reason="silent")
                return  # _mark_dead failed every request waiting on this peer
            kind = "incompatible" if isinstance(outcome, HandshakeIncompatible) else "handshake"
            if outcome.code == "engine_mismatch":
                kind = "engine_mismatch"
            for req, _ in claim.reqs:
                self.stats.failure(kind)
                self._apply_if_live(ev.Error(req=req, kind=kind, detail=f"{peer.address}: {outcome}"))
            return
        if isinstance(outcome, MetadataReply) and (peer.agent is None or peer.stale):
            assert self.transport is not None
            try:
                peer.agent = self.transport.add_peer(outcome.agent_metadata)
            except (ValueError, ConnectionError) as e:
                for req, _ in claim.reqs:
                    self.stats.failure("incompatible")
                    self._apply_if_live(ev.Error(req=req, kind="incompatible", detail=f"{peer.address}: {e}"))
                return
            peer.stale = False
            self.stats.handshake_done((self.loop.now_ns() - claim.sent_ns) / _S)
            self._note("worker.peer_added", None, peer=peer.address, engine=peer.engine, agent=peer.agent)
        assert isinstance(outcome, (MetadataReply, ClaimsReply))
        peer.failures, peer.dead_until_ns = 0, 0
        peer.news_ns = max(peer.news_ns, claim.sent_ns)
        peer.backoff_ns = int(self.cfg.peer_backoff_s * _S)
        for req, remote_req in claim.reqs:
            m = self.recv.get(req)
            io = self._recv_io.get(req)
            if m is None or io is None or m.state != "pending_handshake":
                continue
            status = outcome.claims.get(remote_req, "unknown")
            io.answers[status] = io.answers.get(status, 0) + 1  # logged when the claim phase ends
            if status == "ok":
                io.claim_granted_ns = claim.sent_ns
                # The prefill side's lease decides how long the claim pins the blocks
                # (a peer that does not say is assumed to run ours).
                io.lease_window_ns = outcome.lease_ms * _MS if outcome.lease_ms else self.cfg.lease_ns
                self._apply_recv(ev.HandshakeOk(req=req, remote_engine=peer.engine))
            elif status == "expired":
                self.stats.failure("lease_expired")
                self._apply_recv(ev.Error(req=req, kind="lease_expired", detail=(
                    f"prefill request {remote_req} on {peer.engine} is no longer pinned "
                    f"(its lease expired or it was released); its blocks may have been reused")))
            else:  # not known there (yet): the prefill worker learns of it one step later
                io.retry_timer = self.loop.call_later(CLAIM_RETRY_NS, lambda r=req: self._retry_claim(r),
                                                      req=req, label="claim retry")

    def _apply_if_live(self, event: ev.Event) -> None:
        if event.req in self.recv:
            self._apply_recv(event)

    def _mark_dead(self, peer: _Peer, why: str, reason: str = "") -> None:
        """Remember ``peer`` as dead for a back-off and fail what depends on it.
        ``reason`` (refused, silent, disconnected, ...) goes into the failure kind."""
        now = self.loop.now_ns()
        if peer.dead_until_ns > now:  # already known: one outage, one back-off step
            return
        peer.failures += 1
        peer.last_error = why
        peer.dead_until_ns = now + peer.backoff_ns
        peer.news_ns = now
        self._note("worker.peer_dead", None, peer=peer.address, engine=peer.engine, why=why, reason=reason,
                   retry_in_s=peer.backoff_ns / _S, failures=peer.failures)
        log.warning("kvsm worker %s: peer %s (%s) is dead: %s; failing its requests fast for %.1f s",
                    self.loop.name, peer.address, peer.engine, why, peer.backoff_ns / _S)
        peer.backoff_ns = min(peer.backoff_ns * 2, int(self.cfg.peer_backoff_max_s * _S))
        if peer.agent is not None and self.transport is not None:
            self.transport.remove_peer(peer.agent)  # settles its reads: none can write after this
            peer.agent = None
        kind = f"peer_{reason}" if reason else "peer_dead"
        for req, io in list(self._recv_io.items()):
            if io.peer is peer and req in self.recv:
                self.stats.failure(kind)
                self._apply_recv(ev.PeerDead(req=req, peer=f"{peer.engine}@{peer.address}", reason=reason))

    # -- reads -------------------------------------------------------------------

    def _post_reads_soon(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        self.loop.post(lambda: self._post_reads(req), req=req, label="post reads")

    def _post_reads(self, req: str) -> None:
        io = self._recv_io.get(req)
        m = self.recv.get(req)
        if io is None or m is None or m.state != "remote_known":
            return
        start = io.start
        if not start.local_block_ids:
            self._apply_recv(ev.NothingToRead(req=req))
            return
        peer = io.peer
        assert self.transport is not None
        if peer.agent is None:  # dropped meanwhile (found dead, or replaced)
            self.stats.failure("peer_dead")
            self._apply_recv(ev.PeerDead(req=req, peer=f"{peer.engine}@{peer.address}"))
            return
        h = self.transport.post_read(peer.agent, start.local_block_ids, start.remote_block_ids,
                                     start.remote_req.encode(), tag=req)
        io.handles.append(h)
        io.reads_posted = True
        io.posted_ns = self.loop.now_ns()
        layout = getattr(self.transport, "layout", None)
        num_descs = len(start.local_block_ids) * (len(layout.regions) if layout is not None else 1)
        self._apply_recv(ev.ReadsPosted(req=req, num_blocks=len(start.local_block_ids), num_descs=num_descs))
        self._settle(req)

    def _arm_transfer_timer(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        assert io is not None
        io.transfer_timer = self.loop.call_later(int(self.cfg.transfer_timeout_s * _S),
                                                 lambda: self._timeout(req, "transfer"), req=req,
                                                 label="transfer timeout")

    def _settle(self, req: str) -> None:
        """Check a request's reads and move it if they are over; else keep polling."""
        io = self._recv_io.get(req)
        m = self.recv.get(req)
        if io is None or m is None:
            self._polling.discard(req)
            return
        assert self.transport is not None
        states = [self.transport.check(h) for h in io.handles]
        if any(s is TransferState.PENDING for s in states):
            self._polling.add(req)
            self._arm_poll()
            return
        self._polling.discard(req)
        if m.state == "transferring":
            errors = [getattr(h, "error", "") or "NIXL reported an error" for h, s in zip(io.handles, states)
                      if s is TransferState.ERROR]
            if errors:
                self.stats.failure("transfer")
                self._apply_recv(ev.Error(req=req, kind="transfer", detail="; ".join(errors)[:500]))
                if any("Disconnect" in e for e in errors):
                    self._mark_dead(io.peer, errors[0])
                else:
                    io.peer.stale = True
                return
            io.notif_sent = True  # the notification rode on the completed read
            window = io.lease_window_ns or self.cfg.lease_ns
            margin = min(LEASE_MARGIN_NS, window // 4)
            late_ns = self.loop.now_ns() - (io.claim_granted_ns + window - margin)
            if late_ns > 0:
                self.stats.failure("lease_expired")
                self._apply_recv(ev.Error(req=req, kind="lease_expired", detail=(
                    f"the reads completed {late_ns / _S:.3f} s past the lease the claim granted "
                    f"({window / _S:.3f} s, less a {margin / _S:.3f} s margin): the prefill side may have "
                    f"reused the blocks, so they are not served")))
                return
            self._apply_recv(ev.AllReadsDone(req=req, num_bytes=self._bytes_of(io)))
        elif m.state in ("failing", "aborting"):
            self._release_reads(req, io, None)

    def _bytes_of(self, io: _RecvIO) -> int:
        layout = getattr(self.transport, "layout", None)
        if layout is None:
            return 0
        per_block = sum(r.block_bytes for r in layout.regions)
        return per_block * len(io.start.local_block_ids)

    def _arm_poll(self) -> None:
        if self._poll_timer is None and self._polling:
            self._poll_timer = self.loop.call_later(int(self.cfg.notif_poll_interval_s * _S), self._poll_reads,
                                                    label="poll reads")

    def _poll_reads(self) -> None:
        self._poll_timer = None
        for req in list(self._polling):
            self._guard(req, self._settle, req)
        self._arm_poll()

    def _release_reads(self, req: str, io: _RecvIO | None, o: Outcome | None) -> None:
        if io is None:
            return
        assert self.transport is not None
        if any(self.transport.check(h) is TransferState.DONE for h in io.handles):
            io.notif_sent = True
        keep = [h for h in io.handles if not self.transport.release(h)]
        io.handles = keep
        m = self.recv.get(req)
        if m is None or m.state not in ("failing", "aborting"):
            return
        if keep:  # still in flight: they may write; wait until they settle
            self._polling.add(req)
            self._arm_poll()
            if io.settle_timer is None:
                io.settle_timer = self.loop.call_later(int(self.cfg.transfer_timeout_s * _S),
                                                       lambda: self._unsettled(req), req=req,
                                                       label="reads settle deadline")
        else:
            self._post_event(ev.ReadsQuiesced(req=req), "reads quiesced")

    def _unsettled(self, req: str) -> None:
        """Reads that neither finish nor fail for another transfer timeout: the
        peer is treated as dead, which removes its NIXL agent and so settles
        every read to it (none can write afterwards), and the request ends."""
        io = self._recv_io.get(req)
        if io is None:
            return
        io.settle_timer = None
        if io.handles:
            self._mark_dead(io.peer, f"reads of {req} did not settle within {self.cfg.transfer_timeout_s} s "
                                     f"after the request gave up on them")
            self._settle(req)

    def _send_notif(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        """A read carries its notification. With nothing to read, tell the prefill
        side over the side channel instead: acknowledged, and unlike a NIXL
        notification on an idle agent it does not wait for our next NIXL call
        to leave."""
        assert io is not None
        if io.reads_posted or self.client is None:
            return
        deadline = self.loop.now_ns() + int(self.cfg.handshake_timeout_s * _S)
        rid = self.client.abandon(io.peer.address, [io.start.remote_req], deadline_ns=deadline)
        self._oneway[rid] = (io.peer, self.loop.now_ns())
        self._on_client_results(self.client.poll_results())
        self._arm_client_expiry()

    def _deliver_blocks(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        assert io is not None
        if io.reads_posted:
            self.stats.transfer_done((self.loop.now_ns() - io.posted_ns) / _S, self._bytes_of(io),
                                     len(io.start.local_block_ids))
        if io.start.awaited:
            self.results.received(req)
            io.reported = True

    def _report_invalid(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        assert io is not None
        m_failure = o.event.inputs() if o.event is not None else {}
        log.warning("kvsm worker %s: request %s failed to load its KV from %s (%s): %s", self.loop.name, req,
                    io.peer.engine, o.trigger, m_failure)
        if io.start.awaited:
            self.results.failed(req, io.start.local_block_ids)
            io.reported = True

    def _release_blocks(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        if io is not None and io.start.awaited:
            self.results.received(req)
            io.reported = True

    def _notify_abandon(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        assert io is not None
        peer = io.peer
        if io.notif_sent:
            return  # the completed read already told it; a second message would be a second release
        if peer.dead_until_ns > self.loop.now_ns() or self.client is None:
            return  # nobody to tell; its lease will free the blocks
        deadline = self.loop.now_ns() + int(self.cfg.handshake_timeout_s * _S)
        rid = self.client.abandon(peer.address, [io.start.remote_req], deadline_ns=deadline)
        self._oneway[rid] = (peer, self.loop.now_ns())
        self._on_client_results(self.client.poll_results())
        self._arm_client_expiry()

    def _cancel_recv_timers(self, req: str, io: _RecvIO | None, o: Outcome) -> None:
        if io is None:
            return
        for h in (io.handshake_timer, io.transfer_timer, io.retry_timer, io.settle_timer):
            self.loop.cancel(h)
        io.handshake_timer = io.transfer_timer = io.retry_timer = io.settle_timer = None

    def _send_heartbeat(self, target: HeartbeatTarget) -> None:
        if self.client is None or not target.claims:
            return
        peer = self._peer(target.remote_engine, target.remote_host, target.remote_port)
        if peer.dead_until_ns > self.loop.now_ns():
            return
        deadline = self.loop.now_ns() + int(self.cfg.handshake_timeout_s * _S)
        claims = list(target.claims)
        for at in range(0, len(claims), MAX_CLAIMS):  # the server refuses longer messages
            rid = self.client.heartbeat(peer.address, claims[at:at + MAX_CLAIMS], deadline_ns=deadline)
            self._oneway[rid] = (peer, self.loop.now_ns())
        self._on_client_results(self.client.poll_results())
        self._arm_client_expiry()

    # ======================================================== prefill (sending)

    def _provide(self, tp_rank: int, pp_rank: int) -> tuple[str, bytes, bytes, int] | None:
        if tp_rank != self.tp_rank or pp_rank != 0 or self.transport is None:
            return None
        self._has_readers = True
        self._arm_notif_poll(soon=True)  # a new reader connects: its first read needs us
        return self.agent_name, self.transport.metadata(), b"", 1

    def _on_claims(self, kind: str, requester: str, claims: list[str]) -> dict[str, str]:
        """Answer a decode worker's claims, heartbeats and abandons."""
        answers: dict[str, str] = {}
        for req in claims:
            m = self.send.get(req)
            if m is None:
                final = self.send.final_state(req)
                if kind == "abandon":
                    if final is None:
                        self._remember_abandon(req)
                    answers[req] = "ok"
                else:
                    # Finished here: the blocks are gone (expired, or already read).
                    answers[req] = "unknown" if final is None else "expired"
            elif m.state != "awaiting_pull":
                if kind == "abandon":
                    self._remember_abandon(req)
                    answers[req] = "ok"
                else:
                    answers[req] = "unknown"  # still prefilling: ask again
            elif kind == "abandon":
                self._apply_send(ev.RemoteAbandoned(req=req, reason=f"abandoned by {requester}"))
                answers[req] = "ok"
            else:
                self._apply_send(ev.Heartbeat(req=req, lease_ns=self.cfg.lease_ns))
                answers[req] = "ok"
        if kind == "claim" or (kind == "heartbeat" and "ok" in answers.values()):
            self._arm_notif_poll(soon=True)  # a claimed request is read next
        return answers

    def _remember_abandon(self, req: str) -> None:
        self._early_abandons[req] = None
        if len(self._early_abandons) > _MAX_EARLY_ABANDONS:
            self._early_abandons.popitem(last=False)

    def _on_pins(self, pins: list[SendFinish], via: str) -> None:
        """The scheduler's finishes, straight from it (loop thread)."""
        for finish in pins:
            self._guard(finish.req, self._on_send_finish, (finish, via))

    def _on_send_finish(self, item: tuple[SendFinish, str]) -> None:
        finish, via = item
        req = finish.req
        m = self.send.get(req)
        if m is None:
            final = self.send.final_state(req)
            if final is not None:
                self._note("worker.duplicate_send_finish", req, final=final, via=via)
                return
            self.send.create(req)
        elif m.state != "prefilling":
            # Told twice (a direct hand-off that partly failed also goes with a step).
            self._note("worker.duplicate_send_finish", req, state=m.state, via=via)
            return
        if finish.ok:
            self._send_io[req] = _SendIO()
            self._apply_send(ev.FinishedOk(req=req, block_ids=finish.block_ids, expected_reads=1,
                                           lease_ns=self.cfg.lease_ns, pinned_ns=finish.pinned_ns, via=via))
            if req in self._early_abandons:
                del self._early_abandons[req]
                self._apply_send(ev.RemoteAbandoned(req=req, reason="abandoned before the prefill finished"))
        elif finish.reason == "FINISHED_ABORTED":
            self._apply_send(ev.Abort(req=req))
        else:
            self._apply_send(ev.FinishedAbnormally(req=req, reason=finish.reason))

    def _apply_send(self, event: ev.Event) -> Outcome:
        o = self.send.apply(event)
        if o.violation is not None:
            return o
        effects = self._send_effects
        for name in o.effects:
            effects[name](o.req, o)
        if o.dst in SEND.terminal:
            self._send_io.pop(o.req, None)
            if not self._send_io:
                self._send_io = {}  # as _compact_recv
                self.send.compact()
        return o

    @staticmethod
    def _nothing_send(req: str, o: Outcome) -> None:
        return None

    def _arm_lease(self, req: str, o: Outcome) -> None:
        io = self._send_io.setdefault(req, _SendIO())
        m = self.send.get(req)
        assert m is not None
        self.loop.cancel(io.lease_timer)
        io.lease_timer = self.loop.call_at(m.lease_deadline_ns, lambda: self._lease_expired(req), req=req,
                                           label="lease expiry")
        self._arm_notif_poll()

    def _lease_expired(self, req: str) -> None:
        if req in self.send:
            self._apply_send(ev.LeaseExpired(req=req))

    def _cancel_lease(self, req: str, o: Outcome) -> None:
        io = self._send_io.get(req)
        if io is not None:
            self.loop.cancel(io.lease_timer)
            io.lease_timer = None

    def _free_blocks(self, req: str, o: Outcome) -> None:
        if o.dst == "expired":
            self.stats.lease_expired()
            log.warning("kvsm worker %s: lease of request %s expired unread; its %d blocks are freed",
                        self.loop.name, req, len(o.block_ids))
        elif o.trigger == "read_notif":
            self.stats.read_served()
        self.results.sent(req)

    def _arm_notif_poll(self, *, soon: bool = False) -> None:
        """Poll NIXL notifications (which also drives our side of every NIXL
        connection): every ``notif_poll_interval`` right after a claim (a read
        is coming), backing off to NOTIF_POLL_MAX_NS while nothing arrives. No
        timer until a decode worker has fetched our agent: a prefill engine
        that never served anyone never wakes."""
        if soon:
            # A claimed request is read next, and on a fresh connection the read
            # needs our side to progress too: poll at full speed for a while.
            self._notif_fast_until_ns = self.loop.now_ns() + NOTIF_FAST_WINDOW_NS
            self._notif_interval_ns = self._notif_min_ns
            if self._notif_timer is not None and self._notif_timer.deadline_ns > self.loop.now_ns() + \
                    self._notif_min_ns:
                self.loop.cancel(self._notif_timer)
                self._notif_timer = None
        if self._notif_timer is None and (self._send_io or self._has_readers):
            self._notif_timer = self.loop.call_later(self._notif_interval_ns, self._poll_notifs,
                                                     label="poll notifications")

    def _poll_notifs(self) -> None:
        self._notif_timer = None
        assert self.transport is not None
        notifs = self.transport.get_notifs()
        for peer, msg in notifs:
            try:
                req = msg.decode()
            except UnicodeDecodeError:
                self._note("worker.bad_notification", None, peer=peer, size=len(msg))
                continue
            if req not in self.send and self.send.final_state(req) == "released":
                # Released already (e.g. the reader's abandon overtook its read's
                # notification): nothing is pinned, nothing to do. A read after
                # *expiry* is still applied, and recorded as the violation it is.
                self._note("worker.late_read_notif", req, reader=peer)
                continue
            self._guard(req, self._apply_send, ev.ReadNotif(req=req, reader=peer))
        if notifs or self.loop.now_ns() < self._notif_fast_until_ns:
            self._notif_interval_ns = self._notif_min_ns
        else:
            self._notif_interval_ns = min(self._notif_interval_ns * 2, NOTIF_POLL_MAX_NS)
        self._arm_notif_poll()

    # ================================================================ introspection

    def debug_state(self) -> dict[str, Any]:
        """A snapshot for tests and debugging (runs on the loop)."""

        def snap() -> dict[str, Any]:
            return {
                "recv": {m.req: m.state for m in self.recv.live()},
                "send": {m.req: m.state for m in self.send.live()},
                "peers": {f"{p.engine}@{p.address}": {"agent": p.agent, "dead_until_ns": p.dead_until_ns,
                                                        "failures": p.failures, "last_error": p.last_error}
                          for p in self._peers.values()},
                "io": {"recv": len(self._recv_io), "send": len(self._send_io), "claims": len(self._claims),
                       "oneway": len(self._oneway), "polling": len(self._polling)},
                "server": self.server.stats() if self.server else None,
                "pin_channel": self.pins.stats() if self.pins else None,
                "client": self.client.stats() if self.client else None,
                "loop": self.loop.stats(),
                "resources": self.resources(),
            }

        return self.loop.call(snap, timeout=10.0, label="debug_state")


def _side_channel_outcomes(server_stats: dict[str, Any]) -> dict[str, int]:
    """``HandshakeServer.stats()`` flattened to cumulative counts by outcome:
    ``served``, each refusal's error code, and replies that could not be sent."""
    out = {"served": sum(server_stats.get("served", {}).values())}
    out.update(server_stats.get("errors", {}))
    for key in ("reply_dropped_full", "reply_unroutable", "reply_failed"):
        if server_stats.get(key):
            out[key] = server_stats[key]
    return out
