"""A thread that posts a poll to the loop at a finer grain than its timers.

The loop's timers wake in whole milliseconds (zmq's poll timeout is in ms);
streamed push wants a write's end seen within a fraction of that, on both
sides: the decode worker polls NIXL's notifications while a streamed
request's writes are awaited, the prefill worker its writes while a stream's
last notification waits for the earlier writes to be over. The thread only
posts (every thread but the loop only posts to it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvsm.runtime.loop import EventLoop

# While a streamed request's writes are awaited, NIXL's notifications are polled
# this often, so that the last write's landing is seen soon after it lands: the
# loop's own timers wake in whole milliseconds (zmq's poll), so a thread of its
# own ticks and posts the poll (docs/benchmarks.md section 11).
STREAM_POLL_S = 0.00025


class PollTicker:
    """Posts ``tick`` to the loop every ``interval_s`` until stopped; one post
    at a time (a tick not run yet is not posted again)."""

    def __init__(self, loop: EventLoop, tick: Callable[[], None], interval_s: float) -> None:
        self._loop, self._tick, self._interval_s = loop, tick, interval_s
        self._stop = threading.Event()
        self._posted = False
        self._thread = threading.Thread(target=self._run, name=f"{loop.name}-stream-poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._posted:
                continue
            self._posted = True
            if not self._loop.post(self._run_tick, label="stream poll"):
                return  # the loop is stopped

    def _run_tick(self) -> None:
        self._posted = False
        if not self._stop.is_set():
            self._tick()

    def stop(self) -> None:
        """Stop ticking (the thread ends at its next wake, within ``interval_s``)."""
        self._stop.set()
