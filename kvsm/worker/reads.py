"""Reads in flight (decode engine): polling them until they settle, telling
the request's machine how they ended, and watching for reads a partition
stalls (the receiving part's, apart from its effects in ``recv``).

A read neither completing nor failing for a quarter of ``stall_timeout`` gets
its peer probed (``PeersAndClaims.probe_liveness``); reads still unsettled a
transfer timeout after their request gave up on them mark the peer dead, which
removes its NIXL agent and so settles them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvsm.lifecycle import events as ev
from kvsm.lifecycle.machine import Outcome
from kvsm.runtime.loop import TimerHandle
from kvsm.transport.base import TransferState, XferHandle
from kvsm.worker.context import NOTIF_FOLLOW_UP_NS, PeerIO, Periodic, RecvIO, S, WorkerContext
from kvsm.worker.peers import PeersAndClaims


class ReadError(NamedTuple):
    """How one read failed, as typed facts: NIXL says a peer is gone only in its
    error's text (``nixlRemoteDisconnectError``), read here once."""

    peer: PeerIO
    error: str
    disconnected: bool

    @staticmethod
    def of(peer: PeerIO, handle: XferHandle) -> ReadError:
        error = getattr(handle, "error", "") or "NIXL reported an error"
        return ReadError(peer, error, DISCONNECT_MARK in error)


# How NIXL (and the in-memory transport, which mimics it) names a peer that is gone.
DISCONNECT_MARK = "Disconnect"


