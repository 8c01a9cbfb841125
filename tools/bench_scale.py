"""Section 8 of tools/bench.py, ``scale``: does a request cost the same at 100k
requests as at 1k, and does memory come back after every round?

Issue 16's target 4: per-request scheduler cost and worker cost flat from 1k to
100k requests, memory back to its baseline after each round. A cost that grows
with the number of requests seen (a table that is never pruned, a scan over
every finished request) is invisible at the sizes sections 1 and 2 run; here
each part runs the same work at sizes ten times apart and divides:

* scheduler: vLLM's real ``Scheduler`` (``sched_run`` of tools/bench.py,
  section 1's driver), kvsm with its event log and upstream ``NixlConnector``,
  both roles: µs per request inside the connector's hooks at each size, the
  same less the GC collections that tripped inside a hook (``_GcProbe``), and
  kvsm's flatness of both (largest size over smallest).
* simulation: ``kvsm_testing.sim`` on virtual time (both real ``WorkerHalf``s, the
  clean path: no faults): wall µs per request at each size and its flatness.
* worker loops: ``kvsm_testing.load`` (tests/test_load.py's harness: two real
  ``WorkerHalf`` with loop threads, real ZMQ side channel, in-memory
  transport, every read of a round in flight at once): wall and loop-thread
  CPU per request at each size, and their flatness.

Every timed run starts with the heap that exists before it frozen
(``gc.freeze()``, as vLLM's EngineCore does after start-up): the cyclic GC's
full collections then cost what the run itself keeps alive, not the bench
process's imports (see ``_frozen_heap``).

Memory (simulation and worker loops): after a warm-up round, the heap is read
after every round (``gc.collect()`` first, logs flushed) and compared with its
value after the warm-up. The counters are read in a millisecond without
tracing: tracemalloc would slow the largest rounds (minutes already) 2-4x.
Python objects of up to 512 bytes (every per-request object) live in
pymalloc's blocks (``sys._debugmallocstats``: bytes in allocated blocks, and
``sys.getallocatedblocks()``); larger ones (dict and list tables) and C
libraries' memory in malloc's (glibc ``mallinfo2``, every thread, libzmq's
queues included), shown but not judged: it moves by a few hundred KiB with
the size of the last round. Rounds above ``Sizes.scale_full_max`` requests
run once per section, and the scheduler's at kvsm only (minutes each on 2 cores).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from benchlib import Row, Section, Sizes, Target, _rotated, fmt

SCHED_CONFIGS = ("kvsm_log", "upstream")
ROLES = (("decode", "kv_consumer"), ("prefill", "kv_producer"))
FLAT = Target("max", 1.25, "<= 1.25x")
# What a round may leave behind (as tests/test_load.py's bounds): a per-request
# leak leaves at least one allocation per request.
PY_HEAP_BOUND_KIB = 256
BLOCKS_BOUND = 1000
SIM_SEED = 8000


# --------------------------------------------------------------------------- memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def _pymalloc_bytes() -> int:
    """Bytes in pymalloc's allocated blocks. ``sys._debugmallocstats`` prints to the
    C stderr only: fd 2 goes to a file meanwhile (-1 when there is no pymalloc)."""
    with tempfile.TemporaryFile() as f:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        m = re.search(rb"# bytes in allocated blocks\s*=\s*([\d,]+)", f.read())
    return int(m.group(1).replace(b",", b"")) if m else -1


@dataclass(frozen=True)
class Heap:
    """The process's heap once garbage is collected: pymalloc's bytes and blocks
    (Python objects up to 512 bytes) and what malloc has handed out (the rest)."""

    py_bytes: int
    blocks: int
    malloc_bytes: int

    @classmethod
    def now(cls) -> Heap:
        gc.collect()
        info = _MALLINFO2() if _MALLINFO2 is not None else None
        malloc = info.uordblks + info.hblkhd if info is not None else -1
        return cls(_pymalloc_bytes(), sys.getallocatedblocks(), malloc)

    def over(self, base: Heap) -> tuple[float, float, float]:
        """(Python KiB, blocks, malloc KiB) over ``base``."""
        return ((self.py_bytes - base.py_bytes) / 1024, self.blocks - base.blocks,
                (self.malloc_bytes - base.malloc_bytes) / 1024)


@dataclass
class _Retained:
    """What every measured round of one part left over the warm-up's heap."""

    py_kib: list[float]
    blocks: list[float]
    malloc_kib: list[float]

    def add(self, heap: Heap, base: Heap) -> None:
        py, blocks, malloc = heap.over(base)
        self.py_kib.append(py)
        self.blocks.append(blocks)
        self.malloc_kib.append(malloc)

    def rows(self, part: str) -> list[Row]:
        return [
            Row(f"{part}: Python heap left after each round over the warm-up's (pymalloc)", "KiB", self.py_kib,
                None, Target("each_max", PY_HEAP_BOUND_KIB, f"<= {PY_HEAP_BOUND_KIB} KiB")),
            Row(f"{part}: allocations left after each round (sys.getallocatedblocks)", "blocks", self.blocks, None,
                Target("each_max", BLOCKS_BOUND, f"<= {BLOCKS_BOUND:,}")),
            Row(f"{part}: malloc'd bytes left after each round (every thread; not judged)", "KiB",
                self.malloc_kib),
        ]


