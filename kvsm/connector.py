"""The module path vLLM is given (``"kv_connector_module_path": "kvsm.connector"``):
the connector itself lives in the vLLM adapter, ``kvsm.vllm.connector``."""

from kvsm.vllm.connector import KVSMConnector

__all__ = ["KVSMConnector"]
