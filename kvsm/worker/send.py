"""The sending side (prefill engine): requests whose blocks decode engines read.

SendFinish(ok), straight from the scheduler (``kvsm.handoff.pins``, not with a
later step) -> finished_ok: pin, arm the lease from the scheduler's decision
-> the decode side's read notification -> read_notif: free_blocks, i.e.
finished_sending. Claims and heartbeats extend the lease; expiry frees the
blocks, and a claim after it is answered "expired". Every answer is the
table's: a claim for a live request is its machine's heartbeat input, granted
by a transition or answered "unknown" by a declared stale input (both
recorded); one for a request ended or unknown here is answered by
``CLAIM_ANSWERS``. An abandon that overtakes the finish is the send machine's
``abandoned_early`` state (beyond ``MAX_EARLY_INPUTS`` of them, with early read
notifications, the table refuses one: ``refused_early``). A decode worker that knows us posts
its reads right behind its claims: a read's notification that overtakes its
claim is held until the claim comes (``note_read``), and one that overtakes
the finish too waits in ``read_early``.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec.structs

from kvsm.handoff.facts import SendFinish
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import ANSWER_OK, ANSWER_UNKNOWN, CLAIM_ANSWERS, MAX_EARLY_INPUTS, SEND_EARLY_WAITING
from kvsm.runtime.loop import LoopError, TimerHandle
from kvsm.worker.context import (
    NOTIF_FAST_WINDOW_NS,
    NOTIF_FOLLOW_UP_NS,
    NOTIF_POLL_MAX_NS,
    Periodic,
    S,
    SendIO,
    WorkerContext,
)
from kvsm.worker.push_notif import is_write_notif
from kvsm.worker.push_send import Writer
from kvsm.worker.runner import Effect, EffectTable

# A read's notification: the prefill request id, and when several decode ranks
# read this rank, how many (``<req>\x1f<readers>``; a bare id: one); a read
# posted ahead of its claim says so at the end (``\x1fearly``).
NOTIF_READERS_SEP = "\x1f"
NOTIF_EARLY = f"{NOTIF_READERS_SEP}early"


def notif_of(remote_req: str, readers: int, early: bool = False) -> bytes:
    """The notification a read carries to the prefill rank it reads."""
    text = remote_req if readers == 1 else f"{remote_req}{NOTIF_READERS_SEP}{readers}"
    return (text + NOTIF_EARLY if early else text).encode()


def parse_notif(msg: bytes) -> tuple[str, int, bool]:
    """(prefill request id, readers, posted ahead of its claim) of a read's notification."""
    text = msg.decode()
    early = text.endswith(NOTIF_EARLY)
    if early:
        text = text[:-len(NOTIF_EARLY)]
    req, sep, n = text.rpartition(NOTIF_READERS_SEP)
    if not sep:
        if not text:
            raise ValueError(f"malformed notification {msg[:80]!r}")
        return text, 1, early
    if not n.isdigit() or not 1 <= int(n) <= 1024 or not req:
        raise ValueError(f"malformed notification {text[:80]!r}")
    return req, int(n), early


