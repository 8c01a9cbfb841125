"""What the scheduler half tells the workers, and kv_transfer_params: plain data.

The scheduler sees vLLM's decisions (a remote prefill was matched and its
blocks allocated, a request finished or was aborted); the worker owns the
lifecycle machines and all I/O. The facts are plain msgspec structs, so the
worker layer, the pin channel and the simulation use them without vLLM.
``StepFacts`` is one step's worth; ``kvsm.vllm.metadata`` adds vLLM's base class.

``parse_remote_params`` reads the ``kv_transfer_params`` a router forwards
from the prefill engine, in upstream ``NixlConnector``'s format, and says
exactly which key is missing or wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec


class _RemoteRequest(msgspec.Struct, frozen=True):
    """A local decode request and the prefill request (and engine) it reads from."""

    req: str
    remote_engine: str
    remote_req: str
    remote_host: str
    remote_port: int
    remote_tp_size: int


class RecvStart(_RemoteRequest, frozen=True):
    """Decode side: vLLM matched ``num_tokens`` remote tokens and allocated
    ``local_block_ids`` for them (empty: a full local prefix hit, notify only)."""

    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_tokens: int
    # vLLM parked the request in WAITING_FOR_REMOTE_KVS and waits for it in
    # finished_recving; False for a full local hit (reporting it would be wrong).
    awaited: bool
    # Several KV cache groups (vLLM's hybrid KV cache manager): the block ids above
    # are that many of each group in turn, pairwise (the null block never among
    # them). Empty: one group. Block ids are unique across groups (one block pool).
    group_sizes: tuple[int, ...] = ()
    # Non-empty: why these blocks cannot be read as asked (the scheduler saw it, e.g.
    # a block to load that the prefill side no longer holds); the worker fails it.
    problem: str = ""
    # The engines' block sizes differ (one group only): pair i fills segment
    # ``local_segments[i]`` of its local block from segment ``remote_segments[i]``
    # of its remote block, each ``segment_tokens`` tokens (the smaller block size),
    # and a block id may appear once per segment. Empty: whole blocks.
    segment_tokens: int = 0
    local_segments: tuple[int, ...] = ()
    remote_segments: tuple[int, ...] = ()
    block_sizes: tuple[int, int] = (0, 0)  # (local, remote) tokens per block when segmented
    # The prefill engine's pipeline parallel stages: each holds a run of the model's
    # layers, and the request reads each stage's from that stage's workers.
    remote_pp_size: int = 1
    # When the prefill side said its lease ends (the params' remote_blocks_expiry_time:
    # wall clock, s, upstream's unit; 0: not said). Advisory: reads are not posted
    # ahead of their claims past it (their claims would likely be refused); the
    # claim's answer decides. Read as ``remote_expiry_ns``.
    remote_expiry_s: float = 0.0
    # transfer_mode "push": the prefill workers write the blocks instead of our reading them.
    push: bool = False
    # transfer_mode "stream": push while the prefill computes. ``remote_req`` is then the
    # join key both legs carry (the prefill engine names its request itself), there are
    # no remote blocks, and ``local_block_ids`` are those of positions ``first_position`` on
    # (several KV cache groups: group after group, ``group_sizes`` of them, each from its
    # own first position, ``group_firsts``; ``first_position`` is then the least).
    stream: bool = False
    first_position: int = 0
    group_firsts: tuple[int, ...] = ()

    @property
    def remote_expiry_ns(self) -> int:
        """``remote_expiry_s`` in kvsm's unit (wall clock ns; 0: not said): the one
        conversion of the params' seconds."""
        return int(self.remote_expiry_s * 1e9)

    def group_block_ids(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(local, remote) block ids of each KV cache group."""
        if not self.group_sizes:
            return [(self.local_block_ids, self.remote_block_ids)]
        out, at = [], 0
        for n in self.group_sizes:
            out.append((self.local_block_ids[at:at + n], self.remote_block_ids[at:at + n]))
            at += n
        return out


class RecvAbort(msgspec.Struct, frozen=True):
    """Decode side: vLLM finished a request whose transfer was started.
    ``awaited``: vLLM keeps its blocks until finished_recving names it."""

    req: str
    awaited: bool


class RecvAbandon(_RemoteRequest, frozen=True):
    """Decode side: a remote-prefill request ended before any block was
    allocated; the prefill side must be told so it can unpin at once."""

    remote_pp_size: int = 1


class SendStart(msgspec.Struct, frozen=True):
    """Prefill side: a ``do_remote_decode`` request got its first blocks.
    ``stream``: its join key (transfer_mode "stream"; a decode worker names it so)."""

    req: str
    stream: str = ""


# A streamed prefill's position whose block is not written (``StreamStep``).
UNWRITTEN = -1


class StreamStep(msgspec.Struct, frozen=True):
    """Prefill side, transfer_mode "stream": this step computes the prompt's tokens
    ``start`` to ``end`` of ``req`` (``last``: the prompt's last ones), whose blocks
    by position are ``block_ids``, one tuple per KV cache group. A position its
    decode side never reads (a sliding window's, before the window of the prompt's
    last token) is ``UNWRITTEN``: vLLM may free it under the prefill mid-prompt.
    Each layer's KV can be written once its forward pass is done (``save_kv_layer``)."""

    req: str
    block_ids: tuple[tuple[int, ...], ...]
    start: int
    end: int
    last: bool


class StreamPreempted(msgspec.Struct, frozen=True):
    """Prefill side, transfer_mode "stream": vLLM preempted ``req`` and freed its
    blocks (at ``at_ns`` at the latest, CLOCK_MONOTONIC: the scheduler's step).
    The next step may compute other requests into them, so a write from them not
    seen over before then may carry those bytes; the request is computed again
    later, into the blocks its later ``StreamStep`` names."""

    req: str
    at_ns: int


class SendFinish(msgspec.Struct, frozen=True):
    """Prefill side: the request finished. ``ok``: its blocks are pinned for
    the decode side (``block_ids``) from ``pinned_ns`` (the scheduler's
    monotonic clock when it decided, which starts the lease); otherwise
    nothing is pinned. Sent straight to the workers (``kvsm.handoff.pins``),
    or with the next step when no worker could be reached directly."""

    req: str
    ok: bool
    block_ids: tuple[int, ...] = ()
    reason: str = ""
    pinned_ns: int = 0
    # A decode engine's hold for a next turn (bidirectional_kv_xfer): pinned for
    # ``lease_ns`` (its time to live; 0: the engine's lease); ``release``: the
    # scheduler releases that hold (``reason`` why), ``lease_ns`` then the lease
    # a claim granted before may still read in.
    lease_ns: int = 0
    hold: bool = False
    release: bool = False


class HeartbeatTarget(msgspec.Struct, frozen=True):
    """Decode side: remote requests still waiting here; keep their leases alive."""

    remote_engine: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    claims: tuple[str, ...]
    remote_pp_size: int = 1


# --- one step ----------------------------------------------------------------

class StepFacts:
    """One step's facts from the scheduler half to every worker: all the worker
    reads of a step's connector metadata. ``kvsm.vllm.metadata.KVSMConnectorMetadata``
    is this plus vLLM's base class (what vLLM pickles to the workers); the worker
    layer and the simulation need only this, so no vLLM import.

    Plain slots, pickled as a dict of them (``__getstate__``): vLLM sends it to
    every worker process each step. False when the step carries nothing.
    """

    __slots__ = ("heartbeats", "recv_abandon", "recv_abort", "recv_start", "send_finish", "send_start", "step",
                 "stopping", "stream_preempted", "stream_steps")

    def __init__(self, step: int) -> None:
        self.step = step
        self.recv_start: list[RecvStart] = []
        self.recv_abort: list[RecvAbort] = []
        self.recv_abandon: list[RecvAbandon] = []
        self.send_start: list[SendStart] = []
        self.send_finish: list[SendFinish] = []
        self.heartbeats: list[HeartbeatTarget] = []
        # The engine is stopping (SIGTERM to its engine core) and its drain time is up:
        # the workers close every pin now, so that vLLM gets the blocks back, runs out
        # of work and shuts down cleanly instead of being killed waiting for reads.
        self.stopping = False
        # Streamed push: what this step computes of each streamed prefill request.
        self.stream_steps: list[StreamStep] = []
        self.stream_preempted: list[StreamPreempted] = []

    def __bool__(self) -> bool:
        return bool(self.recv_start or self.recv_abort or self.recv_abandon or self.send_start
                    or self.send_finish or self.heartbeats or self.stopping or self.stream_steps
                    or self.stream_preempted)

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in StepFacts.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in StepFacts.__slots__:
            setattr(self, name, state[name])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(step={self.step}, recv_start={len(self.recv_start)}, "
                f"recv_abort={len(self.recv_abort)}, recv_abandon={len(self.recv_abandon)}, "
                f"send_start={len(self.send_start)}, send_finish={len(self.send_finish)}, "
                f"heartbeats={len(self.heartbeats)}{', stopping' if self.stopping else ''})")


# --- kv_transfer_params ------------------------------------------------------

class RemoteParams(msgspec.Struct, frozen=True):
    """A decode request's view of its prefill: where to read what."""

    remote_engine: str
    remote_req: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    remote_block_ids: tuple[tuple[int, ...], ...]  # one tuple per KV cache group, by position (0: none)
    remote_num_tokens: int | None
    remote_block_size: int | None = None  # tokens per prefill block (kvsm's key; None: not said)
    remote_pp_size: int = 1  # the prefill engine's pipeline stages (each holds a run of the layers)
    # remote_blocks_expiry_time, as upstream writes it (wall clock, s; 0: not said). Advisory:
    # heartbeats may extend the lease past it, and the claim decides.
    remote_expiry_s: float = 0.0
    # transfer_mode "push": the prefill workers write the blocks into ours.
    push: bool = False
    # transfer_mode "stream": pushed while the prefill computes (``remote_req`` is the join key).
    stream: bool = False


# The prefill's fingerprint of the prompt tokens it computed (kvsm's own key; other
# connectors ignore it): a decode request whose prompt does not match is not
# given those blocks.
PROMPT_FINGERPRINT_KEY = "kvsm_prompt_fingerprint"
# Says the params come from a kvsm prefill engine (its side-channel protocol's
# version): a decode engine given params without it warns that the producer may
# run another connector, whose side channel kvsm does not speak.
PRODUCER_KEY = "kvsm_protocol"
# Streamed push (transfer_mode "stream"): the join key a router puts in both legs'
# kv_transfer_params (the decode leg's remote_request_id is the same key).
STREAM_KEY = "kvsm_stream"
STREAM_MODE = "stream"
# Pipeline stages a decode request reads from at most (one claim and read per stage and rank).
MAX_PP_SIZE = 64
# CPython hashes ints modulo this prime and combines a tuple's items without a
# per-process seed, so two processes agree; the scheme names it, and a peer
# with another scheme is not checked rather than refused.
_FINGERPRINT_SCHEME = f"tuple{sys.hash_info.modulus.bit_length()}:"


def prompt_fingerprint(token_ids: Sequence[int], num_tokens: int) -> str:
    """A short, process-independent fingerprint of the first ``num_tokens`` prompt tokens.

    Why not a cryptographic digest: blake2b over the ids costs ~17 µs per 200 tokens
    here (building the bytes dominates), CPython's tuple hash ~3.5 µs, on every
    request of both schedulers. It guards against honest mix-ups (one request's
    params sent with another prompt), not against an adversary."""
    return f"{_FINGERPRINT_SCHEME}{hash(tuple(token_ids[:num_tokens])) & 0xFFFFFFFFFFFFFFFF:016x}"


def prompt_mismatch(params: Mapping[str, Any], remote_num_tokens: int | None,
                    token_ids: Sequence[int] | None, num_prompt_tokens: int) -> str:
    """Why ``params`` cannot be this decode request's own (``""``: they can).

    vLLM's completions API applies one request's ``kv_transfer_params`` to every
    prompt of a list (its response carries the first prompt's), so prompt 2 would
    read prompt 1's blocks; upstream serves that output, silently wrong."""
    if remote_num_tokens is not None and remote_num_tokens > num_prompt_tokens:
        # kvsm's prefill side counts the prompt only; upstream's counts every token it
        # computed, so this is also its prefill leg run with max_tokens > 1: with no
        # fingerprint to tell the two apart, the request computes its prompt itself.
        return (f"kv_transfer_params describe a prefill of {remote_num_tokens} tokens, this prompt has "
                f"{num_prompt_tokens}: they are another request's (e.g. one of a list of prompts sent with "
                f"the first prompt's params), or a prefill leg that generated more than one token on an "
                f"engine that does not count the prompt apart (send it with max_tokens 1)")
    theirs = params.get(PROMPT_FINGERPRINT_KEY)
    if (not isinstance(theirs, str) or token_ids is None or remote_num_tokens is None
            or not theirs.startswith(_FINGERPRINT_SCHEME)):
        return ""
    if theirs != prompt_fingerprint(token_ids, remote_num_tokens):
        return (f"the first {remote_num_tokens} prompt tokens differ from those the prefill engine computed "
                f"({PROMPT_FINGERPRINT_KEY}): the params are another request's")
    return ""


class BadTransferParams(ValueError):
    """kv_transfer_params that cannot be acted on; the message names the key."""


REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


def _block_ids(value: Any) -> tuple[tuple[int, ...], ...]:
    """One list per KV cache group, as upstream writes them (a flat list is one group)."""
    if not isinstance(value, (list, tuple)):
        raise BadTransferParams(f"remote_block_ids must be a list, got {type(value).__name__}")
    groups = value if value and all(isinstance(g, (list, tuple)) for g in value) else [value]
    for g, ids in enumerate(groups):
        if not all(type(b) is int and b >= 0 for b in ids):
            where = f" (KV cache group {g})" if len(groups) > 1 else ""
            raise BadTransferParams(f"remote_block_ids{where} must be non-negative integers, got {list(ids)[:8]!r}")
    return tuple(tuple(ids) for ids in groups)


def parse_remote_params(params: Mapping[str, Any]) -> RemoteParams:
    """The prefill's coordinates from ``kv_transfer_params``; raises BadTransferParams."""
    missing = [k for k in REQUIRED_REMOTE_KEYS if params.get(k) in (None, "")]
    if missing:
        raise BadTransferParams(f"kv_transfer_params lack {', '.join(missing)}")
    if "remote_block_ids" not in params:
        raise BadTransferParams("kv_transfer_params lack remote_block_ids")
    port = params["remote_port"]
    if type(port) is not int or not 0 < port < 65536:
        raise BadTransferParams(f"remote_port must be a port number, got {port!r}")
    tp_size = params.get("tp_size", 1)
    if type(tp_size) is not int or tp_size < 1:
        raise BadTransferParams(f"tp_size must be a positive integer, got {tp_size!r}")
    pp_size = params.get("pp_size", 1)
    if type(pp_size) is not int or not 1 <= pp_size <= MAX_PP_SIZE:
        raise BadTransferParams(f"pp_size must be an integer from 1 to {MAX_PP_SIZE}, got {pp_size!r}")
    num_tokens = params.get("remote_num_tokens")
    if num_tokens is not None and (type(num_tokens) is not int or num_tokens < 0):
        raise BadTransferParams(f"remote_num_tokens must be a non-negative integer, got {num_tokens!r}")
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params[key], str):
            raise BadTransferParams(f"{key} must be a string, got {type(params[key]).__name__}")
    block_size = params.get("remote_block_size")
    if block_size is not None and (type(block_size) is not int or block_size < 1):
        raise BadTransferParams(f"remote_block_size must be a positive integer, got {block_size!r}")
    return RemoteParams(
        remote_engine=params["remote_engine_id"], remote_req=params["remote_request_id"],
        remote_host=params["remote_host"], remote_port=port, remote_tp_size=tp_size,
        remote_block_ids=_block_ids(params["remote_block_ids"]), remote_num_tokens=num_tokens,
        remote_block_size=block_size, remote_pp_size=pp_size, remote_expiry_s=_expiry(params))


def _expiry(params: Mapping[str, Any]) -> float:
    """``remote_blocks_expiry_time`` as a number of seconds; 0 when absent or not a
    positive number (advisory only: nothing is refused for it)."""
    value = params.get("remote_blocks_expiry_time")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return float(value) if value > 0 else 0.0
