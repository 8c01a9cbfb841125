"""A timer heap on whatever clock the caller reads: no threads, no sleeping.

The event loop asks ``next_deadline_ns()`` to know how long it may block in
its poller (on virtual time: where to jump the clock when it has nothing to
do), and ``pop_due(now_ns)`` for what has fired. The simulation's own agenda
(``kvsm_testing.sim``) is the very same heap on the same virtual clock.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class TimerHandle:
    """Returned by ``schedule``; pass it to ``cancel``."""

    __slots__ = ("deadline_ns", "key", "payload", "cancelled")

    def __init__(self, deadline_ns: int, key: Any, payload: Any) -> None:
        self.deadline_ns = deadline_ns
        self.key = key
        self.payload = payload
        self.cancelled = False

    def __repr__(self) -> str:
        state = " cancelled" if self.cancelled else ""
        return f"<TimerHandle {self.key!r} at {self.deadline_ns}{state}>"


class TimerHeap(Generic[T]):
    """Deadlines in a binary heap with lazy cancellation.

    Cancelled entries stay in the heap until they reach the top or until they
    outnumber the live ones, when the heap is rebuilt: memory stays bounded by
    twice the live timers.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, TimerHandle]] = []
        self._order = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def schedule(self, deadline_ns: int, key: Any, payload: T) -> TimerHandle:
        handle = TimerHandle(deadline_ns, key, payload)
        heapq.heappush(self._heap, (deadline_ns, next(self._order), handle))
        self._live += 1
        return handle

    def cancel(self, handle: TimerHandle | None) -> bool:
        """Cancel a pending timer; False if it already fired or was cancelled."""
        if handle is None or handle.cancelled:
            return False
        handle.cancelled = True
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            self._heap = [e for e in self._heap if not e[2].cancelled]
            heapq.heapify(self._heap)
        return True

    def next_deadline_ns(self) -> int | None:
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now_ns: int) -> list[TimerHandle]:
        """Every live timer whose deadline is at or before ``now_ns``, in order."""
        due: list[TimerHandle] = []
        heap = self._heap
        while heap and heap[0][0] <= now_ns:
            _, _, handle = heapq.heappop(heap)
            if not handle.cancelled:
                handle.cancelled = True  # fired: a later cancel() is a no-op
                self._live -= 1
                due.append(handle)
        return due
