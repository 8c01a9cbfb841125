"""Smoke tests of tools/bench.py at the smallest sizes: every implemented
section runs end to end and prints its table with numbers (the numbers
themselves are not judged, except where a behaviour is many times the noise).

* ``test_bench_smoke``: sections 1, 4, 5 in process (about 20 s on 2 cores).
* ``test_bench_servers_smoke``: sections 6 and 7 (7 includes real vLLM server
  pairs): four pairs of API servers, kvsm and upstream (about 3 min on 2 cores).

* ``test_bench_nixl_smoke``: sections 2 and 3 (tools/bench_nixl.py: worker
  processes of both connectors moving real bytes over NIXL; about 1 min).
* ``test_bench_scale_smoke``: section 8 (tools/bench_scale.py: vLLM's
  Scheduler, the simulation and real worker loops at two sizes; about 45 s).
"""

from __future__ import annotations

import json
import re
import socket
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


def _side_by_side(row: list[str]) -> None:
    """Both connectors measured: two numbers and their ratio."""
    assert re.fullmatch(NUMBER, row[2]), f"upstream cell is not a number: {row}"
    # Signed: a "run time over no connector" row is a difference of two wall times,
    # and at smoke sizes noise can make either side negative.
    assert re.fullmatch(r"-?\d+\.\d+x", row[3]) or (row[3] == "-" and _num(row[2]) == 0), row


def test_bench_smoke(tmp_path: Path) -> None:
    out, data = _run(tmp_path, "scheduler,eventlog,replay", timeout=240)

    sched = _table(out, 1, "scheduler")
    for log in ("on", "off"):
        hook_rows = [r for m, r in sched.items() if f"hooks, log {log}" in m]
        assert len(hook_rows) == 4, sched  # decode/prefill x 2 sizes
        for row in hook_rows:
            _side_by_side(row)
            assert _num(row[1]) > 0 and _num(row[2]) > 0, row  # both connectors' hooks were timed
            assert row[4].startswith("<= 1.0x"), row
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
        assert _num(flat[1]) > 0 and flat[4].startswith("<= 1.25x"), flat
    for start in ("simulation, 50 requests: wall per request", "simulation, 200 requests: wall per request",
                  "worker loops, 64-read rounds", "worker loops, 256-read rounds"):
        for row in (r for m, r in scale.items() if m.startswith(start)):
            assert _num(row[1]) > 0 and row[2] == "n/a", row
    for start in ("simulation: wall per request at 200 over 50", "worker loops: wall per request at 256 over 64",
                  "worker loops: loop threads' CPU per request at 256 over 64"):
        row = _find(scale, start)
        assert _num(row[1]) > 0 and row[4].startswith("<= 1.25x"), row
    # Memory: every round's leftovers within their bounds (a per-request leak exceeds them).
    for part in ("simulation", "worker loops"):
        for start in (f"{part}: Python heap left after each round", f"{part}: allocations left after each round"):
            row = _find(scale, start)
            assert row[4].endswith(" met"), row
    # No simulation violation, no round's check failed, no per-request object outlived its round.
    sec = data["sections"]["scale"]
    assert sec["failures"] == [], sec["failures"]
    assert len(sec["extra"]["sim"]["wall_us_per_request"]) == 2, sec["extra"]["sim"]


