"""The committed statecharts are fresh, the freshness check can fail, and the
diagrams cover every declared state and trigger."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvsm.lifecycle.table import LIFECYCLES

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "statecharts.py"
CHARTS = ROOT / "statecharts"


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_committed_statecharts_are_fresh() -> None:
    r = run_tool("--check")
    assert r.returncode == 0, (
        "statecharts/ is stale: run `python tools/statecharts.py` and commit the result\n"
        + r.stdout + r.stderr)


def fresh_copy(tmp_path: Path) -> Path:
    """A fresh set of generated files (independent of whether statecharts/ is)."""
    out = tmp_path / "charts"
    r = run_tool("--out", str(out), "--no-svg")
    assert r.returncode == 0, r.stdout + r.stderr
    assert run_tool("--check", "--out", str(out)).returncode == 0
    return out


def test_check_fails_on_a_modified_copy(tmp_path: Path) -> None:
    out = fresh_copy(tmp_path)
    name = next(iter(LIFECYCLES))
    mmd = out / f"{name}.mmd"
    mmd.write_text(mmd.read_text() + "  %% edited by hand\n")
    r = run_tool("--check", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{name}.mmd (differs)" in r.stderr
    assert "README.md" not in r.stderr  # only the edited file is named


def test_check_fails_on_a_missing_file(tmp_path: Path) -> None:
    out = fresh_copy(tmp_path)
    (out / "README.md").unlink()
    r = run_tool("--check", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "README.md (missing)" in r.stderr


def test_generated_mermaid_matches_committed(tmp_path: Path) -> None:
    out = fresh_copy(tmp_path)
    for name in LIFECYCLES:
        assert (out / f"{name}.mmd").read_bytes() == (CHARTS / f"{name}.mmd").read_bytes(), name


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_every_state_and_trigger_is_drawn(name: str) -> None:
    spec = LIFECYCLES[name]
    text = (CHARTS / f"{name}.mmd").read_text()
    assert "stateDiagram-v2" in text
    edges = re.findall(r"^\s*(\S+) --> (\S+?)(?::\s*(.*))?$", text, flags=re.M)
    drawn_states = {s for src, dst, _ in edges for s in (src, dst)} - {"[*]"}
    declared = re.findall(r'^\s*state "[^"]*" as (\S+)$', text, flags=re.M)
    assert set(declared) == set(spec.states)
    assert drawn_states == set(spec.states)
    labels = " | ".join(label for _, _, label in edges if label)
    drawn_triggers = {re.sub(r"\s*\[.*\]$", "", part.strip()) for part in labels.split("|")}
    assert drawn_triggers == set(spec.triggers)
    assert f"[*] --> {spec.initial}" in text
    for state in spec.terminal:
        assert re.search(rf"^\s*{state} --> \[\*\]$", text, flags=re.M), state
        assert re.search(rf"^\s*class {state} s_terminal$", text, flags=re.M), state


def test_index_lists_every_transition() -> None:
    index = (CHARTS / "README.md").read_text()
    for name, spec in LIFECYCLES.items():
        assert (CHARTS / f"{name}.mmd").read_text().rstrip("\n") in index
        for trigger in spec.triggers:
            assert f"`{trigger}`" in index


def test_the_docs_site_shows_the_current_diagrams() -> None:
    """docs/lifecycles.md embeds each lifecycle's diagram: the same text as the
    generated ``statecharts/<name>.mmd`` (regenerate, then copy it there)."""
    doc = (CHARTS.parent / "docs" / "lifecycles.md").read_text()
    blocks = dict(re.findall(r"^## (\w+):.*?^```mermaid\n(.*?)^```", doc, flags=re.M | re.S))
    assert set(blocks) == set(LIFECYCLES), sorted(blocks)
    for name in LIFECYCLES:
        assert blocks[name].strip() == (CHARTS / f"{name}.mmd").read_text().strip(), \
            f"docs/lifecycles.md's {name} diagram differs from statecharts/{name}.mmd"
