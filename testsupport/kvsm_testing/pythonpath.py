"""The PYTHONPATH of the processes the harnesses start (vLLM servers, the
router): the places this process imported kvsm and kvsm_testing from go first,
so a child imports the same ones whatever its working directory: the
checkout's (editable installs), or kvsm from an installed wheel beside the
checkout's test support (tools/pd_demo.py in a venv that has only the wheel).
"""

from __future__ import annotations

import os
from pathlib import Path


def import_roots() -> list[str]:
    """The directories kvsm and kvsm_testing were imported from, in that order."""
    import kvsm
    import kvsm_testing

    roots: list[str] = []
    for module in (kvsm, kvsm_testing):
        assert module.__file__ is not None
        root = str(Path(module.__file__).resolve().parents[1])
        if root not in roots:
            roots.append(root)
    return roots


def child_pythonpath(current: str | None) -> str:
    """``current`` (a PYTHONPATH, or None) with ``import_roots()`` in front."""
    roots = import_roots()
    rest = [p for p in (current or "").split(os.pathsep) if p and p not in roots]
    return os.pathsep.join(roots + rest)