def _retained() -> _Retained:
    return _Retained([], [], [])


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """What is alive before a run is out of the cyclic GC's sight during it, as
    vLLM's EngineCore freezes its start-up heap (``freeze_gc_heap``). Else every
    full collection scans the ~600k objects of vLLM's and torch's imports (~0.5 s
    here) and lands in whatever code allocates when it trips: none trips in a
    run of 1,000 requests, one every ~7,000 requests in longer runs, so that the
    larger sizes alone pay for them. A run's own objects are still collected,
    leaks included."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _runs_at(sizes: Sizes, ns: Sequence[int], rep: int) -> list[int]:
    """The sizes a repetition runs: every one in the first, then those up to ``scale_full_max``."""
    return [n for n in ns if rep == 0 or n <= sizes.scale_full_max]


def _flat(measured: dict[int, list[float]]) -> list[float]:
    """Largest size's values over the smallest's: paired within a repetition when
    both ran every repetition, else each over the smallest's median."""
    small, big = measured[min(measured)], measured[max(measured)]
    if len(small) == len(big):
        return [b / s for b, s in zip(big, small, strict=True) if s]
    m = statistics.median(small)
    return [b / m for b in big] if m else []


def _flat_row(what: str, measured: dict[int, list[float]], of: str = "requests") -> Row:
    return Row(f"{what} at {max(measured):,} over {min(measured):,} {of}", "ratio", _flat(measured), None, FLAT)


def _sizes_text(ns: Sequence[int]) -> str:
    return " / ".join(f"{n:,}" for n in ns)


# --------------------------------------------------------------------------- parts


class _GcProbe:
    """The cyclic GC's collections during a run: their time in all, and the part
    that tripped inside a timed hook (section 1's ``HookTimer`` wrapper ``timed``,
    of ``hook_file``, on the collecting thread's stack). A collection is paid by
    whatever code allocates when the threshold trips: kvsm's ``on_new_request``
    allocates the most of the hooks (parsing kv_transfer_params) and trips most
    of them, more of them once a run is past its start-up (measured at 20,000
    requests: 607 of 20,000 calls held one, most of the run's GC time; the
    median call took 13.7 µs, as at 500 requests)."""

    def __init__(self, hook_file: str) -> None:
        self.hook_file = hook_file
        self.total_ns = self.in_hooks_ns = 0
        self._t0 = 0
        self._in_hook = False

    def __enter__(self) -> Self:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._in_hook = self._inside_hook()
            self._t0 = time.perf_counter_ns()
            return
        dt = time.perf_counter_ns() - self._t0
        self.total_ns += dt
        if self._in_hook:
            self.in_hooks_ns += dt

    def _inside_hook(self) -> bool:
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_name == "timed" and f.f_code.co_filename == self.hook_file:
                return True
            f = f.f_back  # type: ignore[assignment]
        return False


