"""vLLM plugin entry point: makes ``"kv_connector": "KVSMConnector"`` work
without ``kv_connector_module_path`` once kvsm is installed.

vLLM calls every ``vllm.general_plugins`` entry point in each of its
processes (API server, engine core, workers), so this must be idempotent and
cheap: it registers a lazy loader and imports nothing heavy.

The name ``NixlConnector`` in this module (``kvsm.vllm.plugin.NixlConnector``) is
``KVSMConnector`` again, for routers that accept only connector names they know
(NVIDIA Dynamo looks ``kv_connector`` up in its own table and refuses every
other name with "Unsupported kv_connector"):
``{"kv_connector": "NixlConnector", "kv_connector_module_path": "kvsm.vllm.plugin"}``
runs kvsm. vLLM's ``KVConnectorFactory`` takes a module path before its
registry and fetches the class named ``kv_connector`` from that module, so the
registry is left alone: a config without the module path still gets upstream's
``NixlConnector``. It is resolved on first access (PEP 562), so importing this
module stays cheap. vLLM also keys some NIXL-specific config on the name
(``KVTransferConfig.has_connector("NixlConnector")``: the CPU platform's
``VLLM_SSM_CONV_STATE_LAYOUT`` default, its DCP checks); use the same spelling
on both sides of a deployment (kvsm's compatibility hash carries the conv-state
layout, so a mismatch is refused at the handshake, not read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from kvsm.vllm.connector import KVSMConnector

CONNECTOR_NAME = "KVSMConnector"
# Loaded through kv_connector_module_path only; never registered under this name.
NIXL_ALIAS = "NixlConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvsm.connector", "KVSMConnector")


def __getattr__(name: str) -> type[KVSMConnector]:
    if name == NIXL_ALIAS:
        from kvsm.vllm.connector import KVSMConnector

        return KVSMConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
