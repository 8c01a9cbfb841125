"""What a simulation is asked to do (``SimConfig``, ``Faults``) and what it found (``SimResult``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsm.lifecycle.invariants import InvariantViolation
from kvsm.lifecycle.machine import Outcome

MS = 1_000_000
S = 1_000_000_000


@dataclass(frozen=True)
class Faults:
    """Per-request probabilities of each fault (0 = never).

    Every fault reaches the real workers through their real inputs: what vLLM
    decides (aborts, finishes, allocations, steps), what the peer's address and
    engine id say, and what the in-memory fabric does to a read.
    """

    prefill_abort: float = 0.0  # the client goes away while prefilling
    prefill_abnormal: float = 0.0  # prefill ends by error: nothing to pin
    pin_late: float = 0.0  # the pin goes with a later engine step, not straight to the worker
    decode_never: float = 0.0  # the decode request never comes: the lease expires
    decode_late: float = 0.0  # it comes after the lease expired
    decode_queued: float = 0.0  # it waits for blocks longer than a lease: heartbeats keep the pin
    decode_abort: float = 0.0  # the client aborts the decode request at a random time
    nothing_to_read: float = 0.0  # full local prefix hit on the decode engine
    handshake_error: float = 0.0  # kv_transfer_params name an engine the server is not (restarted)
    handshake_silent: float = 0.0  # nobody listens at the address: handshake timeout
    peer_dead: float = 0.0  # a read fails as a disconnected peer: the worker takes the peer for dead
    transfer_error: float = 0.0
    transfer_hang: float = 0.0  # never completes: transfer timeout, then cancel
    # completes late (half of them seconds late, around the transfer timeout) and cannot be
    # cancelled meanwhile
    transfer_stuck: float = 0.0
    transfer_corrupt: float = 0.0  # one byte flipped on the wire (must be detected)

    @classmethod
    def mixed(cls, p: float = 0.05) -> Faults:
        """Every fault that a correct connector survives, each with probability ``p``."""
        return cls(**{name: p for name in cls.__dataclass_fields__ if name != "transfer_corrupt"})


# The decode-side faults; a decode request gets at most one, tried in this order.
DECODE_FAULTS = ("handshake_error", "handshake_silent", "peer_dead", "transfer_error", "transfer_hang",
                 "transfer_stuck", "transfer_corrupt", "nothing_to_read")


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    num_requests: int = 50
    faults: Faults = Faults()
    block_bytes: int = 32
    num_blocks: int = 2048
    max_blocks_per_request: int = 6
    # KV cache groups (vLLM's hybrid KV cache manager): each request's blocks are
    # split over them (``kvsm_testing.sim.engines.group_split``), one pool for all.
    kv_groups: int = 1
    # Tokens per block on the prefill and on the decode engine when they differ
    # (None: both BLOCK_TOKENS, blocks of block_bytes moved whole). Blocks then hold
    # tokens as kvsm_testing.sim.engines.SIM_PLANES lays them out, and the decode side reads
    # them in segments, paired by kvsm.scheduler.block_pairing as kvsm's scheduler pairs them.
    # One KV cache group only (as kvsm's scheduler: segments are for one group).
    block_tokens: tuple[int, int] | None = None
    # The share of requests in push mode (the prefill worker writes into the decode
    # worker's blocks; transfer_mode "push"), the rest pull.
    push: float = 0.0
    # The share of requests streamed (transfer_mode "stream": the router sends both
    # legs at once, the prefill worker writes each layer as its forward pass computes
    # it, step by step; kvsm_testing.sim.stream). Their engines' blocks are split into
    # ``stream_layers`` layers, and a prompt is computed in up to ``stream_max_steps``
    # steps. Blocks of one size, one KV cache group (as streamed push needs).
    stream: float = 0.0
    stream_layers: int = 2
    stream_max_steps: int = 3
    # Streamed layer writes land out of the order they were posted: each takes up to
    # this many times its wire latency longer (0: a request's writes land in order).
    # NIXL orders a write's notification after that write's bytes, none after another's.
    stream_reorder: float = 0.0
    # The share of streamed requests vLLM preempts between two of their steps: it
    # frees their blocks (others may take them at once) and computes them again from
    # their first token, later, into new blocks (``StreamPreempted`` in the facts).
    stream_preempt: float = 0.0
    arrival_gap_ns: int = 1 * MS
    lease_ns: int = 30 * S
    handshake_timeout_ns: int = 2 * S
    transfer_timeout_ns: int = 5 * S
    heartbeat_ns: int = 5 * S
    wire_latency_ns: int = 300_000
    # How long the decode worker fails a dead peer's requests fast (doubling, to
    # 16x): short, so that one peer death fails the requests in flight and the
    # few that follow, not the rest of the run.
    peer_backoff_ns: int = 2 * MS
    notif_poll_ns: int = 1 * MS
    log_dir: Path | None = None
    strict: bool = False  # raise at the first illegal event instead of recording it
    # Virtual time after which the run stops (None: long enough for every
    # request to end by its timeouts); what is still live then is a violation.
    max_virtual_ns: int | None = None

    def __post_init__(self) -> None:
        if self.stream and (self.block_tokens is not None or self.kv_groups != 1
                            or self.stream_layers < 1 or self.block_bytes % self.stream_layers
                            or self.stream_max_steps < 1):
            raise ValueError("streamed requests need blocks of one size, one KV cache group, and blocks of "
                             "block_bytes that split evenly into stream_layers layers, one or more steps")

    def horizon_ns(self) -> int:
        if self.max_virtual_ns is not None:
            return self.max_virtual_ns
        timeouts = self.handshake_timeout_ns + 2 * self.transfer_timeout_ns
        return self.num_requests * self.arrival_gap_ns + 4 * self.lease_ns + 10 * timeouts + 60 * S


@dataclass
class SimResult:
    final_states: dict[tuple[str, str, str], str]  # (engine_id, lifecycle, req) -> state
    violations: list[InvariantViolation]
    illegal_events: list[Outcome]
    log_paths: list[Path]
    end_ns: int
    steps: int

    def count(self, lifecycle: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, lc, _), state in self.final_states.items():
            if lc == lifecycle:
                out[state] = out.get(state, 0) + 1
        return dict(sorted(out.items()))
