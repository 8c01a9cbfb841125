"""What a decode request loads and from where: the ``RecvStart`` fact its
workers get once vLLM has allocated its blocks.

A pure function of the request's remote params, vLLM's blocks and the block
sizes, so the scheduler half only relays it. The pairing itself
(``block_pairing``) is shared with the simulation.
"""

from __future__ import annotations

from typing import Any

from kvsm.handoff.facts import RecvStart, RemoteParams
from kvsm.scheduler.block_pairing import pair_blocks, pair_segments
from kvsm.scheduler.params import remote_block_sizes


def plan_recv_start(req: str, remote: RemoteParams, local_groups: Any, num_external_tokens: int,
                    group_block_sizes: tuple[int, ...]) -> RecvStart:
    """The request's one transfer (``num_external_tokens`` > 0: awaited, vLLM waits
    for finished_recving), or, with nothing to read (a full local prefix hit), the
    prefill side's unpin. ``local_groups``: vLLM's ``KVCacheBlocks.blocks``."""
    sizes: tuple[int, ...] = ()
    problem = ""
    segmented: dict[str, Any] = {}
    remote_size = remote_block_sizes(remote, group_block_sizes)[0]
    first = 0
    firsts: tuple[int, ...] = ()
    local: tuple[int, ...]
    remote_ids: tuple[int, ...]
    if remote.stream and num_external_tokens > 0:  # written by position as the prefill computes
        first, local, sizes, firsts, problem = stream_positions(local_groups)
        remote_ids = ()
    elif num_external_tokens > 0 and remote_size != group_block_sizes[0]:
        local, remote_ids, segmented, problem = pair_segments(
            local_groups[0], remote.remote_block_ids[0], group_block_sizes[0], remote_size, num_external_tokens)
    elif num_external_tokens > 0:
        local, remote_ids, sizes, problem = pair_blocks(local_groups, remote.remote_block_ids)
        if len(sizes) == 1:
            sizes = ()  # one group: the plain form
    else:
        local = remote_ids = ()
    return RecvStart(
        req=req, remote_engine=remote.remote_engine, remote_req=remote.remote_req,
        remote_host=remote.remote_host, remote_port=remote.remote_port,
        remote_tp_size=remote.remote_tp_size, remote_block_ids=remote_ids,
        local_block_ids=local, num_tokens=num_external_tokens, awaited=num_external_tokens > 0,
        group_sizes=sizes, problem=problem, remote_pp_size=remote.remote_pp_size,
        remote_expiry_s=remote.remote_expiry_s, push=remote.push, stream=remote.stream, first_position=first,
        group_firsts=firsts, **segmented)


def stream_positions(local_groups: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]:
    """A streamed request's blocks to be written, each group's by position from its
    first that is neither a local prefix hit nor vLLM's null block (cached and null
    blocks come first: a prefix hit, a sliding window's start). Several groups:
    group after group, their counts and first positions; and the least first.
    The last item says why the blocks cannot be written by position ("": they can)."""
    rows, firsts, problem = [], [], ""
    for g, group in enumerate(local_groups):
        new = [(j, b.block_id) for j, b in enumerate(group) if b.block_hash is None and not b.is_null]
        first = new[0][0] if new else len(group)
        if [j for j, _ in new] != list(range(first, first + len(new))):
            problem = f"KV cache group {g}'s blocks to be written are not one run of positions"
        rows.append(tuple(b for _, b in new))
        firsts.append(first)
    least = min((f for f, row in zip(firsts, rows, strict=True) if row), default=0)
    if len(rows) == 1:
        return least, rows[0], (), (), problem
    return least, tuple(b for row in rows for b in row), tuple(map(len, rows)), tuple(firsts), problem
