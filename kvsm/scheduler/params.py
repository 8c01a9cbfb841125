"""``kv_transfer_params`` in and out of the scheduler half: a decode request's
judged into the event its machine takes (``ParamsRead``, ``ParamsIgnored`` or
``StreamRefused``),
and a finished prefill's written for the decode side. Pure functions of the
params, the request and the config: what the request's machine then does is
the ``sched`` lifecycle's decision (``kvsm.lifecycle.sched``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec.structs

from kvsm.config import TRANSFER_MODES, KVSMConfig
from kvsm.handoff.facts import (
    PRODUCER_KEY,
    PROMPT_FINGERPRINT_KEY,
    STREAM_KEY,
    STREAM_MODE,
    BadTransferParams,
    RemoteParams,
    parse_remote_params,
    prompt_fingerprint,
    prompt_mismatch,
)
from kvsm.handshake.messages import PROTOCOL_VERSION
from kvsm.lifecycle.events import Event
from kvsm.lifecycle.sched import ParamsIgnored, ParamsRead, StreamRefused

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.request import Request

HELD_BACK_KEY = "_kvsm_held_back"  # in a prefill request's kv_transfer_params: tokens held back

Source = tuple[str, str, int, int, int, str]  # (engine, host, port, tp, pp, remote request id)


@dataclass(frozen=True, slots=True)
class Judged:
    """A decode request's params judged: the event for its machine, the parsed
    params (None: not parsed), and whether they lack kvsm's producer key."""

    event: Event
    remote: RemoteParams | None = None
    foreign: bool = False