class Sender:
    """Prefill requests: pins, leases, claims answered, notifications (the sending part)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.loop = ctx.loop
        self.send = ctx.send
        self.stats = ctx.stats
        self.results = ctx.results
        self.warn = ctx.warn
        self._apply_send = ctx.apply_send
        self._guard = ctx.guard
        self._note = ctx.note
        self.send_io: dict[str, SendIO] = {}
        self._notif_timer: TimerHandle | None = None
        self._has_readers = False  # a decode worker fetched our agent: poll notifications for good
        self._notif_min_ns = max(1, int(self.cfg.notif_poll_interval_s * S))
        self._notif_interval_ns = self._notif_min_ns
        self._notif_fast_until_ns = 0
        self.effects: dict[str, Effect] = {
            "pin_blocks": _nothing,
            "arm_lease": self._arm_lease,
            "extend_lease": self._arm_lease,
            "cancel_lease": self._cancel_lease,
            "free_blocks": self._free_blocks,
            "count_served": lambda req, o: self.stats.read_served(),
            "count_expired_lease": self._count_expired_lease,
            "count_hold_ended": self._count_hold_ended,
            "arm_abandon_timer": self._arm_abandon_timer,
            "cancel_abandon_timer": self._cancel_abandon_timer,
            "count_refused_abandon": self._count_refused_abandon,
            "count_refused_read": self._count_refused_read,
        }
        self.writer = Writer(ctx)  # push mode
        self.effects.update(self.writer.effects)
        ctx.poll_notifs_soon = lambda: self._arm_notif_poll(soon=True)
        ctx.poll_notifs_now = self._progress_now
        ctx.runner.register(self.send, EffectTable(self.effects, _same, self._ended, self._effects_failed))

    def periodic(self) -> dict[Periodic, Callable[[], None]]:
        """How each periodic timer of this part is armed again (``Recovery``)."""
        return {Periodic.POLL_NOTIFS: self._rearm_notif_poll}

    def _rearm_notif_poll(self) -> None:
        self._notif_timer = None
        self._arm_notif_poll()

    def timers(self) -> list[TimerHandle | None]:
        out: list[TimerHandle | None] = [self._notif_timer]
        for io in self.send_io.values():
            out += [io.lease_timer, io.abandon_timer]
        return out

    # -- the side channel's questions -----------------------------------------------------

    def _provide(self, tp_rank: int, pp_rank: int) -> tuple[str, bytes, bytes, int] | None:
        if (tp_rank, pp_rank) != (self.ctx.tp_rank, self.ctx.pp_rank) or self.ctx.transport is None:
            return None
        self._has_readers = True
        self._arm_notif_poll(soon=True)  # a new reader connects: its first read needs us
        return self.ctx.agent_name, self.ctx.transport.metadata(), b"", 1

    def _on_claims(self, kind: str, requester: str, claims: list[str], readers: int = 1) -> dict[str, str]:
        """Answer a decode worker's claims, heartbeats and abandons (``readers``: the
        decode ranks that have business with these blocks here, the requester one of them)."""
        answers: dict[str, str] = {}
        streams = self.writer.streamer.keys
        for req in claims:
            if req in streams:  # streamed push: claimed by its join key
                answers[req] = self._on_stream_claim(kind, requester, streams[req], readers)
                continue
            if kind == "abandon":
                waiting = 0
                if not self.send.known(req):
                    self.send.create(req)  # not heard of yet: the machine waits for its finish, or is refused
                    waiting = self._early_waiting()
                self._apply_send(ev.RemoteAbandoned(req=req, reason=f"abandoned by {requester}", reader=requester,
                                                    readers=readers, early_waiting=waiting))
                answers[req] = "ok"
                continue
            if req not in self.send:  # ended, or unknown here: nothing to record it against
                answers[req] = self.send.verdict(req, CLAIM_ANSWERS)
                continue
            # Live: the claim is its machine's input and the step is the answer (pinned:
            # a transition that extends the lease and counts a read held for it; not yet
            # pinned: a declared stale input), so the log records it and replay re-checks it.
            o = self._apply_send(ev.Heartbeat(req=req, lease_ns=self.cfg.lease_ns, reader=requester))
            answers[req] = ANSWER_OK if o is not None and o.ok and not o.stale else ANSWER_UNKNOWN
        if kind == "claim" or (kind == "heartbeat" and "ok" in answers.values()):
            # A claimed request is read next, and a read posted right behind its claim
            # (early reads) may be here already: a small one completes only once our
            # NIXL agent makes progress, so make it now, before the answer leaves, and
            # the decode worker finds the read done when the grant comes.
            self._progress_now()
            self._arm_notif_poll(soon=True)
        return answers

    def _on_stream_claim(self, kind: str, requester: str, req: str, readers: int) -> str:
        """A claim, heartbeat or abandon of a streamed request, named by its join key:
        the table may grant it before the prefill finished here."""
        if kind == "abandon":
            self._apply_send(ev.RemoteAbandoned(req=req, reason=f"abandoned by {requester}", reader=requester,
                                                readers=readers))
            return ANSWER_OK
        if req not in self.send:
            return self.send.verdict(req, CLAIM_ANSWERS)
        o = self._apply_send(ev.StreamClaimed(req=req, lease_ns=self.cfg.lease_ns, reader=requester))
        return ANSWER_OK if o is not None and o.ok and not o.stale else ANSWER_UNKNOWN

    def _progress_now(self) -> None:
        """Poll NIXL notifications now instead of at the poll timer (re-armed after).
        A failure there is the poll's (a logged loop error), not the claim's."""
        if self.ctx.transport is None:
            return
        if self._notif_timer is not None:
            self.loop.cancel(self._notif_timer)
            self._notif_timer = None
        self._guard(None, self._poll_notifs, None)

    def _on_read_notif(self, notif: ev.ReadNotif) -> None:
        """A read's notification. For a request not heard of yet (a read posted at
        once, before the scheduler's finish reached us) the machine is made to
        hold it, as for an early abandon, within the same bound."""
        req = notif.req
        if not self.send.known(req):
            self.send.create(req)
            notif = msgspec.structs.replace(notif, early_waiting=self._early_waiting())
        self._apply_send(notif)

    def _early_waiting(self) -> int:
        """How many early inputs wait already (the table refuses one more at
        MAX_EARLY_INPUTS): a count, recorded with the input, not a decision."""
        counts = self.ctx.state_counts["send"]
        return sum(counts[s] for s in SEND_EARLY_WAITING)

    # -- finishes from the scheduler ---------------------------------------------------

    def _on_pins(self, pins: list[SendFinish], via: str) -> None:
        """The scheduler's finishes, straight from it (loop thread)."""
        for finish in pins:
            self._guard(finish.req, self._on_send_finish, (finish, via))

    def _on_send_finish(self, item: tuple[SendFinish, str]) -> None:
        finish, via = item
        req = finish.req
        if finish.release:  # the scheduler releases a hold: only a live one has anything to release
            if req in self.send:
                self._apply_send(ev.ReleaseAsked(req=req, reason=finish.reason,
                                                 lease_ns=finish.lease_ns or self.cfg.lease_ns))
            else:
                self._note("worker.release_after_end", req, reason=finish.reason)
            return
        if self.send.may_begin(req):  # (a finish after a forgotten early abandon begins anew)
            self.send.create(req)
        # A finish told twice (a direct hand-off that partly failed also goes with a
        # step) is a declared stale input.
        if finish.ok:
            self._apply_send(ev.FinishedOk(req=req, block_ids=finish.block_ids, expected_reads=1,
                                           lease_ns=finish.lease_ns or self.cfg.lease_ns, pinned_ns=finish.pinned_ns,
                                           via=via, hold=finish.hold))
        elif finish.reason == "FINISHED_ABORTED":
            self._apply_send(ev.Abort(req=req))
        else:
            self._apply_send(ev.FinishedAbnormally(req=req, reason=finish.reason))

    # -- the end of a request ----------------------------------------------------------

    def _ended(self, req: str, _: str) -> None:
        self.writer.ended(req)
        io = self.send_io.pop(req, None)
        if io is not None and (io.lease_timer is not None or io.abandon_timer is not None):
            self.loop.cancel(io.lease_timer)  # (only left armed when an effect raised)
            self.loop.cancel(io.abandon_timer)
        if not self.send_io:
            self.send_io = {}  # a dict keeps the capacity of its peak: rebuilt once empty
            self.send.compact()

    def _effects_failed(self, req: str, _: str, o: Outcome, failed: list[tuple[str, Exception]]) -> None:
        """Effects of a request's last transition raised: its blocks go back to vLLM
        whatever happened (free_blocks, always the last one, may be the one that raised)."""
        names = [name for name, _ in failed]
        if "free_blocks" in names:
            self.results.sent(req)
        self._note("worker.effects_cut_short", req, final=o.dst, effects=names,
                   reported="sent" if "free_blocks" in names else None)
        name, exc = failed[0]
        self.ctx.on_error(LoopError(exc, req, f"effect {name}", "post"))

    def _arm_lease(self, req: str, o: Outcome) -> None:
        io = self.send_io.setdefault(req, SendIO())
        m = self.send.get(req)
        assert m is not None
        self.loop.cancel(io.lease_timer)
        io.lease_timer = self.loop.call_at(m.lease_deadline_ns, lambda: self._lease_expired(req), req=req,
                                           label="lease expiry")
        self._arm_notif_poll()

    def _lease_expired(self, req: str) -> None:
        if req in self.send:
            self._apply_send(ev.LeaseExpired(req=req))

    def _cancel_lease(self, req: str, o: Outcome) -> None:
        io = self.send_io.get(req)
        if io is not None:
            self.loop.cancel(io.lease_timer)
            io.lease_timer = None

    def _arm_abandon_timer(self, req: str, o: Outcome) -> None:
        io = self.send_io.setdefault(req, SendIO())
        io.abandon_timer = self.loop.call_later(self.cfg.lease_ns, lambda: self._abandon_expired(req), req=req,
                                                label="early abandon expiry")

    def _abandon_expired(self, req: str) -> None:
        if req in self.send:
            self._apply_send(ev.AbandonExpired(req=req))

    def _cancel_abandon_timer(self, req: str, o: Outcome) -> None:
        io = self.send_io.get(req)
        if io is not None:
            self.loop.cancel(io.abandon_timer)
            io.abandon_timer = None

    def _free_blocks(self, req: str, o: Outcome) -> None:
        self.results.sent(req)

    def _count_expired_lease(self, req: str, o: Outcome) -> None:
        self.stats.lease_expired()
        self.warn.warning("lease_expired", "lease of request %s expired unread; its %d blocks are freed",
                          req, len(o.block_ids))

    def _count_hold_ended(self, req: str, o: Outcome) -> None:
        self.stats.hold_ended("expired" if o.trigger == "lease_expired" else "released")

    def _count_refused_abandon(self, req: str, o: Outcome) -> None:
        self.stats.failure("early_abandon_dropped")
        self.warn.warning("early_abandon_dropped", "%d early inputs wait already; the abandon for %s is refused "
                          "(its lease frees the blocks)", MAX_EARLY_INPUTS, req)

    def _count_refused_read(self, req: str, o: Outcome) -> None:
        self.stats.failure("early_read_dropped")
        self.warn.warning("early_read_dropped", "%d early inputs wait already; the read notification for %s is "
                          "refused (its lease frees the blocks)", MAX_EARLY_INPUTS, req)

    # -- NIXL notifications -------------------------------------------------------------

    def _arm_notif_poll(self, *, soon: bool = False) -> None:
        """Poll NIXL notifications (which also drives our side of every NIXL
        connection): every ``notif_poll_interval`` right after a claim (a read
        is coming), backing off to NOTIF_POLL_MAX_NS while nothing arrives. No
        timer until a decode worker has fetched our agent: a prefill engine
        that never served anyone never wakes."""
        now = self.loop.now_ns()
        if soon:
            # A claimed request is read next, and on a fresh connection the read
            # needs our side to progress too: poll at full speed for a while, the
            # first poll within NOTIF_FOLLOW_UP_NS (the read may be just behind).
            self._notif_fast_until_ns = now + NOTIF_FAST_WINDOW_NS
            self._notif_interval_ns = min(self._notif_min_ns, NOTIF_FOLLOW_UP_NS)
            if self._notif_timer is not None and self._notif_timer.deadline_ns > now + self._notif_interval_ns:
                self.loop.cancel(self._notif_timer)
                self._notif_timer = None
        if self._notif_timer is None and (self.send_io or self._has_readers or self.ctx.writes_awaited):
            self._notif_timer = self.loop.call_later(self._notif_interval_ns, self._poll_notifs,
                                                     label=Periodic.POLL_NOTIFS.value)

    def _poll_notifs(self, _: None = None) -> None:
        """Take NIXL's notifications, which also drives our side of every NIXL connection
        (``_``: ``_guard``'s argument, when called off the timer)."""
        self._notif_timer = None
        assert self.ctx.transport is not None
        notifs = self.ctx.transport.get_notifs()
        if self.writer.busy():
            self.writer.poll()
        for peer, msg in notifs:
            if is_write_notif(msg):  # push mode: a write into our blocks ended
                self.ctx.on_write_notif(peer, msg)
                continue
            try:
                req, readers, early = parse_notif(msg)
            except (UnicodeDecodeError, ValueError):
                self._note("worker.bad_notification", None, peer=peer, size=len(msg))
                continue
            # After a release (the reader's abandon overtook its read's notification)
            # the table records it as stale; after expiry, as the violation it is.
            self._guard(req, self._on_read_notif, ev.ReadNotif(req=req, reader=peer, readers=readers, early=early))
        if notifs or self.loop.now_ns() < self._notif_fast_until_ns or self.writer.busy() or self.ctx.writes_awaited:
            # Full speed: the configured interval, reached by doubling from a claim's
            # first follow-up (the same interval when it is the default 1 ms).
            self._notif_interval_ns = min(self._notif_interval_ns * 2, self._notif_min_ns)
        else:
            self._notif_interval_ns = min(self._notif_interval_ns * 2, NOTIF_POLL_MAX_NS)
        self._arm_notif_poll()


def _nothing(req: str, o: Outcome) -> None:
    return None


def _same(req: str) -> str:
    """A prefill request's effects act on its id (its timers are looked up in ``send_io``)."""
    return req
