"""The tables that tools/bench.py and tools/bench_nixl.py fill in: rows of kvsm
and upstream numbers over repetitions, their targets, the sections that hold
them, and the sizes every section runs at.

A module of its own so that bench_nixl imports it and not bench.py (which
imports bench_nixl for sections 2 and 3): run as a script, bench.py is
``__main__``, and ``import bench`` from bench_nixl made a second copy of it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Target:
    """What a row is judged against: ``kind`` is ``ratio_max`` (kvsm/upstream
    at most ``value``), ``max`` / ``min`` (kvsm's median at most / at least
    ``value``), ``each_max`` (every repetition of kvsm at most ``value``), or
    ``none`` (only ``text`` is shown). A row that failed is never met."""

    kind: str
    value: float | None
    text: str

    def met(self, row: Row) -> bool | None:
        if row.failed:
            return False
        if self.kind == "none":
            return None
        value = self.value
        assert value is not None, f"a {self.kind!r} target needs a value"
        if self.kind == "ratio_max":
            r = row.ratio
            return None if r is None else r <= value
        if self.kind == "each_max":  # every repetition, not just the median (counts of bad things)
            vals = [v for v in row.kvsm if v is not None and not math.isnan(v)]
            return None if not vals else max(vals) <= value
        k = row.kvsm_median
        if k is None:
            return None
        if self.kind == "max":
            return k <= value
        if self.kind == "min":
            return k >= value
        return None


NO_TARGET = Target("none", None, "")


@dataclass
class Row:
    measure: str
    unit: str
    kvsm: list[float]
    upstream: list[float] | None = None  # None: no upstream equivalent
    target: Target = NO_TARGET
    note: str = ""
    # Sides ("kvsm", "upstream") whose numbers must not be read: e.g. outputs that
    # differed from the reference. Their cells show FAILED instead of a number.
    failed: frozenset[str] = frozenset()

    @property
    def kvsm_median(self) -> float | None:
        return _median(self.kvsm)

    @property
    def upstream_median(self) -> float | None:
        return None if self.upstream is None else _median(self.upstream)

    @property
    def ratio(self) -> float | None:
        k, u = self.kvsm_median, self.upstream_median
        if k is None or u is None or u == 0:
            return None
        return k / u

    @property
    def paired_ratios(self) -> list[float]:
        """kvsm / upstream within each repetition (runs of one repetition are
        neighbours in time, so this ratio sees less of the machine's drift)."""
        if self.upstream is None or len(self.upstream) != len(self.kvsm):
            return []
        return [k / u for k, u in zip(self.kvsm, self.upstream, strict=True) if u]

    def to_json(self) -> dict[str, Any]:
        met = self.target.met(self)
        return {
            "measure": self.measure,
            "unit": self.unit,
            "kvsm": _summary(self.kvsm),
            "upstream": None if self.upstream is None else _summary(self.upstream),
            "ratio": self.ratio,
            "ratio_per_repetition": self.paired_ratios or None,
            "target": self.target.text or None,
            "target_met": met,
            "note": self.note or None,
            "failed": sorted(self.failed) or None,
        }


@dataclass
class Section:
    number: int
    name: str
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    implemented: bool = True
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # non-empty: the run fails (exit status 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "title": self.title,
            "implemented": self.implemented,
            "seconds": round(self.seconds, 2),
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
            "failures": self.failures,
            "extra": self.extra,
        }


