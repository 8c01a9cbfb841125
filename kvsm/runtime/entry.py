"""What crosses into ``kvsm.runtime.loop.EventLoop`` from other threads, and what comes back.

Other threads never touch the loop's sockets or timers: they hand it a
callable (``post``), or a ``CallSlot`` wrapping one when they wait for its
outcome (``call``). This module holds that entry side: the queue and its
wake-up pair (``EntryQueue``), the slot, the error record the loop hands to
``on_error``, and the exceptions ``call`` raises.
``kvsm.runtime.loop`` re-exports every public name.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar

import zmq

T = TypeVar("T")

Where = Literal["post", "call", "timer", "reader", "loop"]

Posted = tuple[Callable[[], None], str | None, str]
"""One entry of the loop's queue: (callable, request it is for, label)."""


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


def describe(fn: object) -> str:
    """A readable name for an unlabelled callable (only computed on error paths)."""
    return getattr(fn, "__qualname__", None) or repr(fn)


_PENDING: Final = 0
_RUNNING: Final = 1
_FINISHED: Final = 2
_ABANDONED: Final = 3


class CallSlot(Generic[T]):
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


class EntryQueue:
    """The loop's entry queue: a bounded deque that any thread appends to, and
    the inproc ``PAIR`` wake pair that rouses a sleeping loop.

    Posters share the sending end under its own lock (a zmq socket is not
    thread-safe); the loop only reads ``rx``, so it never waits on a poster's
    send. One wake byte per sleep, not one per post: ``wake_pending`` says one
    is on its way. ``stopping`` is set once, under ``lock``; from then on
    nothing is accepted.
    """

    __slots__ = ("_tx", "_tx_lock", "dropped", "items", "lock", "max_pending", "posted", "rx", "stopping",
                 "wake_pending", "wakeups")

    def __init__(self, context: zmq.Context, max_pending: int, endpoint: str) -> None:
        self.lock = threading.Lock()
        self.items: deque[Posted] = deque()
        self.max_pending = max_pending
        self.wake_pending = False
        self.stopping = False
        self.posted = 0
        self.dropped = 0
        self.wakeups = 0
        self.rx: zmq.Socket = context.socket(zmq.PAIR)
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.bind(endpoint)
        self._tx_lock = threading.Lock()
        tx = context.socket(zmq.PAIR)
        tx.setsockopt(zmq.LINGER, 0)
        tx.connect(endpoint)
        self._tx: zmq.Socket | None = tx  # None once closed

    def put(self, item: Posted, from_loop: bool) -> bool:
        """Append ``item``; False (counted) when stopping or full. The loop thread
        is awake by definition (``from_loop``): only others send a wake byte."""
        with self.lock:
            if self.stopping or len(self.items) >= self.max_pending:
                self.dropped += 1
                return False
            self.items.append(item)
            self.posted += 1
            wake = not self.wake_pending and not from_loop
            if wake:
                self.wake_pending = True
                self.wakeups += 1
        if wake:
            self.wake()
        return True

    def stop(self) -> bool:
        """Accept nothing from now on; True the first time."""
        with self.lock:
            first = not self.stopping
            self.stopping = True
        return first

    def take(self, max_batch: int) -> Iterable[Posted]:
        """The next batch, at most ``max_batch`` (the rest waits for the next one)."""
        with self.lock:
            # Cleared before taking the batch: a post after this point sends a
            # fresh wake byte, a post before it is in this batch.
            self.wake_pending = False
            items = self.items
            if not items:
                return ()
            if len(items) <= max_batch:
                self.items = deque()
                return items
            return [items.popleft() for _ in range(max_batch)]

    def take_all(self) -> deque[Posted]:
        """Stop, and hand back everything still queued."""
        with self.lock:
            self.stopping = True
            leftover, self.items = self.items, deque()
        return leftover

    def wake(self) -> None:
        with self._tx_lock:
            tx = self._tx
            if tx is None:
                return  # the loop has shut down
            try:
                tx.send(b"\0", zmq.NOBLOCK)
            except zmq.Again:
                pass  # the pipe is full of wake bytes: the loop will wake anyway
            except zmq.ZMQError:
                pass  # context going away: nothing left to wake

    def drain_wake(self) -> None:
        rx = self.rx
        try:
            while True:
                rx.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.rx.close(linger=0)
        with self._tx_lock:
            if self._tx is not None:
                self._tx.close(linger=0)
                self._tx = None
