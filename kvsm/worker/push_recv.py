"""Push mode, decode side: ask the prefill workers to write into our blocks.

Once every claim is granted (as for a read), ``ask_writes`` sends each prefill
worker the request serves from a ``WriteAsk`` over the side channel: our NIXL
agent, our blocks, the pairing (heads, segments) from the read plan, and a
wall-clock deadline after which that worker writes nothing. Each write carries
its notification: when every one has landed the table hears ``writes_landed``.

A request that gives up (a failure, an abort) must not hand its blocks back
while a write may still land in them. ``stop_writes`` waits until each write
is settled: it landed, it failed (the writer said so), it was refused (the
ask's answer), its writer is gone (nothing listens on its side channel), or
the deadline passed. Then the table hears ``writes_stopped``. The deadline is
the bound: a prefill worker that goes silent costs a request at most
``transfer_timeout`` plus the lease margin before its blocks come back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from kvsm.handshake.messages import (
    PROTOCOL_VERSION,
    ClaimsReply,
    HandshakeRefused,
    HandshakeResult,
    HandshakeTimeout,
    WriteAsk,
    WriteSpec,
)
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.folds import LEASE_MARGIN_NS
from kvsm.lifecycle.machine import Outcome
from kvsm.worker.context import Link, RecvIO, S, WorkerContext
from kvsm.worker.peers import PeersAndClaims
from kvsm.worker.push_notif import FAILED, LANDED, WriteNotif, landed_notif, parse_write_notif
from kvsm.worker.runner import Effect
from kvsm.worker.ticker import STREAM_POLL_S, PollTicker

# How a link's write may stand; the settled ones can no longer land anything.
SETTLED = frozenset({LANDED, FAILED, "refused", "gone"})


class WriteAsker:
    """The decode side of push mode (the receiving part's writes)."""

    def __init__(self, ctx: WorkerContext, peers: PeersAndClaims,
                 sources_ready: Callable[[RecvIO], tuple[list[Link], list[str], list[tuple[str, ...] | None]] | None]
                 ) -> None:
        self.ctx = ctx
        self.loop = ctx.loop
        self.peers = peers
        self.sources_ready = sources_ready
        self._apply_recv = ctx.apply_recv
        ctx.on_write_notif = self.on_notif
        self._streams_awaited: set[str] = set()
        self._ticker: PollTicker | None = None
        self.effects: dict[str, Effect] = {"ask_writes": self._ask_writes, "stop_writes": self._stop_writes}

    # -- effects -------------------------------------------------------------------------

    def _ask_writes(self, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        start = io.start
        req = start.req
        ready = self.sources_ready(io)
        if ready is None:
            return
        reads, _, held = ready
        transport, client = self.ctx.transport, self.ctx.client
        assert transport is not None and client is not None
        if () in held:
            self._apply_recv(ev.Error(req=req, kind="layers_uncovered", detail=(
                "push mode needs every prefill worker to hold some of our layers (pipeline stages that differ)")))
            return
        now, wall = self.loop.now_ns(), self.loop.clock.wall_ns()
        window = int(self.ctx.cfg.transfer_timeout_s * S)
        io.write_deadline_ns = now + window + LEASE_MARGIN_NS
        io.posted_ns = now
        metadata = transport.metadata()
        for link in reads:
            ask = WriteAsk(protocol=PROTOCOL_VERSION, requester=client.requester, tp_rank=link.peer.rank,
                           pp_rank=link.peer.pp_rank, agent_metadata=metadata,
                           writes=[self._spec(io, link, wall + window)])
            rid = client.send(link.peer.address, ask, now + int(self.ctx.cfg.handshake_timeout_s * S))
            self.ctx.write_asks[rid] = partial(self._answered, req, link.index)
            link.write = "asked"
        self.peers._after_send()
        self._await(req, start.stream)
        io.write_timer = self.loop.call_at(io.write_deadline_ns, lambda: self._deadline(req), req=req,
                                           label="write deadline")
        self.ctx.poll_notifs_soon()
        self._apply_recv(ev.WritesAsked(req=req, num_blocks=len(dict.fromkeys(start.local_block_ids)),
                                        deadline_wall_ns=wall + window))

    @staticmethod
    def _spec(io: RecvIO, link: Link, deadline_wall_ns: int) -> WriteSpec:
        """What ``link``'s prefill worker writes, from its side: its blocks are the source."""
        start, src = io.start, link.source
        assert src is not None
        if start.stream:  # by position, as the prefill computes: whole blocks, rank to rank
            return WriteSpec(req=start.remote_req, dst_req=start.req, notif=landed_notif(start.req, link.index),
                             readers=link.readers, src_blocks=[], dst_blocks=list(start.local_block_ids),
                             group_sizes=list(start.group_sizes), deadline_wall_ns=deadline_wall_ns, stream=True,
                             dst_first=start.first_position, dst_firsts=list(start.group_firsts))
        here, there = start.block_sizes
        return WriteSpec(
            req=start.remote_req, dst_req=start.req, notif=landed_notif(start.req, link.index), readers=link.readers,
            src_blocks=list(start.remote_block_ids), dst_blocks=list(start.local_block_ids),
            group_sizes=list(start.group_sizes),
            src_heads=None if src.remote.whole else (src.remote.start, src.remote.count, src.remote.of),
            dst_heads=None if src.local.whole else (src.local.start, src.local.count, src.local.of),
            deadline_wall_ns=deadline_wall_ns, segment_tokens=start.segment_tokens,
            src_segments=list(start.remote_segments), dst_segments=list(start.local_segments),
            src_block_tokens=there if start.segment_tokens else 0, dst_block_tokens=here if start.segment_tokens else 0)

    def _stop_writes(self, io: RecvIO | None, o: Outcome) -> None:
        """Giving up: the blocks wait until no write can land (checked now, then at
        each answer, notification and the deadline)."""
        assert io is not None
        io.claims_over = True
        self._settle(io)

    # -- what comes back -------------------------------------------------------------------

    def _answered(self, req: str, index: int, result: HandshakeResult) -> None:
        io = self.ctx.recv_io.get(req)
        if io is None:
            return
        link = self._link(io, index)
        if link is None or link.write != "asked":
            return
        outcome = result.outcome
        if isinstance(outcome, ClaimsReply) and all(s == "ok" for s in outcome.claims.values()):
            link.write = "writing"
            return
        if isinstance(outcome, HandshakeRefused):
            link.write = "gone"  # nothing listens there: that process writes nothing any more
            self.peers.mark_dead(link.peer, str(outcome), "refused")
        elif isinstance(outcome, HandshakeTimeout):
            self.peers.mark_dead(link.peer, f"no answer to a write ask: {outcome}", "silent")
            # (the ask may have arrived: its write is bounded by the deadline only)
        else:
            link.write = "refused"
            detail = (f"the prefill worker answered {dict(outcome.claims)}" if isinstance(outcome, ClaimsReply)
                      else f"{outcome}")
            if req in self.ctx.recv:
                self._apply_recv(ev.Error(req=req, kind="push_refused", detail=detail[:300]))
        self._settle(io)

    def on_notif(self, peer: str, msg: bytes) -> None:
        """A prefill worker's word on one write (from the notification poll)."""
        try:
            notif = parse_write_notif(msg)
        except ValueError:
            self.ctx.note("worker.bad_notification", None, peer=peer, size=len(msg))
            return
        self.ctx.guard(notif.req, self._on_notif, (peer, notif))

    def _on_notif(self, item: tuple[str, WriteNotif]) -> None:
        peer, notif = item
        io = self.ctx.recv_io.get(notif.req)
        link = self._link(io, notif.link) if io is not None else None
        if io is None or link is None or self.peers.agent_of(link.peer) != peer or link.write in SETTLED:
            self.ctx.note("worker.write_notif_unmatched", notif.req, peer=peer, how=notif.how, link=notif.link)
            return
        req = notif.req
        link.write = notif.how
        link.done = True  # (its write is over, landed or not: the prefill worker counted us through)
        if notif.how == LANDED:
            if all(x.write == LANDED for x in io.reads):
                io.done_ns = self.loop.now_ns()
                self._apply_recv(ev.WritesLanded(req=req))
                return
        else:  # failed: nothing of it in flight; cancelled in flight: bytes may still land, until the deadline
            self._apply_recv(ev.Error(req=req, kind="write_failed", detail=f"the write from {peer} ended {notif.how}"))
        self._settle(io)

    def _deadline(self, req: str) -> None:
        """The deadline every write of ``req`` was bound by passed. A writer not
        through yet (cancelled in flight, or silent) has its agent dropped (as reads
        that never settle do), which closes the way its bytes could come by; then no
        write can land any more."""
        io = self.ctx.recv_io.get(req)
        if io is None or req not in self.ctx.recv:
            return
        io.write_timer = None
        for link in io.reads:
            if link.write not in SETTLED:
                self.peers.mark_dead(link.peer, f"writes into {req} not over by their deadline", "unsettled")
        self._not_awaited(req)
        self._apply_recv(ev.WritesStopped(req=req, why="the deadline every write was bound by passed"))

    def _settle(self, io: RecvIO) -> None:
        """Every write settled and not all landed: the request cannot succeed any
        more, and no write can land (the table hears ``writes_stopped``)."""
        req = io.start.req
        settled = [link.write for link in io.reads]
        if req not in self.ctx.recv or not all(w in SETTLED for w in settled) or all(w == LANDED for w in settled):
            return
        self._not_awaited(req)
        self._apply_recv(ev.WritesStopped(req=req, why="every write settled: " + ", ".join(sorted(set(settled)))))

    def _await(self, req: str, stream: bool) -> None:
        self.ctx.writes_awaited.add(req)
        if stream:
            self._streams_awaited.add(req)
            # (Not on a driven loop: a simulation's time is virtual, and its runs repeat.)
            if self._ticker is None and self.loop.thread is not None:
                self._ticker = PollTicker(self.loop, self.ctx.poll_notifs_now, STREAM_POLL_S)

    def _not_awaited(self, req: str) -> None:
        self.ctx.writes_awaited.discard(req)
        self._streams_awaited.discard(req)
        if not self._streams_awaited and self._ticker is not None:
            self._ticker.stop()
            self._ticker = None

    @staticmethod
    def _link(io: RecvIO, index: int) -> Link | None:
        reads = io.reads
        return reads[index] if 0 <= index < len(reads) and reads[index].index == index else None

    def ended(self, req: str) -> None:
        self._not_awaited(req)