def _sched_part(sec: Section, sizes: Sizes, repeat: int, tmp: Path, sched_run: Callable[..., dict]) -> None:
    """Hook µs per request on vLLM's real Scheduler at each size, both roles."""
    ns, inflight = sorted(sizes.scale_sched), sizes.sched_inflight
    log_dir = tmp / "scale-sched-logs"
    for config in SCHED_CONFIGS:  # warm-up: imports, the first VllmConfig, code paths
        for _, role in ROLES:
            sched_run(config, role, min(64, ns[0]), inflight, log_dir)
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rep in range(repeat):
        for n in _runs_at(sizes, ns, rep):
            for _, role in ROLES:
                for config in _rotated(SCHED_CONFIGS, rep):
                    if n > sizes.scale_full_max and config != "kvsm_log":
                        continue
                    with _frozen_heap(), _GcProbe(sched_run.__code__.co_filename) as probe:
                        run = sched_run(config, role, n, inflight, log_dir)
                    run["gc_ns"], run["gc_in_hooks_ns"] = probe.total_ns, probe.in_hooks_ns
                    run["own_hook_ns"] = run["hook_ns"] - probe.in_hooks_ns
                    runs.setdefault((role, n, config), []).append(run)

    def per_req(role: str, n: int, config: str, key: str = "hook_ns") -> list[float] | None:
        rs = runs.get((role, n, config))
        return None if rs is None else [r[key] / r["n"] / 1000 for r in rs]

    def medians(config: str, key: str, role: str) -> str:
        return " / ".join(fmt(statistics.median(v)) if (v := per_req(role, n, config, key)) else "-" for n in ns)

    upstream_flat: list[str] = []
    whole: list[str] = []
    for label, role in ROLES:
        hooks: dict[int, list[float]] = {}
        own: dict[int, list[float]] = {}
        for n in ns:
            hooks[n] = per_req(role, n, "kvsm_log") or []
            own[n] = per_req(role, n, "kvsm_log", "own_hook_ns") or []
            sec.rows.append(Row(f"scheduler, {label}, {n:,} requests: hooks, log on", "µs/req", hooks[n],
                                per_req(role, n, "upstream")))
            sec.rows.append(Row(f"scheduler, {label}, {n:,} requests: hooks less the GC collections that tripped "
                                f"inside them", "µs/req", own[n], per_req(role, n, "upstream", "own_hook_ns")))
        sec.rows.append(_flat_row(f"scheduler, {label}: kvsm's hooks per request", hooks))
        sec.rows.append(_flat_row(f"scheduler, {label}: kvsm's hooks less GC per request", own))
        up = {n: v for n in ns if (v := per_req(role, n, "upstream")) is not None}
        if len(up) > 1:
            upstream_flat.append(f"{label} {fmt(statistics.median(_flat(up)))}x ({max(up):,} over {min(up):,})")
        both = {key: f"{medians('kvsm_log', key, role)} (upstream {medians('upstream', key, role)})"
                for key in ("wall_ns", "gc_ns", "gc_in_hooks_ns")}
        whole.append(f"{label}: whole run {both['wall_ns']}, GC collections {both['gc_ns']}, of which inside the "
                     f"hooks {both['gc_in_hooks_ns']}")
    sec.notes.append(
        f"scheduler: vLLM's real Scheduler (section 1's driver), {inflight} requests in flight, sizes "
        f"{_sizes_text(ns)}; hooks = time inside the connector's scheduler-side hooks per request, kvsm with its "
        f"event log on; 'less the GC' takes out the cyclic GC's collections that tripped inside a hook (whoever "
        f"allocates when the threshold trips pays for it). Upstream's own flatness of its hooks: "
        f"{', '.join(upstream_flat) or 'not run'}. Per request at each size (µs, medians; the whole run includes "
        f"vLLM's scheduler): {'; '.join(whole)}.")
    sec.extra["sched_runs"] = {f"{role}/{n}/{config}": rs for (role, n, config), rs in runs.items()}