def remote_block_sizes(remote: RemoteParams, group_block_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Tokens per prefill block of each group: the params' ``remote_block_size``
    where one group has it (a kvsm producer says so), else this engine's."""
    if remote.remote_block_size is None or len(group_block_sizes) != 1:
        return group_block_sizes
    return (remote.remote_block_size,)


def judge_decode_params(request: Request, params: Mapping[str, Any], cfg: KVSMConfig,
                        group_block_sizes: tuple[int, ...], readers: Mapping[Source, str],
                        stream_unsupported: str = "") -> Judged:
    """What a decode request's ``kv_transfer_params`` (``do_remote_prefill``) say,
    in the order the checks were always made. ``readers``: which request of this
    engine reads each prefill request (the one-reader rule is the lifecycle's)."""
    req = request.request_id
    if not cfg.consumes:
        return Judged(ParamsIgnored(req=req, reason=f"do_remote_prefill on an engine with kv_role {cfg.kv_role!r}"))
    mode = transfer_mode_of(params, cfg)
    if mode not in (*TRANSFER_MODES, STREAM_MODE):
        return Judged(ParamsIgnored(req=req, reason=(
            f"transfer_mode {mode!r:.80}: kvsm moves KV by 'pull' (this engine reads), 'push' (the prefill "
            f"engine writes) or 'stream' (it writes each layer as it computes it)")))
    if mode == "push" and PRODUCER_KEY not in params and params.get("transfer_mode") == "push":
        return Judged(ParamsIgnored(req=req, reason=(
            "transfer_mode 'push' from a prefill engine that is not kvsm's (its params lack kvsm_protocol): "
            "upstream NixlPushConnector's registration protocol is its own, and kvsm's side channel does not "
            "speak it")))
    try:
        remote = parse_remote_params(params)
    except BadTransferParams as e:
        return Judged(ParamsIgnored(req=req, reason=str(e)))
    if mode == "push":
        remote = msgspec.structs.replace(remote, push=True)
    elif mode == STREAM_MODE:
        why = stream_params_problem(params, remote)
        if why:
            return Judged(ParamsIgnored(req=req, reason=f"transfer_mode 'stream': {why}"))
        why = stream_geometry_problem(remote, cfg, group_block_sizes, stream_unsupported)
        if why:  # a kvsm prefill engine that will compute the prompt all the same
            return Judged(StreamRefused(req=req, reason=f"transfer_mode 'stream': {why}",
                                        remote_engine=remote.remote_engine, remote_req=remote.remote_req), remote)
        remote = msgspec.structs.replace(remote, push=True, stream=True)
    if len(remote.remote_block_ids) != len(group_block_sizes):
        return Judged(ParamsIgnored(req=req, reason=(
            f"remote_block_ids has {len(remote.remote_block_ids)} KV cache group(s), this engine's KV cache "
            f"{len(group_block_sizes)} (another model or layout?)")))
    foreign = PRODUCER_KEY not in params
    theirs, ours = remote_block_sizes(remote, group_block_sizes)[0], group_block_sizes[0]
    if max(theirs, ours) % min(theirs, ours):
        return Judged(ParamsIgnored(req=req, reason=(
            f"the prefill engine's blocks hold {theirs} tokens, this engine's {ours}: blocks of different sizes "
            f"are read in segments, so one size must divide the other")), None, foreign)
    rejected = bool(getattr(request, "abort_immediately", False))
    if not rejected:  # vLLM's stand-in for a rejected request has prompt [0]: not compared
        mismatch = prompt_mismatch(params, remote.remote_num_tokens, request.prompt_token_ids,
                                   request.num_prompt_tokens)
        if mismatch:
            return Judged(ParamsIgnored(req=req, reason=mismatch), None, foreign)
    source = (remote.remote_engine, remote.remote_host, remote.remote_port, remote.remote_tp_size,
              remote.remote_pp_size, remote.remote_req)
    return Judged(ParamsRead(req=req, remote_engine=remote.remote_engine, remote_req=remote.remote_req,
                             remote_host=remote.remote_host, remote_port=remote.remote_port,
                             remote_tp_size=remote.remote_tp_size, remote_pp_size=remote.remote_pp_size,
                             reader=readers.get(source, ""), rejected=rejected), remote, foreign)


def stream_params_problem(params: Mapping[str, Any], remote: RemoteParams) -> str:
    """Why a decode leg's params are not a kvsm streamed pair's ("": they are)."""
    if PRODUCER_KEY not in params:
        return "the params lack kvsm_protocol: only a kvsm prefill engine streams"
    if params.get(STREAM_KEY) != remote.remote_req:
        return f"{STREAM_KEY} must be the join key, the same as remote_request_id"
    if any(remote.remote_block_ids):
        return "remote_block_ids must be empty (the prefill engine has not allocated yet)"
    return ""


def stream_geometry_problem(remote: RemoteParams, cfg: KVSMConfig, group_block_sizes: tuple[int, ...],
                            unsupported: str) -> str:
    """Why this engine cannot be streamed into from that prefill engine ("": it can).
    The prefill worker writes each layer's blocks by position as it computes them,
    so both engines must hold the same blocks the same way: KV cache groups of one
    block size, the same tensor parallel size, no pipeline stages."""
    if unsupported:
        return unsupported
    theirs = remote.remote_block_size
    if theirs is not None and theirs != group_block_sizes[0]:
        return (f"the prefill engine's blocks hold {theirs} tokens, this engine's {group_block_sizes[0]}: streamed "
                f"push writes whole blocks (use pull or push mode between block sizes that differ)")
    if remote.remote_tp_size != cfg.tp_size:
        return (f"tensor parallel sizes differ (prefill {remote.remote_tp_size}, decode {cfg.tp_size}): streamed "
                f"push writes whole blocks rank to rank (use pull or push mode)")
    if remote.remote_pp_size != 1 or cfg.pp_size > 1:
        return "pipeline parallel engines are not supported by streamed push (use pull or push mode)"
    return ""


def transfer_mode_of(params: Mapping[str, Any], cfg: KVSMConfig) -> Any:
    """How a request's KV moves: its params' ``transfer_mode`` (upstream's key, which
    a router may set on either leg and a prefill engine echoes), else this engine's
    deployment setting. Not checked here (the caller names a bad value)."""
    mode = params.get("transfer_mode")
    return cfg.transfer_mode if mode is None else mode


def hold_back_last_tokens(request: Request, params: dict[str, Any], n: int) -> bool:
    """Prefill only ``num_prompt_tokens - n`` tokens: the state a Mamba/GDN group
    leaves is then the one the decode side needs before it computes the last
    prompt token itself (vLLM always computes at least one). Once per request
    (a preempted request comes back here). True: held back now."""
    if params.get(HELD_BACK_KEY) or request.num_prompt_tokens <= n or request.prompt_token_ids is None:
        return False
    del request.prompt_token_ids[-n:]
    del request._all_token_ids[-n:]
    request.num_prompt_tokens -= n
    params[HELD_BACK_KEY] = n
    return True


def offered_by(cfg: KVSMConfig, request: Request) -> dict[str, Any]:
    """Where an offer's blocks are read from (upstream's keys): this engine, this request."""
    return {
        "remote_engine_id": cfg.engine_id,
        "remote_request_id": request.request_id,
        "remote_host": cfg.side_channel_host,
        "remote_port": cfg.side_channel_port,
        "tp_size": cfg.tp_size,
        "dcp_size": cfg.dcp_size,
        "pp_size": cfg.pp_size,
        PRODUCER_KEY: PROTOCOL_VERSION,
    }


def prefill_offer(cfg: KVSMConfig, request: Request, block_ids: tuple[list[int], ...], num_tokens: int,
                  group_block_sizes: tuple[int, ...]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill hands the decode side (its
    transfer mode: the prefill leg's own ``transfer_mode``, else this engine's)."""
    mode = transfer_mode_of(request.kv_transfer_params or {}, cfg)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(ids) for ids in block_ids],  # one list per group, by position
        **offered_by(cfg, request),
        "remote_num_tokens": num_tokens,
        # One group: its tokens per block, so a decode engine of another block size pairs them
        # (several groups move block for block, each side's sizes equal: the compatibility check).
        **({"remote_block_size": group_block_sizes[0]} if len(group_block_sizes) == 1 else {}),
        **({} if request.prompt_token_ids is None else
           {PROMPT_FINGERPRINT_KEY: prompt_fingerprint(request.prompt_token_ids, num_tokens)}),
        # Wall-clock seconds, informational: the decode side's claim is what counts.
        "remote_blocks_expiry_time": time.time() + cfg.lease_s,
        # As upstream's pull scheduler: tells a router this is a pull (READ)
        # producer or a push one; kvsm's prefill engines serve both (its _TRANSFER_MODE).
        "transfer_mode": mode,
    }
