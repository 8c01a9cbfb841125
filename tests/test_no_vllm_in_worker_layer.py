"""The worker layer runs without vLLM, checked where a static import contract
cannot see.

The layering itself (only ``kvsm.vllm`` and the ``kvsm.connector`` /
``kvsm.plugin`` shims import vLLM or torch, at module level or inside a
function) is an import contract in pyproject.toml, checked by ``lint-imports``
in the test command. What it cannot see is what happens when the code runs: an
import by name (``importlib.import_module``), an import that a third-party
package makes, and the handshake package's lazy loading of its zmq modules
(an ``importlib`` call the contract does not see, behind ``TYPE_CHECKING``
imports it does), and which of the scheduler's annotation-only vLLM imports
(which the contract lets through) would run. So these checks run real code in a
fresh interpreter in which ``sys.modules[name] = None`` makes ``import vllm``
(and torch, or zmq) raise: the real worker through a whole simulation, every
scheduler module, and the handshake's messages and codec without zmq.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require
from kvsm.handoff.facts import RecvAbort, SendFinish, StepFacts

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_ZMQ = ["kvsm.handshake.messages", "kvsm.handshake.codec"]

# Two real workers (the decode side reading from the prefill side over the
# in-memory transport) through 40 requests with faults: every handler the
# serving path has (claims, reads, leases, retries, notifications) runs once.
RUN_A_SIMULATION = """
from kvsm_testing.sim import Faults, SimConfig, run_simulation
result = run_simulation(SimConfig(seed=7, num_requests=40, faults=Faults.mixed(0.1)))
assert not result.violations, result.violations[:3]
assert result.count("recv").get("done", 0) > 0, result.count("recv")
"""


def run_blocked(body: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter in which every package in ``blocked`` is
    unimportable, and check that none of them got loaded anyway."""
    code = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
            f"{body}\n"
            f"leaked = sorted(m for m in sys.modules\n"
            f"                if m.split('.')[0] in {blocked!r} and sys.modules[m] is not None)\n"
            f"assert not leaked, leaked\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def import_blocked(module: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Import ``module`` in a fresh interpreter in which every package in ``blocked`` is unimportable."""
    return run_blocked(f"import importlib\nimportlib.import_module({module!r})", blocked)


def test_the_worker_runs_without_vllm_or_torch() -> None:
    """The real worker, run (not only imported) where vLLM and torch cannot be
    imported: what it imports at call time, by name or through a library, counts."""
    proc = run_blocked(RUN_A_SIMULATION, ("vllm", "torch"))
    assert proc.returncode == 0, f"the worker needs vLLM or torch when it runs:\n{proc.stderr[-3000:]}"


def test_the_scheduler_imports_without_vllm() -> None:
    """The scheduler's modules name vLLM's types in annotations only (the import
    contract lets ``kvsm.scheduler`` import vllm under ``TYPE_CHECKING``): none
    of them imports vLLM when it is loaded."""
    body = ("import importlib, pkgutil\nimport kvsm.scheduler as pkg\n"
            "for m in pkgutil.walk_packages(pkg.__path__, 'kvsm.scheduler.'):\n"
            "    importlib.import_module(m.name)\n")
    proc = run_blocked(body, ("vllm",))
    assert proc.returncode == 0, f"a scheduler module imports vLLM:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("module", WITHOUT_ZMQ)
def test_handshake_messages_import_without_vllm_or_zmq(module: str) -> None:
    proc = import_blocked(module, ("vllm", "zmq"))
    assert proc.returncode == 0, f"{module} needs vLLM or zmq:\n{proc.stderr[-3000:]}"


def test_step_facts_pickle_as_vllm_sends_them_to_workers() -> None:
    """vLLM pickles the step's connector metadata to every worker process; the
    facts the worker reads survive the trip, and an empty step stays falsy."""
    step = StepFacts(7)
    assert not step
    step.recv_abort.append(RecvAbort(req="r1", awaited=True))
    step.send_finish.append(SendFinish(req="r2", ok=True, block_ids=(3, 4), pinned_ns=5))
    back = pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
    assert back and back.step == 7
    assert (back.recv_abort, back.send_finish) == (step.recv_abort, step.send_finish)
    assert back.recv_start == back.recv_abandon == back.send_start == back.heartbeats == []


def test_vllms_connector_metadata_is_the_step_facts() -> None:
    require("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    from kvsm.vllm.metadata import KVSMConnectorMetadata

    meta = KVSMConnectorMetadata(3)
    assert isinstance(meta, KVConnectorMetadata) and isinstance(meta, StepFacts) and not meta
    meta.send_finish.append(SendFinish(req="r", ok=False, reason="aborted"))
    back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(back) is KVSMConnectorMetadata and back and back.step == 3
    assert back.send_finish == meta.send_finish
    assert repr(back).startswith("KVSMConnectorMetadata(step=3, ")