def _sim_part(sec: Section, sizes: Sizes, repeat: int) -> None:
    """Wall µs per request of the simulation on virtual time at each size, and the heap after each run."""
    from kvsm_testing.load import kvsm_objects, objects_grown
    from kvsm_testing.sim import SimConfig, run_simulation

    ns = sorted(sizes.scale_sim)

    def one(n: int, seed: int) -> tuple[float, float]:
        """(wall s, virtual s) of one clean run; what went wrong is a failure of the section."""
        with _frozen_heap():
            t0 = time.perf_counter()
            result = run_simulation(SimConfig(seed=seed, num_requests=n))
            wall = time.perf_counter() - t0
        bad = [str(v) for v in result.violations] + [f"illegal event {o}" for o in result.illegal_events]
        if result.count("recv") != {"done": n} or result.count("send") != {"released": n}:
            bad.append(f"not every request done: recv {result.count('recv')}, send {result.count('send')}")
        if bad:
            sec.failures.append(f"simulation, {n:,} requests, seed {seed}: {len(bad)} problem(s): "
                                + "; ".join(bad[:3]))
        return wall, result.end_ns / 1e9

    one(ns[0], SIM_SEED - 1)  # warm-up: imports, code paths, the baseline's caches
    base, objects = Heap.now(), kvsm_objects()
    wall_us: dict[int, list[float]] = {}
    virtual_s: dict[int, float] = {}
    retained = _retained()
    for rep in range(repeat):
        for n in _runs_at(sizes, ns, rep):
            wall, virtual_s[n] = one(n, SIM_SEED + rep)
            wall_us.setdefault(n, []).append(wall / n * 1e6)
            retained.add(Heap.now(), base)
            if grown := objects_grown(objects):
                sec.failures.append(f"simulation, {n:,} requests: per-request objects outlived the run: {grown}")
    for n in ns:
        sec.rows.append(Row(f"simulation, {n:,} requests: wall per request", "µs/req", wall_us[n]))
    sec.rows.append(_flat_row("simulation: wall per request", wall_us))
    sec.rows += retained.rows("simulation")
    sec.notes.append(
        f"simulation: kvsm_testing.sim on virtual time, no faults (every request done), an arrival a millisecond, "
        f"sizes "
        f"{_sizes_text(ns)}: " + ", ".join(f"{n:,} requests = {fmt(virtual_s[n])} s virtual in "
                                           f"{fmt(statistics.median(wall_us[n]) * n / 1e6)} s" for n in ns)
        + "; a fresh pair of workers every run, so memory after a run is what outlives the workers.")
    sec.extra["sim"] = {"wall_us_per_request": wall_us, "virtual_s": virtual_s}


def _settle(w: Any) -> None:
    """Until both workers are idle and their logs written: what is left then is retained."""
    from kvsm_testing.load import wait_idle

    wait_idle(w)
    for log in w.logs.values():
        if not log.flush(timeout=60):
            raise RuntimeError(f"{log.path.name}: not flushed within 60 s")


