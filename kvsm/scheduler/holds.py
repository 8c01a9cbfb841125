"""Decode-to-prefill reuse (``bidirectional_kv_xfer``): what a decode engine
offers of a finished request for its conversation's next turn, how a prefill
engine judges such an offer, and the holds' budget.

Pure functions of the params, the request and the config, and one ordered
index: which holds there are, oldest first. Whether a request is held,
released or read is the ``sched`` lifecycle's decision
(``kvsm.lifecycle.sched``).

Why digests: the next turn's prompt is the client's (a chat template renders
the previous answer again; a client may edit it), so the prefill engine reads
only the held blocks its prompt really starts with. Each held block carries a
chained digest of the tokens up to its end, and the prefill engine matches
them against its own prompt, block by block.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec.structs

from kvsm.config import KVSMConfig
from kvsm.handoff.facts import BadTransferParams, parse_remote_params
from kvsm.hold_digests import block_digests, matched_blocks, prefix_digest
from kvsm.lifecycle.sched import HoldOffered, ParamsIgnored
from kvsm.scheduler.params import Judged, Source, offered_by, remote_block_sizes

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.request import Request

# kv_transfer_params key of a hold's offer: the chained digest of each held block's tokens.
HOLD_DIGESTS_KEY = "kvsm_hold_digests"
# ... and the digest of every held token, the partial last block's included (absent: none).
HOLD_TAIL_KEY = "kvsm_hold_tail_digest"
# kv_transfer_params key of a request run on a decode engine alone that asks to be
# held at its finish (its answer then carries the hold's params, as a P/D one's).
HOLD_ASKED_KEY = "kvsm_hold"


def hold_offer(cfg: KVSMConfig, request: Request, block_ids: list[int], num_tokens: int,
               block_size: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a held decode request returns, in upstream's shape
    (``do_remote_decode``, ``remote_*`` naming this decode engine, ``num_tokens``
    its computed tokens, the partial last block's included): a router passes them
    to the next turn's prefill leg."""
    tokens = request.all_token_ids
    full = num_tokens // block_size
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(block_ids[:-(-num_tokens // block_size)])],
        **offered_by(cfg, request),
        "remote_num_tokens": num_tokens,
        "remote_block_size": block_size,
        HOLD_DIGESTS_KEY: block_digests(tokens, block_size, full),
        **({HOLD_TAIL_KEY: prefix_digest(tokens, block_size, num_tokens)} if num_tokens % block_size else {}),
        "remote_blocks_expiry_time": time.time() + cfg.hold_ttl_s,
        "transfer_mode": "pull",
    }


def held_tokens(request: Request, group_block_sizes: tuple[int, ...]) -> tuple[int, str]:
    """How many tokens of a finished decode request a next turn could read (those
    whose KV it computed), or 0 and why none."""
    if len(group_block_sizes) != 1:
        return 0, (f"not held: {len(group_block_sizes)} KV cache groups (a sliding window's or a Mamba/GDN "
                   f"state is not a prefix a next turn can read); holds need one group")
    return request.num_computed_tokens, ""


def judge_hold_params(request: Request, params: Mapping[str, Any], cfg: KVSMConfig,
                      group_block_sizes: tuple[int, ...], readers: Mapping[Source, str]) -> Judged:
    """What a prefill request's params offering a decode engine's hold say: the
    tokens of its prompt that match the held blocks (``HoldOffered``), or why
    none are read (``ParamsIgnored``: the prompt is computed here, as without)."""
    req = request.request_id
    if not cfg.bidirectional:
        return Judged(ParamsIgnored(req=req, reason="the params offer a decode engine's held blocks, and "
                                                    "bidirectional_kv_xfer is off on this engine"))
    try:
        remote = parse_remote_params(params)
    except BadTransferParams as e:
        return Judged(ParamsIgnored(req=req, reason=f"held blocks offered: {e}"))
    digests = params.get(HOLD_DIGESTS_KEY)
    if not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
        return Judged(ParamsIgnored(req=req, reason=(
            f"held blocks offered without {HOLD_DIGESTS_KEY!r} (another connector's decode engine?): the prompt "
            f"cannot be matched against them")))
    if len(group_block_sizes) != 1 or len(remote.remote_block_ids) != 1:
        return Judged(ParamsIgnored(req=req, reason="held blocks need one KV cache group on both engines"))
    theirs, ours = remote_block_sizes(remote, group_block_sizes)[0], group_block_sizes[0]
    if max(theirs, ours) % min(theirs, ours):
        return Judged(ParamsIgnored(req=req, reason=(
            f"the decode engine's blocks hold {theirs} tokens, this engine's {ours}: one size must divide "
            f"the other")))
    prompt = request.prompt_token_ids or []
    blocks = min(matched_blocks(digests, prompt, theirs), len(remote.remote_block_ids[0]))
    tokens = blocks * theirs
    offered, tail = remote.remote_num_tokens or 0, params.get(HOLD_TAIL_KEY)
    if (blocks == len(digests) and offered > tokens and isinstance(tail, str) and len(prompt) >= offered
            and len(remote.remote_block_ids[0]) * theirs >= offered and prefix_digest(prompt, theirs, offered) == tail):
        tokens = offered  # the partial last block matches too
    # At least the prompt's last token is computed here: it gives the first token.
    tokens = min(tokens, max(0, request.num_prompt_tokens - 1))
    if tokens <= 0:
        return Judged(ParamsIgnored(req=req, reason=(
            f"the prompt does not start with the decode engine's held tokens (0 of {len(digests)} blocks "
            f"match): computed here")))
    remote = msgspec.structs.replace(remote, remote_num_tokens=tokens)
    source = (remote.remote_engine, remote.remote_host, remote.remote_port, remote.remote_tp_size,
              remote.remote_pp_size, remote.remote_req)
    return Judged(HoldOffered(req=req, remote_engine=remote.remote_engine, remote_req=remote.remote_req,
                              remote_host=remote.remote_host, remote_port=remote.remote_port,
                              remote_tp_size=remote.remote_tp_size, remote_pp_size=remote.remote_pp_size,
                              tokens=tokens, reader=readers.get(source, "")), remote)


class HoldIndex:
    """The holds of a decode engine, oldest first, with their blocks: what the
    budget is checked against (kept by the ``hold_blocks`` and ``release_hold``
    effects and the holds' end)."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[str, int] = OrderedDict()
        self.total = 0

    def add(self, req: str, blocks: int) -> None:
        self._blocks[req] = blocks
        self.total += blocks

    def remove(self, req: str) -> None:
        self.total -= self._blocks.pop(req, 0)

    def oldest_over(self, budget: int, keep: str) -> list[tuple[str, int]]:
        """The oldest holds (but ``keep``) whose release brings the total within
        ``budget``, with the total each was released at."""
        out: list[tuple[str, int]] = []
        total = self.total
        for req, blocks in self._blocks.items():
            if total <= budget:
                break
            if req != keep:
                out.append((req, total))
                total -= blocks
        return out

    def __len__(self) -> int:
        return len(self._blocks)