def _closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.timeout(900)
def test_bench_servers_smoke(tmp_path: Path) -> None:
    """Sections 6 and 7 on real servers, kvsm and upstream pairs one after the other."""
    out, data = _run(tmp_path, "e2e,handshake", timeout=600)

    e2e = _table(out, 6, "e2e")
    for start in ("decode TTFT p50", "decode TTFT p99", "end to end p50", "end to end p99", "end to end max",
                  "decode alone, 4 arriving at once (prefills done before): TTFT p50",
                  "first request through the fresh pair"):
        row = _find(e2e, start)
        _side_by_side(row)
        assert _num(row[1]) > 0 and _num(row[2]) > 0, row
    assert _find(e2e, "decode TTFT p50")[4].startswith("<= 1.0x"), e2e
    assert _find(e2e, "end to end p99")[4].startswith("<= 0.5x"), e2e
    # Every output equal to the reference, no error, for both connectors.
    for start in ("outputs different from the reference", "errors, timeouts included"):
        row = _find(e2e, start)
        assert row[1] == "0" and row[2] == "0", row
    assert _num(_find(e2e, "decode engine's prompt tokens that came by KV transfer")[1]) > 50, e2e

    # vLLM's own client (vllm bench serve) through the router to each pair, and to a single engine.
    for rate in ("rate unbounded", "rate 8/s"):
        for measure in ("TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "ITL p99"):
            row = _find(e2e, f"vllm bench serve, {rate}: {measure}")
            _side_by_side(row)
            assert _num(row[1]) > 0 and _num(row[2]) > 0, row
        row = _find(e2e, f"vllm bench serve, {rate}: failed requests (of 16)")
        assert row[1] == "0" and row[2] == "0", row
    assert _find(e2e, "vllm bench serve, rate unbounded: TTFT p50")[4].startswith("<= 0.7x"), e2e
    assert _find(e2e, "vllm bench serve, rate unbounded: TTFT p99")[4].startswith("<= 0.3x"), e2e
    overhead = _find(e2e, "P/D overhead over a single engine, rate 8/s: TTFT p50")
    _side_by_side(overhead)
    assert overhead[4].startswith("<= 8 ms"), overhead
    extra = data["sections"]["e2e"]["extra"]
    (single,) = extra["serve_single"]
    runs = extra["runs"]
    for label, results in [("single", single), *((label, rs[0]["serve"]) for label, rs in runs.items())]:
        assert set(results) == {"inf", "8"}, (label, results)
        for rate, r in results.items():  # every prompt answered, with its 16 tokens
            assert r["completed"] == 16 and r["failed"] == 0 and r["total_output_tokens"] == 16 * 16, (label, rate, r)
            assert r["max_concurrency"] == 8 and float(r["request_rate"]) == float(rate), (label, r)
    assert set(runs) == {"kvsm", "upstream"} and all(len(rs) == 1 for rs in runs.values()), runs.keys()
    # The TP 1 -> 2 rows are left out at --smoke (two more server pairs: CI's time), and it says so.
    assert "tp_runs" not in extra and not any(measure.startswith("TP 1 -> 2") for measure in e2e), list(e2e)
    assert any("TP 1 -> 2 rows are not run at --smoke" in n for n in data["sections"]["e2e"]["notes"]), \
        data["sections"]["e2e"]["notes"]
    for label, (run,) in runs.items():
        # first + second + the demo's 11 + 4 through the router at once + 4 straight to the decode engine
        assert len(run["requests"]) == 21, (label, len(run["requests"]))
        assert not any(r["error"] or r["mismatch"] for r in run["requests"]), (label, run["requests"])
        assert all(r["total_s"] > 0 for r in run["requests"]), label

    hs = _table(out, 7, "handshake")
    assert _find(hs, "first request to one fresh peer")[2] == "n/a"  # in process: kvsm only
    for start in ("servers: first request to a fresh prefill peer", "servers: the next request",
                  "servers: first request to a fresh peer, a silent dead peer's handshake pending",
                  "servers: the dead peer's own request"):
        _side_by_side(_find(hs, start))
    # The scenario is real: both decode engines gave up on the dead peer at their handshake timeout (5 s) ...
    dead = _find(hs, "servers: the dead peer's own request")
    assert _num(dead[1]) >= 4 and _num(dead[2]) >= 4, dead
    # ... and kvsm's first request to the healthy peer did not wait for it (upstream's queued behind it).
    behind = _find(hs, "servers: first request to a fresh peer, a silent dead peer's handshake pending")
    assert _num(behind[1]) < 2500, behind

    # Every server and router the bench started is gone: their ports are closed again.
    ports = [p for rs in runs.values() for run in rs for p in run["ports"]]
    ports += [p for rs in data["sections"]["handshake"]["extra"]["server_runs"].values() for run in rs
              for p in run["ports"]]
    assert len(ports) >= 2 * 5 + 2 * 7, ports
    assert all(_closed(p) for p in ports), [p for p in ports if not _closed(p)]


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
