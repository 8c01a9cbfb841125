"""Smoke tests of tools/bench.py at the smallest sizes: every implemented
section runs end to end and prints its table with numbers (the numbers
themselves are not judged, except where a behaviour is many times the noise).

* ``test_bench_smoke``: sections 1, 4, 5 in process (about 20 s on 2 cores).

* ``test_bench_nixl_smoke``: sections 2 and 3 (tools/bench_nixl.py: worker
  processes of both connectors moving real bytes over NIXL; about 1 min).
* ``test_bench_scale_smoke``: section 8 (tools/bench_scale.py: vLLM's
  Scheduler, the simulation and real worker loops at two sizes; about 45 s).

The three section smokes compare kvsm with upstream ``NixlConnector``: they
are marked ``bench`` and run on demand (``bash tools/dev.sh test -m bench``),
not by the test command. Sections 6 and 7 on real servers (four pairs of API
servers, kvsm's and upstream's, about 4 min) have no test: run
``python tools/bench.py --smoke --only e2e,handshake`` for their smoke version.
``test_ttft_breakdown_smoke`` (kvsm's own tool) runs with the slow tests.
Where a section judges a row against a target, the verdict printed beside it
("met" / "MISSED") is checked against the row's own figure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require

require("vllm")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools" / "bench.py"
NUMBER = r"-?[\d,]+(?:\.\d+)?(?:e[-+]?\d+)?"


def _run(tmp_path: Path, only: str, timeout: float) -> tuple[str, dict]:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--repeat", "1", "--only", only, "--json", str(out_json)],
        check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-5000:]}"
    assert re.search(r"^machine: \d+ CPUs .*Python 3\.\d+.*vllm", out, re.MULTILINE), out[:500]
    return out, json.loads(out_json.read_text())


def _table(out: str, number: int, name: str) -> dict[str, list[str]]:
    """The data rows of one section's table: measure (with unit) -> its 6 cells."""
    m = re.search(rf"^### {number}\. {name}: .*?$(.*?)(?=^### |\Z)", out, re.MULTILINE | re.DOTALL)
    assert m, f"section header '### {number}. {name}' missing from:\n{out}"
    lines = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| measure | kvsm | upstream | kvsm/upstream | target | spread |"), lines[:1]
    assert set(lines[1]) <= set("|-: "), lines[1]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]
    assert rows, f"section {name}: empty table"
    for row in rows:
        assert len(row) == 6, row
        assert re.fullmatch(NUMBER, row[1]), f"section {name}: kvsm cell is not a number: {row}"
    return {row[0]: row for row in rows}


def _num(cell: str) -> float:
    return float(cell.replace(",", ""))


def _find(rows: dict[str, list[str]], start: str) -> list[str]:
    hits = [r for m, r in rows.items() if m.startswith(start)]
    assert len(hits) == 1, f"one row starting {start!r} expected, got {len(hits)} in {list(rows)}"
    return hits[0]


def _judged(row: list[str], target: str, figure: float) -> None:
    """The row's target cell is ``target`` followed by a verdict, and the verdict
    agrees with the figure it judges (``target`` is "<= N" or "<= Nx"; a figure
    within rounding of the bound may go either way)."""
    m = re.fullmatch(rf"{re.escape(target)} (met|MISSED)", row[4])
    assert m, f"target cell {row[4]!r} is not {target!r} with a verdict: {row}"
    bound = float(target.removeprefix("<=").strip().rstrip("x"))
    if abs(figure - bound) > 0.01:
        assert (m.group(1) == "met") == (figure <= bound), f"verdict {m.group(1)!r} for {figure} against {bound}: {row}"


def _side_by_side(row: list[str]) -> None:
    """Both connectors measured: two numbers and their ratio."""
    assert re.fullmatch(NUMBER, row[2]), f"upstream cell is not a number: {row}"
    # Signed: a "run time over no connector" row is a difference of two wall times,
    # and at smoke sizes noise can make either side negative.
    assert re.fullmatch(r"-?\d+\.\d+x", row[3]) or (row[3] == "-" and _num(row[2]) == 0), row


@pytest.mark.bench
def test_bench_smoke(tmp_path: Path) -> None:
    out, data = _run(tmp_path, "scheduler,eventlog,replay", timeout=240)

    sched = _table(out, 1, "scheduler")
    for log in ("on", "off"):
        hook_rows = [r for m, r in sched.items() if f"hooks, log {log}" in m]
        assert len(hook_rows) == 4, sched  # decode/prefill x 2 sizes
        for row in hook_rows:
            _side_by_side(row)
            assert _num(row[1]) > 0 and _num(row[2]) > 0, row  # both connectors' hooks were timed
            _judged(row, "<= 1.0x", _num(row[3].rstrip("x")))
    for row in sched.values():
        _side_by_side(row)

    for number, name in ((4, "eventlog"), (5, "replay")):
        for row in _table(out, number, name).values():
            assert row[2] == "n/a" and row[3] == "n/a", row
    replay = list(_table(out, 5, "replay").values())
    assert "events/s" in replay[0][0] and _num(replay[0][1]) > 0, replay

    assert set(data["sections"]) == {"scheduler", "eventlog", "replay"}
    first = data["sections"]["scheduler"]["rows"][0]
    assert first["ratio"] > 0 and first["kvsm"]["values"] and first["upstream"]["values"]


