"""Everything the connector reads from vLLM's config, checked once, in one place.

Operators set kvsm's knobs in ``kv_connector_extra_config`` (the keys below);
upstream ``NixlConnector``'s environment variables for the side channel are
honoured as fallbacks so an existing deployment keeps its ports. A bad value
raises ``ValueError`` naming the key and what was wrong, at engine start,
rather than surfacing as a confusing failure on the first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# kv_connector_extra_config keys kvsm understands (anything else is reported).
EXTRA_KEYS: dict[str, str] = {
    "side_channel_host": "host the prefill side's handshake server binds and advertises",
    "side_channel_port": "base port: data-parallel engine i listens on base + i, whatever its TP size",
    "kv_lease_duration": "seconds the prefill side keeps a finished request's blocks pinned (30)",
    "heartbeat_interval": "seconds between decode-side lease heartbeats (lease / 6)",
    "handshake_timeout": "seconds a decode request may wait for its handshake and claim (5)",
    "transfer_timeout": "seconds a decode request's reads may take (30)",
    "stall_timeout": "seconds a prefill peer may leave a liveness probe unanswered while reads from it are in "
                     "flight before it is taken for unreachable (2)",
    "peer_backoff": "seconds a dead peer is failed fast before it is tried again (1, doubling)",
    "peer_backoff_max": "upper bound of that back-off in seconds (30)",
    "notif_poll_interval_ms": "how often the prefill loop polls NIXL notifications while blocks are pinned (1)",
    "event_log_dir": "directory of the per-process event logs (or env KVSM_EVENT_LOG_DIR; off when unset)",
    "backends": "NIXL backends (['UCX'])",
    "num_threads": "UCX backend worker threads of each NIXL agent, as upstream's key (0: none, the loop "
                   "progresses UCX itself)",
    "early_reads": "decode side: post a request's reads right behind its claims when every prefill worker it "
                   "reads from is known, instead of after the claims' answers (true)",
}

DEFAULT_SIDE_CHANNEL_PORT = 5600
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
BUFFER_DEVICES = ("cpu", "cuda")


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


@dataclass(frozen=True)
class KVSMConfig:
    """kvsm's settings for one engine (the same in its scheduler and workers)."""

    engine_id: str
    kv_role: str
    kv_buffer_device: str
    side_channel_host: str
    side_channel_port: int
    lease_s: float
    heartbeat_interval_s: float
    handshake_timeout_s: float
    transfer_timeout_s: float
    peer_backoff_s: float
    peer_backoff_max_s: float
    notif_poll_interval_s: float
    event_log_dir: str | None
    backends: tuple[str, ...]
    tp_size: int
    dp_rank: int
    pp_size: int
    dcp_size: int
    block_size: int
    kv_load_failure_policy: str
    # The model's KV heads (all ranks together), and how a tensor parallel rank
    # holds them: "heads" (split, heads-major blocks), "replicated" (MLA's latent:
    # every rank all of it), or "none: <why>" (no reading across TP sizes).
    kv_heads: int = 1
    tp_share: str = "heads"
    # Reads in flight longer than a quarter of this get their peer probed over the
    # side channel; a probe unanswered this long marks the peer dead, which settles
    # the reads (a partition stalls a NIXL read silently, for as long as TCP retries).
    stall_timeout_s: float = 2.0
    # UCX backend worker threads per NIXL agent (upstream's num_threads key). They
    # sleep while idle (measured: 0.0 CPU-s per s with 4) and split a read's
    # descriptors between them.
    num_threads: int = 0
    # Post a request's reads right behind its claims when every prefill worker it
    # reads from is known (their round trip then overlaps the reads); the prefill
    # side holds such a read's notification until its claim.
    early_reads: bool = True

    @property
    def produces(self) -> bool:
        """This engine may serve its blocks to a decode engine (do_remote_decode)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        """This engine may read a prefill engine's blocks (do_remote_prefill)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def lease_ns(self) -> int:
        return int(self.lease_s * 1e9)

    @classmethod
    def from_vllm(cls, vllm_config: Any, env: Mapping[str, str] | None = None) -> KVSMConfig:
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
        backends = extra.get("backends", ["UCX"])
        if isinstance(backends, str) or not all(isinstance(b, str) for b in backends):
            raise ValueError(f"kv_connector_extra_config['backends'] must be a list of names, got {backends!r}")
        return cls(
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
        )

    def unknown_extra_keys(self, vllm_config: Any) -> list[str]:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return sorted(k for k in extra if k not in EXTRA_KEYS)

    def event_log_path(self, role: str, rank: int = 0) -> str | None:
        """This process's event-log file, or None when logging is off.

        One file per process and role: ``<engine_id>.<role>[.rank<r>].<pid>.jsonl``.
        The pid keeps a restarted engine from appending to its predecessor's file
        (whose ``seq`` would then restart mid-file)."""
        if not self.event_log_dir:
            return None
        suffix = f".rank{rank}" if role == "worker" else ""
        return os.path.join(self.event_log_dir, f"{self.engine_id}.{role}{suffix}.{os.getpid()}.jsonl")
