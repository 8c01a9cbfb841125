"""The module path routers that only know ``NixlConnector`` are given:
``{"kv_connector": "NixlConnector", "kv_connector_module_path": "kvsm.plugin"}``
runs kvsm (``NixlConnector`` here is ``KVSMConnector``). The plugin itself,
and why the alias works, live in the vLLM adapter: ``kvsm.vllm.plugin``."""

from __future__ import annotations

from typing import Any

from kvsm.vllm import plugin as _plugin
from kvsm.vllm.plugin import CONNECTOR_NAME, NIXL_ALIAS, register

__all__ = ["CONNECTOR_NAME", "NIXL_ALIAS", "register"]


def __getattr__(name: str) -> Any:
    return getattr(_plugin, name)
