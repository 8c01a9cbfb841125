"""Micro-benchmark of the event log: µs per emit (hot path), writer throughput,
reader throughput. Not a test; run: python tools/bench_eventlog.py"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvsm.eventlog import EventLog, read_logs
from kvsm.lifecycle import RECV, LifecycleTracker
from kvsm.lifecycle.events import Matched


def bench_emit(d: Path, n: int) -> None:
    """Time emit in chunks of 1000 calls with the writer running as in
    production (default settings); report the best and the median chunk, since
    this 2-core machine is shared and a single total is mostly noise."""
    for label, extra in (("bare", {}), ("5 extra fields", None)):
        with EventLog(d / f"emit-{label[0]}.jsonl", role="scheduler", engine_id="e0") as log:
            emit = log.emit
            chunks: list[float] = []
            for _ in range(n // 1000):
                t0 = time.perf_counter_ns()
                if extra is None:
                    for _ in range(1000):
                        emit("transition", "reads_posted", "req-123", src="remote_known", dst="transferring",
                             lifecycle="recv", num_blocks=4)
                else:
                    for _ in range(1000):
                        emit("log", "x")
                chunks.append((time.perf_counter_ns() - t0) / 1000)
                log.flush(10)  # keep the buffer as small as a 50 ms drain would
            st = log.stats()
        chunks.sort()
        print(f"emit ({label}): best {chunks[0] / 1000:.2f} µs/call, median {chunks[len(chunks) // 2] / 1000:.2f}, "
              f"p90 {chunks[len(chunks) * 9 // 10] / 1000:.2f} (chunks of 1000, writer running); "
              f"written={st['written']} dropped={st['dropped']}")


def bench_emit_dropping(d: Path, n: int) -> None:
    log = EventLog(d / "drop.jsonl", role="scheduler", engine_id="e0", capacity=1)
    emit = log.emit
    t0 = time.perf_counter_ns()
    for _ in range(n):
        emit("log", "x", "r")
    dt = (time.perf_counter_ns() - t0) / n
    log.close()
    print(f"emit when buffer full:       {dt / 1000:.2f} µs/call (dropped={log.stats()['dropped']})")


def bench_outcome(d: Path, n: int) -> None:
    log = EventLog(d / "outcome.jsonl", role="scheduler", engine_id="e0")
    tracker = LifecycleTracker(RECV)
    tracker.create("r1")
    tracker.apply(Matched(req="r1", num_tokens=5))
    outcome = tracker.apply(Matched(req="r1", num_tokens=5))  # a violation: has input + violation
    chunks: list[float] = []
    for _ in range(n // 1000):
        t0 = time.perf_counter_ns()
        for _ in range(1000):
            log.record_outcome(outcome)
        chunks.append((time.perf_counter_ns() - t0) / 1000)
        log.flush(10)
    log.close(60)
    chunks.sort()
    print(f"record_outcome (violation): best {chunks[0] / 1000:.2f} µs/call, "
          f"median {chunks[len(chunks) // 2] / 1000:.2f}")


def bench_writer_and_reader(d: Path, n: int) -> None:
    """End to end: one thread emits ``n`` records as fast as it can while the
    writer drains (default settings), then close(); then read them back."""
    path = d / "big.jsonl"
    log = EventLog(path, role="worker", engine_id="e1", capacity=n + 16)
    t0 = time.perf_counter()
    for i in range(n):
        log.emit("transition", "all_reads_done", f"req-{i % 1000}", src="transferring", dst="done",
                 lifecycle="recv", input={"num_bytes": 4096 * i}, effects=["release_blocks"])
    t1 = time.perf_counter()
    log.close(120)
    t2 = time.perf_counter()
    st = log.stats()
    print(f"end to end: {n} records emitted in {t1 - t0:.2f} s, all written at {t2 - t0:.2f} s -> "
          f"{n / (t2 - t0) / 1000:.0f}k rec/s sustained; {path.stat().st_size / n:.0f} B/record; "
          f"written={st['written']} dropped={st['dropped']}")
    t0 = time.perf_counter()
    res = read_logs([path])
    r = time.perf_counter() - t0
    print(f"reader: {len(res.records)} records, {len(res.problems)} problems in {r:.2f} s -> "
          f"{len(res.records) / r / 1000:.0f}k rec/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200_000)
    ap.add_argument("--big", type=int, default=1_000_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        bench_emit(d, a.n)
        bench_emit_dropping(d, a.n)
        bench_outcome(d, a.n)
        bench_writer_and_reader(d, a.big)


if __name__ == "__main__":
    main()
