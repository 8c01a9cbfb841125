"""kvsm's wheel holds the product only, and works without the checkout.

The wheel is built from the working tree's files (tracked, and untracked but
not ignored: what a checkout holds), copied to a temporary directory first so
that no stale ``build/`` output of an earlier build can slip into it. The test
support (harnesses, fuzzers, tiny models, the simulation) is the kvsm-testing
distribution in testsupport/ and must not be in it. Installed into a fresh
venv that sees vLLM, torch and NIXL but not the checkout, the kvsm imported is
the wheel's and kvsm_testing cannot be imported.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import require_all

ROOT = Path(__file__).resolve().parents[1]


def checkout_files() -> list[str]:
    """What a checkout of this working tree holds (git's view: tracked files and
    untracked ones that are not ignored, minus files deleted but not committed)."""
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True, text=True).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know which files a checkout holds")
    src = tmp_path_factory.mktemp("src")
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True, timeout=300)
    (built,) = out.glob("kvsm-*.whl")
    return built


def test_the_wheel_holds_only_the_product(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
    outside = [n for n in names if not n.startswith(("kvsm/", f"{dist_info}/"))]
    assert not outside, f"the wheel holds files outside kvsm/: {outside[:10]}"
    test_support = [n for n in names if n.startswith(("kvsm/testing/", "kvsm/sim/")) or "kvsm_testing" in n
                    or "/tests/" in n or n.split("/")[-1].startswith("test_")]
    assert not test_support, f"test support in the wheel: {test_support[:10]}"
    for module in ("kvsm/__init__.py", "kvsm/connector.py", "kvsm/plugin.py", "kvsm/router.py",
                   "kvsm/vllm/connector.py", "kvsm/worker/__init__.py", "kvsm/replay/__main__.py"):
        assert module in names, f"{module} is not in the wheel"
    assert dict(entry_points["vllm.general_plugins"]) == {"kvsm": "kvsm.vllm.plugin:register"}
    assert dict(entry_points["console_scripts"]) == {"kvsm-replay": "kvsm.replay:main"}


# Run in the fresh venv: the kvsm imported (with vLLM) is the wheel's; the test
# support is not there; vLLM finds the plugin of the wheel's distribution.
CHECK_IN_FRESH_VENV = """
import importlib.metadata, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
import kvsm, kvsm.vllm.connector
for mod in (kvsm, kvsm.vllm.connector):
    assert mod.__file__.startswith(site), f"{mod.__name__} from {mod.__file__}, not the wheel in {site}"
try:
    import kvsm_testing
except ModuleNotFoundError:
    pass
else:
    sys.exit(f"kvsm_testing is importable: {kvsm_testing.__file__}")
(ep,) = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "kvsm"]
assert ep.value == "kvsm.vllm.plugin:register", ep
print(kvsm.__file__)
"""


def test_the_wheel_in_a_fresh_venv_is_the_kvsm_imported(wheel: Path, tmp_path: Path) -> None:
    """``pip install`` of the wheel into a venv that sees this venv's packages
    (vLLM, torch, NIXL: through a .pth file, not reinstalled) but not its
    editable kvsm and kvsm_testing (their import hooks live in .pth files, which
    a path added that way does not run)."""
    if importlib.util.find_spec("vllm") is None:
        if require_all():
            pytest.fail("vLLM is not installed, and KVSM_REQUIRE_ALL or CI is set", pytrace=False)
        pytest.skip("needs vLLM")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "kvsm-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", CHECK_IN_FRESH_VENV], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(site)), proc.stdout
    # The console script is the wheel's and runs.
    replay = subprocess.run([str(venv / "bin" / "kvsm-replay"), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert replay.returncode == 0 and "usage" in replay.stdout.lower(), replay.stderr[-3000:]
