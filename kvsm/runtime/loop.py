"""The one event-loop thread per process: every socket, every NIXL call, every timer.

Why (docs/design.md, "One event-loop thread per process owns all I/O"): upstream
spreads I/O over a listener thread that dies silently, a one-worker executor
that lets one dead peer delay everyone, and polling from the model runner.
kvsm gives each process exactly one thread that owns all of it, so nothing
that touches a socket or a NIXL handle ever needs a lock, and every outcome
comes out of one place in one order.

The machinery the loop thread runs each iteration (poller, readers, timers,
counters) is ``kvsm.runtime.dispatch``; this module is the loop's public face.

How other threads talk to it (trio's *entry queue* idea, ``kvsm.runtime.entry``):
they never touch a socket or a timer; they hand a callable to ``post`` (fire
and forget) or ``call`` (wait for the result, with a timeout). ``post``
appends to a bounded ``deque`` under a lock and, only when no wake-up is
already on its way, sends one byte over an inproc ``PAIR`` socket pair that
the loop polls with its own sockets: a burst of posts costs one wake-up.

What the loop does, forever until ``stop``::

    block in zmq.Poller.poll(time until the next timer, at most 1 s)
    run the timers that are due
    run the posted callables (a bounded batch, so a flood cannot starve the rest)
    call the readers whose sockets are readable

Every exception a callable, timer or reader raises is caught and handed to
``on_error`` as a ``LoopError`` naming the request (``req``) it was posted
for, so the connector can fail exactly that request; the loop never dies of
one.

Time (``mode``). Timer deadlines and ``now_ns`` read the injectable clock.

* ``"real"`` (the default, production): the poller waits real milliseconds,
  so the clock must be ``SYSTEM_CLOCK``.
* ``"autojump"`` (trio's ``MockClock(autojump_threshold)``): the loop thread
  runs on a ``VirtualClock``; when nothing is posted, readable or due for
  ``autojump_threshold_s`` of real time, the clock jumps to the next timer
  deadline. ``post``/``call`` from other threads work as usual. For one loop
  (a jump is decided by this loop alone).
* ``"driven"``: no loop thread. The thread that calls ``start`` drives the
  loop with ``run_once``/``run_until_idle`` (zero-timeout polls) and, for
  that thread, ``call`` and the loop-thread-only methods run inline. Several
  driven loops on one ``VirtualClock`` and one zmq context, run from one
  thread, make a deterministic simulation: inproc delivery between sockets
  of one context is immediate, and the driver moves the clock to the
  earliest ``next_deadline_ns`` only when no loop has work (``kvsm_testing.sim``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Final, Literal, Protocol, Self, TypeVar

import zmq

from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.lifecycle.timers import TimerHandle
from kvsm.runtime.dispatch import MAX_BATCH, MAX_BLOCK_MS, Dispatch
from kvsm.runtime.entry import (
    CallSlot,
    EntryQueue,
    LoopError,
    LoopFull,
    LoopRejected,
    LoopStopped,
    Where,
    WrongThread,
    describe,
)

__all__ = [
    "EventLoop",
    "LoopError",
    "LoopFull",
    "LoopMode",
    "LoopRejected",
    "LoopStopped",
    "MAX_BATCH",
    "MAX_BLOCK_MS",
    "TimerHandle",
    "Where",
    "WrongThread",
]

T = TypeVar("T")

LoopMode = Literal["real", "autojump", "driven"]
_MODES: Final = ("real", "autojump", "driven")

THREAD_NAME_PREFIX: Final = "kvsm-loop-"
# run_until_idle gives up after this many busy iterations (a reader that never
# drains, or a callable that re-posts itself forever).
MAX_IDLE_ITERATIONS: Final = 100_000
# Back-off after an unexpected poller error, so a persistent one cannot spin.
_POLL_ERROR_BACKOFF_S: Final = 0.01
_NS_PER_MS: Final = 1_000_000

_wake_endpoint_ids = itertools.count()


class LoopGroup(Protocol):
    """What a loop made with ``group=`` joins (``kvsm.runtime.group.DrivenLoops``;
    a protocol here so that the group and the loop do not import each other)."""

    def add(self, loop: EventLoop) -> None: ...


class EventLoop:
    """One thread that owns its sockets, timers and NIXL calls.

    Any thread may call: ``start``, ``stop``, ``post``, ``call``, ``stats``,
    ``in_loop_thread``. Everything else (timers, readers, sockets) is for the
    loop thread only and raises ``WrongThread`` elsewhere: other threads get
    there through ``post``/``call``. In ``mode="driven"`` the loop thread is the
    thread that called ``start`` (see the module docstring for the modes).
    """

    def __init__(
        self,
        name: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        context: zmq.Context | None = None,
        on_error: Callable[[LoopError], None] | None = None,
        max_pending: int = 100_000,
        mode: LoopMode = "real",
        autojump_threshold_s: float = 0.001,
        group: LoopGroup | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if mode != "real" and not callable(getattr(clock, "jump_to", None)):
            raise ValueError(f"mode {mode!r} needs a clock the loop can move (VirtualClock), got {clock!r}")
        if autojump_threshold_s < 0:
            raise ValueError(f"autojump_threshold_s must be >= 0, got {autojump_threshold_s}")
        self.name = name
        self.mode = mode
        self._clock = clock
        autojump_ms = -(-int(autojump_threshold_s * 1e9) // _NS_PER_MS)
        self._context = context if context is not None else zmq.Context.instance()
        # Entry queue and wake pair, shared with posting threads (kvsm.runtime.entry).
        endpoint = f"inproc://kvsm-loop-wake-{next(_wake_endpoint_ids)}-{id(self):x}"
        self._entry = EntryQueue(self._context, max_pending, endpoint)
        # Loop-thread state: touched only by the loop thread once it runs.
        self._core = Dispatch(name, self._entry, clock, on_error, autojump_ms if mode == "autojump" else None)

        self._thread: threading.Thread | None = None
        self._driven = False  # mode "driven" and started
        self._loop_ident: int | None = None
        if group is not None:
            if mode != "driven":
                raise ValueError(f"a loop of a DrivenLoops group must be mode 'driven', not {mode!r}")
            group.add(self)

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Self:
        """Start the loop thread (a daemon, so a forgotten loop cannot hang exit).
        Driven: make the calling thread the loop's (it then drives ``run_once``)."""
        with self._entry.lock:
            if self._entry.stopping:
                raise LoopStopped(f"loop {self.name!r} is stopped; make a new one")
            if self._thread is not None or self._driven:
                raise RuntimeError(f"loop {self.name!r} is already started")
            if self.mode == "driven":
                self._driven = True
                self._loop_ident = threading.get_ident()
                return self
            self._thread = threading.Thread(
                target=self._run, name=f"{THREAD_NAME_PREFIX}{self.name}", daemon=True
            )
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask the loop to finish and wait up to ``timeout`` seconds for it.

        The loop finishes the callable it is running, runs nothing new (posted
        callables still queued are dropped; their ``call`` waiters get
        ``LoopStopped``), closes the sockets it owns and exits. Idempotent.
        Returns whether the thread has finished; False when called from the
        loop thread itself (it exits once the current callable returns).
        """
        first = self._entry.stop()
        thread = self._thread
        if thread is None:
            if first:
                self._core.shut_down()
                self._loop_ident = None
            return True
        if self.in_loop_thread():
            return False
        if first:
            self._entry.wake()
        thread.join(timeout)
        return not thread.is_alive()

    def __enter__(self) -> Self:
        if self._thread is None and not self._driven:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._entry.stopping else ("running" if self._thread or self._driven else "new")
        return f"<EventLoop {self.name!r} {state} pending={len(self._entry.items)}>"

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def context(self) -> zmq.Context:
        return self._context

    # ------------------------------------------------------------ any thread

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_ident

    def post(self, fn: Callable[[], None], *, req: str | None = None, label: str = "") -> bool:
        """Hand ``fn`` to the loop; never blocks.

        False (and counted in ``dropped_posts``) when the loop is stopped or
        ``max_pending`` callables are already waiting. Callables from one
        thread run in the order they were posted.
        """
        if not callable(fn):
            raise TypeError(f"post needs a callable, got {fn!r}")
        return self._entry.put((fn, req, label), threading.get_ident() == self._loop_ident)

    def call(self, fn: Callable[[], T], timeout: float, *, req: str | None = None, label: str = "") -> T:
        """Run ``fn`` on the loop and return its result (or raise its exception).

        Raises ``TimeoutError`` (naming the label) after ``timeout`` seconds; a
        callable that had not started by then never runs. On the loop thread
        itself ``fn`` runs inline, so a loop callback may ``call`` freely.
        Raises ``LoopStopped``/``LoopFull`` when the loop would not take it.
        """
        if self.in_loop_thread():
            return fn()
        label = label or describe(fn)
        slot: CallSlot[T] = CallSlot(fn, label)
        if not self.post(slot, req=req, label=label):
            if self._entry.stopping:
                raise LoopStopped(f"loop {self.name!r} is stopped: call {label!r} not run")
            raise LoopFull(
                f"loop {self.name!r} has {self._entry.max_pending} posts pending: call {label!r} not run"
            )
        return slot.wait(timeout, self.name)

    def stats(self) -> dict[str, int]:
        """Counters, read without stopping the loop (each is exact; the set is not atomic).

        ``wakeups`` counts wake bytes posters sent: far fewer than ``posted``
        when posts come in bursts. ``errors`` counts exceptions handed to
        ``on_error`` (those ``call`` returns to its caller are not errors).
        """
        core = self._core
        return {
            "posted": self._entry.posted,
            "run": core.run_count,
            "timers_fired": core.timers_fired,
            "timers_pending": len(core.timers),
            "errors": core.errors,
            "on_error_failures": core.on_error_failures,
            "dropped_posts": self._entry.dropped,
            "discarded": core.discarded,
            "wakeups": self._entry.wakeups,
            "iterations": core.iterations,
            "pending": len(self._entry.items),
            "readers": len(core.readers),
        }

    # ------------------------------------------------------- loop thread only

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._loop_ident:
            raise WrongThread(
                f"EventLoop.{what} is for loop {self.name!r}'s own thread; "
                f"from {threading.current_thread().name!r} use post() or call()"
            )

    def now_ns(self) -> int:
        """The loop clock's monotonic time, the base of ``call_at`` deadlines."""
        return self._clock.monotonic_ns()

    def call_later(
        self, delay_ns: int, fn: Callable[[], None], *, req: str | None = None, label: str = ""
    ) -> TimerHandle:
        """Run ``fn`` on the loop ``delay_ns`` from now (never earlier)."""
        self._check_thread("call_later")
        return self._schedule(self._clock.monotonic_ns() + max(0, delay_ns), fn, req, label)

    def call_at(
        self, deadline_ns: int, fn: Callable[[], None], *, req: str | None = None, label: str = ""
    ) -> TimerHandle:
        """Run ``fn`` on the loop once the clock reaches ``deadline_ns``."""
        self._check_thread("call_at")
        return self._schedule(deadline_ns, fn, req, label)

    def _schedule(self, deadline_ns: int, fn: Callable[[], None], req: str | None, label: str) -> TimerHandle:
        return self._core.schedule(deadline_ns, fn, req, label)

    def cancel(self, handle: TimerHandle | None) -> bool:
        """Cancel a timer; False if it already ran or was cancelled."""
        self._check_thread("cancel")
        return self._core.cancel(handle)

    def add_reader(self, sock: zmq.Socket, callback: Callable[[], object], *, label: str = "") -> None:
        """Call ``callback`` on the loop whenever ``sock`` has a message waiting.

        The callback should drain with ``zmq.NOBLOCK`` until ``zmq.Again``
        (anything left makes it run again next iteration). Registering hands
        the socket to the loop: only the loop thread may use it from now on,
        and ``stop`` closes it. Re-adding a socket replaces its callback.
        Close a registered socket with ``close_socket``, never directly.
        """
        self._check_thread("add_reader")
        self._core.add_reader(sock, callback, label)

    def remove_reader(self, sock: zmq.Socket) -> bool:
        """Stop watching ``sock`` (it stays open, and the caller's again); False if not watched."""
        self._check_thread("remove_reader")
        return self._core.remove_reader(sock)

    def socket(self, socket_type: int) -> zmq.Socket:
        """A new socket on the loop's context, owned by the loop (closed by ``stop``).

        ``LINGER`` is 0: at shutdown, unsent messages are dropped rather than
        holding the process.
        """
        self._check_thread("socket")
        sock = self._context.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        self._core.owned.add(sock)
        return sock

    def close_socket(self, sock: zmq.Socket) -> None:
        """Stop watching ``sock`` and close it."""
        self._check_thread("close_socket")
        self._core.close_socket(sock)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        self._loop_ident = threading.get_ident()
        try:
            while not self._entry.stopping:
                if self._core.guarded_iterate(None) < 0:
                    time.sleep(_POLL_ERROR_BACKOFF_S)
        finally:
            self._core.shut_down()
            # Thread ids are reused: a later thread must not pass for this loop's.
            self._loop_ident = None

    def run_once(self) -> int:
        """Driven mode: one iteration that does not wait (a zero-timeout poll, the
        due timers, a batch of posted callables, the readable sockets). Returns
        how many callables, timers and readers ran (0: nothing to do now)."""
        if not self._driven:
            raise RuntimeError(f"loop {self.name!r}: run_once is for a started loop in mode 'driven'")
        self._check_thread("run_once")
        if self._entry.stopping:
            return 0
        if self._core.readers:
            self._core.forget_closed_readers()
        return max(0, self._core.guarded_iterate(0))

    def run_until_idle(self, max_iterations: int = MAX_IDLE_ITERATIONS) -> int:
        """Driven mode: ``run_once`` until it finds nothing to do; returns the work done.
        Raises RuntimeError after ``max_iterations`` busy iterations."""
        total = 0
        for _ in range(max_iterations):
            done = self.run_once()
            if not done:
                return total
            total += done
        raise RuntimeError(f"loop {self.name!r} still busy after {max_iterations} iterations "
                           "(a reader that never drains, or a callable that re-posts itself?)")

    @property
    def driven_running(self) -> bool:
        """Driven, started and not stopped: ``run_once`` has something to drive."""
        return self._driven and not self._entry.stopping

    def next_deadline_ns(self) -> int | None:
        """The earliest pending timer's deadline (loop clock), or None: where a
        driver of several loops moves the clock when none has work."""
        return self._core.timers.next_deadline_ns()

    def has_work_due(self) -> bool:
        """A post is queued or a timer is due (sockets not looked at)."""
        deadline = self._core.timers.next_deadline_ns()
        return bool(self._entry.items) or (deadline is not None and deadline <= self._clock.monotonic_ns())
