"""The per-process event log: a non-blocking JSON-lines sink.

Why it looks like this (docs/design.md, "The event log"): logging must never block
the event loop, and a full buffer or a dead disk must be counted and reported,
never a crash and never an unbounded queue. So:

* ``emit`` (the hot path, any thread) only takes one lock, stamps ``seq`` and
  both clocks, and appends a plain dict to a bounded ``deque``. No JSON, no
  structlog chain, no I/O. A full buffer drops the record *before* it gets a
  ``seq`` (so ``seq`` stays gap-free over what was accepted) and counts it;
  the writer later logs a ``log_overflow`` record saying how many were lost.
* One daemon writer thread (``kvsm-eventlog-writer``) is the only thread that
  touches the file. It wakes every ``flush_interval_s`` (or sooner when a
  batch is ready), renders records through a structlog processor chain ending
  in ``JSONRenderer(serializer=orjson.dumps)`` and writes each batch with one
  ``os.write`` on an ``O_APPEND`` descriptor, so lines are never interleaved.
  An ``OSError`` costs that batch (counted in ``write_errors`` and
  ``lost_on_write``) and the file is reopened for the next one.

There is no userspace file buffer (raw fd + ``os.write``), which keeps a
``fork()`` from duplicating half-written data; a forked child gets its own
buffer, ``pid``, ``seq`` (from 0) and writer, and starts with a ``log_start``
record that names its parent.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from kvsm import __version__ as _KVSM_VERSION
from kvsm.eventlog import exit as _exit
from kvsm.eventlog import schema
from kvsm.eventlog.output import TornWrite, json_renderer, render_batch, render_stub, write_all
from kvsm.eventlog.schema import HEADER_FIELDS, SCHEMA_VERSION
from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock, SystemClock
from kvsm.lifecycle.machine import Outcome

__all__ = ["EventLog", "TornWrite", "WRITER_THREAD_NAME"]

WRITER_THREAD_NAME: Final = "kvsm-eventlog-writer"

# Header names a caller may not pass as extra fields (they would overwrite the
# stamped header). ``req``/``src``/``dst``/``t_mono_ns`` are emit() parameters.
_RESERVED: Final = frozenset(HEADER_FIELDS)

Processor = Callable[[Any, str, dict[str, Any]], Any]

class EventLog:
    """A per-process, thread-safe, non-blocking structured event log (JSONL).

    ``emit`` returns the record's ``seq`` or ``None`` when the record was
    dropped (buffer full, or the log is closed). Use ``record_outcome`` as a
    ``LifecycleTracker`` listener.

    Values passed as fields are rendered later, on the writer thread: pass
    immutable values or fresh copies, not containers you will mutate.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        role: str,
        engine_id: str,
        rank: int = 0,
        clock: Clock = SYSTEM_CLOCK,
        capacity: int = 65536,
        batch_size: int = 1024,
        flush_interval_s: float = 0.05,
        processors: Sequence[Processor] = (),
        pid: int | None = None,
    ) -> None:
        # ``pid``: the process id the records carry (default: this process's). A
        # harness that runs an engine's successive incarnations in one process
        # gives each its own, as replay tells processes apart by it.
        self._given_pid = pid
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        self.path = Path(path)
        self._role = role
        self._engine_id = engine_id
        self._rank = rank
        self.clock = clock
        # The system clock's methods only wrap these builtins: call them
        # directly and save a Python frame per clock read on the hot path.
        if type(clock) is SystemClock:
            self._mono_ns: Callable[[], int] = time.monotonic_ns
            self._wall_ns: Callable[[], int] = time.time_ns
        else:
            self._mono_ns = clock.monotonic_ns
            self._wall_ns = clock.wall_ns
        self.capacity = capacity
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        # The structlog chain the writer runs; the renderer is always last.
        self._processors: list[Processor] = [
            *processors,
            json_renderer(),
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._init_process_state(parent_pid=None)
        _exit.LIVE_LOGS.add(self)

    # -- per-process state (also rebuilt in a forked child) ------------------

    def _init_process_state(self, parent_pid: int | None) -> None:
        """Everything that belongs to one process: lock, buffer, counters, writer."""
        self._pid = self._given_pid if self._given_pid is not None and parent_pid is None else os.getpid()
        # Header with the per-process constants filled in; emit copies it.
        self._template: dict[str, Any] = dict.fromkeys(HEADER_FIELDS)
        self._template.update(schema=SCHEMA_VERSION, pid=self._pid, role=self._role,
                              engine_id=self._engine_id, rank=self._rank)
        self._lock = threading.Lock()
        self._buf: deque[dict[str, Any]] = deque()
        self._seq = 0  # next seq == number of accepted records
        self._closed = False
        self._dropped = 0  # total drops (full buffer + after close)
        self._dropped_pending = 0  # full-buffer drops not yet reported by a log_overflow
        self._overflow_reported = 0  # drops already reported in log_overflow records
        # Written only by the writer thread; read by flush()/stats().
        self._written = 0
        self._write_errors = 0
        self._lost_on_write = 0
        self._render_errors = 0
        self._writer_errors = 0
        self._last_error: str | None = None
        self._fd: int | None = None
        self._torn = False
        self._wake = threading.Event()
        self._progress = threading.Condition(threading.Lock())
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=WRITER_THREAD_NAME, daemon=True)
        start_fields: dict[str, Any] = {
            "version": _KVSM_VERSION,
            "capacity": self.capacity,
            "batch_size": self.batch_size,
            "path": str(self.path),
        }
        if parent_pid is not None:
            start_fields["parent_pid"] = parent_pid
        self.emit("log_start", "log_start", **start_fields)
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        """A forked child is a new process: fresh lock, buffer, seq and writer.

        The parent's buffered records stay the parent's to write. The inherited
        descriptor is closed (the file is reopened with O_APPEND by the child's
        writer), so nothing the parent had half-written is duplicated.
        """
        parent_pid = self._pid
        fd = self._fd
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        if self._closed:
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._buf = deque()
            self._fd = None
            return
        self._init_process_state(parent_pid=parent_pid)

    # -- the hot path --------------------------------------------------------

    def emit(
        self,
        kind: str,
        event: str,
        req: str | None = None,
        *,
        src: str | None = None,
        dst: str | None = None,
        t_mono_ns: int | None = None,
        **fields: Any,
    ) -> int | None:
        """Append one record; return its ``seq``, or ``None`` if it was dropped.

        Never blocks on I/O and never grows the buffer past ``capacity``.
        ``t_mono_ns`` overrides the monotonic time (an outcome carries the time
        its tracker saw); the wall time always comes from the clock.
        """
        rec = self._template.copy()  # header keys in HEADER_FIELDS order
        rec["kind"] = kind
        rec["req"] = req
        rec["event"] = event
        rec["src"] = src
        rec["dst"] = dst
        if fields:
            if not _RESERVED.isdisjoint(fields):
                clash = sorted(_RESERVED & fields.keys())
                raise TypeError(f"emit(): header fields cannot be passed as extras: {clash}")
            rec.update(fields)
        return self._push(rec, t_mono_ns)

    def record_outcome(self, outcome: Outcome) -> None:
        """``LifecycleTracker`` listener: one create/transition/violation record,
        stamped with the monotonic time the tracker saw (``outcome.t_ns``).

        Same record as ``emit(**outcome_fields(outcome), t_mono_ns=outcome.t_ns)``
        without re-packing the fields as keyword arguments."""
        rec = self._template.copy()
        rec.update(schema.outcome_fields(outcome))
        self._push(rec, outcome.t_ns)

    def _push(self, rec: dict[str, Any], t_mono_ns: int | None) -> int | None:
        """The locked part of ``emit`` and ``record_outcome``: stamp and enqueue."""
        buf = self._buf
        with self._lock:
            if self._closed or len(buf) >= self.capacity:
                self._dropped += 1
                if not self._closed:
                    self._dropped_pending += 1
                return None
            seq = self._seq
            self._seq = seq + 1
            rec["seq"] = seq
            rec["t_mono_ns"] = self._mono_ns() if t_mono_ns is None else t_mono_ns
            rec["t_wall_ns"] = self._wall_ns()
            buf.append(rec)
            n = len(buf)
        if n >= self.batch_size and not self._wake.is_set():
            self._wake.set()
        return seq

    # -- flushing, closing, stats -------------------------------------------

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` s) until every record accepted so far has
        been written or counted lost; ``True`` if that happened in time."""
        with self._lock:
            # A pending overflow report will take exactly one more seq.
            target = self._seq + (1 if self._dropped_pending else 0)
        return self._wait_done(target, timeout)

    def _wait_done(self, target: int, timeout: float) -> bool:
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._written + self._lost_on_write < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return self._written + self._lost_on_write >= target
                self._progress.wait(min(remaining, self.flush_interval_s))
                self._wake.set()
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Flush, stop the writer, close the file. Idempotent; later emits are
        counted as dropped. ``True`` if everything was written in time."""
        with self._lock:
            already = self._closed
            self._closed = True
            target = self._seq + (1 if self._dropped_pending else 0)
        if already:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        deadline = time.monotonic() + timeout
        ok = self._wait_done(target, timeout)
        self._stopping = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + self.flush_interval_s)
        _exit.LIVE_LOGS.discard(self)
        return ok and not self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def role(self) -> str:
        return self._role

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def pid(self) -> int:
        """The process this log's records are stamped with (refreshed after fork)."""
        return self._pid

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and tests. Monotonic for the life of the process
        (a forked child starts its own from zero)."""
        with self._lock:
            return {
                "accepted": self._seq,
                "written": self._written,
                "dropped": self._dropped,
                "write_errors": self._write_errors,
                "lost_on_write": self._lost_on_write,
                "render_errors": self._render_errors,
                "writer_errors": self._writer_errors,
                "buffered": len(self._buf),
                "last_error": self._last_error,
                "writer_alive": self._thread.is_alive(),
            }

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<EventLog {str(self.path)!r} role={self.role!r} engine_id={self.engine_id!r} rank={self.rank}>"

    # -- the writer thread ---------------------------------------------------

    def _run(self) -> None:
        """Wake on a batch or the interval, drain everything, write in batches."""
        try:
            while True:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
                stopping = self._stopping
                try:
                    self._drain()
                except Exception as e:  # noqa: BLE001 - a bug here must not end logging
                    self._writer_errors += 1
                    self._last_error = f"writer: {type(e).__name__}: {e}"
                if stopping:
                    break
        finally:
            self._close_fd()
            with self._progress:
                self._progress.notify_all()

    def _take_batch(self) -> list[dict[str, Any]]:
        """Pop up to ``batch_size`` records; after drops, also queue the
        ``log_overflow`` report (under the lock, right after freeing room, so
        it always fits and keeps its place in ``seq`` order)."""
        buf = self._buf
        k = min(len(buf), self.batch_size)
        popleft = buf.popleft
        if not self._dropped_pending:
            # deque.popleft is atomic; emitters only append, so no lock needed.
            return [popleft() for _ in range(k)]
        with self._lock:
            k = min(len(buf), self.batch_size)
            batch = [popleft() for _ in range(k)]
            dropped = self._dropped_pending
            if dropped and len(buf) < self.capacity:
                self._dropped_pending = 0
                self._overflow_reported += dropped
                seq = self._seq
                self._seq = seq + 1
                rec = self._template.copy()
                rec["seq"] = seq
                rec["t_mono_ns"] = self._mono_ns()
                rec["t_wall_ns"] = self._wall_ns()
                rec["kind"] = "log_overflow"
                rec["event"] = "log_overflow"
                rec["dropped"] = dropped
                rec["total_dropped"] = self._overflow_reported
                rec["capacity"] = self.capacity
                buf.append(rec)
        return batch

    def _drain(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                if not self._dropped_pending:
                    return
                continue  # the overflow report was just queued
            data = self._render_batch(batch)
            ok = self._write_batch(data)
            with self._progress:
                if ok:
                    self._written += len(batch)
                else:
                    self._lost_on_write += len(batch)
                self._progress.notify_all()

    def _render_batch(self, batch: list[dict[str, Any]]) -> bytearray:
        """The batch as one buffer for one write (``kvsm.eventlog.output``)."""
        return render_batch(self._processors, batch, self._render_stub)

    def _render_stub(self, rec: dict[str, Any], error: BaseException) -> bytes:
        data, failed = render_stub(rec, error, _RESERVED)
        if failed:
            self._render_errors += 1
        return data

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _write_batch(self, data: bytes | bytearray) -> bool:
        """Write one rendered batch; on an error count it, drop the descriptor
        (reopened on the next batch) and carry on. Never raises."""
        try:
            if self._fd is None:
                self._fd = self._open()
            # After a torn write, end the cut line first: it stays one bad
            # line (the reader reports it) instead of swallowing our first one.
            self._write_bytes(self._fd, b"\n" + data if self._torn else data)
            self._torn = False
            return True
        except Exception as e:  # noqa: BLE001 - OSError mostly; nothing may kill the writer
            if isinstance(e, TornWrite):
                self._torn = True
            self._write_errors += 1
            self._last_error = f"{type(e).__name__}: {e}"
            self._close_fd()
            return False

    def _write_bytes(self, fd: int, data: bytes | bytearray) -> None:
        """The one system call per batch (a seam tests use to inject faults)."""
        write_all(fd, data)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


# Fork and interpreter exit reach every live log through kvsm.eventlog.exit.
_close_all_at_exit = _exit.close_all_at_exit
