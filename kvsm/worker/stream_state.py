"""Streamed push, prefill side: what the worker knows of each streamed request
(``Progress``: how far it is computed here) and of each decode rank's write of
it (``Stream``), and how a layer's blocks pair with the decode rank's. Plain
data and pure functions: ``kvsm.worker.push_stream`` acts on them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsm.handshake.messages import WriteSpec
from kvsm.transport.base import XferHandle


@dataclass(slots=True)
class Progress:
    """How far a streamed request's KV is computed here."""

    key: str
    blocks: tuple[tuple[int, ...], ...] = ()  # per KV cache group, by position
    done: int = 0  # tokens every layer holds
    start: int = 0  # the step under way computes tokens start..end
    end: int = 0
    upto: list[int] = field(default_factory=list)  # per layer: tokens it holds (``end`` once saved)
    last: bool = False  # that step computes the prompt's last tokens
    steps: int = 0  # steps that computed some of it
    last_layer_ns: int = 0  # when the prompt's last layer was done (the handover's start)


@dataclass(slots=True)
class Stream:
    """One decode rank's streamed write of one request."""

    agent: str
    spec: WriteSpec
    deadline_ns: int  # the loop's clock: nothing of it may be in flight after this
    written: list[int]  # per layer: tokens written so far (from the first)
    dst_rows: tuple[tuple[int, tuple[int, ...]], ...]  # per KV cache group: the decode's first position, blocks
    handles: list[XferHandle] = field(default_factory=list)
    seen_over_ns: int = 0  # when a check last found one of ``handles`` over
    final: XferHandle | None = None  # the write carrying the notification
    writes: int = 0  # posted so far
    final_posting_ns: int = 0  # when the last write's post began (NIXL may send some of it in the call)
    final_posted_ns: int = 0  # ... and returned
    rewrite: bool = False  # preempted under a write: written again whole once ``handles`` are over


def complete(p: Progress, w: Stream) -> bool:
    """Every layer of the whole prompt is written (or being written)."""
    return p.last and all(x >= p.end for x in w.written)


def dst_rows(spec: WriteSpec, groups: int) -> tuple[tuple[int, tuple[int, ...]], ...] | str:
    """The decode's first position and blocks per KV cache group, or why they do
    not fit a KV cache of ``groups`` groups."""
    sizes = spec.group_sizes or [len(spec.dst_blocks)]
    firsts = spec.dst_firsts if spec.group_sizes else [spec.dst_first]
    if len(sizes) != groups or len(firsts) != groups or sum(sizes) != len(spec.dst_blocks):
        return (f"its blocks come in {len(sizes)} KV cache group(s) ({list(sizes)}, {len(spec.dst_blocks)} "
                f"blocks, first positions {list(firsts)}) for a KV cache of {groups} group(s) here")
    rows, at = [], 0
    for first, n in zip(firsts, sizes, strict=True):
        rows.append((first, tuple(spec.dst_blocks[at:at + n])))
        at += n
    return tuple(rows)


def pair_rows(p: Progress, w: Stream, group: int) -> tuple[tuple[int, ...], tuple[int, tuple[int, ...]]]:
    """KV cache group ``group``'s blocks by position here (from the first), and on
    the decode side its first position and blocks from there."""
    return (p.blocks[group] if group < len(p.blocks) else (),
            w.dst_rows[group] if group < len(w.dst_rows) else (0, ()))
