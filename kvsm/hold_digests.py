"""The chained block digests of a decode engine's hold (``bidirectional_kv_xfer``).

A leaf module, stdlib only: the scheduler computes and checks them
(``kvsm.scheduler.holds``), and kvsm's router matches a next turn's prompt
against the holds it learned (``kvsm.router_holds``) without importing the
engine side. Both must compute the very same digest, hence one copy here.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["block_digests", "matched_blocks", "prefix_digest"]

_MASK = 0xFFFFFFFFFFFFFFFF


def block_digests(token_ids: Sequence[int], block_size: int, num_blocks: int) -> list[str]:
    """The chained digest of the first ``num_blocks`` blocks of ``token_ids``:
    digest ``i`` covers every token up to the end of block ``i``. CPython's tuple
    hash of ints is the same in every process (no hash seed), and ~0.3 µs a block."""
    out: list[str] = []
    h = 0
    for i in range(num_blocks):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size]))) & _MASK
        out.append(f"{h:016x}")
    return out


def matched_blocks(digests: Sequence[str], token_ids: Sequence[int], block_size: int) -> int:
    """How many of the held blocks ``token_ids`` start with (their digests agree)."""
    n = min(len(digests), len(token_ids) // block_size)
    h = 0
    for i in range(n):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size]))) & _MASK
        if f"{h:016x}" != digests[i]:
            return i
    return n


def prefix_digest(token_ids: Sequence[int], block_size: int, num_tokens: int) -> str:
    """The digest of the first ``num_tokens`` tokens: the chain of their full blocks,
    then their partial last block (a hold offers it too, as upstream's does)."""
    full, h = num_tokens // block_size, 0
    for i in range(full):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size]))) & _MASK
    if num_tokens % block_size:
        h = hash((h, tuple(token_ids[full * block_size:num_tokens]))) & _MASK
    return f"{h:016x}"
