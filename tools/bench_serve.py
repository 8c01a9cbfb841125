"""Section 6's first rows: vLLM's own benchmark client, ``vllm bench serve``.

The client runs unchanged (``python -m kvsm.testing.vllm_cli bench serve``: the
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


def rate_title(rate: str) -> str:
    return "rate unbounded" if rate == "inf" else f"rate {rate}/s"


def vllm_bench_serve(base_url: str, model: str, workdir: Path, *, rate: str, num_prompts: int, seed: int,
                     timeout_s: float = SERVE_TIMEOUT_S) -> dict[str, Any]:
    """One ``vllm bench serve`` run; return its result file's summary (without the
    per-request lists). A client that exits non-zero raises with what it printed;
    failed requests are in the result's ``failed`` count."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"serve-rate-{rate}-seed-{seed}.json"
    cmd = [sys.executable, "-m", "kvsm.testing.vllm_cli", "bench", "serve", "--backend", "vllm",
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
    from kvsm.testing.servers import ServerSpec, VLLMServer

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
        f"vllm bench serve rows: vLLM's own client, run unchanged (`python -m kvsm.testing.vllm_cli bench serve`), "
        f"--dataset-name random, {SERVE_INPUT_LEN} tokens in, {SERVE_OUTPUT_LEN} out (--ignore-eos, greedy), "
        f"--num-prompts {num_prompts}, --max-concurrency {SERVE_CONCURRENCY}, --request-rate "
        f"{' and '.join(SERVE_RATES)}, through kvsm.router to each pair, right after the pair's two warm-up "
        f"requests; the same client and prompts against a single engine with no connector on core 1 "
        f"(medians over repetitions): {single}. TTFT at the client includes the router's prefill leg.")
    sec.extra["serve_single"] = list(singles)
