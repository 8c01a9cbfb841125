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
    local: tuple[int, ...]
    remote_ids: tuple[int, ...]
    if remote.stream and num_external_tokens > 0:  # written by position as the prefill computes
        new = [(j, b.block_id) for j, b in enumerate(local_groups[0]) if b.block_hash is None and not b.is_null]
        first = new[0][0] if new else 0
        local, remote_ids = tuple(b for _, b in new), ()
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
        **segmented)
