"""How a decode request reads: the prefill workers it deals with, what each
read moves, and why a request cannot be read at all (the receiving side's
planning, apart from its effects in ``recv``).

A request deals with one prefill worker per (tensor parallel source, pipeline
stage): tensor parallel sizes that differ read runs of heads (``tp_map``), and
a prefill engine of several pipeline stages holds a run of the model's layers
in each, so the request reads each stage's layers from that stage (the
transport reads the layers both workers hold). Before anything moves, every
layer of ours must come from some stage, for every run of heads.
"""

from __future__ import annotations

from kvsm.handoff.facts import RecvStart
from kvsm.transport.base import Transport
from kvsm.transport.layout import Segments
from kvsm.worker.context import Link, WorkerContext
from kvsm.worker.tp_map import HeadRun, ReadPlan, Source, read_plan

# Equal tensor parallel sizes: the same rank's whole blocks.
FULL_SOURCE = Source(0, HeadRun(0, 1, 1), HeadRun(0, 1, 1))


class ReadPlanner:
    """Decode requests' read plans (no I/O, no transition): used by the receiving
    part for its requests and by the peers part for their heartbeats."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.tp_rank = ctx.tp_rank
        self.pp_rank = ctx.pp_rank

    @property
    def transport(self) -> Transport | None:
        return self.ctx.transport

    def describe_plan(self, plan: ReadPlan | None, remote_pp: int) -> str:
        """The plan for the event log: tensor ranks and heads, and pipeline stages where
        either engine has several ("" when it is the same rank's whole blocks)."""
        text = plan.describe() if plan is not None else ""
        if remote_pp > 1 or self.cfg.pp_size > 1:
            stages = (f"stage {self.pp_rank}/{self.cfg.pp_size} reads the layers it shares with each of "
                      f"{remote_pp} prefill stage(s)")
            text = f"{text}; {stages}" if text else stages
        return text

    def read_plan(self, remote_tp: int) -> ReadPlan | None:
        """Which prefill ranks this rank reads, and which of their heads (None: the
        same rank, whole blocks: tensor parallel sizes are equal). ``ValueError``
        saying why when the sizes differ and the KV cache cannot be read across them."""
        if remote_tp == self.cfg.tp_size:
            return None
        share = self.cfg.tp_share
        if share not in ("heads", "replicated"):
            raise ValueError(f"the prefill engine runs tensor parallel {remote_tp}, this engine "
                             f"{self.cfg.tp_size}, and this model's KV cache cannot be read across "
                             f"different sizes ({share.removeprefix('none: ')})")
        try:
            return read_plan(self.tp_rank, self.cfg.tp_size, remote_tp, self.cfg.kv_heads,
                             replicated_layout=share == "replicated")
        except ValueError as e:
            raise ValueError(f"the prefill engine runs tensor parallel {remote_tp}, this engine "
                             f"{self.cfg.tp_size}: {e}") from None

    def workers_of(self, plan: ReadPlan | None, remote_pp: int) -> list[tuple[int, int, int, Source | None]]:
        """(tensor rank, pipeline stage, readers, source) of every prefill worker a
        request deals with, reads first: each source's rank in every stage (each
        holds a run of the layers), then the ranks only told nobody reads them.
        Every stage of ours deals with every stage there, so a prefill worker waits
        for its tensor parallel readers in each of our stages."""
        stages = range(max(1, remote_pp))
        ours = max(1, self.cfg.pp_size)
        if plan is None:
            return [(self.tp_rank, s, ours, FULL_SOURCE) for s in stages]
        out: list[tuple[int, int, int, Source | None]] = [
            (src.rank, s, plan.completions[src.rank] * ours, src) for src in plan.sources for s in stages]
        out += [(k, s, plan.completions[k] * ours, None) for k in plan.notify_only for s in stages]
        return out

    def unreadable(self, start: RecvStart) -> tuple[str, str] | None:
        why = self._unreadable_params(start)
        if why is None and start.segment_tokens and self.transport is not None:
            try:
                layout = getattr(self.transport, "layout", None)
                if layout is None:
                    raise ValueError(f"{type(self.transport).__name__} moves whole blocks only")
                layout.check_segments(start.block_sizes[0], start.segment_tokens)
            except ValueError as e:
                why = ("bad_params", f"the prefill engine's blocks hold {start.block_sizes[1]} tokens, this "
                                     f"engine's {start.block_sizes[0]}, and they cannot be read in segments: {e}")
        return why

    def _unreadable_params(self, start: RecvStart) -> tuple[str, str] | None:
        """Why this request cannot be read at all, before any I/O."""
        if start.problem:
            return ("bad_params", start.problem)
        if len(start.remote_block_ids) != len(start.local_block_ids) and not start.stream:
            return ("bad_params", (f"{len(start.local_block_ids)} local blocks to fill but the prefill side "
                                   f"offers {len(start.remote_block_ids)} (remote_block_ids too short?)"))
        groups = self.transport.num_groups if self.transport is not None else 1
        if start.group_sizes and (len(start.group_sizes) != groups
                                  or sum(start.group_sizes) != len(start.local_block_ids)):
            return ("bad_params", (f"blocks of {len(start.group_sizes)} KV cache groups "
                                   f"({list(start.group_sizes)}, {len(start.local_block_ids)} blocks) for a KV "
                                   f"cache of {groups} group(s)"))
        if not start.group_sizes and groups > 1 and start.local_block_ids:
            return ("bad_params", f"block ids without their KV cache groups for a KV cache of {groups} groups")
        return None

    def plan_or_none(self, remote_tp: int) -> ReadPlan | None:
        try:
            return self.read_plan(remote_tp)
        except ValueError:
            return None

    def layers_uncovered(self, reads: list[Link], held: list[tuple[str, ...] | None]) -> str:
        """Why some of our layers would not be filled ("" if every one is): for each
        run of heads, the stages read must hold every layer of ours between them
        (a prefill engine split over pipeline stages differently, or another model).
        ``held``: each read's ``layers_read``, a subset of ours in our order."""
        assert self.transport is not None
        ours = self.transport.layers()
        if ours is None or all(some is None or len(some) == len(ours) for some in held):
            return ""  # (the usual case: every read fills all of our layers)
        whole = {link.source for link, some in zip(reads, held) if some is None or len(some) == len(ours)}
        got: dict[Source | None, set[str]] = {}
        for link, some in zip(reads, held):
            if link.source not in whole:  # (the usual case, one stage holding all: no set built)
                got.setdefault(link.source, set()).update(some or ())
        for source, have in got.items():
            missing = [name for name in ours if name not in have]
            if missing:
                links = [link for link in reads if link.source == source]
                return (f"{len(missing)} of this worker's {len(ours)} layers are held by none of the "
                        f"{len(links)} pipeline stage(s) of the prefill engine read (tensor rank "
                        f"{links[0].rank}): {missing[:4]}{'...' if len(missing) > 4 else ''}")
        return ""

    def descs_of(self, start: RecvStart, link: Link, agent: str) -> int:
        """How many descriptors one link's read takes (for the event log)."""
        pairs = len(start.local_block_ids)
        reader = getattr(self.transport, "read_layout", None)
        layout = reader(agent) if reader is not None else getattr(self.transport, "layout", None)
        if layout is None:
            return pairs if reader is None else 0
        src = link.source
        if start.segment_tokens:
            return layout.num_segment_descs(pairs, None if src is None or src.local.whole else src.local.count)
        return layout.num_descs(pairs, start.group_sizes)


def segments_of(start: RecvStart) -> Segments | None:
    """The segments a read of blocks of different sizes moves (None: whole blocks)."""
    if not start.segment_tokens:
        return None
    return Segments(start.segment_tokens, start.local_segments, start.remote_segments, *start.block_sizes)


def describe_segments(start: RecvStart) -> str:
    """How a read across block sizes pairs its blocks, for the event log ("" if it does not)."""
    if not start.segment_tokens:
        return ""
    here, there = start.block_sizes
    return (f"{len(start.local_segments)} segments of {start.segment_tokens} tokens: prefill blocks of {there} "
            f"tokens into blocks of {here}")
