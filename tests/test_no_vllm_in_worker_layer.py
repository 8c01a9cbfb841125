"""The worker layer runs without vLLM: the simulation and the worker's own tests
import it in processes where vLLM is absent (or too slow to import), so a vLLM
import creeping into it must fail here, not there.

Each check runs in a fresh interpreter with ``sys.modules['vllm'] = None``, so
that any ``import vllm...`` raises ImportError; the handshake's messages and
codec are also checked with zmq blocked the same way. Only the vLLM adapters
(``kvsm.vllm.metadata``, ``kvsm.vllm.stats``, ``kvsm.connector``, ``kvsm.vllm.plugin``)
may import vLLM.
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

WORKER_LAYER = ["kvsm.worker.stats", "kvsm.handoff.facts", "kvsm.handoff.pins", "kvsm.transport.memory",
                "kvsm.lifecycle", "kvsm.scheduler",
                "kvsm.eventlog"]
WITHOUT_ZMQ = ["kvsm.handshake.messages", "kvsm.handshake.codec"]


def import_blocked(module: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """Import ``module`` in a fresh interpreter in which every package in ``blocked`` is unimportable."""
    code = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
            f"import importlib\nimportlib.import_module({module!r})\n"
            f"leaked = sorted(m for m in sys.modules\n"
            f"                if m.split('.')[0] in {blocked!r} and sys.modules[m] is not None)\n"
            f"assert not leaked, leaked\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("module", WORKER_LAYER)
def test_worker_layer_module_imports_without_vllm(module: str) -> None:
    proc = import_blocked(module, ("vllm",))
    assert proc.returncode == 0, f"{module} needs vLLM:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("module", WITHOUT_ZMQ)
def test_handshake_messages_import_without_vllm_or_zmq(module: str) -> None:
    proc = import_blocked(module, ("vllm", "zmq"))
    assert proc.returncode == 0, f"{module} needs vLLM or zmq:\n{proc.stderr[-3000:]}"


def test_worker_imports_without_vllm() -> None:
    proc = import_blocked("kvsm.worker", ("vllm",))
    assert proc.returncode == 0, f"kvsm.worker needs vLLM:\n{proc.stderr[-3000:]}"


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