class ReadsInFlight:
    """Polls the reads of decode requests until they settle."""

    def __init__(self, ctx: WorkerContext, peers: PeersAndClaims) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.loop = ctx.loop
        self.recv = ctx.recv
        self.stats = ctx.stats
        self.peers = peers
        self._apply_recv = ctx.apply_recv
        self._guard = ctx.guard
        self._recv_io = ctx.recv_io
        self._polling = ctx.polling
        self._poll_timer: TimerHandle | None = None
        self._stall_timer: TimerHandle | None = None
        self._notif_min_ns = max(1, int(self.cfg.notif_poll_interval_s * S))
        self._read_poll_ns = self._notif_min_ns  # the configured interval, or ramping up to it after a grant

    def periodic(self) -> dict[Periodic, Callable[[], None]]:
        """How each periodic timer of this part is armed again (``Recovery``)."""
        return {Periodic.POLL_READS: self._rearm_read_poll, Periodic.STALL_PROBE: self._rearm_stall_watch}

    def _rearm_read_poll(self) -> None:
        self._poll_timer = None
        self._arm_poll()

    def _rearm_stall_watch(self) -> None:
        self._stall_timer = None
        self._arm_stall_watch()

    def timers(self) -> list[TimerHandle | None]:
        return [self._poll_timer, self._stall_timer]

    def stop(self) -> None:
        """No read is in flight: the read poll and the stalled-read probe have
        nothing to do (cancelled, rather than left to fire on nothing)."""
        for timer in (self._poll_timer, self._stall_timer):
            self.loop.cancel(timer)
        self._poll_timer = self._stall_timer = None

    def _settle(self, req: str) -> None:
        """Check a request's reads; once none is in flight, say how they ended."""
        io = self._recv_io.get(req)
        if io is None or req not in self.recv:
            self._polling.pop(req, None)
            return
        assert self.ctx.transport is not None
        states = [self.ctx.transport.check(h) for h in io.handles]
        if any(s is TransferState.PENDING for s in states):
            self._watch(req)
            return
        self._polling.pop(req, None)
        io.done_ns = self.loop.now_ns()
        for link in io.reads:
            if link.handle is not None and states[io.handles.index(link.handle)] is TransferState.DONE:
                link.done = True
        failed = [ReadError.of(self._peer_of_handle(io, h), h)
                  for h, s in zip(io.handles, states) if s is TransferState.ERROR]
        if failed:
            self.stats.failure("transfer")
            self._apply_recv(ev.Error(req=req, kind="transfer", detail="; ".join(f.error for f in failed)[:500],
                                      peer_gone=any(f.disconnected for f in failed)))
            for f in failed:  # (a typed input: the peer's machine is told what happened)
                if f.disconnected:
                    self.peers.mark_dead(f.peer, f.error, "disconnected")
                else:
                    self.ctx.apply_peer(ev.ReadFailed(req=f.peer.key, why=f.error[:200]))
            return
        self._apply_recv(ev.AllReadsDone(req=req, num_bytes=self.bytes_of(io)))

    @staticmethod
    def _peer_of_handle(io: RecvIO, handle: XferHandle) -> PeerIO:
        return next((link.peer for link in io.links if link.handle is handle), io.peer)

    def _watch(self, req: str) -> None:
        self._polling[req] = None
        self._arm_poll()
        self._arm_stall_watch()

    def check_reads_after_answer(self, reqs: list[str]) -> None:
        """Reads posted behind these claims: the prefill worker made its NIXL agent
        progress as it answered (a small read completes only then), so they may be
        done already; see now rather than at the next poll."""
        polling = self._polling
        for req in reqs:
            if req in polling:
                self._guard(req, self._settle, req)
        if any(req in polling for req in reqs):
            self._arm_poll(soon=True)  # still in flight: served a moment after the answer, most likely

    # -- reads in flight: is their peer still there? ----------------------------------------

    def _arm_stall_watch(self) -> None:
        if self._stall_timer is None and self._polling:
            self._stall_timer = self.loop.call_later(int(self.cfg.stall_timeout_s * S) // 4,
                                                     self._probe_stalled_reads, label=Periodic.STALL_PROBE.value)

    def _probe_stalled_reads(self) -> None:
        """Probe every peer that reads have been in flight from for over a quarter of
        ``stall_timeout`` (``PeersAndClaims.probe_liveness``). A NIXL read over a
        partitioned network neither completes nor fails for as long as TCP retries;
        the probe's timeout marks the peer dead instead. Reads posted ahead of their
        claims are probed once their claims are granted (the claim's answer, or its
        deadline, says whether the peer is there, and a busy peer answers claims first)."""
        self._stall_timer = None
        now = self.loop.now_ns()
        min_age = int(self.cfg.stall_timeout_s * S) // 4
        due: dict[str, PeerIO] = {}
        for req in self._polling:
            io = self._recv_io.get(req)
            if io is None or now - io.posted_ns < min_age:
                continue
            for link in io.reads:
                if not link.done and link.handle is not None and io.granted(link):
                    due[link.peer.key] = link.peer
        if due:
            self.peers.probe_liveness(list(due.values()))
        self._arm_stall_watch()

    def cancel_reads(self, io: RecvIO | None, o: Outcome) -> None:
        """Interrupted (timeout, dead peer, abort): release what can be released.
        Reads still in flight may write: watch them until they settle (then the
        table hears how they ended); with none left, they quiesced."""
        req = o.req
        if io is None:
            return
        io.claims_over = True  # (its claims need no retry: the request gives up)
        assert self.ctx.transport is not None
        keep = []
        for h in io.handles:
            if self.ctx.transport.check(h) is TransferState.DONE:
                io.completed += 1
                for link in io.links:
                    if link.handle is h:
                        link.done = True
            if not self.ctx.transport.release(h):
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
                self.peers.mark_dead(peer, f"reads of {req} did not settle within {self.cfg.transfer_timeout_s} s "
                                      f"after the request gave up on them", "unsettled")
            self._settle(req)

    def bytes_of(self, io: RecvIO) -> int:
        layout = getattr(self.ctx.transport, "layout", None)
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
            self._poll_timer = self.loop.call_later(self._read_poll_ns, self._poll_reads,
                                                    label=Periodic.POLL_READS.value)

    def _poll_reads(self) -> None:
        self._poll_timer = None
        for req in list(self._polling):
            self._guard(req, self._settle, req)
        self._read_poll_ns = min(self._read_poll_ns * 2, self._notif_min_ns)
        self._arm_poll()

