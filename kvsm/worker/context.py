"""What every part of the worker shares: its state, its results box, and the
one way it applies events.

``WorkerHalf`` is a composition of parts, one per concern (``recv``, ``send``,
``peers``, ``recovery``), each handed the ``WorkerContext`` and the other parts
it calls. Only the loop thread touches any of it, except ``Results`` (locked;
vLLM's thread takes from it).

The worker decides nothing about a request or a peer itself: it turns I/O into
events, applies them to the trackers, and carries out the effects the table
returns (``runner``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import RecvStart
from kvsm.handoff.pins import PinChannelServer
from kvsm.handshake import CompatInfo, HandshakeClient, HandshakeServer
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.machine import LifecycleTracker, Outcome
from kvsm.lifecycle.table import PEER, RECV, SEND
from kvsm.runtime.loop import EventLoop, LoopError, TimerHandle
from kvsm.transport.base import Transport, XferHandle
from kvsm.worker.runner import EffectRunner
from kvsm.worker.stats import StatsRecorder
from kvsm.worker.tp_map import Source

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


class Periodic(enum.Enum):
    """The worker's periodic timers, by kind. Each re-arms itself as it runs; one
    whose callback raised did not, and ``Recovery`` re-arms it by its kind (or
    polling of reads, of NIXL notifications or of handshake deadlines would stop
    for good). The value is the timer's label in the loop, what a ``LoopError``
    names it by."""

    POLL_READS = "poll reads"
    STALL_PROBE = "stalled-read probe"
    POLL_NOTIFS = "poll notifications"
    CLIENT_DEADLINES = "handshake deadlines"
    CLAIM_RETRY_FLUSH = "claim retry flush"


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


@dataclass(slots=True)
class Link:
    """One prefill worker a decode request deals with (a tensor parallel rank of
    one pipeline stage): a read of ``source``'s heads of the layers both hold, or
    (``source`` None) only the word that nobody reads it (``tp_map``).

    ``done`` and ``told`` are I/O bookkeeping, not decisions, so they stay here
    rather than in the recv machine. The table decides *that* the prefill side is
    told (``notify_abandon``, ``send_notif``) and whether a read counts (the
    machine's ``claims_granted``, ``reads_done_ns``); these two only say *where*
    a message already went, so the effect does not send it twice: ``done`` is the
    transport's word that this link's read completed (its NIXL notification told
    that rank; set from ``check(handle)`` at the final poll or when reads are
    cancelled, and read while the reads are in flight by the stall probe), and
    ``told`` that an abandon went over the side channel already (a rank nobody
    reads, or a stage holding none of our layers, is told when the claims or
    reads go out, before the request's end tells the rest). Folding them would
    put a per-link bitmask in every ``error``/``reads_quiesced`` input for replay
    to carry and check nothing new: no transition reads them.
    """

    peer: PeerIO
    rank: int
    readers: int = 1  # decode workers that prefill worker waits for (told with every message)
    source: Source | None = None
    handle: XferHandle | None = None
    done: bool = False  # its read completed (its notification went with it), or (no layer to read) it was told
    # Its place among the request's reads (a claim's ``source``; -1: not read): whether
    # its claim was granted is the machine's (``claims_granted``), not kept here.
    index: int = -1
    told: bool = False  # it was told over the side channel that we read nothing (more) there
    # Push mode: where its write stands ("": not asked; asked, writing (answered ok),
    # landed, failed, refused, gone, cancelled), as the ask's answer and the writer's
    # notifications said. I/O bookkeeping as ``done``: the table hears the sums
    # (writes_landed, writes_stopped).
    write: str = ""


@dataclass(slots=True)
class RecvIO:
    """The I/O side of one decode request: what its effects need. ``peer`` is the
    first prefill rank it reads (the only one unless tensor parallel sizes differ)."""

    start: RecvStart
    peer: PeerIO
    links: list[Link] = field(default_factory=list)
    # Its recv machine (set once created; still readable after it ended): what the
    # table knows of its claims.
    machine: RequestMachine | None = None
    handles: list[XferHandle] = field(default_factory=list)
    completed: int = 0  # reads that completed before they were released
    handshake_timer: TimerHandle | None = None
    transfer_timer: TimerHandle | None = None
    retry_timer: TimerHandle | None = None
    settle_timer: TimerHandle | None = None
    posted_ns: int = 0
    claims_over: bool = False  # its claims need no retry any more (the table stopped them: cancel_handshake_timer)
    done_ns: int = 0  # when every read had completed
    answers: dict[str, int] = field(default_factory=dict)  # claim answers so far, by status
    # Push mode: the writes' deadline (the loop's clock; 0: none asked) and its timer.
    write_deadline_ns: int = 0
    write_timer: TimerHandle | None = None

    def timers(self) -> tuple[TimerHandle | None, ...]:
        return (self.handshake_timer, self.transfer_timer, self.retry_timer, self.settle_timer, self.write_timer)

    @property
    def reads(self) -> list[Link]:
        """The links it reads through, in plan order (a claim's ``source`` index)."""
        return [link for link in self.links if link.source is not None]

    def granted(self, link: Link) -> bool:
        """Whether ``link``'s claim was granted (its machine's ``claims_granted``; a
        read notification that came before it is held there until then)."""
        m = self.machine
        return m is not None and link.index >= 0 and bool(m.claims_granted >> link.index & 1)

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


class WorkerContext:
    """What every part of the worker shares (loop thread only): the configuration,
    the trackers, the results box, the I/O objects opened at start, the tables of
    per-request I/O that more than one part reads, and the one way events are
    applied (``runner``). The parts are handed this object; none of them inherits
    from another."""

    def __init__(self, cfg: KVSMConfig, tp_rank: int, pp_rank: int, event_log: EventLog | None,
                 stats: StatsRecorder, loop: EventLoop) -> None:
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.log = event_log
        self.stats = stats
        self.loop = loop
        self.results = Results()
        self.warn = RateLimitedLog(loop.name)
        self.recv = LifecycleTracker(RECV, loop.clock, listener=self.on_outcome)
        self.send = LifecycleTracker(SEND, loop.clock, listener=self.on_outcome)
        self.peers = LifecycleTracker(PEER, loop.clock, listener=self.on_outcome)
        # Machines per state (recv, send), kept by the outcome listener: the metrics' gauges.
        self.state_counts: dict[str, dict[str, int]] = {
            spec.name: dict.fromkeys(spec.states, 0) for spec in (RECV, SEND)}
        # Opened by ``WorkerHalf.start`` (on the loop): None until then, or when this
        # engine has no such role.
        self.transport: Transport | None = None
        self.server: HandshakeServer | None = None
        self.client: HandshakeClient | None = None
        self.pins: PinChannelServer | None = None
        self.compat: CompatInfo | None = None
        self.agent_name = ""
        # Decode requests' I/O (the receiving part's, read by the peers part when a
        # claim is answered or a peer dies), and those with reads in flight
        # (insertion-ordered: the same run polls in the same order).
        self.recv_io: dict[str, RecvIO] = {}
        self.polling: dict[str, None] = {}
        # Requests whose claims go out with this turn's flush, by peer key.
        self.claim_queue: dict[str, list[str]] = {}
        # Push mode, decode side: the side-channel asks in flight (their answers' handlers,
        # by request id), the requests whose writes are awaited (the notification poll
        # runs while any is), and who takes the writers' notifications.
        self.write_asks: dict[int, Callable[[Any], None]] = {}
        self.writes_awaited: set[str] = set()
        self.on_write_notif: Callable[[str, bytes], None] = _ignore_notif
        self.poll_notifs_soon: Callable[[], None] = _nothing
        self.poll_notifs_now: Callable[[], None] = _nothing
        self.runner = EffectRunner(self._on_error)
        self.on_error: Callable[[LoopError], None] = _no_recovery

    def _on_error(self, err: LoopError) -> None:
        self.on_error(err)

    # -- applying events (one runner, see ``runner``) -----------------------------------

    def apply_recv(self, event: ev.Event) -> Outcome | None:
        return self.runner.apply(self.recv, event)

    def apply_send(self, event: ev.Event) -> Outcome | None:
        return self.runner.apply(self.send, event)

    def apply_peer(self, event: ev.Event) -> Outcome | None:
        return self.runner.apply(self.peers, event)

    def guard(self, req: str | None, fn: Callable[[Any], object], arg: Any) -> Exception | None:
        """Run one request's handler; an exception fails that request only (and is returned)."""
        try:
            fn(arg)
        except Exception as e:  # noqa: BLE001
            self.on_error(LoopError(e, req, getattr(fn, "__name__", "handler"), "post"))
            return e
        return None

    def note(self, event: str, req: str | None, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)

    def on_outcome(self, o: Outcome) -> None:
        """Every tracker's listener: the event log's record, a warning for a
        violation, and the per-state counts."""
        if self.log is not None:
            self.log.record_outcome(o)
        if o.violation is not None:
            self.warn.warning("violation", "%s", o.describe())
        elif not o.stale:
            counts = self.state_counts.get(o.lifecycle)
            if counts is not None:
                if o.src is not None:
                    counts[o.src] -= 1
                counts[o.dst] += 1  # type: ignore[index]


def _ignore_notif(peer: str, msg: bytes) -> None:
    return None


def _nothing() -> None:
    return None


def _no_recovery(err: LoopError) -> None:
    raise err.exc
