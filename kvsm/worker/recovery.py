"""Recovery: an exception anywhere on the loop fails exactly the request it was
for, and nothing it held is lost (no stranded machine, no unarmed timer)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvsm.lifecycle import events as ev
from kvsm.runtime.loop import LoopError
from kvsm.worker.context import Periodic, SendIO, WorkerContext, log
from kvsm.worker.send import Sender

# A loop error names its timer by label; the worker's periodic timers by kind.
PERIODIC_BY_LABEL: Mapping[str, Periodic] = {kind.value: kind for kind in Periodic}


class Recovery:
    """What the loop's ``on_error`` does (the recovery part). ``rearm``: how each
    periodic timer is armed again when its callback raised (``Periodic``)."""

    def __init__(self, ctx: WorkerContext, sender: Sender, rearm: Mapping[Periodic, Callable[[], None]]) -> None:
        self.ctx = ctx
        self.sender = sender
        self.rearm = rearm

    def on_loop_error(self, err: LoopError) -> None:
        """An exception in a loop callback: fail exactly the request it was for."""
        ctx = self.ctx
        log.error("kvsm worker %s: %s", ctx.loop.name, err, exc_info=err.exc)
        ctx.stats.failure("internal")
        ctx.note("worker.loop_error", err.req, where=err.where, label=err.label,
                 error=f"{type(err.exc).__name__}: {err.exc}")
        try:
            if err.req is not None and err.req in ctx.recv:
                ctx.apply_recv(ev.InternalError(req=err.req, where=err.label or err.where,
                                                detail=f"{type(err.exc).__name__}: {err.exc}"))
            if err.req is not None and err.req in ctx.send:
                self._recover_send(err.req)
            if err.where == "timer":
                kind = PERIODIC_BY_LABEL.get(err.label)
                if kind is not None:
                    self.rearm[kind]()
        except Exception:  # noqa: BLE001 - logged; the loop goes on
            log.exception("kvsm worker %s: recovering from an error of request %s also failed",
                          ctx.loop.name, err.req)

    def _recover_send(self, req: str) -> None:
        """A send-side handler raised for ``req``. Its blocks must come back to vLLM
        by the end of its lease at the latest (and not before: a decode worker that
        claimed them may read until then)."""
        m = self.ctx.send.get(req)
        if m is None or m.lease_deadline_ns == 0:  # not pinned: nothing is held
            return
        io = self.sender.send_io.setdefault(req, SendIO())
        if io.lease_timer is not None and not io.lease_timer.cancelled:
            return  # its lease timer is still armed
        loop = self.ctx.loop
        if m.lease_deadline_ns <= loop.now_ns():
            self.ctx.apply_send(ev.LeaseExpired(req=req))
        else:
            io.lease_timer = loop.call_at(m.lease_deadline_ns, lambda: self.sender._lease_expired(req), req=req,
                                          label="lease expiry")
