"""What the scheduler half tells the worker half each step (vLLM's side of it).

Each step the scheduler relays the new facts (``kvsm.handoff.facts``) inside
``KVSMConnectorMetadata``, which vLLM pickles to the workers or hands over
in-process; the worker turns each into a lifecycle event. Nothing here holds
a reference to a vLLM object. The facts and the step (``StepFacts``, all the
worker reads) live in ``kvsm.handoff.facts`` (no vLLM import) and are re-exported
here; this module only adds vLLM's base class.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvsm.handoff.facts import (
    REQUIRED_REMOTE_KEYS,
    BadTransferParams,
    HeartbeatTarget,
    RecvAbandon,
    RecvAbort,
    RecvStart,
    RemoteParams,
    SendFinish,
    SendStart,
    StepFacts,
    parse_remote_params,
)

__all__ = [
    "REQUIRED_REMOTE_KEYS",
    "BadTransferParams",
    "HeartbeatTarget",
    "KVSMConnectorMetadata",
    "RecvAbandon",
    "RecvAbort",
    "RecvStart",
    "RemoteParams",
    "SendFinish",
    "SendStart",
    "StepFacts",
    "parse_remote_params",
]


class KVSMConnectorMetadata(StepFacts, KVConnectorMetadata):
    """One step's facts from the scheduler half to every worker, as vLLM's
    connector metadata. Everything (slots, pickling, ``__bool__``, repr) is
    ``StepFacts``'; this class only adds the base vLLM checks for. StepFacts
    comes first so that its methods win over anything a vLLM base (or a test's
    stand-in for it) defines."""

    __slots__ = ()
