"""The receiving side (decode engine): requests whose KV is read from a prefill engine.

RecvStart -> matched, allocated -> start_handshake: claim the remote request
(``peers``) -> handshake_ok -> post_reads: one NIXL READ carrying a
notification -> all_reads_done: the table checks the reads completed inside
the lease the claim granted -> deliver_blocks (finished_recving), or the
blocks are reported invalid. When every prefill worker the request reads from
is known here (its agent loaded), the reads go out right behind the claims
instead (``reading_unclaimed``), so that the claims' round trip overlaps them;
reads that complete first wait for the grants (``read_unclaimed``), and are
served only if every claim is granted.

Which prefill workers a request reads from, and what each read moves, is
``recv_plan``'s.
"""

from __future__ import annotations

from typing import Any

from kvsm.handoff.facts import RecvAbandon, RecvAbort, RecvStart
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.folds import LEASE_MARGIN_NS
from kvsm.lifecycle.machine import Outcome
from kvsm.runtime.loop import LoopError, TimerHandle
from kvsm.transport.base import Heads
from kvsm.worker.context import Link, RecvIO, S, WorkerContext
from kvsm.worker.peers import PeersAndClaims
from kvsm.worker.push_recv import WriteAsker
from kvsm.worker.reads import ReadsInFlight
from kvsm.worker.recv_plan import ReadPlanner, describe_segments, segments_of
from kvsm.worker.runner import Effect, EffectTable
from kvsm.worker.send import notif_of
from kvsm.worker.tp_map import ReadPlan

# How a peer's death that fails a request is counted, by how it was found dead
# (the ``reason`` of ``Died``; a request that found it dead already, or its agent
# gone, counts as ``peer_dead``).
PEER_DEATH_FAILURES = {reason: f"peer_{reason}" for reason in ("refused", "silent", "disconnected", "unsettled")}



