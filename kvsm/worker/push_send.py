"""Push mode, prefill side: write a pinned request's blocks into a decode worker's.

A decode worker's ``WriteAsk`` (side channel, loop thread) loads its agent and
is each request's ``write_asked`` input: the table moves a pinned request to
``writing`` and ``post_write`` posts one NIXL WRITE per asking decode rank,
carrying the notification that rank chose. The notification poll checks the
writes (NIXL sends a write's notification in the check that sees it done):
each one over is ``write_done``, and once every decode rank is through the
blocks are freed. A write still in flight at the deadline its decode rank set
is cancelled (the rank is told ``cancelled`` and waits out its deadline); one
that fails is reported ``failed``. Nothing is written after a deadline, and
the request's lease still bounds how long its blocks stay pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsm.handshake.messages import WriteAsk, WriteSpec
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.folds import LEASE_MARGIN_NS
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import ANSWER_OK, ANSWER_UNKNOWN, CLAIM_ANSWERS
from kvsm.transport.base import TransferState, XferHandle
from kvsm.transport.regions import Segments
from kvsm.worker.context import WorkerContext
from kvsm.worker.push_notif import FAILED, Drains, tell
from kvsm.worker.push_stream import Streamer
from kvsm.worker.runner import Effect


@dataclass(slots=True)
class _Write:
    """One decode rank's write of one request: asked, then posted (``handle``)."""

    agent: str
    spec: WriteSpec
    deadline_ns: int  # the loop's clock: nothing of it may be in flight after this
    handle: XferHandle | None = None


class WriteAskRefused(ValueError):
    """A write ask this worker cannot serve at all (its agent cannot be loaded)."""


