"""Reading vLLM's config: ``kvsm_config`` turns vLLM's ``kv_transfer_config``
(its ``kv_connector_extra_config`` keys, ``kvsm.config.EXTRA_KEYS``) and
parallel, cache and model configs into ``KVSMConfig``. Upstream
``NixlConnector``'s side-channel environment variables are honoured as
fallbacks, so an existing deployment keeps its ports. vLLM's objects are read
by attribute: nothing here imports vLLM."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvsm.config import BUFFER_DEVICES, DEFAULT_SIDE_CHANNEL_PORT, EXTRA_KEYS, KV_ROLES, TRANSFER_MODES, KVSMConfig
from kvsm.handshake.keys import load_keys


def _num_threads(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise ValueError(f"kv_connector_extra_config['num_threads'] must be an integer from 0 to 64, got {value!r}")
    return value


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def _positive(key: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}") from None
    if not number > 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be > 0, got {value!r}")
    return number


def _total_kv_heads(vllm_config: Any) -> int:
    try:
        return max(1, int(vllm_config.model_config.get_total_num_kv_heads()))
    except (AttributeError, TypeError, ValueError):
        return 1


def _port(where: str, value: Any) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a port number, got {value!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{where} must be in 1..65535, got {port}")
    return port



def kvsm_config(vllm_config: Any, env: Mapping[str, str] | None = None) -> KVSMConfig:
    """kvsm's settings from vLLM's config (``env``: the environment, for upstream's
    side-channel variables); a bad value raises ValueError naming its key."""
    env = os.environ if env is None else env
    kvt = vllm_config.kv_transfer_config
    if kvt is None:
        raise ValueError("KVSMConnector needs a kv_transfer_config")
    extra: dict[str, Any] = dict(kvt.kv_connector_extra_config or {})
    role = kvt.kv_role
    if role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {KV_ROLES}, got {role!r}")
    device = str(kvt.kv_buffer_device or "cpu")
    if device not in BUFFER_DEVICES:
        raise ValueError(f"kv_buffer_device must be one of {BUFFER_DEVICES}, got {device!r}")
    parallel = vllm_config.parallel_config
    dp_rank = int(getattr(parallel, "data_parallel_index", 0) or 0)
    tp_size = int(parallel.tensor_parallel_size)
    host = extra.get("side_channel_host") or env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost"
    if "side_channel_port" in extra:
        base = _port("kv_connector_extra_config['side_channel_port']", extra["side_channel_port"])
    else:
        base = _port("VLLM_NIXL_SIDE_CHANNEL_PORT",
                     env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_SIDE_CHANNEL_PORT))
    # One port per engine, as upstream: data-parallel engine i listens on base + i,
    # its rank 0 serving every rank (kvsm.handshake.relay).
    port = base + dp_rank
    if port > 65535:
        raise ValueError(f"side-channel port {base} + data-parallel index {dp_rank} exceeds 65535")
    lease = _positive("kv_lease_duration", extra.get("kv_lease_duration", 30))
    heartbeat = _positive("heartbeat_interval", extra.get("heartbeat_interval", lease / 6))
    if heartbeat >= lease:
        raise ValueError(f"heartbeat_interval ({heartbeat} s) must be shorter than "
                         f"kv_lease_duration ({lease} s), or leases expire between heartbeats")
    backoff = _positive("peer_backoff", extra.get("peer_backoff", 1.0))
    backoff_max = _positive("peer_backoff_max", extra.get("peer_backoff_max", 30.0))
    if backoff_max < backoff:
        raise ValueError(f"peer_backoff_max ({backoff_max}) is below peer_backoff ({backoff})")
    log_dir = extra.get("event_log_dir") or env.get("KVSM_EVENT_LOG_DIR") or None
    keys_dir = extra.get("side_channel_keys") or env.get("KVSM_SIDE_CHANNEL_KEYS") or None
    if keys_dir is not None:
        if not isinstance(keys_dir, str):
            raise ValueError(f"kv_connector_extra_config['side_channel_keys'] must be a directory path, "
                             f"got {keys_dir!r:.80}")
        load_keys(keys_dir)  # raises SideChannelKeysError (a ValueError) naming what is wrong
    bidirectional = _flag("bidirectional_kv_xfer", extra.get("bidirectional_kv_xfer", False))
    if bidirectional and role != "kv_both":
        raise ValueError(f"kv_connector_extra_config['bidirectional_kv_xfer'] needs kv_role 'kv_both' (got {role!r}): "
                         f"the decode engine serves the blocks it holds and the prefill engine reads them, so both "
                         f"engines serve and read")
    if bidirectional and str(getattr(kvt, "kv_load_failure_policy", "fail")) != "recompute":
        raise ValueError("kv_connector_extra_config['bidirectional_kv_xfer'] needs kv_load_failure_policy "
                         "'recompute': a next turn whose held blocks are gone (expired, or released under memory "
                         "pressure) must compute its prompt, not fail")
    mode = extra.get("transfer_mode", "pull")
    if mode not in TRANSFER_MODES:
        raise ValueError(f"kv_connector_extra_config['transfer_mode'] must be one of {list(TRANSFER_MODES)}, "
                         f"got {mode!r:.80}")
    if mode == "push" and bidirectional:
        raise ValueError("kv_connector_extra_config['transfer_mode'] 'push' with 'bidirectional_kv_xfer': a next "
                         "turn reads the decode engine's held blocks, which push mode does not serve (upstream "
                         "refuses the pair too)")
    backends = extra.get("backends", ["UCX"])
    if isinstance(backends, str) or not all(isinstance(b, str) for b in backends):
        raise ValueError(f"kv_connector_extra_config['backends'] must be a list of names, got {backends!r}")
    return KVSMConfig(
        engine_id=str(kvt.engine_id),
        kv_role=role,
        kv_buffer_device=device,
        side_channel_host=str(host),
        side_channel_port=port,
        lease_s=lease,
        heartbeat_interval_s=heartbeat,
        handshake_timeout_s=_positive("handshake_timeout", extra.get("handshake_timeout", 5.0)),
        transfer_timeout_s=_positive("transfer_timeout", extra.get("transfer_timeout", 30.0)),
        peer_backoff_s=backoff,
        peer_backoff_max_s=backoff_max,
        notif_poll_interval_s=_positive("notif_poll_interval_ms", extra.get("notif_poll_interval_ms", 1)) / 1000,
        event_log_dir=str(log_dir) if log_dir else None,
        backends=tuple(backends),
        tp_size=tp_size,
        dp_rank=dp_rank,
        pp_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
        dcp_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
        block_size=int(vllm_config.cache_config.block_size),
        kv_load_failure_policy=str(getattr(kvt, "kv_load_failure_policy", "fail")),
        kv_heads=_total_kv_heads(vllm_config),
        tp_share="replicated" if getattr(vllm_config.model_config, "use_mla", False) else "heads",
        stall_timeout_s=_positive("stall_timeout", extra.get("stall_timeout", 2.0)),
        num_threads=_num_threads(extra.get("num_threads", 0)),
        early_reads=_flag("early_reads", extra.get("early_reads", True)),
        recompute_threshold=_count("kv_recompute_threshold", extra.get("kv_recompute_threshold", 0)),
        side_channel_keys=os.path.abspath(keys_dir) if keys_dir else None,
        side_channel_keys_reload_s=_positive("side_channel_keys_reload", extra.get("side_channel_keys_reload", 2.0)),
        bidirectional=bidirectional,
        transfer_mode=str(mode),
        hold_ttl_s=_positive("decoder_kv_blocks_ttl", extra.get("decoder_kv_blocks_ttl", 480.0)),
        hold_budget_blocks=_count("decoder_kv_hold_blocks", extra.get("decoder_kv_hold_blocks", 0)),
    )

def _count(key: str, value: Any) -> int:
    """A non-negative whole number of tokens (an int, or a float that is one: JSON)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not value.is_integer()) or value < 0):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a non-negative integer, got {value!r}")
    return int(value)


def unknown_extra_keys(vllm_config: Any) -> list[str]:
    """kv_connector_extra_config keys kvsm does not know (reported at start)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return sorted(k for k in extra if k not in EXTRA_KEYS)
