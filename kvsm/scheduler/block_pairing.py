"""Which prefill block segments fill which decode blocks, when the two engines'
block sizes differ: a pure function of block ids and sizes, shared by kvsm's
scheduler half (on vLLM's blocks) and the simulation (on its own), so both
pair blocks the one way. No vLLM here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

NULL_BLOCK = 0  # vLLM's null block (BlockPool's first): a position a group holds nothing at


class LocalBlock(Protocol):
    """What pairing needs of a decode block (vLLM's ``KVCacheBlock`` has it)."""

    @property
    def block_id(self) -> int: ...
    @property
    def block_hash(self) -> Any: ...  # not None: a local prefix hit, not read
    @property
    def is_null(self) -> bool: ...


def pair_segments(local_blocks: Sequence[LocalBlock], theirs: tuple[int, ...], local_size: int, remote_size: int,
                   num_external_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...], dict[str, Any], str]:
    """``pair_blocks`` for one group whose block sizes differ between the engines:
    every new local block is filled in segments of the smaller size, each from the
    prefill block holding the same tokens (local ids, remote ids, the RecvStart
    segment fields, what cannot be read).

    Local prefix hits (hashed blocks) come first and are not read; segments past
    the tokens to load (the rest of the last block) are not read either."""
    unit = min(local_size, remote_size)
    if max(local_size, remote_size) % unit:
        return (), (), {}, (f"block sizes {local_size} here and {remote_size} on the prefill side: one must "
                            f"divide the other to read blocks in segments")
    hits = sum(1 for b in local_blocks if b.block_hash is not None)
    end = hits * local_size + num_external_tokens
    local: list[int] = []
    remote: list[int] = []
    local_segs: list[int] = []
    remote_segs: list[int] = []
    for j, block in enumerate(local_blocks):
        if block.is_null or block.block_hash is not None:
            continue
        for k in range(local_size // unit):
            t = j * local_size + k * unit
            if t >= end:
                break
            r = t // remote_size
            if r >= len(theirs) or theirs[r] == NULL_BLOCK:
                return (), (), {}, (f"tokens {t}..{t + unit - 1} are to be loaded, but the prefill side has "
                                    f"{'no block' if r >= len(theirs) else 'the null block'} there "
                                    f"({len(theirs)} block ids of {remote_size} tokens)")
            local.append(block.block_id)
            local_segs.append(k)
            remote.append(theirs[r])
            remote_segs.append((t % remote_size) // unit)
    fields = {"segment_tokens": unit, "local_segments": tuple(local_segs), "remote_segments": tuple(remote_segs),
              "block_sizes": (local_size, remote_size)}
    return tuple(local), tuple(remote), fields, ""


def pair_blocks(local_groups: Any, remote_groups: tuple[tuple[int, ...], ...],
                 ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], str]:
    """Which local block each remote block is read into, group by group:
    (local ids, remote ids, how many of each group, what cannot be read).

    ``local_groups``: vLLM's blocks of the decode request per group (its
    ``KVCacheBlocks.blocks``: local prefix hits, which are hashed, then the new
    blocks; the null block where the group keeps nothing). Both sides index a
    group's blocks by position, so block ``j`` is read from the prefill's block
    ``j``: for every new, non-null local block. One the prefill side does not
    hold (past its list, or null there: a sliding window that moved on) cannot
    be filled, which fails the request rather than deliver a block of garbage.
    """
    local: list[int] = []
    remote: list[int] = []
    sizes: list[int] = []
    problems: list[str] = []
    for g, (blocks, theirs) in enumerate(zip(local_groups, remote_groups, strict=True)):
        n = 0
        for j, block in enumerate(blocks):
            if block.is_null or block.block_hash is not None:
                continue
            if j >= len(theirs) or theirs[j] == NULL_BLOCK:
                held = "past the end of its blocks" if j >= len(theirs) else "the null block there"
                problems.append(f"KV cache group {g}: block {j} is to be loaded, but the prefill side has {held} "
                                f"({len(theirs)} block ids)")
                continue
            local.append(block.block_id)
            remote.append(theirs[j])
            n += 1
        sizes.append(n)
    return tuple(local), tuple(remote), tuple(sizes), "; ".join(problems[:3])
