"""kvsm's settings (``KVSMConfig``) and the keys operators may set.

They are read from vLLM's config, checked once, in one place, by the vLLM
adapter (``kvsm.vllm.config.kvsm_config``).

Operators set kvsm's knobs in ``kv_connector_extra_config`` (the keys below);
upstream ``NixlConnector``'s environment variables for the side channel are
honoured as fallbacks so an existing deployment keeps its ports. A bad value
raises ``ValueError`` naming the key and what was wrong, at engine start,
rather than surfacing as a confusing failure on the first request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
    "kv_recompute_threshold": "decode side: a request with fewer remote tokens to load than this computes its "
                              "prompt here and the prefill side unpins at once (upstream's key; 0: off, the "
                              "default)",
    "side_channel_keys": "directory of the deployment's CURVE keys (zmq.auth certificates, or env "
                         "KVSM_SIDE_CHANNEL_KEYS): only engines holding one get an answer; unset: the side "
                         "channel answers any host that reaches it (docs: security)",
    "side_channel_keys_reload": "seconds between checks of that directory for rotated keys (2)",
    "bidirectional_kv_xfer": "decode-to-prefill reuse (upstream's key; needs kv_role 'kv_both' on both engines): a "
                             "finished decode request's blocks are held and its params let the next turn's prefill "
                             "read them (false)",
    "decoder_kv_blocks_ttl": "seconds a decode engine holds a finished request's blocks for the next turn (480, "
                             "upstream's key)",
    "decoder_kv_hold_blocks": "decode side: at most this many blocks held for next turns; beyond it the oldest "
                              "unclaimed holds are released (a quarter of the engine's KV cache)",
    "transfer_mode": "'pull' (the decode engine reads the prefill engine's blocks) or 'push' (the prefill "
                     "engine writes them into the decode engine's blocks); a request's kv_transfer_params may "
                     "say either (pull)",
    "early_reads": "decode side: post a request's reads right behind its claims when every prefill worker it "
                   "reads from is known, instead of after the claims' answers (true)",
}

DEFAULT_SIDE_CHANNEL_PORT = 5600
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
TRANSFER_MODES = ("pull", "push")
BUFFER_DEVICES = ("cpu", "cuda")


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
    # Fewer remote tokens to load than this: computed here (upstream's kv_recompute_threshold; 0: off).
    recompute_threshold: int = 0
    # The deployment's CURVE keys (a directory, kvsm.handshake.keys), checked every
    # side_channel_keys_reload_s for a rotation; None: the side channel is open.
    side_channel_keys: str | None = None
    side_channel_keys_reload_s: float = 2.0
    # Decode-to-prefill reuse (bidirectional_kv_xfer): a finished decode request's
    # blocks are held (at most hold_ttl_s, and at most hold_budget_blocks blocks of
    # all holds; 0: a quarter of the engine's KV cache, set by the adapter).
    bidirectional: bool = False
    # How a request's KV moves when its params do not say (transfer_mode): "pull",
    # the decode worker reads; "push", the prefill worker writes into the decode's blocks.
    transfer_mode: str = "pull"
    hold_ttl_s: float = 480.0
    hold_budget_blocks: int = 0

    @property
    def produces(self) -> bool:
        """This engine may serve its blocks to a decode engine (do_remote_decode)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        """This engine may read a prefill engine's blocks (do_remote_prefill)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def hold_ttl_ns(self) -> int:
        return int(self.hold_ttl_s * 1e9)

    @property
    def lease_ns(self) -> int:
        return int(self.lease_s * 1e9)

    def event_log_path(self, role: str, rank: int = 0) -> str | None:
        """This process's event-log file, or None when logging is off.

        One file per process and role: ``<engine_id>.<role>[.rank<r>].<pid>.jsonl``.
        The pid keeps a restarted engine from appending to its predecessor's file
        (whose ``seq`` would then restart mid-file)."""
        if not self.event_log_dir:
            return None
        suffix = f".rank{rank}" if role == "worker" else ""
        return os.path.join(self.event_log_dir, f"{self.engine_id}.{role}{suffix}.{os.getpid()}.jsonl")