def _median(values: Sequence[float] | None) -> float | None:
    vals = [v for v in (values or ()) if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else None


def _summary(values: Sequence[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return {
        "values": list(values),
        "median": statistics.median(vals) if vals else None,
        "min": min(vals) if vals else None,
        "max": max(vals) if vals else None,
    }


def fmt(x: float | None) -> str:
    """Three significant digits, thousands separated; '-' for nothing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    if ax == 0:
        return "0"
    return f"{x:.3g}"


def _spread(values: Sequence[float] | None) -> str:
    vals = [v for v in (values or ()) if v is not None and not math.isnan(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return fmt(vals[0])
    return f"{fmt(min(vals))}-{fmt(max(vals))}"


def render_section(sec: Section) -> str:
    lines = [f"### {sec.number}. {sec.name}: {sec.title}", ""]
    if not sec.implemented:
        lines.append("not implemented yet")
        return "\n".join(lines) + "\n"
    lines.append("| measure | kvsm | upstream | kvsm/upstream | target | spread |")
    lines.append("| --- | ---: | ---: | ---: | --- | --- |")
    for r in sec.rows:
        unit = f" ({r.unit})" if r.unit else ""
        kv = "FAILED" if "kvsm" in r.failed else fmt(r.kvsm_median)
        up = "n/a" if r.upstream is None else "FAILED" if "upstream" in r.failed else fmt(r.upstream_median)
        ratio = "n/a" if r.upstream is None else (f"{r.ratio:.2f}x" if r.ratio is not None and not r.failed else "-")
        met = r.target.met(r)
        target = r.target.text
        if r.failed:
            target = (target + " " if target else "") + "FAILED (" + ", ".join(sorted(r.failed)) + ")"
        elif target and met is not None:
            target += " met" if met else " MISSED"
        if r.upstream is None:
            spread = "FAILED" if r.failed else _spread(r.kvsm)
        else:
            k_spread = "FAILED" if "kvsm" in r.failed else _spread(r.kvsm)
            u_spread = "FAILED" if "upstream" in r.failed else _spread(r.upstream)
            spread = f"kvsm {k_spread}; upstream {u_spread}"
            paired = r.paired_ratios
            if len(paired) > 1 and not r.failed:
                spread += f"; ratio per repetition {min(paired):.2f}-{max(paired):.2f}x"
        measure = r.measure + unit + (f" [{r.note}]" if r.note else "")
        lines.append(f"| {measure} | {kv} | {up} | {ratio} | {target} | {spread} |")
    if sec.notes or sec.failures:
        lines.append("")
        lines.extend(f"- FAILED: {f}" for f in sec.failures)
        lines.extend(f"- {n}" for n in sec.notes)
    lines.append(f"\n({sec.seconds:.0f} s)")
    return "\n".join(lines) + "\n"



# --------------------------------------------------------------------------- sizes


E2E_DEFAULT_REPEAT = 3  # 6., 7.: each repetition starts four or more vLLM servers (minutes)


@dataclass(frozen=True)
class Sizes:
    sched_requests: tuple[int, ...]
    sched_inflight: int
    emit_calls: int  # per repetition, per kind of emit
    writer_records: int
    replay_events: int
    hs_trials: int  # per scenario, per repetition
    hs_deadline_ms: int
    worker_inflight: tuple[int, ...] = (16, 256)  # 2. transfers in flight per step
    worker_steps: int = 200  # 2. steps measured per repetition
    transfer_blocks: int = 4096  # 3. blocks moved per transfer
    transfer_block_kib: int = 64  # 3. bytes per block
    e2e_requests: int = 50  # 6. concurrent requests after the prompt mix
    serve_prompts: int = 200  # 6. vllm bench serve --num-prompts, per rate
    tp_rows: bool = True  # 6. the TP 1 -> 2 rows (two more server pairs, ~1 min each)
    hs_server_repeat: int = E2E_DEFAULT_REPEAT  # 7. most repetitions on servers (0: none), ~2 min each
    scale_sched: tuple[int, ...] = (1_000, 10_000, 100_000)  # 8. requests through vLLM's Scheduler
    scale_sim: tuple[int, ...] = (1_000, 10_000, 100_000)  # 8. requests through the simulation
    scale_worker: tuple[int, ...] = (1_000, 10_000)  # 8. reads in flight per round through the real worker loops
    scale_full_max: int = 10_000  # 8. larger sizes run once, the scheduler's for kvsm only (minutes each)



def _rotated(items: Sequence[Any], k: int) -> list[Any]:
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def stream_ttft_ms(url: str, body: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None) -> float:
    """POST a streamed completion to ``url``; ms until its first event with a token
    (the stream is read to its end)."""
    import http.client
    import json
    import time

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status} {resp.read()[:300]!r}")
        first: float | None = None
        while line := resp.readline():
            if first is None and line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                first = (time.perf_counter() - t0) * 1e3
        if first is None:
            raise RuntimeError(f"{url}: a stream without a token")
        return first
    finally:
        conn.close()