def _worker_part(sec: Section, sizes: Sizes, repeat: int, tmp: Path) -> None:
    """Wall and loop CPU per request of rounds through the real worker loops, and the heap after each."""
    from kvsm.lifecycle.machine import LifecycleTracker
    from kvsm_testing.load import RoundSizes, Workers, kvsm_objects, objects_grown, run_round

    ns = sorted(sizes.scale_worker)
    biggest = RoundSizes.scaled(ns[-1])
    w = Workers(tmp / "scale-workers", biggest)
    try:
        # Warm-up: enough rounds to fill each tracker's ring of finished requests.
        ring = inspect.signature(LifecycleTracker).parameters["remember_finished"].default
        round_no = 0
        while round_no * (biggest.total - biggest.abnormal) <= ring:
            run_round(w, round_no, biggest)
            round_no += 1
        warmups = round_no
        _settle(w)
        base, objects = Heap.now(), kvsm_objects()
        wall_us: dict[int, list[float]] = {}
        cpu_us: dict[int, list[float]] = {}
        retained = _retained()
        for rep in range(repeat):
            for n in _runs_at(sizes, ns, rep):
                s = RoundSizes.scaled(n)
                with _frozen_heap():
                    cpu0 = w.loop_cpu_s()
                    t = run_round(w, round_no, s)
                    cpu = w.loop_cpu_s() - cpu0
                round_no += 1
                wall_us.setdefault(n, []).append((t["submit_to_peak_s"] + t["peak_to_done_s"]) / s.total * 1e6)
                cpu_us.setdefault(n, []).append(cpu / s.total * 1e6)
                _settle(w)
                retained.add(Heap.now(), base)
                if grown := objects_grown(objects):
                    sec.failures.append(f"worker loops, {n:,}-read round: per-request objects outlived their "
                                        f"requests: {grown}")
    finally:
        w.close()
    for n in ns:
        s = RoundSizes.scaled(n)
        what = f"worker loops, {n:,}-read rounds ({s.total:,} requests, {s.reads + s.aborts:,} reading at once)"
        sec.rows.append(Row(f"{what}: round wall per request", "µs/req", wall_us[n]))
        sec.rows.append(Row(f"{what}: both loop threads' CPU per request", "µs/req", cpu_us[n]))
    sec.rows.append(_flat_row("worker loops: wall per request", wall_us, "reads a round"))
    sec.rows.append(_flat_row("worker loops: loop threads' CPU per request", cpu_us, "reads a round"))
    sec.rows += retained.rows("worker loops")
    sec.notes.append(
        f"worker loops: kvsm_testing.load (tests/test_load.py's harness), one prefill and one decode WorkerHalf "
        f"with their loop threads and event logs, rounds of {_sizes_text(ns)} reads (and per 10,000 reads 500 "
        f"aborted mid-read, 250 with nothing to read, 250 abandoned, 250 ended abnormally), all reads of a round "
        f"in flight at once; every outcome and every byte checked. The same pair for every round, after "
        f"{warmups} warm-up round(s) of {biggest.total:,} (the rings of "
        f"{ring:,} finished requests full). Round wall: first step to the last request finished on both sides.")
    sec.extra["workers"] = {"wall_us_per_request": wall_us, "loop_cpu_us_per_request": cpu_us}


# --------------------------------------------------------------------------- the section


def bench_scale(sizes: Sizes, repeat: int, tmp: Path, *, sched_run: Callable[..., dict]) -> Section:
    """Section 8 (see the module docstring). A part that raises is a failure of
    the section; the other parts still run."""
    sec = Section(8, "scale", "per-request cost at 1k to 100k requests: scheduler hooks, the simulation, "
                  "real worker loops; memory after every round (kvsm; upstream where comparable)")
    parts: list[tuple[str, Callable[[], None]]] = [
        ("scheduler", lambda: _sched_part(sec, sizes, repeat, tmp, sched_run)),
        ("simulation", lambda: _sim_part(sec, sizes, repeat)),
        ("worker loops", lambda: _worker_part(sec, sizes, repeat, tmp)),
    ]
    took = []
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            part()
        except Exception as e:  # noqa: BLE001 - one broken part must not cost the others
            traceback.print_exc()
            sec.failures.append(f"{name}: {type(e).__name__}: {e}")
        took.append(f"{name} {time.perf_counter() - t0:.0f} s")
    sec.notes.append(f"sizes above {sizes.scale_full_max:,} requests run once (the first repetition) and on the "
                     f"scheduler for kvsm only; every timed run with the heap before it frozen (gc.freeze(), as "
                     f"vLLM's EngineCore does); took: {', '.join(took)}.")
    if _MALLINFO2 is None:
        sec.notes.append("malloc'd bytes: no mallinfo2 here (not glibc >= 2.33), shown as 0.")
    return sec

