"""What every part of the worker shares: its state, its results box, and the
one way it applies events.

``WorkerHalf`` is assembled from one mixin per concern (``recv``, ``send``,
``peers``, ``recovery``) over ``WorkerContext``, which declares the state they
share and the few methods one side calls on another. Only the loop thread
touches any of it, except ``Results`` (locked; vLLM's thread takes from it).

The worker decides nothing about a request or a peer itself: it turns I/O into
events, applies them to the trackers, and carries out the effects the table
returns. An event raised while another transition's effects run (a follow-up:
a read posted inside ``handshake_ok``'s effects, a peer's death failing its
requests) is queued and applied right after, in order, on the same loop turn:
nothing is handed to the loop again, so nothing can be dropped on the way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import RecvStart
from kvsm.handoff.pins import PinChannelServer
from kvsm.handshake import CompatInfo, HandshakeClient, HandshakeServer
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.machine import LifecycleTracker, Outcome
from kvsm.runtime.loop import EventLoop, LoopError, TimerHandle
from kvsm.transport.base import Transport, XferHandle
from kvsm.worker.stats import StatsRecorder
from kvsm.worker.tp_map import ReadPlan, Source

log = logging.getLogger("kvsm.worker")

MS = 1_000_000
S = 1_000_000_000
# How soon a claim answered "unknown" is asked again. The prefill worker may
# hear of a finished request a little after the decode side's claim arrived.
# Retries due together go out as one message per peer, so a short interval
# costs at most one message per peer every few ms.
CLAIM_RETRY_NS = 4 * MS
# Slowest notification polling while blocks are pinned and no read is announced.
NOTIF_POLL_MAX_NS = 50 * MS
# How long after a claim the prefill side polls at full speed.
NOTIF_FAST_WINDOW_NS = 200 * MS
# The first poll after a claim comes this soon, whatever the configured interval,
# and the next ones double up to it: a read posted right behind its claim (early
# reads) may reach our NIXL agent just after the claim's own progress call, and a
# small read completes only at our next progress.
NOTIF_FOLLOW_UP_NS = 1 * MS
# Per-request warnings (a failed load, an expired lease, a violation): at most
# this many per kind and window go to Python logging; the event log has all.
WARN_BURST = 20
WARN_WINDOW_S = 10.0


class Results:
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


class RateLimitedLog:
    """Python-logging warnings that may come once per request, capped per kind
    (like the handshake server's): a storm of failures must not become a storm
    of log lines. What was suppressed is counted and said with the next one."""

    def __init__(self, name: str, burst: int = WARN_BURST, window_s: float = WARN_WINDOW_S) -> None:
        self.name = name
        self._burst = burst
        self._window_s = window_s
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind -> (start, said, suppressed)

    def warning(self, kind: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        start, said, suppressed = self._windows.get(kind, (now, 0, 0))
        if now - start > self._window_s:
            start, said = now, 0
        if said >= self._burst:
            self._windows[kind] = (start, said, suppressed + 1)
            return
        if suppressed:
            msg += f" ({suppressed} more {kind} warnings were suppressed)"
        self._windows[kind] = (start, said + 1, 0)
        log.warning("kvsm worker %s: " + msg, self.name, *args)


@dataclass(slots=True)
class PeerIO:
    """The I/O side of one peer (its state and data live in its peer machine)."""

    key: str  # engine@address[/tp<rank>][/pp<stage>]: the peer machine's id
    engine: str
    address: str
    rank: int = 0  # the prefill rank behind it (every request on the engine's one port names it)
    pp_rank: int = 0  # and its pipeline parallel stage
    backoff_timer: TimerHandle | None = None
    probe_rid: int | None = None  # the liveness probe outstanding while reads from it are in flight


@dataclass(slots=True)
class Link:
    """One prefill worker a decode request deals with (a tensor parallel rank of
    one pipeline stage): a read of ``source``'s heads of the layers both hold, or
    (``source`` None) only the word that nobody reads it (``tp_map``)."""

    peer: PeerIO
    rank: int
    readers: int = 1  # decode workers that prefill worker waits for (told with every message)
    source: Source | None = None
    handle: XferHandle | None = None
    done: bool = False  # its read completed (its notification went with it), or (no layer to read) it was told
    granted: bool = False  # its claim was granted (a notification that came first was held there until then)
    told: bool = False  # it was told over the side channel that we read nothing (more) there


@dataclass(slots=True)
class RecvIO:
    """The I/O side of one decode request: what its effects need. ``peer`` is the
    first prefill rank it reads (the only one unless tensor parallel sizes differ)."""

    start: RecvStart
    peer: PeerIO
    links: list[Link] = field(default_factory=list)
    handles: list[XferHandle] = field(default_factory=list)
    completed: int = 0  # reads that completed before they were released
    handshake_timer: TimerHandle | None = None
    transfer_timer: TimerHandle | None = None
    retry_timer: TimerHandle | None = None
    settle_timer: TimerHandle | None = None
    posted_ns: int = 0
    done_ns: int = 0  # when every read had completed
    answers: dict[str, int] = field(default_factory=dict)  # claim answers so far, by status

    def timers(self) -> tuple[TimerHandle | None, ...]:
        return (self.handshake_timer, self.transfer_timer, self.retry_timer, self.settle_timer)

    @property
    def reads(self) -> list[Link]:
        """The links it reads through, in plan order (a claim's ``source`` index)."""
        return [link for link in self.links if link.source is not None]

    def deals_with(self, peer: PeerIO) -> bool:
        return any(link.peer is peer for link in self.links)


@dataclass(slots=True)
class SendIO:
    lease_timer: TimerHandle | None = None
    abandon_timer: TimerHandle | None = None


@dataclass(slots=True)
class Claim:
    """A claim request in flight: which local requests wait on its answer."""

    peer: PeerIO
    sent_ns: int
    reqs: list[tuple[str, str]]  # (local req, remote req)
    fetch: bool


RecvEffect = Callable[[str, "RecvIO | None", Outcome], None]
SendEffect = Callable[[str, Outcome], None]
PeerEffect = Callable[[PeerIO, Outcome], None]


class WorkerContext:
    """The state every part of the worker shares (loop thread only)."""

    cfg: KVSMConfig
    tp_rank: int
    pp_rank: int
    log: EventLog | None
    stats: StatsRecorder
    state_counts: dict[str, dict[str, int]]
    results: Results
    loop: EventLoop
    warn: RateLimitedLog
    recv: LifecycleTracker
    send: LifecycleTracker
    peers: LifecycleTracker
    transport: Transport | None
    server: HandshakeServer | None
    client: HandshakeClient | None
    pins: PinChannelServer | None
    compat: CompatInfo | None
    agent_name: str
    _recv_io: dict[str, RecvIO]
    _send_io: dict[str, SendIO]
    _peer_io: dict[str, PeerIO]
    _claims: dict[int, Claim]
    _claim_queue: dict[str, list[str]]
    _early_posts: list[str]  # requests whose reads go out right after this turn's claims
    _retry_flush: TimerHandle | None
    _oneway: dict[int, tuple[PeerIO, int]]
    _polling: dict[str, None]  # insertion-ordered: the same run polls in the same order
    _poll_timer: TimerHandle | None
    _read_poll_ns: int  # the read poll's interval: the configured one, or ramping up to it after a grant
    _stall_timer: TimerHandle | None
    _notif_timer: TimerHandle | None
    _expiry_timer: TimerHandle | None
    _has_readers: bool
    _notif_min_ns: int
    _notif_interval_ns: int
    _notif_fast_until_ns: int
    _recv_effects: Mapping[str, RecvEffect]
    _send_effects: Mapping[str, SendEffect]
    _peer_effects: Mapping[str, PeerEffect]
    _followups: deque[tuple[LifecycleTracker, ev.Event]]
    _applying: bool

    def _init_context(self) -> None:
        self._recv_io = {}
        self._send_io = {}
        self._peer_io = {}
        self._claims = {}
        self._claim_queue = {}
        self._early_posts = []
        self._retry_flush = None
        self._oneway = {}
        self._polling = {}
        self._poll_timer = None
        self._stall_timer = None
        self._notif_timer = None
        self._expiry_timer = None
        self._has_readers = False
        self._followups = deque()
        self._applying = False

    # -- applying events ---------------------------------------------------------

    def _apply(self, tracker: LifecycleTracker, event: ev.Event) -> Outcome | None:
        """Apply ``event`` and carry out its effects; an event applied while another
        transition's effects run is queued and applied right after it (None)."""
        if self._applying:
            self._followups.append((tracker, event))
            return None
        self._applying = True
        try:
            return self._step(tracker, event)
        finally:
            try:
                self._drain()
            finally:
                self._applying = False

    def _drain(self) -> None:
        """Apply the queued follow-ups; one that raises fails its own request only."""
        queue = self._followups
        while queue:
            tracker, event = queue.popleft()
            try:
                self._step(tracker, event)
            except Exception as e:  # noqa: BLE001 - fail that request, go on with the rest
                self._on_loop_error(LoopError(e, event.req, f"follow-up {event.trigger}", "post"))

    def _step(self, tracker: LifecycleTracker, event: ev.Event) -> Outcome:
        if tracker is self.recv:
            return self._step_recv(event)
        if tracker is self.send:
            return self._step_send(event)
        return self._step_peer(event)

    def _apply_recv(self, event: ev.Event) -> Outcome | None:
        return self._apply(self.recv, event)

    def _apply_send(self, event: ev.Event) -> Outcome | None:
        return self._apply(self.send, event)

    def _apply_peer(self, event: ev.Event) -> Outcome | None:
        return self._apply(self.peers, event)

    def _guard(self, req: str | None, fn: Callable[[Any], object], arg: Any) -> Exception | None:
        """Run one request's handler; an exception fails that request only (and is returned)."""
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001
            self._on_loop_error(LoopError(e, req, getattr(fn, "__name__", "handler"), "post"))
            return e
        return None

    def _note(self, event: str, req: str | None, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)

    # -- what one part calls on another (implemented by the mixins) ---------------

    def _step_recv(self, event: ev.Event) -> Outcome:
        raise NotImplementedError

    def _step_send(self, event: ev.Event) -> Outcome:
        raise NotImplementedError

    def _step_peer(self, event: ev.Event) -> Outcome:
        raise NotImplementedError

    def _on_loop_error(self, err: LoopError) -> None:
        raise NotImplementedError

    def _peer(self, engine: str, host: str, port: int, rank: int | None = None, pp_rank: int = 0) -> PeerIO:
        raise NotImplementedError

    def _peer_state(self, peer: PeerIO) -> str:
        raise NotImplementedError

    def _read_plan(self, remote_tp: int) -> ReadPlan | None:
        raise NotImplementedError

    def _peer_agent(self, peer: PeerIO) -> str:
        raise NotImplementedError

    def _tell_abandon(self, peer: PeerIO, remote_reqs: list[str], readers: int = 1) -> None:
        raise NotImplementedError

    def _workers_of(self, plan: ReadPlan | None, remote_pp: int) -> list[tuple[int, int, int, Source | None]]:
        raise NotImplementedError

    def _mark_dead(self, peer: PeerIO, why: str, reason: str, sent_ns: int = 0) -> None:
        raise NotImplementedError

    def _post_claimed_early(self, req: str) -> None:
        raise NotImplementedError

    def _settle(self, req: str) -> None:
        raise NotImplementedError

    def _arm_poll(self, *, soon: bool = False) -> None:
        raise NotImplementedError

    def _arm_notif_poll(self, *, soon: bool = False) -> None:
        raise NotImplementedError

    def _arm_stall_watch(self) -> None:
        raise NotImplementedError

    def _arm_client_expiry(self) -> None:
        raise NotImplementedError

    def _lease_expired(self, req: str) -> None:
        raise NotImplementedError

    def _compact_recv(self) -> None:
        raise NotImplementedError
