"""The worker (and the scheduler half) decide nothing about a request or a peer
from its state: every such decision is a transition of a declared lifecycle
(``kvsm/lifecycle/table.py``), its guards reading data the table's ``prepare``
callbacks fold from recorded events, so replay re-checks it.

The check is syntactic, over ``kvsm/worker/*.py`` and ``kvsm/scheduler/*.py``:
no read of a machine's ``.state``, no call of ``final_state(`` or
``_peer_state(``, no membership test against a ``*_STATES`` set, no comparison
against a state's name. Decisions not moved into the tables yet are listed in
``NOT_YET_IN_THE_TABLES`` by (file, function, what): the list may only shrink
(an entry that no longer occurs fails too, so it is removed when its decision
moves)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvsm.scheduler
import kvsm.worker
from kvsm.lifecycle.table import LIFECYCLES

PACKAGES = {"worker": Path(kvsm.worker.__file__).parent, "scheduler": Path(kvsm.scheduler.__file__).parent}
STATE_NAMES = {s for spec in LIFECYCLES.values() for s in spec.states}
STATE_CALLS = {"final_state", "_peer_state"}

# (file, function, what): decisions still taken outside the tables.
NOT_YET_IN_THE_TABLES: set[tuple[str, str, str]] = set()


def _enclosing_functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node's innermost enclosing function (``ast.walk`` is breadth first:
    inner functions come later and overwrite)."""
    owner: dict[ast.AST, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if node is not fn:
                    owner[node] = fn.name
    return owner


def _names_of(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _ends_in_states(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.endswith("_STATES")


def state_decisions(path: Path) -> list[tuple[str, str, str]]:
    """Every place in ``path`` that reads or tests a lifecycle state: (file, function, what)."""
    tree = ast.parse(path.read_text())
    owner = _enclosing_functions(tree)
    found = []

    def hit(node: ast.AST, what: str) -> None:
        found.append((path.name, owner.get(node, "<module>"), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "state" and isinstance(node.ctx, ast.Load):
            hit(node, f"reads {ast.unparse(node)}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in STATE_CALLS:
                hit(node, f"calls {name}")
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and _ends_in_states(right):
                    hit(node, f"tests membership in {ast.unparse(right)}")
            if any(STATE_NAMES & set(_names_of(operand)) for operand in (node.left, *node.comparators)):
                hit(node, f"compares with a state name: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_decision_reads_a_state(package: str) -> None:
    found = {d for path in sorted(PACKAGES[package].glob("*.py")) for d in state_decisions(path)}
    known = {d for d in NOT_YET_IN_THE_TABLES if (PACKAGES[package] / d[0]).exists()}
    new = sorted(found - known)
    assert new == [], "decisions outside the tables:\n" + "\n".join(map(str, new))
    gone = sorted(known - found)
    assert gone == [], "moved into the tables: remove from NOT_YET_IN_THE_TABLES:\n" + "\n".join(map(str, gone))


def test_the_check_finds_every_kind_of_state_decision(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvsm.lifecycle.table import PEER_FETCH_STATES\n"
        "def f(m, t, p):\n"
        '    if m.state == "awaiting_pull" or m.state in ("failing", "x"):\n'
        "        return t.final_state(m.req)\n"
        "    if p._peer_state(p) in PEER_FETCH_STATES:\n"
        "        return 1\n"
        '    return p.kind == "done"\n')
    whats = [what for _, fn, what in state_decisions(bad) if fn == "f"]
    assert sum(w.startswith("reads ") for w in whats) == 2, whats
    assert "calls final_state" in whats and "calls _peer_state" in whats, whats
    assert "tests membership in PEER_FETCH_STATES" in whats, whats
    assert sum(w.startswith("compares with a state name") for w in whats) == 3, whats
