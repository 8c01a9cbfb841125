"""Injectable clocks, so simulation tests and replay run on virtual time.

Everything in kvsm that reads the time takes a ``Clock``; nothing calls
``time.monotonic_ns()`` directly. The system clock is for production; the
virtual clock only moves when something moves it: a test, the replay, or an
event loop on virtual time (``kvsm.runtime.loop``, ``mode="autojump"`` or
``"driven"``), which jumps it to its next timer when it has nothing to do.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Both clocks an event-log record carries, in nanoseconds."""

    def monotonic_ns(self) -> int: ...

    def wall_ns(self) -> int: ...


class SystemClock:
    """The real clocks. ``CLOCK_MONOTONIC`` is shared by all processes on a
    Linux host, which is what lets replay order records across processes."""

    __slots__ = ()

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()


class VirtualClock:
    """A clock that stands still until told to move (trio's MockClock idea).

    ``wall_ns`` keeps a fixed offset from ``monotonic_ns`` so records made on
    virtual time still look like real ones. Reads take no lock; moves take one,
    so a loop thread's jump and a test thread's ``advance`` cannot lose either.
    """

    __slots__ = ("_lock", "_now_ns", "_wall_offset_ns")

    def __init__(self, start_ns: int = 0, wall_offset_ns: int = 1_700_000_000_000_000_000) -> None:
        self._now_ns = start_ns
        self._wall_offset_ns = wall_offset_ns
        self._lock = threading.Lock()

    def monotonic_ns(self) -> int:
        return self._now_ns

    def wall_ns(self) -> int:
        return self._now_ns + self._wall_offset_ns

    def advance(self, delta_ns: int) -> None:
        """Move time forward; time never goes backwards."""
        if delta_ns < 0:
            raise ValueError(f"VirtualClock cannot go back in time (delta_ns={delta_ns})")
        with self._lock:
            self._now_ns += delta_ns

    def set(self, now_ns: int) -> None:
        """Jump to an absolute time (used by replay to stand at a record's time)."""
        with self._lock:
            if now_ns < self._now_ns:
                raise ValueError(f"VirtualClock cannot go back in time ({now_ns} < {self._now_ns})")
            self._now_ns = now_ns

    def jump_to(self, now_ns: int) -> bool:
        """Move to ``now_ns`` if that is later (an event loop's jump to its next
        timer); False, and no move, if the clock is there or past it already."""
        with self._lock:
            if now_ns <= self._now_ns:
                return False
            self._now_ns = now_ns
            return True


SYSTEM_CLOCK = SystemClock()
