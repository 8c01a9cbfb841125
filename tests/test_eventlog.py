"""The event log: gap-free concurrent writing, bounded overflow, surviving
write errors, the structlog route, lifecycle outcomes, and the tolerant reader."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

import kvsm
from kvsm.eventlog import (
    HEADER_FIELDS,
    SCHEMA_VERSION,
    EventLog,
    Problem,
    configure_structlog,
    iter_log,
    read_logs,
    schema,
)
from kvsm.eventlog.log import WRITER_THREAD_NAME
from kvsm.lifecycle import RECV, LifecycleTracker, VirtualClock
from kvsm.lifecycle.events import Allocated, Matched

WAIT = 5.0  # every wait in these tests is bounded


def _pyproject_version() -> str:
    """The one source of kvsm's version (kvsm.__version__ reads it from the installed metadata)."""
    import tomllib

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def load_lines(path: Path) -> list[dict[str, Any]]:
    """Strict parse: every line a JSON object, the file ends with a newline."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), "last line not newline-terminated"
    return [orjson.loads(line) for line in data.split(b"\n")[:-1]]


class GatedLog(EventLog):
    """Test seam: the writer's one system call can be held or made to fail."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.hold = threading.Event()  # while set, a write waits for `release`
        self.release = threading.Event()
        self.entered = threading.Event()  # a write is being held
        self.fail = threading.Event()  # while set, a write raises OSError
        self.max_buffered = 0
        super().__init__(*args, **kwargs)

    def _write_bytes(self, fd: int, data: bytes) -> None:
        if self.hold.is_set():
            self.entered.set()
            assert self.release.wait(WAIT)
        if self.fail.is_set():
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        super()._write_bytes(fd, data)


# -- writing ------------------------------------------------------------------