class Receiver:
    """Decode requests: their machines' effects and their reads (the receiving part)."""

    def __init__(self, ctx: WorkerContext, planner: ReadPlanner, peers: PeersAndClaims) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.loop = ctx.loop
        self.recv = ctx.recv
        self.stats = ctx.stats
        self.results = ctx.results
        self.warn = ctx.warn
        self.planner = planner
        self.peers = peers
        self._apply_recv = ctx.apply_recv
        self._guard = ctx.guard
        self._note = ctx.note
        self._recv_io = ctx.recv_io
        self._polling = ctx.polling
        self._early_posts: list[str] = []  # requests whose reads go out right after this turn's claims
        self.reads = ReadsInFlight(ctx, peers)
        self.asker = WriteAsker(ctx, peers, self.sources_ready)  # push mode
        self.effects: dict[str, Effect] = {
            "take_blocks": _nothing,
            "arm_handshake_timer": self._arm_handshake_timer,
            "start_handshake": self._start_handshake,
            "cancel_handshake_timer": self._cancel_handshake_timer,
            "post_reads": self._post_reads,
            "post_early_reads": self._post_early_reads,
            "arm_transfer_timer": self._arm_transfer_timer,
            "send_notif": self._send_notif,
            "release_reads": self._release_reads,
            "cancel_reads": self.reads.cancel_reads,
            "deliver_blocks": self._deliver_blocks,
            "report_invalid": self._report_invalid,
            "count_late_reads": self._count_late_reads,
            "count_failure": self._count_failure,
            "release_blocks": self._release_blocks,
            "notify_abandon": self._notify_abandon,
            "cancel_timers": self._cancel_recv_timers,
            **self.asker.effects,
        }
        ctx.runner.register(self.recv, EffectTable(self.effects, self._recv_io.get, self._ended,
                                                   self._effects_failed, self._moved))

    def timers(self) -> list[TimerHandle | None]:
        out = self.reads.timers()
        for io in self._recv_io.values():
            out += io.timers()
        return out

    # -- inputs from the step's metadata ---------------------------------------------

    def _on_recv_start(self, start: RecvStart) -> None:
        req = start.req
        if req in self.recv:
            self._note("worker.duplicate_recv_start", req)
            return
        plan: ReadPlan | None = None
        plan_problem = ""
        try:
            plan = self.planner.read_plan(start.remote_tp_size)
        except ValueError as e:
            plan_problem = str(e)
        io = self._recv_io[req] = self._recv_io_of(start, plan)
        self.recv.create(req)
        io.machine = self.recv.get(req)
        self._apply_recv(ev.Matched(req=req, num_tokens=start.num_tokens, remote_engine=start.remote_engine,
                                    remote_req=start.remote_req, remote_host=start.remote_host,
                                    remote_port=start.remote_port,
                                    remote_blocks=len(dict.fromkeys(start.remote_block_ids)),
                                    sources=len(io.reads), plan=self.planner.describe_plan(plan, start.remote_pp_size),
                                    segments=describe_segments(start), push=start.push))
        if plan_problem:
            self._apply_recv(ev.Error(req=req, kind="tp_mismatch", detail=plan_problem))
            return
        problem = self.planner.unreadable(start)
        if problem is not None:
            kind, detail = problem
            self._apply_recv(ev.Error(req=req, kind=kind, detail=detail))
            return
        # (each block once: in segments a block id comes once per segment)
        self._apply_recv(ev.Allocated(req=req, block_ids=tuple(dict.fromkeys(start.local_block_ids)),
                                      num_external_tokens=start.num_tokens, group_sizes=start.group_sizes,
                                      early=self._readable_now(io)))

    def _recv_io_of(self, start: RecvStart, plan: ReadPlan | None) -> RecvIO:
        """The request's links: one per prefill worker it deals with."""
        engine, host, port = start.remote_engine, start.remote_host, start.remote_port
        links = [Link(self.peers.peer(engine, host, port, rank, stage), rank, readers, source)
                 for rank, stage, readers, source in self.planner.workers_of(plan, start.remote_pp_size)]
        for index, link in enumerate(link for link in links if link.source is not None):
            link.index = index
        return RecvIO(start, links[0].peer, links)

    def _readable_now(self, io: RecvIO) -> bool:
        """Whether the reads may go out with the claims (``early_reads``): every
        prefill worker read is known and readable here and holds some of our
        layers (a stage sharing none is told over the side channel instead, which
        must not overtake its claim)."""
        if not self.cfg.early_reads or self.ctx.transport is None:
            return False
        # The params' expiry is advisory (a heartbeat may have extended the lease;
        # the claim's answer decides): near it the claim asks first, as a read
        # posted now would likely be refused. The same margin as the claim's lease.
        expiry_ns = io.start.remote_expiry_ns
        if expiry_ns and self.loop.clock.wall_ns() > expiry_ns - LEASE_MARGIN_NS:
            return False
        for link in io.reads:
            agent = self.peers.agent_of(link.peer)
            if not agent or self.ctx.transport.layers_read(agent) == ():
                return False
        return True

    def _fail_untracked(self, args: tuple[RecvStart, Exception]) -> None:
        """A RecvStart whose handling raised before its machine existed: vLLM waits
        for the request all the same. Track it just to fail it (and tell the prefill
        side to unpin)."""
        start, exc = args
        req = start.req
        if req not in self._recv_io:
            self._recv_io[req] = self._recv_io_of(start, self.planner.plan_or_none(start.remote_tp_size))
        self.recv.create(req)
        self._recv_io[req].machine = self.recv.get(req)
        self._apply_recv(ev.InternalError(req=req, where="_on_recv_start", detail=f"{type(exc).__name__}: {exc}"))

    def _on_recv_abandon(self, abandon: RecvAbandon) -> None:
        """vLLM gave up on a request before it reached the worker: track it just to
        abort it, which tells the prefill side to unpin."""
        req = abandon.req
        if req not in self.recv:
            start = RecvStart(req=req, remote_engine=abandon.remote_engine, remote_req=abandon.remote_req,
                              remote_host=abandon.remote_host, remote_port=abandon.remote_port,
                              remote_tp_size=abandon.remote_tp_size, remote_block_ids=(), local_block_ids=(),
                              num_tokens=0, awaited=False, remote_pp_size=abandon.remote_pp_size)
            self._recv_io[req] = self._recv_io_of(start, self.planner.plan_or_none(abandon.remote_tp_size))
            self.recv.create(req)
            self._recv_io[req].machine = self.recv.get(req)
            self._apply_recv(ev.Matched(req=req, num_tokens=0, remote_engine=abandon.remote_engine,
                                        remote_req=abandon.remote_req, remote_host=abandon.remote_host,
                                        remote_port=abandon.remote_port))
        self._apply_recv(ev.Abort(req=req))

    def _on_recv_abort(self, abort: RecvAbort) -> None:
        # After the end (the transfer was reported before vLLM's abort came) the
        # table records it as a stale input.
        self._apply_recv(ev.Abort(req=abort.req))

    # -- what the runner calls beside the effects ---------------------------------------

    def _moved(self, io: RecvIO | None, o: Outcome) -> None:
        """The request moved. A peer's death that moves it fails it (one whose own
        failure or abort is under way stays where it is): counted, by how the death
        was found. If its claims were answered, one record of how (not one per
        reply: thousands of requests retried every few ms starved the loop under load)."""
        if type(o.event) is ev.PeerDead:
            self.stats.failure(PEER_DEATH_FAILURES.get(o.event.reason, "peer_dead"))
        if io is not None and io.answers:
            if self.ctx.log is not None:
                by_status: dict[str, Any] = {status: {o.req: n} for status, n in io.answers.items()}
                self.ctx.log.emit("log", "worker.claims_answered", None, peer=io.peer.address,
                                  engine=io.peer.engine, **by_status)
            io.answers = {}

    def _ended(self, req: str, io: RecvIO | None) -> None:
        self.asker.ended(req)
        self._recv_io.pop(req, None)
        self._polling.pop(req, None)
        if not self._recv_io:
            self._compact_recv()

    def _effects_failed(self, req: str, io: RecvIO | None, o: Outcome,
                        failed: list[tuple[str, Exception]]) -> None:
        """Effects of a request's last transition raised: say so, and if the one that
        tells vLLM was among them, tell it now that the request failed."""
        names = [name for name, _ in failed]
        reported = None
        if io is not None and io.start.awaited and {"deliver_blocks", "release_blocks", "report_invalid"} & set(
                names):
            self.results.failed(req, io.start.local_block_ids)
            reported = "failed"
        if io is not None and self.ctx.transport is not None:
            for h in io.handles:  # terminal: every read has settled
                self.ctx.transport.release(h)
        for timer in io.timers() if io is not None else ():
            self.loop.cancel(timer)
        self._note("worker.effects_cut_short", req, final=o.dst, effects=names, reported=reported)
        name, exc = failed[0]
        self.ctx.on_error(LoopError(exc, req, f"effect {name}", "post"))

    def _compact_recv(self) -> None:
        """Nothing is receiving: empty the per-request tables, so memory returns to
        its baseline after a burst (a dict keeps the capacity of its peak until
        cleared), and stop the reads' polls (a clean stop then finds no timer that
        outlived its work)."""
        self._recv_io.clear()  # (clear, unlike a new dict, keeps the tables the parts share)
        self._polling.clear()
        self.recv.compact()
        self.reads.stop()

    # -- timers --------------------------------------------------------------------------

    def _arm_handshake_timer(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        assert io is not None
        io.handshake_timer = self.loop.call_later(
            int(self.cfg.handshake_timeout_s * S),
            lambda: self._timeout(req, "handshake"), req=req, label="handshake timeout")

    def _cancel_handshake_timer(self, io: RecvIO | None, o: Outcome) -> None:
        if io is not None:
            io.claims_over = True
            self.loop.cancel(io.handshake_timer)
            self.loop.cancel(io.retry_timer)
            io.handshake_timer = io.retry_timer = None

    def _arm_transfer_timer(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        assert io is not None
        io.transfer_timer = self.loop.call_later(int(self.cfg.transfer_timeout_s * S),
                                                 lambda: self._timeout(req, "transfer"), req=req,
                                                 label="transfer timeout")
        if not io.start.push:  # a fast read may be over already (push mode: the writes' notifications tell)
            self._guard(req, self.reads._settle, req)

    def _timeout(self, req: str, what: str) -> None:
        if req in self.recv:
            self.stats.failure(f"{what}_timeout")
            self._apply_recv(ev.Timeout(req=req, what=what))

    def _cancel_recv_timers(self, io: RecvIO | None, o: Outcome) -> None:
        if io is None:
            return
        for h in io.timers():
            self.loop.cancel(h)
        io.handshake_timer = io.transfer_timer = io.retry_timer = io.settle_timer = io.write_timer = None

    # -- the handshake (claims themselves are the peers part's) ---------------------------

    def _start_handshake(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        assert io is not None
        for link in io.reads:
            if not self.peers.reachable(link.peer):
                # Known dead: fail now rather than wait out another timeout.
                self._apply_recv(ev.PeerDead(req=req, peer=link.peer.key, reason="known_dead"))
                return
        for link in io.links:
            if link.source is not None:
                self.ctx.claim_queue.setdefault(link.peer.key, []).append(req)
            else:  # a prefill rank nobody of ours reads: it may unpin its share now
                link.told = True
                self.peers.tell_abandon(link.peer, [io.start.remote_req], link.readers)

    # -- reads ---------------------------------------------------------------------------

    def _post_early_reads(self, io: RecvIO | None, o: Outcome) -> None:
        """Post the reads as soon as the claims this transition queued have left:
        the claims go first, so their round trip overlaps the reads (a large read
        copies inside NIXL's post). ``Allocated`` comes only from a step's metadata,
        whose handling ends with ``_flush_claims``, which posts them."""
        req = o.req
        self._early_posts.append(req)

    def post_claimed_early(self) -> None:
        """The claims queued this turn have left (``flush_claims``): post the reads
        of the requests whose ``post_early_reads`` asked for it. One that ended
        meanwhile (a claim refused at once, a peer known dead) posts none; one still
        live is in ``reading_unclaimed`` (tests/test_lifecycle.py checks that every
        failure or abort from there ends it within the turn: no read is out yet)."""
        posts, self._early_posts = self._early_posts, []
        for req in posts:
            self._guard(req, self._post_claimed_early, req)

    def _post_claimed_early(self, req: str) -> None:
        io = self._recv_io.get(req)
        if io is not None and req in self.recv:
            self._post_reads(io, None)

    def _post_reads(self, io: RecvIO | None, o: Outcome | None) -> None:
        """Post the request's reads now; the machine hears of it right after this
        transition (a follow-up), on the same loop turn."""
        assert io is not None
        start = io.start
        req = start.req
        ready = self.sources_ready(io)
        if ready is None:
            return
        reads, agents, held = ready
        assert self.ctx.transport is not None
        io.posted_ns = self.loop.now_ns()
        segments = segments_of(start)
        for link, agent, layers in zip(reads, agents, held):
            src = link.source
            assert src is not None
            if layers == ():
                # A pipeline stage that holds none of our layers: nothing to read there. Told
                # over the side channel (acknowledged), as a rank nobody reads is: a NIXL
                # notification alone leaves an idle agent only at its next NIXL call.
                self.peers.tell_abandon(link.peer, [start.remote_req], link.readers)
                link.done = link.told = True
                continue
            heads: dict[str, Heads] = {}  # (only when a run is cut: equal sizes read as ever)
            if not src.local.whole:
                heads["local_heads"] = (src.local.start, src.local.count, src.local.of)
            if not src.remote.whole:
                heads["remote_heads"] = (src.remote.start, src.remote.count, src.remote.of)
            # (a read posted before its claim was granted says so: the prefill side holds
            # its notification until the claim comes)
            notif = notif_of(start.remote_req, link.readers, early=not io.granted(link))
            link.handle = self.ctx.transport.post_read(agent, start.local_block_ids, start.remote_block_ids, notif,
                                                   tag=req, group_sizes=start.group_sizes, segments=segments,
                                                   **heads)
            io.handles.append(link.handle)
        self._apply_recv(ev.ReadsPosted(req=req, num_blocks=len(dict.fromkeys(start.local_block_ids)),
                                        num_descs=sum(self.planner.descs_of(start, link, agent)
                                                      for link, agent in zip(reads, agents))))

    def sources_ready(self, io: RecvIO) -> tuple[list[Link], list[str], list[tuple[str, ...] | None]] | None:
        """The links a request moves its blocks through, their agents and the layers
        each fills here; None once the machine heard why there is nothing to move
        (a full local hit), or why it cannot be (an agent dropped meanwhile, a layer
        no prefill worker holds). Reads and push mode's writes both start here."""
        req = io.start.req
        if not io.start.local_block_ids:
            self._apply_recv(ev.NothingToRead(req=req))
            return None
        assert self.ctx.transport is not None
        reads = io.reads
        agents = [self.peers.agent_of(link.peer) for link in reads]
        for link, agent in zip(reads, agents):
            if not agent:  # dropped meanwhile (found dead)
                self._apply_recv(ev.PeerDead(req=req, peer=link.peer.key, reason="no_agent"))
                return None
        held = [self.ctx.transport.layers_read(agent) for agent in agents]
        uncovered = self.planner.layers_uncovered(reads, held)
        if uncovered:
            self.stats.failure("layers_uncovered")
            self._apply_recv(ev.Error(req=req, kind="layers_uncovered", detail=uncovered))
            return None
        return reads, agents, held

    def _release_reads(self, io: RecvIO | None, o: Outcome) -> None:
        """The request ended: its reads have all settled; let their handles go."""
        if io is None or self.ctx.transport is None:
            return
        for h in io.handles:
            self.ctx.transport.release(h)
        io.handles = []

    # -- telling vLLM and the prefill side ----------------------------------------------------

    def _send_notif(self, io: RecvIO | None, o: Outcome) -> None:
        """Nothing to read: tell the prefill side over the side channel (acknowledged,
        and unlike a NIXL notification on an idle agent it does not wait for our next
        NIXL call to leave)."""
        assert io is not None
        self._abandon_links(io)

    def _notify_abandon(self, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        self._abandon_links(io)

    def _abandon_links(self, io: RecvIO) -> None:
        """Tell every prefill rank we read nothing (more) from that it may unpin its
        share; a rank whose read completed and whose claim was granted was told by
        the read's notification (one whose claim was not is holding it: an abandon
        counts us through there). A rank nobody reads (``source`` None) is told at
        the handshake's start; ended before it (an abort while vLLM had not
        allocated), it is told here too, or it would hold its share for its lease."""
        for link in io.links:
            if not link.told and not (link.source is not None and link.done and io.granted(link)):
                link.told = True
                self.peers.tell_abandon(link.peer, [io.start.remote_req], link.readers)

    def _deliver_blocks(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        assert io is not None
        if o.trigger in ("all_reads_done", "handshake_ok", "writes_landed"):  # (handshake_ok: reads done before
            # the grants; writes_landed: push mode)
            self.stats.transfer_done(((io.done_ns or self.loop.now_ns()) - io.posted_ns) / S, self.reads.bytes_of(io),
                                     len(io.start.local_block_ids))
        if io.start.awaited:
            self.results.received(req)

    def _report_invalid(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        assert io is not None
        inputs = o.event.inputs() if o.event is not None else {}
        self.warn.warning("load_failed", "request %s failed to load its KV from %s (%s): %s", req,
                          io.peer.engine, o.trigger, inputs)
        if io.start.awaited:
            self.results.failed(req, io.start.local_block_ids)

    def _count_failure(self, io: RecvIO | None, o: Outcome) -> None:
        self.stats.failure(getattr(o.event, "kind", o.trigger))

    def _count_late_reads(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        self.stats.failure("lease_expired")
        assert io is not None
        self._note("worker.reads_late", req, peer=io.peer.address,
                   reads_took_s=round((self.loop.now_ns() - io.posted_ns) / S, 6),
                   lease_window_ns=io.machine.lease_window_ns if io.machine is not None else 0)

    def _release_blocks(self, io: RecvIO | None, o: Outcome) -> None:
        req = o.req
        if io is not None and io.start.awaited:
            self.results.received(req)


def _nothing(io: RecvIO | None, o: Outcome) -> None:
    return None
