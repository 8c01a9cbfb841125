"""What the scheduler half tells the worker half each step (vLLM's side of it).

Each step the scheduler relays the new facts (``kvsm.facts``) inside
``KVSMConnectorMetadata``, which vLLM pickles to the workers or hands over
in-process; the worker turns each into a lifecycle event. Nothing here holds
a reference to a vLLM object. The facts themselves live in ``kvsm.facts``
(no vLLM import) and are re-exported here.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvsm.facts import (
    REQUIRED_REMOTE_KEYS,
    BadTransferParams,
    HeartbeatTarget,
    RecvAbandon,
    RecvAbort,
    RecvStart,
    RemoteParams,
    SendFinish,
    SendStart,
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
    "parse_remote_params",
]


class KVSMConnectorMetadata(KVConnectorMetadata):
    """One step's facts from the scheduler half to every worker."""

    __slots__ = ("heartbeats", "recv_abandon", "recv_abort", "recv_start", "send_finish", "send_start", "step")

    def __init__(self, step: int) -> None:
        self.step = step
        self.recv_start: list[RecvStart] = []
        self.recv_abort: list[RecvAbort] = []
        self.recv_abandon: list[RecvAbandon] = []
        self.send_start: list[SendStart] = []
        self.send_finish: list[SendFinish] = []
        self.heartbeats: list[HeartbeatTarget] = []

    def __bool__(self) -> bool:
        return bool(self.recv_start or self.recv_abort or self.recv_abandon or self.send_start
                    or self.send_finish or self.heartbeats)

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in self.__slots__:
            setattr(self, name, state[name])

    def __repr__(self) -> str:
        return (f"KVSMConnectorMetadata(step={self.step}, recv_start={len(self.recv_start)}, "
                f"recv_abort={len(self.recv_abort)}, recv_abandon={len(self.recv_abandon)}, "
                f"send_start={len(self.send_start)}, send_finish={len(self.send_finish)}, "
                f"heartbeats={len(self.heartbeats)})")
