"""Section 6's first rows: vLLM's own benchmark client, ``vllm bench serve``.

The client runs unchanged (``python -m kvsm_testing.vllm_cli bench serve``: the
CPU wheel's ``vllm`` console script cannot start, see that module) against
kvsm's router in front of each pair, and against a single engine with no
connector: the random dataset, ``SERVE_INPUT_LEN`` tokens in and
``SERVE_OUTPUT_LEN`` out (ignore_eos), at most ``SERVE_CONCURRENCY`` requests in
flight, at each of ``SERVE_RATES``. The prompts are the same for the three
within a repetition (same seed). What the client reports (TTFT, TPOT, ITL,
failures) comes from its own result file.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib import NO_TARGET, Row, Section, Target, _median, fmt

ROOT = Path(__file__).resolve().parent.parent

SERVE_INPUT_LEN = 200
SERVE_OUTPUT_LEN = 16
SERVE_CONCURRENCY = 8
SERVE_RATES = ("inf", "8")  # requests per second; "inf": all at once, bounded by the concurrency
SERVE_TIMEOUT_S = 600.0
OVERHEAD_GOAL_MS = 8.0  # kvsm's P/D TTFT p50 over the single engine's, at rate 8


# The tensor parallel rows: a TP 1 prefill -> TP 2 decode pair, one rate.
TP_RATE = "8"
TP_TITLE = "TP 1 -> 2 (a TP 1 prefill server on core 0, a TP 2 decode server, a worker per core)"


def rate_title(rate: str) -> str:
    return "rate unbounded" if rate == "inf" else f"rate {rate}/s"


def vllm_bench_serve(base_url: str, model: str, workdir: Path, *, rate: str, num_prompts: int, seed: int,
                     timeout_s: float = SERVE_TIMEOUT_S) -> dict[str, Any]:
    """One ``vllm bench serve`` run; return its result file's summary (without the
    per-request lists). A client that exits non-zero raises with what it printed;
    failed requests are in the result's ``failed`` count."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"serve-rate-{rate}-seed-{seed}.json"
    cmd = [sys.executable, "-m", "kvsm_testing.vllm_cli", "bench", "serve", "--backend", "vllm",
           "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(SERVE_INPUT_LEN),
           "--random-output-len", str(SERVE_OUTPUT_LEN), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(SERVE_CONCURRENCY), "--request-rate", rate, "--ignore-eos",
           "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(workdir),
           "--result-filename", name]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, cwd=workdir,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    (workdir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve (rate {rate}) exited {proc.returncode}: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads((workdir / name).read_text())
    return {k: v for k, v in result.items() if not isinstance(v, list)}  # per-request lists: in the file


def serve_all_rates(base_url: str, model: str, workdir: Path, *, num_prompts: int, seed: int) -> dict[str, Any]:
    """Every rate of ``SERVE_RATES`` against ``base_url``, one after the other."""
    return {rate: vllm_bench_serve(base_url, model, workdir, rate=rate, num_prompts=num_prompts, seed=seed)
            for rate in SERVE_RATES}


def single_engine_serve(model: str, workdir: Path, *, num_prompts: int, seed: int) -> dict[str, Any]:
    """A single engine with no connector on core 1 (the decode server's core), the
    same client runs against it: the baseline P/D is compared with."""
    from kvsm_testing.servers import ServerSpec, VLLMServer

    server = VLLMServer(ServerSpec("single", "kv_both", connector="", cpu=1), model, workdir)
    server.start()
    try:
        server.wait_ready(timeout=600)
        return serve_all_rates(server.url, model, workdir, num_prompts=num_prompts, seed=seed)
    finally:
        server.stop(timeout=20)


def _values(runs: Sequence[dict[str, Any]], rate: str, key: str) -> list[float]:
    out = []
    for run in runs:
        v = (run.get("serve") or {}).get(rate, {}).get(key)
        out.append(float(v) if v is not None else math.nan)
    return out


def serve_rows(sec: Section, runs: dict[str, list[dict[str, Any]]], singles: Sequence[dict[str, Any]],
               failed: frozenset[str], num_prompts: int) -> None:
    """Section 6's ``vllm bench serve`` rows (each run's ``serve`` results) and notes."""
    single_runs = [{"serve": s} for s in singles]

    def row(measure: str, unit: str, key: str, rate: str, target: Target = NO_TARGET) -> Row:
        return Row(measure, unit, _values(runs["kvsm"], rate, key), _values(runs["upstream"], rate, key), target,
                   failed=failed)

    for rate in SERVE_RATES:
        title = f"vllm bench serve, {rate_title(rate)}"
        sec.rows.append(row(f"{title}: TTFT p50", "ms", "p50_ttft_ms", rate, Target("ratio_max", 0.7, "<= 0.7x")))
        sec.rows.append(row(f"{title}: TTFT p99", "ms", "p99_ttft_ms", rate, Target("ratio_max", 0.3, "<= 0.3x")))
        sec.rows.append(row(f"{title}: TPOT p50", "ms", "p50_tpot_ms", rate))
        sec.rows.append(row(f"{title}: ITL p50", "ms", "p50_itl_ms", rate))
        sec.rows.append(row(f"{title}: ITL p99", "ms", "p99_itl_ms", rate))
        sec.rows.append(Row(f"{title}: failed requests (of {num_prompts})", "", _values(runs["kvsm"], rate, "failed"),
                            _values(runs["upstream"], rate, "failed"), Target("each_max", 0, "0")))

    # P/D's cost over one engine: the pair's TTFT p50 less the single engine's, repetition by repetition.
    last = SERVE_RATES[-1]
    base = _values(single_runs, last, "p50_ttft_ms")

    def over(label: str) -> list[float]:
        return [v - b for v, b in zip(_values(runs[label], last, "p50_ttft_ms"), base, strict=True)]

    sec.rows.append(Row(f"P/D overhead over a single engine, {rate_title(last)}: TTFT p50 minus the single "
                        f"engine's", "ms", over("kvsm"), over("upstream"),
                        Target("max", OVERHEAD_GOAL_MS, f"<= {OVERHEAD_GOAL_MS:g} ms"), failed=failed))
    single = "; ".join(
        f"{rate_title(rate)}: TTFT p50 {fmt(_median(_values(single_runs, rate, 'p50_ttft_ms')))}, p99 "
        f"{fmt(_median(_values(single_runs, rate, 'p99_ttft_ms')))}, TPOT p50 "
        f"{fmt(_median(_values(single_runs, rate, 'p50_tpot_ms')))} ms" for rate in SERVE_RATES)
    sec.notes.append(
        f"vllm bench serve rows: vLLM's own client, run unchanged (`python -m kvsm_testing.vllm_cli bench serve`), "
        f"--dataset-name random, {SERVE_INPUT_LEN} tokens in, {SERVE_OUTPUT_LEN} out (--ignore-eos, greedy), "
        f"--num-prompts {num_prompts}, --max-concurrency {SERVE_CONCURRENCY}, --request-rate "
        f"{' and '.join(SERVE_RATES)}, through kvsm.router to each pair, right after the pair's two warm-up "
        f"requests; the same client and prompts against a single engine with no connector on core 1 "
        f"(medians over repetitions): {single}. TTFT at the client includes the router's prefill leg.")
    sec.extra["serve_single"] = list(singles)


def tp_pair_serve(connector: str, model: str, workdir: Path, *, num_prompts: int, seed: int,
                  event_log_dir: Path | None = None) -> dict[str, Any]:
    """A TP 1 prefill server (core 0) and a TP 2 decode server (a worker per core)
    with ``connector``, kvsm's router in front, one warm-up request through it (the
    handshake, and the TP 2 engine's first forward, which compiles), then ``vllm
    bench serve`` at ``TP_RATE``. Every process in this session (see
    ``kvsm_testing.servers``: in sessions of their own the TP 2 workers' spinning
    starves the prefill server on this kernel)."""
    from kvsm_testing.servers import RouterProcess, ServerSpec, VLLMServer, free_ports, running_pair

    workdir.mkdir(parents=True, exist_ok=True)
    http_p, http_d, side_p, side_d = free_ports(4)
    logs = str(event_log_dir) if event_log_dir is not None else None
    prefill = VLLMServer(ServerSpec("prefill", "kv_producer", http_p, side_p, "prefill", cpu=0, connector=connector,
                                    event_log_dir=logs, own_session=False), model, workdir)
    decode = VLLMServer(ServerSpec("decode", "kv_consumer", http_d, side_d, "decode", cpu=None, connector=connector,
                                   event_log_dir=logs, extra_args=["--tensor-parallel-size", "2"],
                                   env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, own_session=False), model, workdir)
    router = RouterProcess([prefill.url], [decode.url], workdir, timeout_s=SERVE_TIMEOUT_S, own_session=False)
    t0 = time.perf_counter()
    with running_pair(prefill, decode, router):
        startup_s = time.perf_counter() - t0
        warm = {"model": model, "prompt": list(range(10, 10 + SERVE_INPUT_LEN)), "max_tokens": SERVE_OUTPUT_LEN,
                "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(router.url + "/v1/completions", json.dumps(warm).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=SERVE_TIMEOUT_S) as r:
            r.read()
        serve = {TP_RATE: vllm_bench_serve(router.url, model, workdir, rate=TP_RATE, num_prompts=num_prompts,
                                           seed=seed)}
        return {"serve": serve, "startup_s": startup_s}


def tp_rows(sec: Section, runs: dict[str, list[dict[str, Any]]], num_prompts: int) -> None:
    """Section 6's tensor parallel rows: kvsm and upstream at TP 1 -> 2 (``tp_pair_serve``)."""
    def row(measure: str, key: str, target: Target = NO_TARGET, unit: str = "ms") -> Row:
        return Row(f"{TP_TITLE}, vllm bench serve, {rate_title(TP_RATE)}: {measure}", unit,
                   _values(runs["kvsm"], TP_RATE, key), _values(runs["upstream"], TP_RATE, key), target)

    for measure, key in (("TTFT p50", "p50_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "p50_tpot_ms")):
        sec.rows.append(row(measure, key))
    sec.rows.append(row(f"failed requests (of {num_prompts})", "failed", Target("each_max", 0, "0"), unit=""))
    sec.notes.append(
        f"{TP_TITLE} rows: a fresh pair per connector and repetition, kvsm.router in front, one warm-up request "
        f"through it (the handshake, and the TP 2 engine's first forward, which compiles), then the same client "
        f"and dataset as above at {rate_title(TP_RATE)}. All processes in the benchmark's session: in sessions of "
        f"their own, the TP 2 decode workers' spinning (vLLM's shared-memory queue, sched_yield) starves the "
        f"prefill server on this kernel (testsupport/kvsm_testing/servers.py says how).")
    sec.extra["tp_runs"] = runs
