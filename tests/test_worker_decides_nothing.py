"""The worker decides nothing about a request or a peer: no comparison in
``kvsm/worker/`` names a lifecycle state. What a state allows is looked up in
the sets the table declares (``PEER_FETCH_STATES``, ``CLAIM_ANSWERS``, ...);
everything else is a transition. This is how a newcomer checks that no
request or peer state lives outside the declared lifecycles."""

from __future__ import annotations

import ast
from pathlib import Path

import kvsm.worker
from kvsm.lifecycle.table import LIFECYCLES

WORKER = Path(kvsm.worker.__file__).parent
STATE_NAMES = {s for spec in LIFECYCLES.values() for s in spec.states}


def _state_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            names = []
            if isinstance(operand, ast.Constant) and isinstance(operand.value, str):
                names = [operand.value]
            elif isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
                names = [e.value for e in operand.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if STATE_NAMES & set(names):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_worker_comparison_names_a_state() -> None:
    found = [hit for path in sorted(WORKER.glob("*.py")) for hit in _state_comparisons(path)]
    assert found == [], "decisions outside the table:\n" + "\n".join(found)


def test_the_check_finds_a_state_comparison(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('def f(m):\n    return m.state == "awaiting_pull" or m.state in ("failing", "x")\n')
    assert len(_state_comparisons(bad)) == 2