def test_concurrent_emitters_gap_free_and_unmangled(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "concurrent.jsonl"  # parent dirs created
    threads_n, per = 8, 5000
    log = EventLog(path, role="scheduler", engine_id="e0", rank=3, capacity=threads_n * per + 10,
                   batch_size=256, flush_interval_s=0.01)
    start = threading.Barrier(threads_n)
    errors: list[BaseException] = []
    results: dict[int, list[int | None]] = {}

    def work(t: int) -> None:
        try:
            start.wait(WAIT)
            results[t] = [log.emit("log", "tick", f"req-{t}", thread=t, i=i, pad="x" * (i % 97)) for i in range(per)]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert not errors
    assert log.close() is True
    st = log.stats()
    total = threads_n * per + 1
    assert st["accepted"] == st["written"] == total
    assert st["dropped"] == st["write_errors"] == st["lost_on_write"] == st["buffered"] == 0

    recs = load_lines(path)
    assert len(recs) == total
    assert recs[0]["kind"] == "log_start" and recs[0]["seq"] == 0
    assert recs[0]["version"] == kvsm.__version__ == _pyproject_version()
    assert recs[0]["capacity"] == threads_n * per + 10
    # Written in seq order, gap-free, no duplicate; time never goes back with seq.
    assert [r["seq"] for r in recs] == list(range(total))
    monos = [r["t_mono_ns"] for r in recs]
    assert monos == sorted(monos)
    pairs = [(r["thread"], r["i"]) for r in recs[1:]]
    assert sorted(pairs) == [(t, i) for t in range(threads_n) for i in range(per)]
    for r in recs[1:]:
        assert list(r)[: len(HEADER_FIELDS)] == list(HEADER_FIELDS)
        assert r["pad"] == "x" * (r["i"] % 97) and r["req"] == f"req-{r['thread']}"
        assert (r["schema"], r["pid"], r["role"], r["engine_id"], r["rank"]) == (
            SCHEMA_VERSION, os.getpid(), "scheduler", "e0", 3)
    # Each thread's seqs increase with its own order, and match what emit returned.
    by_pair = {(r["thread"], r["i"]): r["seq"] for r in recs[1:]}
    for t, seqs in results.items():
        assert seqs == [by_pair[(t, i)] for i in range(per)]
        assert seqs == sorted(seqs)


def test_header_order_and_reserved_fields(tmp_path: Path) -> None:
    with EventLog(tmp_path / "h.jsonl", role="worker", engine_id="e1") as log:
        seq = log.emit("transition", "matched", "r1", src="new", dst="awaiting_blocks", lifecycle="recv",
                       input={"num_tokens": 5}, blocks=(1, 2))
        assert seq == 1
        with pytest.raises(TypeError, match="seq"):
            log.emit("log", "bad", seq=7)
        with pytest.raises(TypeError, match="pid"):
            log.emit("log", "bad", pid=7)
        assert log.emit("log", "after") == 2  # a rejected call took no seq
        assert log.emit("log", "stamped", t_mono_ns=123) == 3
    recs = load_lines(tmp_path / "h.jsonl")
    r = recs[1]
    assert list(r) == [*HEADER_FIELDS, "lifecycle", "input", "blocks"]
    assert (r["kind"], r["req"], r["event"], r["src"], r["dst"], r["blocks"]) == (
        "transition", "r1", "matched", "new", "awaiting_blocks", [1, 2])
    assert [x["seq"] for x in recs] == [0, 1, 2, 3]
    assert recs[3]["t_mono_ns"] == 123 and recs[3]["t_wall_ns"] > 10**18  # wall time still from the clock
    assert recs[2]["t_mono_ns"] >= recs[1]["t_mono_ns"] > 123


def test_writer_thread_named_and_daemon(tmp_path: Path) -> None:
    with EventLog(tmp_path / "t.jsonl", role="worker", engine_id="e") as log:
        t = log._thread
        assert t.name == WRITER_THREAD_NAME and t.daemon and t.is_alive()
    assert not t.is_alive()


def test_close_idempotent_and_emit_after_close_counts_as_dropped(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    log = EventLog(path, role="worker", engine_id="e")
    log.emit("log", "one")
    assert log.close() is True
    assert log.close() is True
    assert log.emit("log", "late") is None
    log.record_outcome(LifecycleTracker(RECV).create("r9"))
    st = log.stats()
    assert st["dropped"] == 2 and st["accepted"] == 2 and st["written"] == 2
    assert [r["event"] for r in load_lines(path)] == ["log_start", "one"]


def test_overflow_drops_counted_reported_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "overflow.jsonl"
    cap = 10
    log = GatedLog(path, role="worker", engine_id="e", capacity=cap, batch_size=4, flush_interval_s=0.01)
    returned: list[int | None] = []

    def flood(n: int) -> None:
        for i in range(n):
            returned.append(log.emit("log", "flood", i=i))
            assert log.stats()["buffered"] <= cap
            assert len(log._buf) <= cap

    for round_ in (1, 2):
        log.release.clear()
        log.entered.clear()
        log.hold.set()
        log.emit("log", "trigger", round=round_)
        log._wake.set()
        assert log.entered.wait(WAIT), "writer never reached its write"
        flood(100)  # writer is stuck in a write: exactly `cap` fit, the rest drop
        assert log.stats()["buffered"] == cap
        t0 = time.monotonic()
        assert log.flush(timeout=0.1) is False  # bounded, not blocking
        assert time.monotonic() - t0 < 2.0
        log.hold.clear()
        log.release.set()
        assert log.flush(WAIT) is True

    assert log.close() is True
    st = log.stats()
    assert returned.count(None) == 180 == st["dropped"]
    assert st["lost_on_write"] == 0 and st["buffered"] == 0

    recs = load_lines(path)
    assert [r["seq"] for r in recs] == list(range(len(recs)))  # gap-free despite the drops
    assert st["accepted"] == st["written"] == len(recs)
    overflows = [r for r in recs if r["kind"] == "log_overflow"]
    assert [(o["dropped"], o["total_dropped"]) for o in overflows] == [(90, 90), (90, 180)]
    floods = [r for r in recs if r["event"] == "flood"]
    assert len(floods) == 2 * cap
    assert sorted(s for s in returned if s is not None) == [r["seq"] for r in floods]
    # Each report comes after the records accepted before the drops it reports.
    first_overflow = recs.index(overflows[0])
    assert all(r["seq"] < overflows[0]["seq"] for r in floods[:cap])
    assert recs[first_overflow - 1]["event"] == "flood"


def test_write_errors_counted_writer_survives(tmp_path: Path) -> None:
    path = tmp_path / "errors.jsonl"
    log = GatedLog(path, role="worker", engine_id="e", flush_interval_s=0.01)
    assert log.emit("log", "before") == 1
    assert log.flush(WAIT)
    log.fail.set()
    seqs = [log.emit("log", "during", i=i) for i in range(50)]  # never raises
    assert seqs == list(range(2, 52))
    assert log.flush(WAIT) is True  # lost records count as done
    st = log.stats()
    assert st["write_errors"] >= 1 and st["lost_on_write"] == 50
    assert "injected" in st["last_error"]
    assert log._thread.is_alive() and st["writer_alive"]
    log.fail.clear()  # the fault clears: the file is reopened, writing resumes
    assert log.emit("log", "after") == 52
    assert log.close() is True
    st = log.stats()
    assert st["written"] == 3 and st["lost_on_write"] == 50 and st["accepted"] == 53
    recs = load_lines(path)
    assert [(r["seq"], r["event"]) for r in recs] == [(0, "log_start"), (1, "before"), (52, "after")]


@pytest.mark.skipif(not os.access("/dev/full", os.W_OK), reason="needs /dev/full")
def test_dead_disk_never_raises() -> None:
    log = EventLog("/dev/full", role="worker", engine_id="e", flush_interval_s=0.01)
    for i in range(100):
        assert log.emit("log", "x", i=i) is not None
    assert log.close() is True  # everything accounted for, nothing raised
    st = log.stats()
    assert st["written"] == 0 and st["lost_on_write"] == 101 and st["write_errors"] >= 1
    assert "No space" in st["last_error"]


def test_unserializable_field_becomes_stub_not_crash(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"

    class Odd:
        def __repr__(self) -> str:
            return "<Odd>"

    with EventLog(path, role="worker", engine_id="e") as log:
        log.emit("log", "odd", thing=Odd(), big=2**80, ids={3, 1})
        log.emit("log", "fine")
    recs = load_lines(path)
    assert [r["seq"] for r in recs] == [0, 1, 2]
    odd = recs[1]
    assert odd["event"] == "odd" and "render_error" in odd and "<Odd>" in odd["fields_repr"]
    assert log.stats()["render_errors"] == 1
    assert recs[2]["event"] == "fine"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # 3.12+: fork() with threads running
def test_forked_child_has_own_pid_and_seq(tmp_path: Path) -> None:
    path = tmp_path / "fork.jsonl"
    log = EventLog(path, role="worker", engine_id="e", flush_interval_s=0.01)
    log.emit("log", "parent-before")
    assert log.flush(WAIT)
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            ok = log.emit("log", "child") == 1 and log.pid == os.getpid()
            code = 0 if (log.close(WAIT) and ok) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    log.emit("log", "parent-after")
    assert log.close()
    recs = load_lines(path)
    parent = [r for r in recs if r["pid"] == os.getpid()]
    child = [r for r in recs if r["pid"] == pid]
    assert [(r["seq"], r["event"]) for r in parent] == [(0, "log_start"), (1, "parent-before"), (2, "parent-after")]
    assert [(r["seq"], r["event"]) for r in child] == [(0, "log_start"), (1, "child")]
    assert child[0]["parent_pid"] == os.getpid()


# -- lifecycle outcomes ---------------------------------------------------------


def test_record_outcome_from_tracker(tmp_path: Path) -> None:
    path = tmp_path / "outcomes.jsonl"
    clock = VirtualClock(start_ns=1_000)
    log = EventLog(path, role="scheduler", engine_id="dec", clock=clock)
    tracker = LifecycleTracker(RECV, clock, listener=log.record_outcome)
    outcomes = []
    times = []
    for step in (
        lambda: tracker.create("r1"),
        lambda: tracker.apply(Matched(req="r1", num_tokens=5, remote_engine="pre")),
        lambda: tracker.apply(Allocated(req="r1", block_ids=(7, 8), num_external_tokens=5)),
        lambda: tracker.apply(Matched(req="r1", num_tokens=5)),  # illegal here
        lambda: tracker.apply(Matched(req="ghost", num_tokens=1)),  # unknown request
    ):
        clock.advance(250)
        times.append(clock.monotonic_ns())
        outcomes.append(step())
    assert log.close()
    recs = load_lines(path)[1:]
    assert [r["kind"] for r in recs] == ["create", "transition", "transition", "violation", "violation"]
    for rec, outcome, t in zip(recs, outcomes, times):
        expected = orjson.loads(orjson.dumps(schema.outcome_fields(outcome)))
        assert {k: rec[k] for k in expected} == expected
        assert rec["t_mono_ns"] == outcome.t_ns == t
        assert rec["t_wall_ns"] == t + (clock.wall_ns() - clock.monotonic_ns())
        assert list(rec)[: len(HEADER_FIELDS)] == list(HEADER_FIELDS)
        assert (rec["role"], rec["engine_id"]) == ("scheduler", "dec")
    assert recs[0]["dst"] == "new" and recs[0]["blocks"] == []
    assert recs[2]["blocks"] == [7, 8] and "take_blocks" in recs[2]["effects"]
    assert recs[2]["input"] == {"block_ids": [7, 8], "num_external_tokens": 5, "group_sizes": [], "early": False}
    assert recs[3]["src"] == recs[3]["dst"] == "pending_handshake" and recs[3]["violation"] == "illegal_transition"
    assert recs[4]["violation"] == "unknown_request" and recs[4]["req"] == "ghost"


# -- structlog ------------------------------------------------------------------


@pytest.fixture
def restore_structlog() -> Any:
    yield
    structlog.reset_defaults()


def test_structlog_routes_into_event_log(tmp_path: Path, restore_structlog: Any) -> None:
    path = tmp_path / "slog.jsonl"
    with EventLog(path, role="worker", engine_id="e") as log:
        configure_structlog(log, min_level=logging.INFO)
        logger = structlog.get_logger("kvsm")
        assert logger.info("hello", req="r1", x=1) is None  # dropped after forwarding
        logger.debug("filtered out")
        structlog.contextvars.bind_contextvars(peer="p1")
        try:
            logger.warning("clash", seq=99, kind="mine")
        finally:
            structlog.contextvars.clear_contextvars()
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed", req="r2")
    recs = [r for r in load_lines(path) if r["kind"] == "log"]
    assert [r["event"] for r in recs] == ["hello", "clash", "failed"]
    hello, clash, failed = recs
    assert (hello["req"], hello["x"], hello["level"]) == ("r1", 1, "info")
    assert list(hello)[: len(HEADER_FIELDS)] == list(HEADER_FIELDS)
    assert clash["level"] == "warning" and clash["peer"] == "p1"
    assert clash["arg_seq"] == 99 and clash["arg_kind"] == "mine" and clash["seq"] == 2
    assert failed["level"] == "error" and "ValueError: boom" in failed["exception"]


# -- reader ---------------------------------------------------------------------


def _write_good_log(path: Path, n: int) -> None:
    with EventLog(path, role="worker", engine_id="e") as log:
        for i in range(n):
            log.emit("log", "ok", f"r{i}", i=i)


def test_reader_reports_damage_by_file_and_line_and_keeps_going(tmp_path: Path) -> None:
    path = tmp_path / "damaged.jsonl"
    _write_good_log(path, 10)
    lines = path.read_bytes().split(b"\n")[:-1]  # 11 lines
    bad_schema = orjson.loads(lines[6])
    bad_schema["schema"] = 99
    no_header = orjson.loads(lines[7])
    del no_header["t_wall_ns"], no_header["rank"]
    damaged = [
        *lines[:4],
        b"this is not json",  # line 5
        *lines[4:6],
        orjson.dumps(bad_schema),  # line 8
        orjson.dumps(no_header),  # line 9
        b"[1, 2, 3]",  # line 10
        *lines[8:],  # lines 11..13
        lines[10][: len(lines[10]) // 2],  # line 14: truncated, no newline
    ]
    path.write_bytes(b"\n".join(damaged))
    missing = tmp_path / "nope.jsonl"

    res = read_logs([path, missing])
    assert [(p.path, p.line) for p in res.problems] == [
        (str(path), 5), (str(path), 8), (str(path), 9), (str(path), 10), (str(path), 14), (str(missing), 0)]
    reasons = [p.reason for p in res.problems]
    assert "not valid JSON" in reasons[0]
    assert "schema version 99" in reasons[1]
    assert "t_wall_ns" in reasons[2] and "rank" in reasons[2]
    assert "not a JSON object" in reasons[3]
    assert "truncated last line" in reasons[4]
    assert "cannot open" in reasons[5]
    assert str(res.problems[0]) == f"{path}:5: {reasons[0]}"
    # Every good record comes back, tagged with where it was.
    assert [r["seq"] for r in res.records] == [0, 1, 2, 3, 4, 5, 8, 9, 10]
    assert [r["_line"] for r in res.records] == [1, 2, 3, 4, 6, 7, 11, 12, 13]
    assert all(r["_file"] == str(path) for r in res.records)
    for r in res.records:
        assert damaged[r["_line"] - 1] == orjson.dumps({k: v for k, v in r.items() if k not in ("_file", "_line")})


def test_reader_accepts_last_line_without_newline_if_complete(tmp_path: Path) -> None:
    path = tmp_path / "nonl.jsonl"
    _write_good_log(path, 2)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    res = read_logs([path])
    assert not res.problems and [r["_line"] for r in res.records] == [1, 2, 3]


def test_reader_directories_and_unreadable_paths(tmp_path: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    _write_good_log(d / "b.jsonl", 2)
    _write_good_log(d / "a.jsonl", 1)
    (d / "notes.txt").write_text("ignored")
    (d / "sub.jsonl").mkdir()  # a directory named like a log: skipped by the glob
    res = read_logs([d])
    assert not res.problems
    assert [(Path(r["_file"]).name, r["seq"]) for r in res.records] == [
        ("a.jsonl", 0), ("a.jsonl", 1), ("b.jsonl", 0), ("b.jsonl", 1), ("b.jsonl", 2)]

    items = list(iter_log(tmp_path / "missing.jsonl"))
    assert len(items) == 1 and isinstance(items[0], Problem) and items[0].line == 0

    under_a_file = tmp_path / "notes.txt" / "x.jsonl"  # unreadable even for root
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    res = read_logs([under_a_file, d / "a.jsonl"])
    assert [(p.path, p.line) for p in res.problems] == [(str(under_a_file), 0)]
    assert "cannot open" in res.problems[0].reason and len(res.records) == 2

    if os.geteuid() != 0:  # root reads through permission bits
        locked = tmp_path / "locked.jsonl"
        _write_good_log(locked, 1)
        locked.chmod(0)
        locked_dir = tmp_path / "locked-dir"
        locked_dir.mkdir()
        locked_dir.chmod(0)
        try:
            res = read_logs([locked, locked_dir, d / "a.jsonl"])
        finally:
            locked_dir.chmod(0o755)
        assert [(p.path, p.line) for p in res.problems] == [(str(locked), 0), (str(locked_dir), 0)]
        assert len(res.records) == 2


def test_reader_empty_file_and_blank_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    blank = tmp_path / "blank.jsonl"
    _write_good_log(blank, 1)
    blank.write_bytes(blank.read_bytes() + b"\n")
    res = read_logs([empty, blank])
    assert [(Path(p.path).name, p.line, p.reason) for p in res.problems] == [("blank.jsonl", 3, "empty line")]
    assert len(res.records) == 2


def test_eventlog_imports_no_heavy_dependencies() -> None:
    code = ("import sys, kvsm.eventlog; "
            "bad = [m for m in ('vllm', 'nixl', 'zmq', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env, timeout=60)


def test_reader_unlistable_directory_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvsm.eventlog.reader as reader

    d = tmp_path / "logs"
    d.mkdir()
    _write_good_log(d / "a.jsonl", 1)
    good = tmp_path / "good.jsonl"
    _write_good_log(good, 1)

    def denied(path: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(reader.os, "scandir", denied)  # as root, chmod 0 would not stop us
    res = read_logs([d, good])
    assert [(p.path, p.line) for p in res.problems] == [(str(d), 0)]
    assert "cannot list directory: Permission denied" in res.problems[0].reason
    assert [Path(r["_file"]).name for r in res.records] == ["good.jsonl", "good.jsonl"]


def test_user_processors_run_on_writer_and_can_drop(tmp_path: Path) -> None:
    path = tmp_path / "procs.jsonl"
    seen_threads: set[str] = set()

    def redact(logger: Any, name: str, ed: dict[str, Any]) -> dict[str, Any]:
        seen_threads.add(threading.current_thread().name)
        if ed.get("event") == "secret":
            raise structlog.DropEvent
        ed.pop("password", None)
        return ed

    with EventLog(path, role="worker", engine_id="e", processors=[redact]) as log:
        log.emit("log", "login", password="hunter2", user="u")
        log.emit("log", "secret", password="x")
    recs = load_lines(path)
    assert [r["seq"] for r in recs] == [0, 1, 2]  # a dropped line still leaves its seq visible
    assert "password" not in recs[1] and recs[1]["user"] == "u"
    assert recs[2]["dropped_by_processor"] is True and "password" not in recs[2]
    assert seen_threads == {WRITER_THREAD_NAME}


def test_torn_write_leaves_one_bad_line_and_later_lines_intact(tmp_path: Path) -> None:
    from kvsm.eventlog.log import TornWrite

    path = tmp_path / "torn.jsonl"

    class TearOnce(EventLog):
        tear = False

        def _write_bytes(self, fd: int, data: bytes) -> None:
            if self.tear:
                self.tear = False
                os.write(fd, data[: len(data) // 2])  # half a batch reaches the disk
                raise TornWrite(errno.ENOSPC, "disk full mid-write (injected)")
            super()._write_bytes(fd, data)

    log = TearOnce(path, role="worker", engine_id="e", flush_interval_s=0.01)
    assert log.flush(WAIT)
    log.tear = True
    log.emit("log", "torn", pad="y" * 100)
    assert log.flush(WAIT)
    log.emit("log", "after")
    assert log.close()
    assert log.stats()["lost_on_write"] == 1 and log.stats()["write_errors"] == 1
    res = read_logs([path])
    assert [(p.line, p.reason[:14]) for p in res.problems] == [(2, "not valid JSON")]
    assert [(r["seq"], r["event"], r["_line"]) for r in res.records] == [(0, "log_start", 1), (2, "after", 3)]


def test_unclosed_log_is_flushed_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "atexit.jsonl"
    code = ("from kvsm.eventlog import EventLog; "
            f"log = EventLog({str(path)!r}, role='worker', engine_id='e', flush_interval_s=30); "
            "[log.emit('log', 'bye', i=i) for i in range(3)]")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env, timeout=60)
    assert [r["seq"] for r in load_lines(path)] == [0, 1, 2, 3]


def test_a_stop_hook_writes_before_the_logs_close_at_exit_whatever_atexits_order(tmp_path: Path) -> None:
    """The clean-stop record a shutdown writes at exit is not lost, whether
    another exit handler (vLLM's finalizers) runs before or after kvsm's."""
    path = tmp_path / "stop.jsonl"
    code = ("import atexit, weakref\n"
            "from kvsm.eventlog import EventLog\n"
            "from kvsm.eventlog.exit import on_exit\n"
            f"log = EventLog({str(path)!r}, role='worker', engine_id='e', flush_interval_s=30)\n"
            # registered after kvsm's handler, so it runs first: the log is still open
            "atexit.register(lambda: log.emit('log', 'other.first'))\n"
            "on_exit(lambda: log.emit('log', 'worker.shutdown', clean=True))\n"
            "cancelled = on_exit(lambda: log.emit('log', 'never'))\n"
            "cancelled()\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env, timeout=60)
    assert [r["event"] for r in load_lines(path)] == ["log_start", "other.first", "worker.shutdown"]


def test_a_stop_hook_that_hangs_does_not_hang_the_exit(tmp_path: Path) -> None:
    path = tmp_path / "hang.jsonl"
    code = ("import time\n"
            "from kvsm.eventlog import EventLog, exit as log_exit\n"
            "log_exit.STOP_TIMEOUT_S = 0.5\n"
            f"log = EventLog({str(path)!r}, role='worker', engine_id='e', flush_interval_s=30)\n"
            "log_exit.on_exit(lambda: time.sleep(60))\n"
            "log.emit('log', 'before')\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env, timeout=60)
    assert time.monotonic() - t0 < 30
    assert [r["event"] for r in load_lines(path)] == ["log_start", "before"]
