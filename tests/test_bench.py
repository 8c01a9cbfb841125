"""Smoke test of tools/bench.py: the implemented sections run end to end at the
smallest sizes and print their tables with numbers (about 20 s on 2 cores)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "tools" / "bench.py"
SECTIONS = {1: "scheduler", 4: "eventlog", 5: "replay", 7: "handshake"}
NUMBER = r"-?[\d,]+(?:\.\d+)?(?:e[-+]?\d+)?"


def _table(out: str, number: int, name: str) -> list[list[str]]:
    """The data rows of one section's table, as lists of cell texts."""
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
    return rows


def _num(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_bench_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--quick", "--repeat", "1",
         "--only", "scheduler,eventlog,replay,handshake,worker", "--json", str(out_json)],
        check=False, capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-5000:]}"
    assert re.search(r"^machine: \d+ CPUs .*Python 3\.\d+.*vllm", out, re.MULTILINE), out[:500]

    sched = _table(out, 1, "scheduler")
    hook_rows = [r for r in sched if "hooks, log on" in r[0]]
    assert len(hook_rows) == 4, sched  # decode/prefill x 2 sizes
    for row in sched:
        assert re.fullmatch(NUMBER, row[2]), f"upstream cell is not a number: {row}"
        ratio = re.fullmatch(r"(\d+\.\d+)x", row[3])
        assert ratio, f"ratio cell is not 'N.NNx': {row}"
    for row in hook_rows:
        assert _num(row[1]) > 0 and _num(row[2]) > 0, row  # both connectors' hooks were timed
        assert float(row[3].rstrip("x")) > 0, row
        assert row[4].startswith("<= 1.0x"), row

    for number, name in ((4, "eventlog"), (5, "replay"), (7, "handshake")):
        for row in _table(out, number, name):
            assert row[2] == "n/a" and row[3] == "n/a", row
    replay = _table(out, 5, "replay")
    assert "events/s" in replay[0][0] and _num(replay[0][1]) > 0, replay
    handshake = _table(out, 7, "handshake")
    assert _num(handshake[0][1]) > 0, handshake

    assert re.search(r"^### 2\. worker: .*\n\nnot implemented yet", out, re.MULTILINE), out

    data = json.loads(out_json.read_text())
    assert set(data["sections"]) == {*SECTIONS.values(), "worker"}
    assert data["sections"]["worker"]["implemented"] is False
    first = data["sections"]["scheduler"]["rows"][0]
    assert first["ratio"] > 0 and first["kvsm"]["values"] and first["upstream"]["values"]
