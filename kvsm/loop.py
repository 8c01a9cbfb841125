"""The one event-loop thread per process: every socket, every NIXL call, every timer.

Why (DESIGN.md, "One event-loop thread per process owns all I/O"): upstream
spreads I/O over a listener thread that dies silently, a one-worker executor
that lets one dead peer delay everyone, and polling from the model runner.
kvsm gives each process exactly one thread that owns all of it, so nothing
that touches a socket or a NIXL handle ever needs a lock, and every outcome
comes out of one place in one order.

How other threads talk to it (trio's *entry queue* idea): they never touch a
socket or a timer; they hand a callable to ``post`` (fire and forget) or
``call`` (wait for the result, with a timeout). ``post`` appends to a bounded
``deque`` under a lock and, only when no wake-up is already on its way, sends
one byte over an inproc ``PAIR`` socket pair that the loop polls together
with its own sockets. A burst of posts therefore costs one wake-up, not one
syscall each.

What the loop does, forever until ``stop``::

    block in zmq.Poller.poll(time until the next timer, at most 1 s)
    run the timers that are due
    run the posted callables (a bounded batch, so a flood cannot starve the rest)
    call the readers whose sockets are readable

Every exception a callable, timer or reader raises is caught and handed to
``on_error`` as a ``LoopError`` naming the request (``req``) it was posted
for, so the connector can fail exactly that request; the loop never dies of
one.

Time: the loop is real-time. Its clock is injectable (timer deadlines and
``now_ns`` read it, so log records and deadlines share one time base), but
the poller waits real milliseconds, so the clock must advance with real
time (``SYSTEM_CLOCK``). Tests that need virtual time drive
``kvsm.lifecycle.timers.TimerHeap`` through the simulation harness
(``kvsm.sim``) instead of this loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Generic, Literal, Self, TypeVar

import zmq

from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.lifecycle.timers import TimerHandle, TimerHeap

__all__ = [
    "EventLoop",
    "LoopError",
    "LoopFull",
    "LoopRejected",
    "LoopStopped",
    "TimerHandle",
    "Where",
    "WrongThread",
]

T = TypeVar("T")

log = logging.getLogger(__name__)

THREAD_NAME_PREFIX: Final = "kvsm-loop-"
# Longest single wait in the poller: even an idle loop with no timers looks at
# its stop flag this often, and no wait is ever unbounded.
MAX_BLOCK_MS: Final = 1000
# Posted callables run per iteration at most; the rest wait one iteration, so
# timers and sockets get their turn even under a flood of posts.
MAX_BATCH: Final = 1024
# Back-off after an unexpected poller error, so a persistent one cannot spin.
_POLL_ERROR_BACKOFF_S: Final = 0.01
_NS_PER_MS: Final = 1_000_000

Where = Literal["post", "call", "timer", "reader", "loop"]

_wake_endpoint_ids = itertools.count()


class LoopRejected(RuntimeError):
    """``call`` could not hand its callable to the loop."""


class LoopStopped(LoopRejected):
    """The loop is stopped (or stopping): it runs nothing new."""


class LoopFull(LoopRejected):
    """``max_pending`` posted callables are already waiting."""


class WrongThread(RuntimeError):
    """A loop-thread-only method was called from another thread (use ``post``/``call``)."""


@dataclass(frozen=True, slots=True)
class LoopError:
    """An exception the loop caught, with enough context to blame one request.

    ``where`` says what raised: a posted callable (``post``), an abandoned
    ``call`` (its caller had timed out, so nobody else will see it), a timer,
    a socket reader, or the loop's own machinery (``loop``).
    """

    exc: BaseException
    req: str | None
    label: str
    where: Where

    def __str__(self) -> str:
        req = f" req={self.req}" if self.req is not None else ""
        return f"{self.where} {self.label!r}{req} raised {type(self.exc).__name__}: {self.exc}"


def _describe(fn: object) -> str:
    """A readable name for an unlabelled callable (only computed on error paths)."""
    return getattr(fn, "__qualname__", None) or repr(fn)


class _Timer:
    """What a timer runs; ``done`` lets ``cancel`` stop a timer that is due but
    not yet run in the current batch (the heap already counts it as fired)."""

    __slots__ = ("done", "fn", "label", "req")

    def __init__(self, fn: Callable[[], None], req: str | None, label: str) -> None:
        self.fn = fn
        self.req = req
        self.label = label
        self.done = False


_PENDING: Final = 0
_RUNNING: Final = 1
_FINISHED: Final = 2
_ABANDONED: Final = 3


class _CallSlot(Generic[T]):
    """The loop-side half of ``call``: runs the callable and hands back its outcome.

    A caller that times out marks the slot abandoned: if the loop has not
    started it yet, it never runs (the caller was told it failed); if it is
    already running, its result is dropped and an exception goes to
    ``on_error`` instead, since nobody else will see it.
    """

    __slots__ = ("exc", "finished", "fn", "label", "lock", "state", "value")

    def __init__(self, fn: Callable[[], T], label: str) -> None:
        self.fn = fn
        self.label = label
        self.state = _PENDING
        self.value: T | None = None
        self.exc: BaseException | None = None
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def __call__(self) -> None:
        with self.lock:
            if self.state != _PENDING:
                return  # abandoned before it started
            self.state = _RUNNING
        exc: BaseException | None = None
        try:
            value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            exc, value = e, None
        with self.lock:
            abandoned = self.state == _ABANDONED
            self.state = _FINISHED
            self.value, self.exc = value, exc
        self.finished.set()
        if abandoned and exc is not None:
            raise exc  # the loop reports it (where="call"): the caller is gone

    def fail(self, exc: BaseException) -> None:
        """Finish without running (the loop stopped first)."""
        with self.lock:
            if self.state != _PENDING:
                return
            self.state = _FINISHED
            self.exc = exc
        self.finished.set()

    def wait(self, timeout: float, loop_name: str) -> T:
        if not self.finished.wait(timeout):
            with self.lock:
                if self.state != _FINISHED:
                    self.state = _ABANDONED
                    raise TimeoutError(
                        f"loop {loop_name!r}: call {self.label!r} did not finish within {timeout:g} s"
                    )
        if self.exc is not None:
            raise self.exc
        return self.value  # type: ignore[return-value]


_Posted = tuple[Callable[[], None], str | None, str]


class EventLoop:
    """One thread that owns its sockets, timers and (later) NIXL calls.

    Any thread may call: ``start``, ``stop``, ``post``, ``call``, ``stats``,
    ``in_loop_thread``. Everything else (timers, readers, sockets) is for the
    loop thread only and raises ``WrongThread`` elsewhere: other threads get
    there through ``post``/``call``.
    """

    def __init__(
        self,
        name: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        context: zmq.Context | None = None,
        on_error: Callable[[LoopError], None] | None = None,
        max_pending: int = 100_000,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.name = name
        self._clock = clock
        self._context = context if context is not None else zmq.Context.instance()
        self._on_error = on_error
        self._max_pending = max_pending

        # Entry queue, shared with posting threads: guarded by _lock.
        self._lock = threading.Lock()
        self._queue: deque[_Posted] = deque()
        self._wake_pending = False  # a wake byte is on its way; posters need not send another
        self._stopping = False
        self._posted = 0
        self._dropped_posts = 0
        self._wakeups = 0

        # The wake pair. Posters share _wake_tx under _wake_lock (a zmq socket is
        # not thread-safe); the loop only ever reads _wake_rx, so it never waits
        # on a poster's send.
        endpoint = f"inproc://kvsm-loop-wake-{next(_wake_endpoint_ids)}-{id(self):x}"
        self._wake_rx: zmq.Socket = self._context.socket(zmq.PAIR)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(endpoint)
        self._wake_lock = threading.Lock()
        wake_tx = self._context.socket(zmq.PAIR)
        wake_tx.setsockopt(zmq.LINGER, 0)
        wake_tx.connect(endpoint)
        self._wake_tx: zmq.Socket | None = wake_tx  # None once the loop has shut down

        # Loop-thread state: touched only by the loop thread once it runs.
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._readers: dict[zmq.Socket, tuple[Callable[[], None], str]] = {}
        self._owned: set[zmq.Socket] = set()
        self._timers: TimerHeap[_Timer] = TimerHeap()
        self._run_count = 0
        self._timers_fired = 0
        self._errors = 0
        self._on_error_failures = 0
        self._discarded = 0
        self._iterations = 0

        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Self:
        """Start the loop thread (a daemon, so a forgotten loop cannot hang exit)."""
        with self._lock:
            if self._stopping:
                raise LoopStopped(f"loop {self.name!r} is stopped; make a new one")
            if self._thread is not None:
                raise RuntimeError(f"loop {self.name!r} is already started")
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
        with self._lock:
            first = not self._stopping
            self._stopping = True
            thread = self._thread
        if thread is None:
            if first:
                self._shut_down()
            return True
        if self.in_loop_thread():
            return False
        if first:
            self._send_wake()
        thread.join(timeout)
        return not thread.is_alive()

    def __enter__(self) -> Self:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopping else ("running" if self._thread else "new")
        return f"<EventLoop {self.name!r} {state} pending={len(self._queue)}>"

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
        with self._lock:
            if self._stopping or len(self._queue) >= self._max_pending:
                self._dropped_posts += 1
                return False
            self._queue.append((fn, req, label))
            self._posted += 1
            # The loop thread is awake by definition; elsewhere send one wake
            # byte per sleep, not one per post.
            wake = not self._wake_pending and threading.get_ident() != self._loop_ident
            if wake:
                self._wake_pending = True
                self._wakeups += 1
        if wake:
            self._send_wake()
        return True

    def call(
        self, fn: Callable[[], T], timeout: float, *, req: str | None = None, label: str = ""
    ) -> T:
        """Run ``fn`` on the loop and return its result (or raise its exception).

        Raises ``TimeoutError`` (naming the label) after ``timeout`` seconds; a
        callable that had not started by then never runs. On the loop thread
        itself ``fn`` runs inline, so a loop callback may ``call`` freely.
        Raises ``LoopStopped``/``LoopFull`` when the loop would not take it.
        """
        if self.in_loop_thread():
            return fn()
        label = label or _describe(fn)
        slot: _CallSlot[T] = _CallSlot(fn, label)
        if not self.post(slot, req=req, label=label):
            if self._stopping:
                raise LoopStopped(f"loop {self.name!r} is stopped: call {label!r} not run")
            raise LoopFull(
                f"loop {self.name!r} has {self._max_pending} posts pending: call {label!r} not run"
            )
        return slot.wait(timeout, self.name)

    def stats(self) -> dict[str, int]:
        """Counters, read without stopping the loop (each is exact; the set is not atomic).

        ``wakeups`` counts wake bytes posters sent: far fewer than ``posted``
        when posts come in bursts. ``errors`` counts exceptions handed to
        ``on_error`` (those ``call`` returns to its caller are not errors).
        """
        return {
            "posted": self._posted,
            "run": self._run_count,
            "timers_fired": self._timers_fired,
            "timers_pending": len(self._timers),
            "errors": self._errors,
            "on_error_failures": self._on_error_failures,
            "dropped_posts": self._dropped_posts,
            "discarded": self._discarded,
            "wakeups": self._wakeups,
            "iterations": self._iterations,
            "pending": len(self._queue),
            "readers": len(self._readers),
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

    def _schedule(
        self, deadline_ns: int, fn: Callable[[], None], req: str | None, label: str
    ) -> TimerHandle:
        if not callable(fn):
            raise TypeError(f"a timer needs a callable, got {fn!r}")
        return self._timers.schedule(deadline_ns, label, _Timer(fn, req, label))

    def cancel(self, handle: TimerHandle | None) -> bool:
        """Cancel a timer; False if it already ran or was cancelled."""
        self._check_thread("cancel")
        if handle is None:
            return False
        entry = handle.payload
        if not isinstance(entry, _Timer) or entry.done:
            return False
        entry.done = True
        self._timers.cancel(handle)  # False when it is already popped as due: still cancelled
        return True

    def add_reader(self, sock: zmq.Socket, callback: Callable[[], None], *, label: str = "") -> None:
        """Call ``callback`` on the loop whenever ``sock`` has a message waiting.

        The callback should drain with ``zmq.NOBLOCK`` until ``zmq.Again``
        (anything left makes it run again next iteration). Registering hands
        the socket to the loop: only the loop thread may use it from now on,
        and ``stop`` closes it. Re-adding a socket replaces its callback.
        Close a registered socket with ``close_socket``, never directly.
        """
        self._check_thread("add_reader")
        if not callable(callback):
            raise TypeError(f"add_reader needs a callable, got {callback!r}")
        if sock not in self._readers:
            self._poller.register(sock, zmq.POLLIN)
        self._readers[sock] = (callback, label)

    def remove_reader(self, sock: zmq.Socket) -> bool:
        """Stop watching ``sock`` (it stays open, and the caller's again); False if not watched."""
        self._check_thread("remove_reader")
        if self._readers.pop(sock, None) is None:
            return False
        self._poller.unregister(sock)
        return True

    def socket(self, socket_type: int) -> zmq.Socket:
        """A new socket on the loop's context, owned by the loop (closed by ``stop``).

        ``LINGER`` is 0: at shutdown, unsent messages are dropped rather than
        holding the process.
        """
        self._check_thread("socket")
        sock = self._context.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        self._owned.add(sock)
        return sock

    def close_socket(self, sock: zmq.Socket) -> None:
        """Stop watching ``sock`` and close it."""
        self._check_thread("close_socket")
        if sock in self._readers:
            self.remove_reader(sock)
        self._owned.discard(sock)
        sock.close(linger=0)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        self._loop_ident = threading.get_ident()
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except zmq.ContextTerminated as exc:
                    # Without its context the loop can do nothing: say so and stop.
                    self._report(exc, None, "context terminated", "loop", None)
                    with self._lock:
                        self._stopping = True
                except BaseException as exc:  # noqa: BLE001 - the loop must not die
                    self._report(exc, None, "loop iteration", "loop", None)
                    time.sleep(_POLL_ERROR_BACKOFF_S)
        finally:
            self._shut_down()
            # Thread ids are reused: a later thread must not pass for this loop's.
            self._loop_ident = None

    def _iterate(self) -> None:
        ready = self._poller.poll(self._poll_timeout_ms())
        self._iterations += 1
        woke = False
        readable: list[zmq.Socket] = []
        for sock, _events in ready:
            if sock is self._wake_rx:
                woke = True
            else:
                readable.append(sock)
        if woke:
            self._drain_wake()
        self._run_due_timers()
        if woke or self._queue:
            self._run_posted()
        if readable:
            self._dispatch(readable)

    def _poll_timeout_ms(self) -> int:
        """How long the poller may block: until the next timer, rounded up
        (a timer never fires early), at most ``MAX_BLOCK_MS``; 0 with work queued."""
        if self._queue:
            return 0
        if self._readers:
            self._forget_closed_readers()
        deadline = self._timers.next_deadline_ns()
        if deadline is None:
            return MAX_BLOCK_MS
        wait_ns = deadline - self._clock.monotonic_ns()
        if wait_ns <= 0:
            return 0
        return min(MAX_BLOCK_MS, -(-wait_ns // _NS_PER_MS))

    def _forget_closed_readers(self) -> None:
        """A socket closed behind the loop's back must leave the poller: zmq would
        poll fd 0 in its place (pyzmq passes a NULL handle)."""
        closed = [s for s in self._readers if s.closed]
        for sock in closed:
            _, label = self._readers.pop(sock)
            self._poller.unregister(sock)
            self._owned.discard(sock)
            err = RuntimeError("socket was closed while registered; use close_socket()")
            self._report(err, None, label, "reader", None)

    def _drain_wake(self) -> None:
        rx = self._wake_rx
        try:
            while True:
                rx.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass

    def _send_wake(self) -> None:
        with self._wake_lock:
            tx = self._wake_tx
            if tx is None:
                return  # the loop has shut down
            try:
                tx.send(b"\0", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the pipe is full of wake bytes: the loop will wake anyway
            except zmq.ZMQError:
                pass  # context going away: nothing left to wake

    def _run_due_timers(self) -> None:
        if not self._timers:
            return
        for handle in self._timers.pop_due(self._clock.monotonic_ns()):
            entry: _Timer = handle.payload
            if entry.done:
                continue  # cancelled by a timer that ran before it in this batch
            if self._stopping:
                return
            entry.done = True
            try:
                entry.fn()
            except BaseException as exc:  # noqa: BLE001 - the loop must not die
                self._report(exc, entry.req, entry.label, "timer", entry.fn)
            self._timers_fired += 1

    def _run_posted(self) -> None:
        with self._lock:
            # Cleared before taking the batch: a post after this point sends a
            # fresh wake byte, a post before it is in this batch.
            self._wake_pending = False
            queue = self._queue
            if not queue:
                return
            if len(queue) <= MAX_BATCH:
                self._queue = deque()
                batch: Iterable[_Posted] = queue
            else:
                batch = [queue.popleft() for _ in range(MAX_BATCH)]
        # No lock held from here on: posters never wait on a callable.
        batch_iter = iter(batch)
        for fn, req, label in batch_iter:
            if self._stopping:
                self._discard(itertools.chain([(fn, req, label)], batch_iter))
                return
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - the loop must not die
                where: Where = "call" if isinstance(fn, _CallSlot) else "post"
                self._report(exc, req, label, where, fn)
            self._run_count += 1

    def _dispatch(self, readable: list[zmq.Socket]) -> None:
        for sock in readable:
            if self._stopping:
                return
            entry = self._readers.get(sock)
            if entry is None:
                continue  # removed by an earlier callback in this iteration
            callback, label = entry
            if sock.closed:
                self._forget_closed_readers()
                continue
            try:
                callback()
            except BaseException as exc:  # noqa: BLE001 - the loop must not die
                self._report(exc, None, label, "reader", callback)

    def _report(
        self, exc: BaseException, req: str | None, label: str, where: Where, fn: object
    ) -> None:
        self._errors += 1
        error = LoopError(exc, req, label or (_describe(fn) if fn is not None else ""), where)
        handler = self._on_error
        if handler is None:
            log.error("loop %r: %s", self.name, error, exc_info=exc)
            return
        try:
            handler(error)
        except BaseException:  # nor may its error handler kill it
            self._on_error_failures += 1
            log.exception("loop %r: on_error raised while handling %s", self.name, error)

    def _discard(self, items: Iterable[_Posted]) -> None:
        """Drop posted callables that will never run; wake their ``call`` waiters."""
        for fn, _req, label in items:
            self._discarded += 1
            if isinstance(fn, _CallSlot):
                fn.fail(LoopStopped(f"loop {self.name!r} stopped before call {label!r} ran"))

    def _shut_down(self) -> None:
        """Drop what is left and close every socket the loop owns (runs once, last)."""
        with self._lock:
            self._stopping = True
            leftover, self._queue = self._queue, deque()
        self._discard(leftover)
        for sock in list(self._readers) + list(self._owned):
            try:
                sock.close(linger=0)
            except zmq.ZMQError:  # pragma: no cover - closing a socket of a dead context
                pass
        self._readers.clear()
        self._owned.clear()
        self._wake_rx.close(linger=0)
        with self._wake_lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
