"""Shared test settings.

``KVSM_HYPOTHESIS_SCALE=10`` runs every property-based test with ten times its
usual number of examples (a deeper search than CI's, for before a release).

``require("vllm")`` (or ``"nixl._api"``, ``"torch"``, ...) at the top of a test
module, before the imports that need it, is the one way a test module says it
needs an optional dependency:

* not installed: the module is skipped, except where everything must be
  installed (``KVSM_REQUIRE_ALL`` or ``CI`` set, as ``tools/dev.sh test`` and CI
  do): there a missing dependency fails the run, it is never a silent skip;
* installed but failing to import: always an error (a broken install is a
  failure, not a reason to skip).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

import pytest

HYPOTHESIS_SCALE = max(1, int(os.environ.get("KVSM_HYPOTHESIS_SCALE", "1")))


def examples(n: int) -> int:
    """``n`` examples, scaled by KVSM_HYPOTHESIS_SCALE."""
    return n * HYPOTHESIS_SCALE


def _env_set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def require_all() -> bool:
    """Must every optional dependency be installed (``KVSM_REQUIRE_ALL`` or ``CI`` set)?"""
    return _env_set("KVSM_REQUIRE_ALL") or _env_set("CI")


def require_netns() -> None:
    """Skip the calling test module where network namespaces cannot be made (fail
    it instead when :func:`require_all`: CI runs the two-host tests). Module level."""
    from kvsm.testing.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None:
        if require_all():
            pytest.fail(f"two-host tests cannot run: {reason}, and KVSM_REQUIRE_ALL or CI is set", pytrace=False)
        pytest.skip(f"two-host tests need network namespaces: {reason}", allow_module_level=True)


def require(module: str, reason: str = "") -> ModuleType:
    """Import and return ``module`` for the calling test module; skip that module
    when its distribution is not installed, or fail when :func:`require_all`.
    Call it at module level (it skips or fails the whole module)."""
    top = module.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        what = f"{caller} needs {module}: {top} is not installed" + (f" ({reason})" if reason else "")
        if require_all():
            pytest.fail(f"{what}, and KVSM_REQUIRE_ALL or CI is set: every test must run here", pytrace=False)
        pytest.skip(what, allow_module_level=True)
    return importlib.import_module(module)
