"""Recovery: an exception anywhere on the loop fails exactly the request it was
for, and nothing it held is lost (no stranded machine, no unarmed timer)."""

from __future__ import annotations

from kvsm.lifecycle import events as ev
from kvsm.runtime.loop import LoopError
from kvsm.worker.context import SendIO, WorkerContext, log


class Recovery(WorkerContext):
    """What the loop's ``on_error`` does."""

    def _on_loop_error(self, err: LoopError) -> None:
        """An exception in a loop callback: fail exactly the request it was for."""
        log.error("kvsm worker %s: %s", self.loop.name, err, exc_info=err.exc)
        self.stats.failure("internal")
        self._note("worker.loop_error", err.req, where=err.where, label=err.label,
                   error=f"{type(err.exc).__name__}: {err.exc}")
        try:
            if err.req is not None and err.req in self.recv:
                self._apply_recv(ev.InternalError(req=err.req, where=err.label or err.where,
                                                  detail=f"{type(err.exc).__name__}: {err.exc}"))
            if err.req is not None and err.req in self.send:
                self._recover_send(err.req)
            if err.where == "timer":
                self._rearm_periodic(err.label)
        except Exception:  # noqa: BLE001 - logged; the loop goes on
            log.exception("kvsm worker %s: recovering from an error of request %s also failed",
                          self.loop.name, err.req)

    def _recover_send(self, req: str) -> None:
        """A send-side handler raised for ``req``. Its blocks must come back to vLLM
        by the end of its lease at the latest (and not before: a decode worker that
        claimed them may read until then)."""
        m = self.send.get(req)
        if m is None or m.lease_deadline_ns == 0:  # not pinned: nothing is held
            return
        io = self._send_io.setdefault(req, SendIO())
        if io.lease_timer is not None and not io.lease_timer.cancelled:
            return  # its lease timer is still armed
        if m.lease_deadline_ns <= self.loop.now_ns():
            self._apply_send(ev.LeaseExpired(req=req))
        else:
            io.lease_timer = self.loop.call_at(m.lease_deadline_ns, lambda: self._lease_expired(req), req=req,
                                               label="lease expiry")

    def _rearm_periodic(self, label: str) -> None:
        """A periodic timer whose callback raised did not re-arm itself: do it here,
        or polling of reads, of NIXL notifications or of handshake deadlines would
        stop for good."""
        if label == "poll reads":
            self._poll_timer = None
            self._arm_poll()
        elif label == "stalled-read probe":
            self._stall_timer = None
            self._arm_stall_watch()
        elif label == "poll notifications":
            self._notif_timer = None
            self._arm_notif_poll()
        elif label == "handshake deadlines" and self.client is not None:
            self._expiry_timer = None
            self._arm_client_expiry()
        elif label == "claim retry flush":
            self._retry_flush = None
