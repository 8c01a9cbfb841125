"""The event loop: one thread that runs everything posted to it, its timers and
its socket readers, never dies of a callback's exception and sleeps when idle.

Real ZMQ (inproc wake-ups, a tcp PULL on loopback). Every loop a test makes is
stopped in the fixture, and the test fails if a loop thread outlives it.

Timer logic (order, cancellation, which clock, errors) runs on virtual time
(``mode="autojump"``: the clock jumps to the next timer once the loop is idle),
so it asserts exact virtual times and waits for no real ones. Wall-clock
assertions are kept where real time is what is tested: how fast a post or a
stop wakes the loop, ``call``'s and ``stop``'s real-second timeouts, a real
timer's lateness, fairness under a flood, idle CPU. The driven mode (no
thread; several loops on one clock run from one thread) is at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvsm.lifecycle.clock import VirtualClock
from kvsm.runtime.group import DrivenLoops
from kvsm.runtime.loop import (
    MAX_BATCH,
    MAX_BLOCK_MS,
    EventLoop,
    LoopError,
    LoopFull,
    LoopStopped,
    TimerHandle,
    WrongThread,
)

MS = 1_000_000  # ns
S = 1_000_000_000
WAIT_S = 2.0  # upper bound on any (real) wait for the loop to get something done

MakeLoop = Callable[..., EventLoop]


@pytest.fixture
def make_loop() -> Iterator[MakeLoop]:
    """Started loops that are always stopped, and checked to have stopped."""
    loops: list[EventLoop] = []

    def make(name: str = "t", **kwargs: object) -> EventLoop:
        loop = EventLoop(name, **kwargs)  # type: ignore[arg-type]
        loops.append(loop)
        return loop.start()

    yield make
    stopped = [loop.stop(timeout=WAIT_S) for loop in loops]
    assert all(stopped), "a loop thread did not stop"
    leaked = [loop.thread for loop in loops if loop.thread is not None and loop.thread.is_alive()]
    assert not leaked


@pytest.fixture
def make_virtual_loop(make_loop: MakeLoop) -> MakeLoop:
    """Started loops on a fresh VirtualClock that jumps to the next timer when idle."""

    def make(name: str = "v", **kwargs: object) -> EventLoop:
        kwargs.setdefault("clock", VirtualClock(start_ns=7 * S))
        return make_loop(name, mode="autojump", **kwargs)

    return make


@pytest.fixture
def make_driven(make_loop: MakeLoop) -> MakeLoop:
    """Driven loops (no thread; this thread runs them) on a fresh VirtualClock, always stopped."""

    def make(name: str = "d", **kwargs: object) -> EventLoop:
        kwargs.setdefault("clock", VirtualClock())
        return make_loop(name, mode="driven", **kwargs)

    return make


class ErrorSink:
    """An ``on_error`` that remembers what it got and lets a test wait for it."""

    def __init__(self) -> None:
        self.errors: list[LoopError] = []
        self._cond = threading.Condition()

    def __call__(self, error: LoopError) -> None:
        with self._cond:
            self.errors.append(error)
            self._cond.notify_all()

    def wait(self, n: int = 1) -> list[LoopError]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.errors) >= n, WAIT_S), self.errors
            return list(self.errors)


def barrier(loop: EventLoop) -> None:
    """Return once everything posted before it (from any thread) has run."""
    loop.call(lambda: None, timeout=WAIT_S)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU time one (other) thread has used, from its POSIX thread CPU clock."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def blocker(loop: EventLoop, first: Callable[[], object] | None = None) -> threading.Event:
    """Keep the loop busy in one callable until the returned event is set
    (``first``, if given, runs inside that callable before it blocks)."""
    started, release = threading.Event(), threading.Event()

    def block() -> None:
        if first is not None:
            first()
        started.set()
        release.wait(WAIT_S)

    assert loop.post(block, label="blocker")
    assert started.wait(WAIT_S)
    return release


# ------------------------------------------------------------------- life cycle


def test_thread_is_named_daemon_and_stop_is_idempotent() -> None:
    loop = EventLoop("named").start()
    try:
        assert loop.thread is not None
        assert loop.thread.name == "kvsm-loop-named"
        assert loop.thread.daemon
        assert not loop.in_loop_thread()
        assert loop.call(loop.in_loop_thread, timeout=WAIT_S)
    finally:
        t0 = time.monotonic()
        assert loop.stop(timeout=WAIT_S)
        # An idle loop blocks up to MAX_BLOCK_MS in its poll: stop must wake it, not
        # find it at its next poll timeout.
        assert time.monotonic() - t0 < MAX_BLOCK_MS / 1000 / 2, "an idle loop must wake up to stop, not time out"
    assert not loop.thread.is_alive()
    assert loop.stop()  # idempotent
    with pytest.raises(LoopStopped):
        loop.start()


def test_context_manager_stops_and_closes_owned_sockets() -> None:
    with EventLoop("ctx") as loop:
        sock = loop.call(lambda: loop.socket(zmq.PULL), timeout=WAIT_S)
        thread = loop.thread
    assert thread is not None and not thread.is_alive()
    assert sock.closed


def test_stop_before_start() -> None:
    loop = EventLoop("never")
    assert loop.stop()
    assert not loop.post(lambda: None)


def test_post_after_stop_is_refused_and_counted(make_loop: MakeLoop) -> None:
    loop = make_loop()
    assert loop.stop(timeout=WAIT_S)
    assert loop.post(lambda: None) is False
    assert loop.post(lambda: None) is False
    assert loop.stats()["dropped_posts"] == 2
    with pytest.raises(LoopStopped):
        loop.call(lambda: 1, timeout=WAIT_S)


def test_stop_waits_for_the_running_callable_then_runs_nothing_new(make_loop: MakeLoop) -> None:
    loop = make_loop()
    ran: list[str] = []
    outcome: list[BaseException] = []
    release_first = blocker(loop)
    # Queued behind the first blocker, so the loop takes all three in one batch.
    second_started, release_second = threading.Event(), threading.Event()
    loop.post(lambda: (second_started.set(), release_second.wait(WAIT_S)), label="second blocker")
    loop.post(lambda: ran.append("same batch"))

    def caller() -> None:
        try:
            loop.call(lambda: ran.append("call"), timeout=WAIT_S)
        except (LoopStopped, TimeoutError) as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=caller)
    waiter.start()
    wait_until(lambda: loop.stats()["pending"] == 3, "the call to be queued")
    release_first.set()
    assert second_started.wait(WAIT_S)
    t0 = time.monotonic()
    assert loop.stop(timeout=0.1) is False, "stop must time out while a callable runs"
    assert 0.09 <= time.monotonic() - t0 < 0.5
    assert loop.post(lambda: ran.append("after stop")) is False
    release_second.set()
    assert loop.stop(timeout=WAIT_S)
    waiter.join(WAIT_S)
    assert ran == [], "nothing may start once stop was asked for"
    assert len(outcome) == 1 and isinstance(outcome[0], LoopStopped), outcome
    assert loop.stats()["discarded"] == 2


def test_max_pending_bounds_the_queue(make_loop: MakeLoop) -> None:
    loop = make_loop(max_pending=10)
    ran: list[int] = []
    release = blocker(loop)
    accepted = [loop.post(lambda i=i: ran.append(i)) for i in range(10)]
    assert all(accepted)
    assert loop.post(lambda: ran.append(99)) is False
    with pytest.raises(LoopFull):
        loop.call(lambda: None, timeout=WAIT_S)
    stats = loop.stats()
    assert stats["dropped_posts"] == 2 and stats["pending"] == 10
    release.set()
    wait_until(lambda: loop.stats()["pending"] == 0, "the queue to drain")
    barrier(loop)
    assert ran == list(range(10))


# ------------------------------------------------------------------------ post


def test_post_from_8_threads_runs_each_exactly_once_in_per_thread_order(
    make_loop: MakeLoop,
) -> None:
    loop = make_loop()
    n_threads, per_thread = 8, 1250
    seen: list[tuple[int, int, int]] = []  # appended on the loop thread only
    refused: list[tuple[int, int]] = []
    go = threading.Barrier(n_threads)

    def poster(t: int) -> None:
        go.wait()
        for i in range(per_thread):
            if not loop.post(lambda t=t, i=i: seen.append((t, i, threading.get_ident()))):
                refused.append((t, i))

    threads = [threading.Thread(target=poster, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S)
    barrier(loop)

    assert refused == []
    assert len(seen) == n_threads * per_thread
    assert {(t, i) for t, i, _ in seen} == {(t, i) for t in range(n_threads) for i in range(per_thread)}
    for t in range(n_threads):
        assert [i for tt, i, _ in seen if tt == t] == list(range(per_thread)), f"thread {t} out of order"
    assert loop.thread is not None
    assert {ident for _, _, ident in seen} == {loop.thread.ident}
    stats = loop.stats()
    assert stats["run"] == stats["posted"] == n_threads * per_thread + 1  # + the barrier
    assert stats["pending"] == 0 and stats["errors"] == 0
    assert stats["wakeups"] <= stats["posted"]


def test_posts_from_other_threads_wake_the_loop_at_once(make_loop: MakeLoop) -> None:
    """A lost wake-up would only show as a stall of up to MAX_BLOCK_MS (1 s)."""
    loop = make_loop()
    for i in range(300):
        # Generous for a noisy 2-core machine, but half of what a lost wake-up costs.
        assert loop.call(lambda i=i: i, timeout=0.5, label=f"ping {i}") == i


def test_a_burst_of_posts_costs_one_wakeup(make_loop: MakeLoop) -> None:
    loop = make_loop()
    release = blocker(loop)
    before = loop.stats()["wakeups"]
    for _ in range(500):
        assert loop.post(lambda: None)
    assert loop.stats()["wakeups"] - before == 1
    release.set()
    barrier(loop)


def test_a_flood_of_posts_does_not_starve_timers_or_readers(make_loop: MakeLoop) -> None:
    loop = make_loop(max_pending=4 * MAX_BATCH)
    fired, got_message = threading.Event(), threading.Event()
    flooding = True

    def breed() -> None:  # each run posts two more: the queue never drains
        if flooding:
            loop.post(breed)
            loop.post(breed)

    def setup() -> str:
        loop.call_later(20 * MS, fired.set, label="timer")
        pull = loop.socket(zmq.PULL)
        loop.add_reader(pull, lambda: (pull.recv(zmq.NOBLOCK), got_message.set()), label="pull")
        pull.bind("tcp://127.0.0.1:*")
        loop.post(breed)
        return pull.getsockopt_string(zmq.LAST_ENDPOINT)

    endpoint = loop.call(setup, timeout=WAIT_S)
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(endpoint)
        push.send(b"x")
        assert fired.wait(WAIT_S), "a flood of posts starved the timer"
        assert got_message.wait(WAIT_S), "a flood of posts starved the reader"
        # The flood hits max_pending rather than growing (on a slow machine the
        # timer and the reader may get their turn before it gets there).
        wait_until(lambda: loop.stats()["dropped_posts"] > 0, "the flood to reach max_pending")
        assert loop.stats()["pending"] <= 4 * MAX_BATCH
    finally:
        push.close(linger=0)
        flooding = False


# ------------------------------------------------------------------------ call


def test_call_returns_the_value_on_the_loop_thread(make_loop: MakeLoop) -> None:
    loop = make_loop()
    assert loop.call(lambda: 41 + 1, timeout=WAIT_S) == 42
    ident = loop.call(threading.get_ident, timeout=WAIT_S)
    assert loop.thread is not None and ident == loop.thread.ident != threading.get_ident()


def test_call_reraises_in_the_caller_and_is_not_an_error(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)

    def boom() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        loop.call(boom, timeout=WAIT_S)
    assert loop.call(lambda: "still alive", timeout=WAIT_S) == "still alive"
    assert sink.errors == [] and loop.stats()["errors"] == 0


def test_call_times_out_naming_the_label(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)
    finished = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="slow-handshake"):
        # The sleep is the slow callable (0.3 s) that the 0.05 s timeout must not wait for.
        loop.call(lambda: (time.sleep(0.3), finished.set()), timeout=0.05, label="slow-handshake")
    assert not finished.is_set(), "call waited for the callable instead of timing out"
    assert time.monotonic() - t0 < 0.25
    assert loop.call(lambda: "after", timeout=WAIT_S) == "after"  # waits out the sleep
    assert finished.is_set()


def test_timed_out_call_that_had_not_started_never_runs(make_loop: MakeLoop) -> None:
    loop = make_loop()
    ran: list[str] = []
    release = blocker(loop)
    with pytest.raises(TimeoutError):
        loop.call(lambda: ran.append("late"), timeout=0.05, label="late")
    release.set()
    barrier(loop)
    assert ran == []


def test_exception_of_an_abandoned_call_goes_to_on_error(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)

    def slow_then_fail() -> None:
        time.sleep(0.15)
        raise KeyError("nobody waits for me")

    with pytest.raises(TimeoutError):
        loop.call(slow_then_fail, timeout=0.03, req="r-7", label="abandoned")
    [error] = sink.wait()
    assert (error.req, error.label, error.where) == ("r-7", "abandoned", "call")
    assert isinstance(error.exc, KeyError)


def test_call_from_the_loop_thread_runs_inline(make_loop: MakeLoop) -> None:
    loop = make_loop()

    def outer() -> tuple[int, bool]:
        # Would deadlock if call() posted and waited from the loop thread.
        return loop.call(lambda: 7, timeout=0.1), loop.in_loop_thread()

    assert loop.call(outer, timeout=WAIT_S) == (7, True)


# ---------------------------------------------------------------------- timers


def test_timers_fire_in_deadline_order(make_virtual_loop: MakeLoop) -> None:
    loop = make_virtual_loop()
    fired: list[tuple[str, int]] = []
    done = threading.Event()
    plan = [("c", 30), ("a", 10), ("b", 20), ("now", 0), ("a2", 10)]

    def setup() -> int:
        for label, delay_s in plan:
            loop.call_later(delay_s * S, lambda label=label: fired.append((label, loop.now_ns())), label=label)
        loop.call_later(40 * S, done.set)
        return loop.now_ns()

    t0 = loop.call(setup, timeout=WAIT_S)
    assert done.wait(WAIT_S)
    assert fired == [("now", t0), ("a", t0 + 10 * S), ("a2", t0 + 10 * S), ("b", t0 + 20 * S), ("c", t0 + 30 * S)]
    assert loop.stats()["timers_fired"] == 6


def test_call_at_uses_the_loop_clock(make_virtual_loop: MakeLoop) -> None:
    clock = VirtualClock(start_ns=10**15)  # nowhere near the system's monotonic clock
    loop = make_virtual_loop(clock=clock)
    at: list[int] = []
    done = threading.Event()

    def fire() -> None:
        at.append(clock.monotonic_ns())
        done.set()

    def setup() -> int:
        deadline = loop.now_ns() + 5 * MS
        loop.call_at(deadline, fire)
        return deadline

    deadline = loop.call(setup, timeout=WAIT_S)
    assert deadline == 10**15 + 5 * MS
    assert done.wait(WAIT_S)
    assert at == [deadline]


def test_a_timer_fires_at_its_deadline_never_earlier(make_virtual_loop: MakeLoop) -> None:
    """On virtual time, exactly at the deadline, however far; the clock jumps
    only once the loop has nothing else to do."""
    loop = make_virtual_loop()
    times: dict[str, int] = {}
    done = threading.Event()

    def fire() -> None:
        times["fired"] = loop.now_ns()
        done.set()

    def setup() -> None:
        times["scheduled"] = loop.now_ns()
        loop.call_later(3600 * S, fire)  # an hour

    t0 = time.monotonic()
    loop.call(setup, timeout=WAIT_S)
    assert done.wait(WAIT_S)
    assert times["fired"] - times["scheduled"] == 3600 * S
    assert time.monotonic() - t0 < WAIT_S


def test_a_50ms_timer_fires_after_50ms_not_much_later(make_loop: MakeLoop) -> None:
    """Real time (the poller's wait, rounded up to whole ms, is what is tested)."""
    loop = make_loop()
    times: dict[str, int] = {}
    done = threading.Event()

    def fire() -> None:
        times["fired"] = time.monotonic_ns()
        done.set()

    def setup() -> None:
        times["scheduled"] = time.monotonic_ns()
        loop.call_later(50 * MS, fire)

    loop.call(setup, timeout=WAIT_S)
    assert done.wait(WAIT_S)
    elapsed_ms = (times["fired"] - times["scheduled"]) / MS
    assert 50 <= elapsed_ms < 150, elapsed_ms


def test_cancel(make_virtual_loop: MakeLoop) -> None:
    loop = make_virtual_loop()
    fired: list[str] = []
    done = threading.Event()
    handles: dict[str, TimerHandle] = {}

    def setup() -> tuple[bool, bool]:
        handles["kept"] = loop.call_later(10 * S, lambda: fired.append("kept"))
        handles["gone"] = loop.call_later(10 * S, lambda: fired.append("gone"))
        # Due in the same batch: the first cancels the second before it runs.
        loop.call_later(5 * S, lambda: fired.append(f"cancel-same-batch={loop.cancel(handles['late'])}"))
        handles["late"] = loop.call_later(5 * S, lambda: fired.append("late"))
        loop.call_later(30 * S, done.set)
        return loop.cancel(handles["gone"]), loop.cancel(handles["gone"])

    assert loop.call(setup, timeout=WAIT_S) == (True, False)
    assert done.wait(WAIT_S)
    assert fired == ["cancel-same-batch=True", "kept"]
    assert loop.call(lambda: loop.cancel(handles["kept"]), timeout=WAIT_S) is False  # already ran
    assert loop.call(lambda: loop.cancel(None), timeout=WAIT_S) is False


def test_timer_scheduled_from_another_thread_through_post(make_virtual_loop: MakeLoop) -> None:
    loop = make_virtual_loop()
    fired = threading.Event()
    on_thread: list[int] = []

    def fire() -> None:
        on_thread.append(threading.get_ident())
        fired.set()

    scheduler = threading.Thread(target=lambda: loop.post(lambda: loop.call_later(10 * S, fire)))
    scheduler.start()
    scheduler.join(WAIT_S)
    assert fired.wait(WAIT_S)
    assert loop.thread is not None and on_thread == [loop.thread.ident]


def test_loop_only_api_refuses_other_threads(make_loop: MakeLoop) -> None:
    loop = make_loop()
    with pytest.raises(WrongThread, match="call_later"):
        loop.call_later(MS, lambda: None)
    with pytest.raises(WrongThread):
        loop.call_at(0, lambda: None)
    with pytest.raises(WrongThread):
        loop.cancel(None)
    with pytest.raises(WrongThread):
        loop.add_reader(zmq.Context.instance().socket(zmq.PULL), lambda: None)
    with pytest.raises(WrongThread):
        loop.socket(zmq.PULL)
    with pytest.raises(TypeError):
        loop.post("not callable")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- errors


def test_posted_callable_that_raises_is_reported_and_the_loop_goes_on(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)

    def boom() -> None:
        raise RuntimeError("kaput")

    assert loop.post(boom, req="req-1", label="read-blocks")
    [error] = sink.wait()
    assert (error.req, error.label, error.where) == ("req-1", "read-blocks", "post")
    assert isinstance(error.exc, RuntimeError) and "kaput" in str(error)
    ran = threading.Event()
    assert loop.post(ran.set)
    assert ran.wait(WAIT_S)
    assert loop.stats()["errors"] == 1


def test_unlabelled_callable_is_named_after_its_function(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)

    def handshake_with_peer() -> None:
        raise OSError("peer gone")

    loop.post(handshake_with_peer, req="r")
    [error] = sink.wait()
    assert "handshake_with_peer" in error.label


def test_system_exit_in_a_callable_does_not_end_the_loop(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)

    def leave() -> None:
        raise SystemExit(3)

    loop.post(leave, req="r-exit")
    [error] = sink.wait()
    assert isinstance(error.exc, SystemExit)
    assert loop.call(lambda: "alive", timeout=WAIT_S) == "alive"


def test_timer_that_raises_is_reported_with_its_request(make_virtual_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_virtual_loop(on_error=sink)

    def expire() -> None:
        raise TimeoutError("lease")

    loop.call(lambda: loop.call_later(30 * S, expire, req="req-9", label="lease-timer"), timeout=WAIT_S)
    [error] = sink.wait()
    assert (error.req, error.label, error.where) == ("req-9", "lease-timer", "timer")
    fired = threading.Event()
    loop.call(lambda: loop.call_later(S, fired.set), timeout=WAIT_S)
    assert fired.wait(WAIT_S)


def test_on_error_that_raises_does_not_kill_the_loop(make_loop: MakeLoop) -> None:
    calls: list[LoopError] = []

    def bad_handler(error: LoopError) -> None:
        calls.append(error)
        raise ZeroDivisionError("handler bug")

    loop = make_loop(on_error=bad_handler)
    loop.post(lambda: 1 / 0, req="r1", label="first")
    loop.post(lambda: {}.pop("missing"), req="r2", label="second")
    assert loop.call(lambda: "alive", timeout=WAIT_S) == "alive"
    assert [c.req for c in calls] == ["r1", "r2"]
    stats = loop.stats()
    assert stats["errors"] == 2 and stats["on_error_failures"] == 2


def test_without_on_error_errors_are_logged(make_loop: MakeLoop, caplog: pytest.LogCaptureFixture) -> None:
    loop = make_loop()
    with caplog.at_level("ERROR", logger="kvsm.runtime.loop"):
        loop.post(lambda: 1 / 0, req="r-log", label="logged")
        barrier(loop)
    assert any("logged" in r.getMessage() and "r-log" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------- readers


def test_reader_receives_tcp_messages_on_the_loop_thread(make_loop: MakeLoop) -> None:
    loop = make_loop()
    received: list[tuple[bytes, int]] = []
    got_all = threading.Event()
    holder: dict[str, zmq.Socket] = {}

    def on_readable() -> None:
        pull = holder["pull"]
        while True:
            try:
                msg = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            received.append((msg, threading.get_ident()))
            if len(received) == 3:
                got_all.set()

    def setup() -> str:
        pull = loop.socket(zmq.PULL)
        holder["pull"] = pull
        pull.bind("tcp://127.0.0.1:*")
        loop.add_reader(pull, on_readable, label="pull")
        return pull.getsockopt_string(zmq.LAST_ENDPOINT)

    endpoint = loop.call(setup, timeout=WAIT_S)
    assert endpoint.startswith("tcp://127.0.0.1:")
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(endpoint)
        for msg in (b"one", b"two", b"three"):
            push.send(msg)
        assert got_all.wait(WAIT_S)
    finally:
        push.close(linger=0)
    assert [m for m, _ in received] == [b"one", b"two", b"three"]
    assert loop.thread is not None and {t for _, t in received} == {loop.thread.ident}
    assert loop.stats()["readers"] == 1
    assert loop.stop(timeout=WAIT_S)
    assert holder["pull"].closed, "stop must close the sockets the loop owns"


def test_remove_reader_stops_callbacks(make_loop: MakeLoop) -> None:
    loop = make_loop()
    ctx = zmq.Context.instance()
    calls: list[int] = []
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")

    def on_readable() -> None:
        calls.append(len(pull.recv_multipart(zmq.NOBLOCK)))

    # Registering hands the socket to the loop; the test no longer touches it.
    loop.call(lambda: loop.add_reader(pull, on_readable, label="pull"), timeout=WAIT_S)
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"a")
        wait_until(lambda: bool(calls), "the reader")
        assert calls == [1]
        assert loop.call(lambda: loop.remove_reader(pull), timeout=WAIT_S) is True
        assert loop.call(lambda: loop.remove_reader(pull), timeout=WAIT_S) is False
        push.send(b"b")
        # No longer registered, so ours again: wait until the message is there, then let
        # the loop run two full iterations (one to see it, one to have dispatched it).
        assert pull.poll(int(WAIT_S * 1000)) == zmq.POLLIN
        barrier(loop)
        barrier(loop)
        assert calls == [1]
        assert pull.recv(zmq.NOBLOCK) == b"b"  # still there for us
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def test_reader_that_raises_is_reported_and_called_again(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)
    got: list[bytes] = []
    done = threading.Event()
    holder: dict[str, zmq.Socket] = {}

    def on_readable() -> None:
        msg = holder["pull"].recv(zmq.NOBLOCK)
        if msg == b"poison":
            raise ValueError("malformed message")  # upstream's listener died of this
        got.append(msg)
        done.set()

    def setup() -> int:
        holder["pull"] = pull = loop.socket(zmq.PULL)
        loop.add_reader(pull, on_readable, label="side-channel")
        return pull.bind_to_random_port("tcp://127.0.0.1")

    port = loop.call(setup, timeout=WAIT_S)
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"poison")
        push.send(b"good")
        [error] = sink.wait()
        assert (error.req, error.label, error.where) == (None, "side-channel", "reader")
        assert done.wait(WAIT_S)
        assert got == [b"good"]
    finally:
        push.close(linger=0)


def test_socket_closed_behind_the_loops_back_is_dropped_not_polled(make_loop: MakeLoop) -> None:
    sink = ErrorSink()
    loop = make_loop(on_error=sink)

    def setup() -> None:
        pull = loop.socket(zmq.PULL)
        loop.add_reader(pull, lambda: None, label="doomed")
        pull.close()  # wrong: should be loop.close_socket(pull)

    loop.call(setup, timeout=WAIT_S)
    [error] = sink.wait()
    assert (error.label, error.where) == ("doomed", "reader")
    assert loop.call(lambda: "alive", timeout=WAIT_S) == "alive"
    assert loop.stats()["readers"] == 0


# -------------------------------------------------------------------- idleness


def _idle_cost(loop: EventLoop, seconds: float = 1.0) -> tuple[float, int]:
    """CPU seconds and iterations the loop thread spends over ``seconds`` of idleness."""
    assert loop.thread is not None
    barrier(loop)  # the loop is idle from here on (the rest of this iteration is counted, a few µs)
    cpu0, it0 = thread_cpu_s(loop.thread), loop.stats()["iterations"]
    time.sleep(seconds)  # the idleness that is measured
    return thread_cpu_s(loop.thread) - cpu0, loop.stats()["iterations"] - it0


def test_idle_loop_burns_no_cpu(make_loop: MakeLoop) -> None:
    loop = make_loop()
    cpu_s, iterations = _idle_cost(loop)
    assert cpu_s < 0.020, f"idle loop used {cpu_s * 1000:.1f} ms CPU in 1 s"
    assert iterations <= 3, f"idle loop woke {iterations} times in 1 s (busy polling?)"


def test_idle_loop_with_a_far_timer_burns_no_cpu(make_loop: MakeLoop) -> None:
    loop = make_loop()
    loop.call(lambda: loop.call_later(60_000 * MS, lambda: None), timeout=WAIT_S)
    cpu_s, iterations = _idle_cost(loop)
    assert cpu_s < 0.020, f"loop with a far timer used {cpu_s * 1000:.1f} ms CPU in 1 s"
    assert iterations <= 3, f"loop with a far timer woke {iterations} times in 1 s"
    assert loop.stats()["timers_pending"] == 1


# ----------------------------------------------------------------- virtual time


def test_virtual_modes_need_a_clock_they_can_move() -> None:
    with pytest.raises(ValueError, match="VirtualClock"):
        EventLoop("bad", mode="autojump")
    with pytest.raises(ValueError, match="mode must be one of"):
        EventLoop("bad", mode="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be mode 'driven'"):
        EventLoop("bad", clock=VirtualClock(), mode="autojump", group=DrivenLoops(VirtualClock()))


def test_autojump_waits_while_the_loop_is_busy(make_virtual_loop: MakeLoop) -> None:
    """A callable that runs (in real time) holds virtual time still: the jump
    comes only once nothing is posted, readable or due. The timer is armed
    inside the busy callable, so no idle moment comes before the check."""
    loop = make_virtual_loop()
    fired = threading.Event()
    t0: list[int] = []
    release = blocker(loop, first=lambda: (t0.append(loop.now_ns()), loop.call_later(60 * S, fired.set)))
    time.sleep(0.05)  # fifty thresholds of real time
    assert loop.now_ns() == t0[0] and not fired.is_set()
    release.set()
    assert fired.wait(WAIT_S)
    assert loop.now_ns() == t0[0] + 60 * S


def test_autojump_loop_takes_posts_and_calls_from_other_threads(make_virtual_loop: MakeLoop) -> None:
    loop = make_virtual_loop()
    for i in range(50):
        assert loop.call(lambda i=i: i, timeout=WAIT_S) == i
    ran = threading.Event()
    assert loop.post(ran.set)
    assert ran.wait(WAIT_S)


def test_driven_loop_has_no_thread_and_runs_inline_for_its_driver(make_driven: Callable[..., EventLoop]) -> None:
    loop = make_driven()
    assert loop.thread is None and loop.in_loop_thread()
    assert loop.call(lambda: 42, timeout=WAIT_S) == 42  # inline: nothing to wait for
    sock = loop.socket(zmq.PULL)  # loop-thread-only methods work from the driver
    ran: list[str] = []
    assert loop.post(lambda: ran.append("posted"))
    assert ran == [] and loop.run_once() == 1 and ran == ["posted"]
    assert loop.run_once() == 0  # idle: returns at once
    assert loop.stop() and sock.closed


def test_driven_loop_runs_timers_only_when_the_driver_moves_the_clock(make_driven: Callable[..., EventLoop]) -> None:
    clock = VirtualClock()
    loop = make_driven(clock=clock)
    fired: list[int] = []
    loop.call_later(5 * S, lambda: fired.append(clock.monotonic_ns()))
    assert loop.run_until_idle() == 0 and fired == []
    assert loop.next_deadline_ns() == 5 * S
    clock.jump_to(5 * S)
    assert loop.run_until_idle() == 1 and fired == [5 * S]
    assert loop.next_deadline_ns() is None


def test_driven_loop_takes_posts_from_other_threads_at_its_next_turn(make_driven: Callable[..., EventLoop]) -> None:
    loop = make_driven()
    ran: list[int] = []
    poster = threading.Thread(target=lambda: [loop.post(lambda i=i: ran.append(i)) for i in range(100)])
    poster.start()
    poster.join(WAIT_S)
    assert ran == []
    assert loop.run_until_idle() == 100 and ran == list(range(100))
    assert loop.stats()["wakeups"] >= 1


def test_driven_loop_refuses_to_spin_forever(make_driven: Callable[..., EventLoop]) -> None:
    loop = make_driven()

    def again() -> None:
        loop.post(again)

    loop.post(again)
    with pytest.raises(RuntimeError, match="still busy"):
        loop.run_until_idle(max_iterations=50)


def test_two_driven_loops_on_one_clock_run_a_deterministic_exchange() -> None:
    """Ping-pong over inproc PAIR sockets with timers in between: the group runs
    both loops from this thread; a message sent is readable at once, so one
    ``run_until_idle`` settles a whole exchange; the clock moves only between."""

    def run() -> list[tuple[int, str]]:
        clock = VirtualClock()
        group = DrivenLoops(clock, zmq.Context())
        a = EventLoop("a", clock=clock, **group.loop_options()).start()
        b = EventLoop("b", clock=clock, **group.loop_options()).start()
        trace: list[tuple[int, str]] = []
        sa, sb = a.socket(zmq.PAIR), b.socket(zmq.PAIR)
        sa.bind("inproc://ping")
        sb.connect("inproc://ping")

        def on(loop: EventLoop, sock: zmq.Socket, name: str) -> Callable[[], None]:
            def readable() -> None:
                while True:
                    try:
                        n = int(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        return
                    trace.append((clock.monotonic_ns(), f"{name} got {n}"))
                    if n < 6:
                        # Answer at once when even, after (n + 1) seconds when odd.
                        if n % 2 == 0:
                            sock.send(str(n + 1).encode())
                        else:
                            loop.call_later((n + 1) * S, lambda n=n: sock.send(str(n + 1).encode()))
            return readable

        a.add_reader(sa, on(a, sa, "a"))
        b.add_reader(sb, on(b, sb, "b"))
        sa.send(b"0")
        rounds = 0
        while True:
            group.run_until_idle()
            deadline = group.next_deadline_ns()
            if deadline is None:
                break
            clock.jump_to(deadline)
            rounds += 1
        assert rounds == 3
        group.close()
        assert sa.closed and sb.closed
        return trace

    trace = run()
    assert trace == [(0, "b got 0"), (0, "a got 1"), (2 * S, "b got 2"), (2 * S, "a got 3"),
                     (6 * S, "b got 4"), (6 * S, "a got 5"), (12 * S, "b got 6")]
    assert run() == trace


_STOP_CHILD = """
import signal, sys, time
from kvsm.runtime.stop import stop_on_exit
if sys.argv[2] == "own-handler":  # as vLLM's processes do before making a connector
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
stop_on_exit(lambda: open(sys.argv[1], "a").write("stopped\\n"))
stop_on_exit(lambda: open(sys.argv[1], "a").write("stopped-later\\n"))()  # cancelled: never runs
print("ready", flush=True)
if sys.argv[2] != "end":
    time.sleep(60)
"""


@pytest.mark.parametrize("how, rc", [("end", 0), ("sigterm", 143), ("own-handler", 7)])
def test_the_stop_runs_at_the_end_and_on_sigterm(tmp_path: Path, how: str, rc: int) -> None:
    """kvsm.runtime.stop: a script's end runs the stop; SIGTERM under the default
    disposition exits through it (143); a SIGTERM handler of the process's own
    (vLLM's) is left alone."""
    out = tmp_path / "stopped.txt"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-c", _STOP_CHILD, str(out), how], cwd=root, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        if how != "end":
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == rc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert out.read_text() == "stopped\n"


_NOTICE_CHILD = """
import signal, sys, time
from kvsm.runtime.stop import on_stop_requested
said = []
def handler(*a):
    said.append("own")
    print(*said, flush=True)
    sys.exit(7)
if sys.argv[1] == "vllm-handler":  # vLLM's engine core: it drains, then exits
    handler.__module__ = "vllm.v1.engine.core"
if sys.argv[1] != "default":
    signal.signal(signal.SIGTERM, handler)
unwrap = on_stop_requested(lambda: said.append("notice"), owner="vllm.v1.engine.core")
if sys.argv[2] == "unwrapped":
    unwrap()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("handler, wrap, rc, said", [("vllm-handler", "wrapped", 7, "notice own\n"),
                                                     ("vllm-handler", "unwrapped", 7, "own\n"),
                                                     ("app-handler", "wrapped", 7, "own\n"),
                                                     ("default", "wrapped", -signal.SIGTERM, "")])
def test_a_stop_notice_runs_before_the_process_s_own_sigterm_handler(handler: str, wrap: str, rc: int,
                                                                    said: str) -> None:
    """kvsm.runtime.stop.on_stop_requested: where vLLM's engine core has its SIGTERM
    handler (it drains), the notice (the connector closing its pins in time) runs
    first, then that handler; unwrapped, only the handler; an application's own
    handler (which may not stop the process) is left alone; under the default
    disposition nothing is wrapped (SIGTERM still kills)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", _NOTICE_CHILD, handler, wrap], cwd=root,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == rc
        assert proc.stdout.read() == said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