@pytest.mark.bench
def test_bench_nixl_smoke(tmp_path: Path) -> None:
    """Sections 2 and 3: both connectors' workers in their own processes over real NIXL."""
    out, data = _run(tmp_path, "worker,transfer", timeout=420)

    worker = _table(out, 2, "worker")
    for measure in ("4 in flight: start_load_kv + get_transfer_results per step (µs)",
                    "16 in flight: start_load_kv + get_transfer_results per step (µs)",
                    "16 in flight: transfers completed (/s)",
                    "16 in flight: decode process CPU per transfer, all threads (µs)",
                    "16 in flight: prefill process CPU per transfer served, all threads (µs)"):
        row = worker[measure]
        _side_by_side(row)
        assert _num(row[1]) > 0 and _num(row[2]) > 0, row
    # Idle: kvsm's loop sleeps; upstream as shipped runs NIXL's busy progress thread.
    # Measured 0.003 against 0.98 CPU-s per second here and 0.005 against 0.29 on a
    # busier CI machine, where the spinning thread gets less of a core: the bound on
    # upstream is relative (still far above the noise), the bound on kvsm absolute.
    idle = worker["idle: decode process CPU (CPU-s/s)"]
    assert _num(idle[1]) < 0.05 and _num(idle[2]) > max(0.1, 10 * _num(idle[1])), idle

    transfer = _table(out, 3, "transfer")
    for measure in ("one transfer, start to reported done (ms)", "throughput (GiB/s)"):
        row = transfer[measure]
        _side_by_side(row)
        assert _num(row[1]) > 0 and _num(row[2]) > 0, row
    assert set(data["sections"]) == {"worker", "transfer"}
    # Bytes are checked against their source pattern; a wrong transfer is a failure.
    assert not any(sec.get("failures") for sec in data["sections"].values()), \
        [sec.get("failures") for sec in data["sections"].values()]


@pytest.mark.bench
def test_bench_scale_smoke(tmp_path: Path) -> None:
    """Section 8: every part measured at both sizes, flatness rows, no simulation
    violation, memory back to its baseline after every round."""
    out, data = _run(tmp_path, "scale", timeout=240)

    scale = _table(out, 8, "scale")
    for role in ("decode", "prefill"):
        for n in (64, 256):
            row = scale[f"scheduler, {role}, {n} requests: hooks, log on (µs/req)"]
            _side_by_side(row)
            assert _num(row[1]) > 0 and _num(row[2]) > 0, row
        flat = _find(scale, f"scheduler, {role}: kvsm's hooks per request at 256 over 64 requests")
        assert _num(flat[1]) > 0, flat
        _judged(flat, "<= 1.25x", _num(flat[1].rstrip("x")))
    for start in ("simulation, 50 requests: wall per request", "simulation, 200 requests: wall per request",
                  "worker loops, 64-read rounds", "worker loops, 256-read rounds"):
        for row in (r for m, r in scale.items() if m.startswith(start)):
            assert _num(row[1]) > 0 and row[2] == "n/a", row
    for start in ("simulation: wall per request at 200 over 50", "worker loops: wall per request at 256 over 64",
                  "worker loops: loop threads' CPU per request at 256 over 64"):
        row = _find(scale, start)
        assert _num(row[1]) > 0, row
        _judged(row, "<= 1.25x", _num(row[1].rstrip("x")))
    # Memory: every round's leftovers within their bounds (a per-request leak exceeds them).
    for part in ("simulation", "worker loops"):
        for start in (f"{part}: Python heap left after each round", f"{part}: allocations left after each round"):
            row = _find(scale, start)
            assert row[4].endswith(" met"), row
    # No simulation violation, no round's check failed, no per-request object outlived its round.
    sec = data["sections"]["scale"]
    assert sec["failures"] == [], sec["failures"]
    assert len(sec["extra"]["sim"]["wall_us_per_request"]) == 2, sec["extra"]["sim"]


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_ttft_breakdown_smoke() -> None:
    """tools/ttft_breakdown.py on a real pair: every decode leg lined up with both
    workers' logs, and the parts fit inside the TTFT they split."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "ttft_breakdown.py"), "--rounds", "1",
                           "--concurrency", "4"], check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-5000:]}"
    assert "4 of 4 decode legs" in proc.stdout, proc.stdout
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(NUMBER, cells[1]):
            rows[cells[0]] = [_num(c) for c in cells[1:]]
    assert len(rows) == 6, proc.stdout
    ttft = rows.pop("decode TTFT (leg start to first chunk)")
    assert all(v >= 0 for vals in rows.values() for v in vals), rows
    # Each part lies inside its request's TTFT (claim and read may overlap), so no part's median can
    # exceed the largest TTFT.
    assert all(vals[0] <= ttft[3] for vals in rows.values()), (ttft, rows)
