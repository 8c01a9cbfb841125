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
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

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
    from kvsm_testing.netns import netns_unavailable_reason

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


# --------------------------------------------------------------------------- shared servers

SHARED_SERVERS = "llama_servers"


@dataclass
class LlamaServers:
    """The session's one pair of tiny-Llama API servers, with kvsm's router in front."""

    model: str
    prefill: Any  # kvsm_testing.servers.VLLMServer
    decode: Any
    router: Any  # kvsm_testing.servers.RouterProcess
    events: Path  # both servers' event logs
    keys: Path  # the pair's side_channel_keys directory (CURVE; test_side_channel_auth rotates it)


def vllm_left(server: Any, grace: float = 15) -> list[str]:
    """Processes of this server still alive after ``grace`` s: its process group, or a server on its port."""
    assert server.proc is not None
    deadline = time.monotonic() + grace
    while True:
        left = subprocess.run(["pgrep", "-f", f"vllm.entrypoints.* --port {server.spec.port} "],
                              check=False, capture_output=True, text=True).stdout.split()
        try:
            os.killpg(server.proc.pid, 0)
            left.append(f"group {server.proc.pid}")
        except ProcessLookupError:
            pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.fixture(scope="session")
def llama_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServers]:
    """One prefill and one decode API server (the tiny Llama, KVSMConnector) and
    the router (``python -m kvsm.router``), keyed as a deployment should be
    (``side_channel_keys``: CURVE, checked for rotation every 0.5 s), shared by every module that only sends
    them requests and reads their logs and metrics (``test_e2e_servers``,
    ``test_router``, ``test_side_channel_auth``): starting a pair is most of such a module's time. (The
    dashboard's test keeps a pair of its own: its handshake-latency panel needs a
    first handshake while Prometheus scrapes.) vLLM's stats are on
    (``/metrics``), the decode server logs each request
    (``--enable-log-requests``: the router's disconnect test reads its "aborted"
    line) and recomputes what it could not load. Their tests run last in the session (see
    ``pytest_collection_modifyitems``), so the pair stops right after its last
    user; on the way out every process it started must be gone."""
    require("vllm")
    from kvsm_testing import build_tiny_model
    from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs, running_pair

    tmp = tmp_path_factory.mktemp("llama-servers")
    model = str(build_tiny_model())
    events = tmp / "events"
    p_spec, d_spec = pd_specs(event_log_dir=str(events))
    keys = tmp / "keys"
    keys.mkdir()
    import zmq.auth
    zmq.auth.create_certificates(str(keys), "current")
    for spec in (p_spec, d_spec):
        spec.log_stats = True
        spec.extra_config.update(side_channel_keys=str(keys), side_channel_keys_reload=0.5)
    d_spec.extra_args = ("--enable-log-requests",)
    d_spec.kv_load_failure_policy = "recompute"
    prefill, decode = VLLMServer(p_spec, model, tmp), VLLMServer(d_spec, model, tmp)
    router = RouterProcess([prefill.url], [decode.url], tmp, timeout_s=60)
    with running_pair(prefill, decode, router, ready_timeout=240, stop_timeout=20):
        yield LlamaServers(model, prefill, decode, router, events, keys)
    left = [p for s in (prefill, decode) for p in vllm_left(s)]
    assert not left, f"vLLM processes left behind: {left}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the shared servers run last, in their modules' order: the
    servers (session-scoped) then stop right after them instead of idling beside
    every other test."""
    def shared(item: pytest.Item) -> bool:
        return SHARED_SERVERS in getattr(item, "fixturenames", ())

    items[:] = [i for i in items if not shared(i)] + [i for i in items if shared(i)]
