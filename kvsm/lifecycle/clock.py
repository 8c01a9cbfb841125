"""Injectable clocks, so simulation tests and replay run on virtual time.

Everything in kvsm that reads the time takes a ``Clock``; nothing calls
``time.monotonic_ns()`` directly. The system clock is for production; the
virtual clock only moves when a test (or the replay) moves it.
"""

from __future__ import annotations

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
    virtual time still look like real ones.
    """

    __slots__ = ("_now_ns", "_wall_offset_ns")

    def __init__(self, start_ns: int = 0, wall_offset_ns: int = 1_700_000_000_000_000_000) -> None:
        self._now_ns = start_ns
        self._wall_offset_ns = wall_offset_ns

    def monotonic_ns(self) -> int:
        return self._now_ns

    def wall_ns(self) -> int:
        return self._now_ns + self._wall_offset_ns

    def advance(self, delta_ns: int) -> None:
        """Move time forward; time never goes backwards."""
        if delta_ns < 0:
            raise ValueError(f"VirtualClock cannot go back in time (delta_ns={delta_ns})")
        self._now_ns += delta_ns

    def set(self, now_ns: int) -> None:
        """Jump to an absolute time (used by replay to stand at a record's time)."""
        if now_ns < self._now_ns:
            raise ValueError(f"VirtualClock cannot go back in time ({now_ns} < {self._now_ns})")
        self._now_ns = now_ns


SYSTEM_CLOCK = SystemClock()
