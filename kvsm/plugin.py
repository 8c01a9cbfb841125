"""vLLM plugin entry point: makes ``"kv_connector": "KVSMConnector"`` work
without ``kv_connector_module_path`` once kvsm is installed.

vLLM calls every ``vllm.general_plugins`` entry point in each of its
processes (API server, engine core, workers), so this must be idempotent and
cheap: it registers a lazy loader and imports nothing heavy.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVSMConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvsm.connector", "KVSMConnector")
