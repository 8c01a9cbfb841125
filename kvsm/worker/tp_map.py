"""Which prefill ranks a decode rank reads, and which heads of their blocks.

Tensor parallelism splits a layer's KV heads over the ranks of an engine:
rank ``k`` of ``tp`` holds heads ``[k * h, (k + 1) * h)`` with ``h = K // tp``
(``K``: the model's KV heads), or, when the ranks outnumber the heads
(``K < tp``), the one head ``k * K // tp``, which neighbouring ranks hold
alike (replicated). MLA's latent is not split at all: every rank holds all of
it (``replicated_layout``).

A decode rank reads, from the prefill ranks whose heads overlap its own, the
overlap: a run of heads of the remote block into a run of heads of its local
block (vLLM-CPU's blocks are heads-major, ``[heads, tokens, 2 * head_size]``,
so a run of heads is one contiguous byte range; ``KVLayout.sliced`` turns
the runs into descriptors). Where several prefill ranks hold the same heads,
decode ranks spread over them (``rank % copies``). A prefill rank no decode
rank reads from still has its blocks pinned: one decode rank (``k % d``)
tells it, over the side channel, that nobody will (``notify_only``).

Each prefill rank frees its blocks once every decode rank that has business
with it (its readers, or the one that tells it) is through: ``completions``,
carried to it with each claim, read notification and abandon.

Pure and small: the same plan is computed on both sides and in the tests,
from three numbers, for any pair of TP sizes one of which divides the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRun:
    """Heads ``[start, start + count)`` of a block that holds ``of`` heads."""

    start: int
    count: int
    of: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.count == self.of

    def __str__(self) -> str:
        return "all" if self.whole else f"{self.start}..{self.start + self.count - 1}/{self.of}"


@dataclass(frozen=True)
class Source:
    """One read of a request: ``remote`` heads of prefill rank ``rank``'s
    blocks into ``local`` heads of ours."""

    rank: int
    remote: HeadRun
    local: HeadRun


@dataclass(frozen=True)
class ReadPlan:
    """What decode rank ``rank`` of ``tp`` does with a prefill engine of ``remote_tp``."""

    rank: int
    tp: int
    remote_tp: int
    sources: tuple[Source, ...]
    notify_only: tuple[int, ...]  # prefill ranks this rank only tells "nobody reads"
    completions: tuple[int, ...]  # per prefill rank: decode ranks it waits for

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every prefill rank this rank claims (and so talks to)."""
        return tuple(s.rank for s in self.sources) + self.notify_only

    def describe(self) -> str:
        """One line for the event log and the replay."""
        reads = ", ".join(f"p{s.rank}[{s.remote}]->[{s.local}]" for s in self.sources)
        told = f"; tells p{','.join(map(str, self.notify_only))} nobody reads" if self.notify_only else ""
        return f"d{self.rank}/{self.tp} from p*/{self.remote_tp}: {reads}{told}"


def heads_of(rank: int, tp: int, total_heads: int) -> tuple[int, int]:
    """Global heads ``[start, end)`` that rank ``rank`` of ``tp`` holds."""
    if total_heads >= tp:
        per = total_heads // tp
        return rank * per, (rank + 1) * per
    head = rank * total_heads // tp
    return head, head + 1


def _check(tp: int, remote_tp: int, total_heads: int) -> None:
    if tp < 1 or remote_tp < 1 or total_heads < 1:
        raise ValueError(f"tensor parallel sizes and KV heads must be positive: decode {tp}, "
                         f"prefill {remote_tp}, heads {total_heads}")
    if tp % remote_tp and remote_tp % tp:
        raise ValueError(f"tensor parallel sizes {remote_tp} (prefill) and {tp} (decode): one must divide "
                         f"the other")
    for size in (tp, remote_tp):
        if total_heads >= size and total_heads % size:
            raise ValueError(f"{total_heads} KV heads do not split evenly over tensor parallel {size}")
        if total_heads < size and size % total_heads:
            raise ValueError(f"{total_heads} KV heads cannot be replicated evenly over tensor parallel {size}")


def read_plan(rank: int, tp: int, remote_tp: int, total_heads: int, *,
              replicated_layout: bool = False) -> ReadPlan:
    """The plan of decode rank ``rank`` (see the module doc). ``replicated_layout``:
    every rank holds the whole block (MLA's latent), whatever the heads."""
    heads = 1 if replicated_layout else total_heads
    _check(tp, remote_tp, heads)
    if not 0 <= rank < tp:
        raise ValueError(f"decode rank {rank} out of range for tensor parallel {tp}")
    plans = [_sources(r, tp, remote_tp, heads) for r in range(tp)]
    readers = [0] * remote_tp
    for srcs in plans:
        for s in srcs:
            readers[s.rank] += 1
    completions = tuple(max(1, n) for n in readers)
    notify_only = tuple(k for k in range(remote_tp) if readers[k] == 0 and k % tp == rank)
    return ReadPlan(rank, tp, remote_tp, plans[rank], notify_only, completions)


def _sources(rank: int, tp: int, remote_tp: int, heads: int) -> tuple[Source, ...]:
    lo, hi = heads_of(rank, tp, heads)
    local_of = hi - lo
    # Prefill ranks grouped by the heads they hold (replicas of one run together).
    holders: dict[tuple[int, int], list[int]] = {}
    for k in range(remote_tp):
        holders.setdefault(heads_of(k, remote_tp, heads), []).append(k)
    out = []
    for (r_lo, r_hi), ranks in sorted(holders.items()):
        a, b = max(lo, r_lo), min(hi, r_hi)
        if a >= b:
            continue
        k = ranks[rank % len(ranks)]
        out.append(Source(k, HeadRun(a - r_lo, b - a, r_hi - r_lo), HeadRun(a - lo, b - a, local_of)))
    return tuple(out)
