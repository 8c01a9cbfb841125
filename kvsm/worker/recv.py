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
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import PEER_UNREACHABLE_STATES, RECV, RECV_EARLY_POST_STATES
from kvsm.runtime.loop import LoopError
from kvsm.transport.base import Heads, TransferState, XferHandle
from kvsm.worker.context import NOTIF_FOLLOW_UP_NS, PeerIO, RecvEffect, RecvIO, S
from kvsm.worker.recv_plan import RecvPlanning, describe_segments, segments_of
from kvsm.worker.send import notif_of
from kvsm.worker.tp_map import ReadPlan

# Reads go out ahead of their claims only this long before the lease the prefill
# side announced ends (clocks of two hosts differ a little).
EARLY_READ_MARGIN_S = 1.0


class RecvSide(RecvPlanning):
    """Decode requests: their machines' effects and their reads."""

    def _recv_effect_table(self) -> dict[str, RecvEffect]:
        return {
            "take_blocks": self._nothing,
            "arm_handshake_timer": self._arm_handshake_timer,
            "start_handshake": self._start_handshake,
            "cancel_handshake_timer": self._cancel_handshake_timer,
            "post_reads": self._post_reads,
            "post_early_reads": self._post_early_reads,
            "arm_transfer_timer": self._arm_transfer_timer,
            "send_notif": self._send_notif,
            "release_reads": self._release_reads,
            "cancel_reads": self._cancel_reads,
            "deliver_blocks": self._deliver_blocks,
            "report_invalid": self._report_invalid,
            "count_late_reads": self._count_late_reads,
            "release_blocks": self._release_blocks,
            "notify_abandon": self._notify_abandon,
            "cancel_timers": self._cancel_recv_timers,
        }

    # -- inputs from the step's metadata ---------------------------------------------

    def _on_recv_start(self, start: RecvStart) -> None:
        req = start.req
        if req in self.recv:
            self._note("worker.duplicate_recv_start", req)
            return
        plan: ReadPlan | None = None
        plan_problem = ""
        try:
            plan = self._read_plan(start.remote_tp_size)
        except ValueError as e:
            plan_problem = str(e)
        io = self._recv_io[req] = self._recv_io_of(start, plan)
        self.recv.create(req)
        self._apply_recv(ev.Matched(req=req, num_tokens=start.num_tokens, remote_engine=start.remote_engine,
                                    remote_req=start.remote_req, remote_host=start.remote_host,
                                    remote_port=start.remote_port,
                                    remote_blocks=len(dict.fromkeys(start.remote_block_ids)),
                                    sources=len(io.reads), plan=self._describe_plan(plan, start.remote_pp_size),
                                    segments=describe_segments(start)))
        if plan_problem:
            self._apply_recv(ev.Error(req=req, kind="tp_mismatch", detail=plan_problem))
            return
        problem = self._unreadable(start)
        if problem is not None:
            kind, detail = problem
            self._apply_recv(ev.Error(req=req, kind=kind, detail=detail))
            return
        # (each block once: in segments a block id comes once per segment)
        self._apply_recv(ev.Allocated(req=req, block_ids=tuple(dict.fromkeys(start.local_block_ids)),
                                      num_external_tokens=start.num_tokens, group_sizes=start.group_sizes,
                                      early=self._readable_now(io)))

    def _readable_now(self, io: RecvIO) -> bool:
        """Whether the reads may go out with the claims (``early_reads``): every
        prefill worker read is known and readable here and holds some of our
        layers (a stage sharing none is told over the side channel instead, which
        must not overtake its claim)."""
        if not self.cfg.early_reads or self.transport is None:
            return False
        expiry = io.start.remote_expiry_s
        if expiry and self.loop.clock.wall_ns() > (expiry - EARLY_READ_MARGIN_S) * S:
            return False  # the lease may be over: the claim asks first (a read now would likely be refused)
        for link in io.reads:
            agent = self._peer_agent(link.peer)
            if not agent or self.transport.layers_read(agent) == ():
                return False
        return True

    def _fail_untracked(self, args: tuple[RecvStart, Exception]) -> None:
        """A RecvStart whose handling raised before its machine existed: vLLM waits
        for the request all the same. Track it just to fail it (and tell the prefill
        side to unpin)."""
        start, exc = args
        req = start.req
        if req not in self._recv_io:
            self._recv_io[req] = self._recv_io_of(start, self._plan_or_none(start.remote_tp_size))
        self.recv.create(req)
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
            self._recv_io[req] = self._recv_io_of(start, self._plan_or_none(abandon.remote_tp_size))
            self.recv.create(req)
            self._apply_recv(ev.Matched(req=req, num_tokens=0, remote_engine=abandon.remote_engine,
                                        remote_req=abandon.remote_req, remote_host=abandon.remote_host,
                                        remote_port=abandon.remote_port))
        self._apply_recv(ev.Abort(req=req))

    def _on_recv_abort(self, abort: RecvAbort) -> None:
        # After the end (the transfer was reported before vLLM's abort came) the
        # table records it as a stale input.
        self._apply_recv(ev.Abort(req=abort.req))

    # -- one transition and its effects ------------------------------------------------

    def _step_recv(self, event: ev.Event) -> Outcome:
        o = self.recv.apply(event)
        if not o.ok or o.stale:  # a violation (warned by _on_outcome) or a stale input: nothing to do
            return o
        req = o.req
        io = self._recv_io.get(req)
        if io is not None and io.answers and o.src != o.dst:
            # Its claims are over: one record of how each was answered (not one per reply:
            # thousands of requests retried every few ms starved the loop under load).
            if self.log is not None:
                by_status: dict[str, Any] = {status: {req: n} for status, n in io.answers.items()}
                self.log.emit("log", "worker.claims_answered", None, peer=io.peer.address, engine=io.peer.engine,
                              **by_status)
            io.answers = {}
        effects = self._recv_effects
        if o.dst not in RECV.terminal:
            for name in o.effects:
                try:
                    effects[name](req, io, o)
                except Exception as e:  # noqa: BLE001 - fails this request only (the rest are moot)
                    self._on_loop_error(LoopError(e, req, f"effect {name}", "post"))
                    break
            return o
        # The request ends here: every effect runs even if one raises, and vLLM hears
        # of the request whatever happens (as failed if the report itself raised).
        failed: list[tuple[str, Exception]] = []
        try:
            for name in o.effects:
                try:
                    effects[name](req, io, o)
                except Exception as e:  # noqa: BLE001 - reported below, the rest still runs
                    failed.append((name, e))
        finally:
            self._recv_io.pop(req, None)
            self._polling.pop(req, None)
            if not self._recv_io:
                self._compact_recv()
        if failed:
            self._effects_failed(req, io, o, failed)
        return o

    def _effects_failed(self, req: str, io: RecvIO | None, o: Outcome, failed: list[tuple[str, Exception]]) -> None:
        """Effects of a request's last transition raised: say so, and if the one that
        tells vLLM was among them, tell it now that the request failed."""
        names = [name for name, _ in failed]
        reported = None
        if io is not None and io.start.awaited and {"deliver_blocks", "release_blocks", "report_invalid"} & set(
                names):
            self.results.failed(req, io.start.local_block_ids)
            reported = "failed"
        if io is not None and self.transport is not None:
            for h in io.handles:  # terminal: every read has settled
                self.transport.release(h)
        for timer in io.timers() if io is not None else ():
            self.loop.cancel(timer)
        self._note("worker.effects_cut_short", req, final=o.dst, effects=names, reported=reported)
        name, exc = failed[0]
        self._on_loop_error(LoopError(exc, req, f"effect {name}", "post"))

    @staticmethod
    def _nothing(req: str, io: RecvIO | None, o: Outcome) -> None:
        return None

    def _compact_recv(self) -> None:
        """Nothing is receiving: rebuild the per-request tables, so memory returns to
        its baseline after a burst (dicts and sets keep the capacity of their peak). No
        read is in flight, so the read poll and the stalled-read probe have nothing to
        do: cancelled, rather than left to fire on nothing (a clean stop then finds no
        timer that outlived its work)."""
        self._recv_io = {}
        self._polling = {}
        self.recv.compact()
        for timer in (self._poll_timer, self._stall_timer):
            self.loop.cancel(timer)
        self._poll_timer = self._stall_timer = None

    # -- timers --------------------------------------------------------------------------

    def _arm_handshake_timer(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        io.handshake_timer = self.loop.call_later(
            int(self.cfg.handshake_timeout_s * S),
            lambda: self._timeout(req, "handshake"), req=req, label="handshake timeout")

    def _cancel_handshake_timer(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        if io is not None:
            self.loop.cancel(io.handshake_timer)
            self.loop.cancel(io.retry_timer)
            io.handshake_timer = io.retry_timer = None

    def _arm_transfer_timer(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        io.transfer_timer = self.loop.call_later(int(self.cfg.transfer_timeout_s * S),
                                                 lambda: self._timeout(req, "transfer"), req=req,
                                                 label="transfer timeout")
        self._guard(req, self._settle, req)  # a fast read may be over already

    def _timeout(self, req: str, what: str) -> None:
        if req in self.recv:
            self.stats.failure(f"{what}_timeout")
            self._apply_recv(ev.Timeout(req=req, what=what))

    def _cancel_recv_timers(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        if io is None:
            return
        for h in io.timers():
            self.loop.cancel(h)
        io.handshake_timer = io.transfer_timer = io.retry_timer = io.settle_timer = None

    # -- the handshake (claims themselves are the peers part's) ---------------------------

    def _start_handshake(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        for link in io.reads:
            if self._peer_state(link.peer) in PEER_UNREACHABLE_STATES:
                # Known dead: fail now rather than wait out another timeout.
                self.stats.failure("peer_dead")
                self._apply_recv(ev.PeerDead(req=req, peer=link.peer.key, reason="known_dead"))
                return
        for link in io.links:
            if link.source is not None:
                self._claim_queue.setdefault(link.peer.key, []).append(req)
            else:  # a prefill rank nobody of ours reads: it may unpin its share now
                link.told = True
                self._tell_abandon(link.peer, [io.start.remote_req], link.readers)

    # -- reads ---------------------------------------------------------------------------

    def _post_early_reads(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        """Post the reads as soon as the claims this transition queued have left:
        the claims go first, so their round trip overlaps the reads (a large read
        copies inside NIXL's post). ``Allocated`` comes only from a step's metadata,
        whose handling ends with ``_flush_claims``, which posts them."""
        self._early_posts.append(req)

    def _post_claimed_early(self, req: str) -> None:
        """``_flush_claims``'s second half: the reads of a request whose claims just
        left, unless it failed meanwhile (a claim refused at once)."""
        io = self._recv_io.get(req)
        m = self.recv.get(req)
        if io is None or m is None or m.state not in RECV_EARLY_POST_STATES or io.posted_ns:
            return
        self._post_reads(req, io, None)

    def _post_reads(self, req: str, io: RecvIO | None, o: Outcome | None) -> None:
        """Post the request's reads now; the machine hears of it right after this
        transition (a follow-up), on the same loop turn."""
        assert io is not None
        start = io.start
        if not start.local_block_ids:
            self._apply_recv(ev.NothingToRead(req=req))
            return
        assert self.transport is not None
        reads = io.reads
        agents = [self._peer_agent(link.peer) for link in reads]
        for link, agent in zip(reads, agents):
            if not agent:  # dropped meanwhile (found dead)
                self.stats.failure("peer_dead")
                self._apply_recv(ev.PeerDead(req=req, peer=link.peer.key, reason="no_agent"))
                return
        held = [self.transport.layers_read(agent) for agent in agents]
        uncovered = self._layers_uncovered(reads, held)
        if uncovered:
            self.stats.failure("layers_uncovered")
            self._apply_recv(ev.Error(req=req, kind="layers_uncovered", detail=uncovered))
            return
        io.posted_ns = self.loop.now_ns()
        segments = segments_of(start)
        for link, agent, layers in zip(reads, agents, held):
            src = link.source
            assert src is not None
            if layers == ():
                # A pipeline stage that holds none of our layers: nothing to read there. Told
                # over the side channel (acknowledged), as a rank nobody reads is: a NIXL
                # notification alone leaves an idle agent only at its next NIXL call.
                self._tell_abandon(link.peer, [start.remote_req], link.readers)
                link.done = link.told = True
                continue
            heads: dict[str, Heads] = {}  # (only when a run is cut: equal sizes read as ever)
            if not src.local.whole:
                heads["local_heads"] = (src.local.start, src.local.count, src.local.of)
            if not src.remote.whole:
                heads["remote_heads"] = (src.remote.start, src.remote.count, src.remote.of)
            # (a read posted before its claim was granted says so: the prefill side holds
            # its notification until the claim comes)
            notif = notif_of(start.remote_req, link.readers, early=not link.granted)
            link.handle = self.transport.post_read(agent, start.local_block_ids, start.remote_block_ids, notif,
                                                   tag=req, group_sizes=start.group_sizes, segments=segments,
                                                   **heads)
            io.handles.append(link.handle)
        self._apply_recv(ev.ReadsPosted(req=req, num_blocks=len(dict.fromkeys(start.local_block_ids)),
                                        num_descs=sum(self._descs_of(start, link, agent)
                                                      for link, agent in zip(reads, agents))))

    def _settle(self, req: str) -> None:
        """Check a request's reads; once none is in flight, say how they ended."""
        io = self._recv_io.get(req)
        if io is None or req not in self.recv:
            self._polling.pop(req, None)
            return
        assert self.transport is not None
        states = [self.transport.check(h) for h in io.handles]
        if any(s is TransferState.PENDING for s in states):
            self._watch(req)
            return
        self._polling.pop(req, None)
        io.done_ns = self.loop.now_ns()
        for link in io.reads:
            if link.handle is not None and states[io.handles.index(link.handle)] is TransferState.DONE:
                link.done = True
        failed = [(self._peer_of_handle(io, h), getattr(h, "error", "") or "NIXL reported an error")
                  for h, s in zip(io.handles, states) if s is TransferState.ERROR]
        if failed:
            self.stats.failure("transfer")
            errors = [e for _, e in failed]
            gone = any("Disconnect" in e for e in errors)
            self._apply_recv(ev.Error(req=req, kind="transfer", detail="; ".join(errors)[:500], peer_gone=gone))
            for peer, error in failed:
                if "Disconnect" in error:
                    self._mark_dead(peer, error, "disconnected")
                else:
                    self._apply_peer(ev.ReadFailed(req=peer.key, why=error[:200]))
            return
        self._apply_recv(ev.AllReadsDone(req=req, num_bytes=self._bytes_of(io)))

    @staticmethod
    def _peer_of_handle(io: RecvIO, handle: XferHandle) -> PeerIO:
        return next((link.peer for link in io.links if link.handle is handle), io.peer)

    def _watch(self, req: str) -> None:
        self._polling[req] = None
        self._arm_poll()
        self._arm_stall_watch()

    def _release_reads(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        """The request ended: its reads have all settled; let their handles go."""
        if io is None or self.transport is None:
            return
        for h in io.handles:
            self.transport.release(h)
        io.handles = []

    def _cancel_reads(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        """Interrupted (timeout, dead peer, abort): release what can be released.
        Reads still in flight may write: watch them until they settle (then the
        table hears how they ended); with none left, they quiesced."""
        if io is None:
            return
        assert self.transport is not None
        keep = []
        for h in io.handles:
            if self.transport.check(h) is TransferState.DONE:
                io.completed += 1
                for link in io.links:
                    if link.handle is h:
                        link.done = True
            if not self.transport.release(h):
                keep.append(h)
        io.handles = keep
        if keep:
            self._watch(req)
            if io.settle_timer is None:
                io.settle_timer = self.loop.call_later(int(self.cfg.transfer_timeout_s * S),
                                                       lambda: self._unsettled(req), req=req,
                                                       label="reads settle deadline")
        else:
            self._apply_recv(ev.ReadsQuiesced(req=req, completed=io.completed))

    def _unsettled(self, req: str) -> None:
        """Reads that neither finish nor fail for another transfer timeout: the
        peer is treated as dead, which removes its NIXL agent and so settles
        every read to it (none can write afterwards), and the request ends."""
        io = self._recv_io.get(req)
        if io is None:
            return
        io.settle_timer = None
        if io.handles:
            for peer in {id(self._peer_of_handle(io, h)): self._peer_of_handle(io, h) for h in io.handles}.values():
                self._mark_dead(peer, f"reads of {req} did not settle within {self.cfg.transfer_timeout_s} s "
                                      f"after the request gave up on them", "unsettled")
            self._settle(req)

    def _bytes_of(self, io: RecvIO) -> int:
        layout = getattr(self.transport, "layout", None)
        if layout is None:
            return 0
        start = io.start
        whole = layout.num_bytes(len(start.local_block_ids), start.group_sizes)
        return whole * start.segment_tokens // start.block_sizes[0] if start.segment_tokens else whole

    def _arm_poll(self, *, soon: bool = False) -> None:
        """Poll the reads in flight every ``notif_poll_interval``; ``soon``: a claim
        was just granted with its reads still in flight, which the prefill worker
        may serve a moment after its answer left: poll within NOTIF_FOLLOW_UP_NS,
        then at doubling intervals up to the configured one."""
        if soon:
            self._read_poll_ns = min(self._notif_min_ns, NOTIF_FOLLOW_UP_NS)
            if self._poll_timer is not None and self._poll_timer.deadline_ns > self.loop.now_ns() + self._read_poll_ns:
                self.loop.cancel(self._poll_timer)
                self._poll_timer = None
        if self._poll_timer is None and self._polling:
            self._poll_timer = self.loop.call_later(self._read_poll_ns, self._poll_reads, label="poll reads")

    def _poll_reads(self) -> None:
        self._poll_timer = None
        for req in list(self._polling):
            self._guard(req, self._settle, req)
        self._read_poll_ns = min(self._read_poll_ns * 2, self._notif_min_ns)
        self._arm_poll()

    # -- telling vLLM and the prefill side ----------------------------------------------------

    def _send_notif(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        """Nothing to read: tell the prefill side over the side channel (acknowledged,
        and unlike a NIXL notification on an idle agent it does not wait for our next
        NIXL call to leave)."""
        assert io is not None
        self._abandon_links(io)

    def _notify_abandon(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        self._abandon_links(io)

    def _abandon_links(self, io: RecvIO) -> None:
        """Tell every prefill rank we read nothing (more) from that it may unpin its
        share; a rank whose read completed and whose claim was granted was told by
        the read's notification (one whose claim was not is holding it: an abandon
        counts us through there)."""
        for link in io.links:
            if link.source is not None and not link.told and not (link.done and link.granted):
                link.told = True
                self._tell_abandon(link.peer, [io.start.remote_req], link.readers)

    def _deliver_blocks(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        if o.trigger in ("all_reads_done", "handshake_ok"):  # (handshake_ok: reads done before the grants)
            self.stats.transfer_done(((io.done_ns or self.loop.now_ns()) - io.posted_ns) / S, self._bytes_of(io),
                                     len(io.start.local_block_ids))
        if io.start.awaited:
            self.results.received(req)

    def _report_invalid(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        assert io is not None
        inputs = o.event.inputs() if o.event is not None else {}
        self.warn.warning("load_failed", "request %s failed to load its KV from %s (%s): %s", req,
                          io.peer.engine, o.trigger, inputs)
        if io.start.awaited:
            self.results.failed(req, io.start.local_block_ids)

    def _count_late_reads(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        self.stats.failure("lease_expired")
        assert io is not None
        self._note("worker.reads_late", req, peer=io.peer.address,
                   reads_took_s=round((self.loop.now_ns() - io.posted_ns) / S, 6),
                   lease_window_s=self.cfg.lease_s)

    def _release_blocks(self, req: str, io: RecvIO | None, o: Outcome) -> None:
        if io is not None and io.start.awaited:
            self.results.received(req)
