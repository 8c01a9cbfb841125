"""What the loop thread does each iteration: poll, run due timers, run posted
callables, call readers; and what it owns while doing so (the poller, the
watched and owned sockets, the timer heap, the counters).

Why apart from ``kvsm.runtime.loop``: ``EventLoop`` is the public face (life
cycle, thread checks, ``post``/``call``), this is the machinery behind it, which
only the loop thread touches once the loop runs. Every exception a callable,
timer or reader raises is caught here and handed to ``on_error`` as a
``LoopError``; the loop never dies of one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Final

import zmq

from kvsm.lifecycle.clock import Clock
from kvsm.lifecycle.timers import TimerHandle, TimerHeap
from kvsm.runtime.entry import CallSlot, EntryQueue, LoopError, LoopStopped, Posted, Where, describe

log = logging.getLogger("kvsm.runtime.loop")

# Longest single wait in the poller: even an idle loop with no timers looks at
# its stop flag this often, and no wait is ever unbounded.
MAX_BLOCK_MS: Final = 1000
# Posted callables run per iteration at most; the rest wait one iteration, so
# timers and sockets get their turn even under a flood of posts.
MAX_BATCH: Final = 1024
_NS_PER_MS: Final = 1_000_000


class _Timer:
    """What a timer runs; ``done`` lets ``cancel`` stop a timer that is due but
    not yet run in the current batch (the heap already counts it as fired)."""

    __slots__ = ("done", "fn", "label", "req")

    def __init__(self, fn: Callable[[], None], req: str | None, label: str) -> None:
        self.fn = fn
        self.req = req
        self.label = label
        self.done = False


class Dispatch:
    """The loop thread's state and one iteration over it (``iterate``)."""

    def __init__(self, name: str, entry: EntryQueue, clock: Clock,
                 on_error: Callable[[LoopError], None] | None, autojump_ms: int | None) -> None:
        self.name = name
        self.entry = entry
        self.clock = clock
        self.on_error = on_error
        # None: real time; else the autojump threshold in whole milliseconds.
        self.autojump_ms = autojump_ms
        self.poller = zmq.Poller()
        self.poller.register(entry.rx, zmq.POLLIN)
        self.readers: dict[zmq.Socket, tuple[Callable[[], object], str]] = {}
        self.owned: set[zmq.Socket] = set()
        self.timers: TimerHeap[_Timer] = TimerHeap()
        self.run_count = 0
        self.timers_fired = 0
        self.errors = 0
        self.on_error_failures = 0
        self.discarded = 0
        self.iterations = 0

    # ------------------------------------------------------- timers and sockets

    def schedule(self, deadline_ns: int, fn: Callable[[], None], req: str | None, label: str) -> TimerHandle:
        if not callable(fn):
            raise TypeError(f"a timer needs a callable, got {fn!r}")
        return self.timers.schedule(deadline_ns, label, _Timer(fn, req, label))

    def cancel(self, handle: TimerHandle | None) -> bool:
        if handle is None:
            return False
        entry = handle.payload
        if not isinstance(entry, _Timer) or entry.done:
            return False
        entry.done = True
        self.timers.cancel(handle)  # False when it is already popped as due: still cancelled
        return True

    def add_reader(self, sock: zmq.Socket, callback: Callable[[], object], label: str) -> None:
        if not callable(callback):
            raise TypeError(f"add_reader needs a callable, got {callback!r}")
        if sock not in self.readers:
            self.poller.register(sock, zmq.POLLIN)
        self.readers[sock] = (callback, label)

    def remove_reader(self, sock: zmq.Socket) -> bool:
        if self.readers.pop(sock, None) is None:
            return False
        self.poller.unregister(sock)
        return True

    def close_socket(self, sock: zmq.Socket) -> None:
        if sock in self.readers:
            self.remove_reader(sock)
        self.owned.discard(sock)
        sock.close(linger=0)

    def forget_closed_readers(self) -> None:
        """A socket closed behind the loop's back must leave the poller: zmq would
        poll fd 0 in its place (pyzmq passes a NULL handle)."""
        closed = [s for s in self.readers if s.closed]
        for sock in closed:
            _, label = self.readers.pop(sock)
            self.poller.unregister(sock)
            self.owned.discard(sock)
            err = RuntimeError("socket was closed while registered; use close_socket()")
            self.report(err, None, label, "reader", None)

    # ------------------------------------------------------------ one iteration

    def guarded_iterate(self, timeout_ms: int | None) -> int:
        """One iteration; -1 when the loop's own machinery raised (reported)."""
        try:
            return self.iterate(self.poll_timeout_ms() if timeout_ms is None else timeout_ms)
        except zmq.ContextTerminated as exc:
            # Without its context the loop can do nothing: say so and stop.
            self.report(exc, None, "context terminated", "loop", None)
            self.entry.stop()
        except BaseException as exc:  # noqa: BLE001 - the loop must not die
            self.report(exc, None, "loop iteration", "loop", None)
        return -1

    def iterate(self, timeout_ms: int) -> int:
        ready = self.poller.poll(timeout_ms)
        self.iterations += 1
        woke = False
        readable: list[zmq.Socket] = []
        wake_rx = self.entry.rx
        for sock, _events in ready:
            if sock is wake_rx:
                woke = True
            else:
                readable.append(sock)
        if woke:
            self.entry.drain_wake()
        elif self.autojump_ms is not None and not ready and not self.entry.items:
            # Nothing happened for the threshold: virtual time moves to the next timer.
            deadline = self.timers.next_deadline_ns()
            if deadline is not None:
                self.clock.jump_to(deadline)  # type: ignore[attr-defined]
        before = self.run_count + self.timers_fired
        self.run_due_timers()
        if woke or self.entry.items:
            self.run_posted()
        if readable:
            self.dispatch(readable)
        return self.run_count + self.timers_fired - before + len(readable)

    def poll_timeout_ms(self) -> int:
        """How long the poller may block: until the next timer, rounded up
        (a timer never fires early), at most ``MAX_BLOCK_MS``; 0 with work queued."""
        if self.entry.items:
            return 0
        if self.readers:
            self.forget_closed_readers()
        deadline = self.timers.next_deadline_ns()
        if deadline is None:
            return MAX_BLOCK_MS
        wait_ns = deadline - self.clock.monotonic_ns()
        if wait_ns <= 0:
            return 0
        if self.autojump_ms is not None:
            return self.autojump_ms
        return min(MAX_BLOCK_MS, -(-wait_ns // _NS_PER_MS))

    def run_due_timers(self) -> None:
        if not self.timers:
            return
        for handle in self.timers.pop_due(self.clock.monotonic_ns()):
            entry: _Timer = handle.payload
            if entry.done:
                continue  # cancelled by a timer that ran before it in this batch
            if self.entry.stopping:
                return
            entry.done = True
            try:
                entry.fn()
            except BaseException as exc:  # noqa: BLE001 - the loop must not die
                self.report(exc, entry.req, entry.label, "timer", entry.fn)
            self.timers_fired += 1

    def run_posted(self) -> None:
        # No lock held while they run: posters never wait on a callable.
        batch_iter = iter(self.entry.take(MAX_BATCH))
        entry = self.entry
        for fn, req, label in batch_iter:
            if entry.stopping:
                self.discard(itertools.chain([(fn, req, label)], batch_iter))
                return
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - the loop must not die
                where: Where = "call" if isinstance(fn, CallSlot) else "post"
                self.report(exc, req, label, where, fn)
            self.run_count += 1

    def dispatch(self, readable: list[zmq.Socket]) -> None:
        for sock in readable:
            if self.entry.stopping:
                return
            entry = self.readers.get(sock)
            if entry is None:
                continue  # removed by an earlier callback in this iteration
            callback, label = entry
            if sock.closed:
                self.forget_closed_readers()
                continue
            try:
                callback()
            except BaseException as exc:  # noqa: BLE001 - the loop must not die
                self.report(exc, None, label, "reader", callback)

    # ------------------------------------------------------------ errors, the end

    def report(self, exc: BaseException, req: str | None, label: str, where: Where, fn: object) -> None:
        self.errors += 1
        error = LoopError(exc, req, label or (describe(fn) if fn is not None else ""), where)
        handler = self.on_error
        if handler is None:
            log.error("loop %r: %s", self.name, error, exc_info=exc)
            return
        try:
            handler(error)
        except BaseException:  # nor may its error handler kill it
            self.on_error_failures += 1
            log.exception("loop %r: on_error raised while handling %s", self.name, error)

    def discard(self, items: Iterable[Posted]) -> None:
        """Drop posted callables that will never run; wake their ``call`` waiters."""
        for fn, _req, label in items:
            self.discarded += 1
            if isinstance(fn, CallSlot):
                fn.fail(LoopStopped(f"loop {self.name!r} stopped before call {label!r} ran"))

    def shut_down(self) -> None:
        """Drop what is left and close every socket the loop owns (runs once, last)."""
        self.discard(self.entry.take_all())
        for sock in list(self.readers) + list(self.owned):
            try:
                sock.close(linger=0)
            except zmq.ZMQError:  # pragma: no cover - closing a socket of a dead context
                pass
        self.readers.clear()
        self.owned.clear()
        self.entry.close()