class Writer:
    """The sending part's writes (push mode)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.loop = ctx.loop
        self._apply_send = ctx.apply_send
        self.writes: dict[str, dict[str, _Write]] = {}  # prefill request -> decode rank -> its write
        self.drains = Drains(lambda: ctx.transport, self.loop.now_ns)  # stopped writes still on their way
        self.streamer = Streamer(ctx, self.drains)  # streamed push
        self.effects: dict[str, Effect] = {
            "post_write": self._post_write, "cancel_writes": self._cancel_writes,
            "abandon_writes": lambda req, o: self._cancel_writes(req, o, given_up=True),
            "count_write": self._count_write,
            **self.streamer.effects}

    def busy(self) -> bool:
        """Writes are in flight (the poll keeps its full speed)."""
        return bool(self.writes) or self.streamer.busy() or bool(self.drains)

    # -- the side channel's ask ------------------------------------------------------------

    def on_ask(self, ask: WriteAsk) -> dict[str, str]:
        """Answer a decode worker's write ask: per request "ok" (posted, or being
        posted), else the claim answer its state gives (nothing is written)."""
        transport = self.ctx.transport
        if transport is None:
            raise WriteAskRefused("this worker has no transport yet")
        unreachable = ""
        try:
            agent = transport.add_peer(ask.agent_metadata)
        except ValueError as e:  # not an agent, or an incompatible one: nothing changes here
            raise WriteAskRefused(f"the decode worker's agent cannot be loaded: {e}") from e
        except ConnectionError as e:  # NIXL cannot reach it (its process gone, say): nothing can be written
            agent, unreachable = "", f"its agent cannot be reached: {e}"
        wall, now = self.loop.clock.wall_ns(), self.loop.now_ns()
        answers: dict[str, str] = {}
        for spec in ask.writes:
            req = spec.req
            if spec.stream:
                answers[req] = self.streamer.on_ask(ask, spec, agent, unreachable, wall, now)
                continue
            if req not in self.ctx.send:
                answers[req] = self.ctx.send.verdict(req, CLAIM_ANSWERS)
                continue
            m = self.ctx.send.get(req)
            pinned = set(m.block_ids) if m is not None else set()
            if pinned and not set(spec.src_blocks) <= pinned:
                raise WriteAskRefused(f"the write of request {req} names blocks "
                                      f"{sorted(set(spec.src_blocks) - pinned)[:8]} that are not the request's")
            # The decode side frees its blocks at its deadline: a write must be over a
            # margin before it (our clock may run behind), so a late ask writes nothing.
            left = spec.deadline_wall_ns - LEASE_MARGIN_NS - wall
            if left <= 0 or unreachable:
                # That decode rank will never be written to: it is through (as by an abandon).
                why = unreachable or f"its write ask came {-left / 1e9:.3f} s past its deadline"
                self._apply_send(ev.RemoteAbandoned(req=req, reason=f"write ask of {ask.requester}: {why}"[:300],
                                                    reader=ask.requester, readers=spec.readers))
                answers[req] = "expired"
                continue
            if ask.requester in self.writes.get(req, {}):  # asked again while its write is out: that one serves
                answers[req] = ANSWER_OK
                continue
            self.writes.setdefault(req, {})[ask.requester] = _Write(agent, spec, now + left)
            o = self._apply_send(ev.WriteAsked(req=req, reader=ask.requester, readers=spec.readers,
                                               num_blocks=len(spec.dst_blocks), deadline_wall_ns=spec.deadline_wall_ns))
            taken = o is not None and o.ok and not o.stale
            if not taken:
                self._drop(req, ask.requester)
            answers[req] = ANSWER_OK if taken else ANSWER_UNKNOWN
        self.ctx.poll_notifs_soon()
        return answers

    # -- effects ---------------------------------------------------------------------------

    def _post_write(self, req: str, o: Outcome) -> None:
        assert isinstance(o.event, ev.WriteAsked)
        reader = o.event.reader
        w = self.writes.get(req, {}).get(reader)
        transport = self.ctx.transport
        if w is None or transport is None:
            self._apply_send(ev.WriteDone(req=req, reader=reader, ok=False, detail="nothing to write with"))
            return
        spec = w.spec
        segments = None
        if spec.segment_tokens:
            segments = Segments(spec.segment_tokens, tuple(spec.src_segments), tuple(spec.dst_segments),
                                spec.src_block_tokens, spec.dst_block_tokens)
        try:
            w.handle = transport.post_write(
                w.agent, spec.src_blocks, spec.dst_blocks, spec.notif, tag=spec.dst_req, group_sizes=spec.group_sizes,
                local_heads=spec.src_heads, remote_heads=spec.dst_heads, segments=segments)
        except (ValueError, ConnectionError, NotImplementedError) as e:
            self._end(req, reader, w, f"{type(e).__name__}: {e}")
            return
        self._check(req, reader, w)

    def _cancel_writes(self, req: str, o: Outcome | None, given_up: bool = False) -> None:
        """Before the blocks are freed: nothing of this request may land as written
        out of them (``Drains``; ``given_up``: its decode ranks gave up, so a write
        in flight may finish, landed notification and all)."""
        for reader, w in list(self.writes.get(req, {}).items()):
            self._cancel(req, reader, w, "its blocks were freed", given_up=given_up)
        self.writes.pop(req, None)
        self.streamer.cancel(req, given_up=given_up)

    def _count_write(self, req: str, o: Outcome) -> None:
        assert isinstance(o.event, ev.WriteDone)
        if o.event.ok:
            self.ctx.stats.read_served()
        else:
            self.ctx.stats.failure("write_failed")
            self.ctx.warn.warning("write_failed", "the write of request %s to %s did not complete: %s", req,
                                  o.event.reader, o.event.detail)

    # -- the poll ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Check every write in flight (from the notification poll)."""
        self.streamer.poll()
        self.ctx.guard(None, lambda _: self.drains.poll(), None)
        for req, by_reader in list(self.writes.items()):
            for reader, w in list(by_reader.items()):
                if w.handle is not None:
                    self.ctx.guard(req, self._check_one, (req, reader, w))

    def _check_one(self, item: tuple[str, str, _Write]) -> None:
        self._check(*item)

    def _check(self, req: str, reader: str, w: _Write) -> None:
        transport = self.ctx.transport
        assert transport is not None and w.handle is not None
        state = transport.check(w.handle)
        if state is TransferState.DONE:
            transport.release(w.handle)
            self._drop(req, reader)
            self._apply_send(ev.WriteDone(req=req, reader=reader, readers=w.spec.readers))
        elif state is TransferState.ERROR:
            self._end(req, reader, w, getattr(w.handle, "error", "") or "the transfer ended in error")
        elif self.loop.now_ns() >= w.deadline_ns:
            self._cancel(req, reader, w, "its deadline passed", at_deadline=True)
            self._apply_send(ev.WriteDone(req=req, reader=reader, readers=w.spec.readers, ok=False,
                                          detail="cancelled in flight at its deadline"))

    def _end(self, req: str, reader: str, w: _Write, detail: str) -> None:
        """A write that failed: its decode rank is told (nothing of it is in flight)."""
        transport = self.ctx.transport
        if transport is not None:
            if w.handle is not None:
                transport.release(w.handle, force=True)
            tell(transport, w.agent, w.spec.notif, FAILED)
        self._drop(req, reader)
        self._apply_send(ev.WriteDone(req=req, reader=reader, readers=w.spec.readers, ok=False, detail=detail[:300]))

    def _cancel(self, req: str, reader: str, w: _Write, why: str, at_deadline: bool = False,
                given_up: bool = False) -> None:
        """Stop ``w`` (``Drains``): its decode rank hears how it ended."""
        transport = self.ctx.transport
        if transport is None or w.handle is None:
            self._drop(req, reader)
            return
        if self.drains.stop(w.agent, w.spec.notif, [w.handle], w.handle, w.deadline_ns, at_deadline=at_deadline,
                            given_up=given_up):
            self.ctx.note("worker.write_cancelled", req, reader=reader, why=why)
        self._drop(req, reader)

    def _drop(self, req: str, reader: str) -> None:
        by_reader = self.writes.get(req)
        if by_reader is not None:
            by_reader.pop(reader, None)
            if not by_reader:
                del self.writes[req]

    def ended(self, req: str) -> None:
        """The request's machine ended: nothing of its writes is left (cancelled first)."""
        if req in self.writes:
            self._cancel_writes(req, None)
        self.streamer.ended(req)
