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
    """``kvsm.scheduler._pair_blocks`` for one group whose block sizes differ between the engines:
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
