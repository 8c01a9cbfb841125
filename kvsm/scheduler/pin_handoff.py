"""How a finished prefill reaches this engine's workers: straight through the
pin channel (``kvsm.handoff.pins``), batched per step, or, where no worker can
be reached directly, with the next step's metadata. Which requests are pinned
is the ``sched`` lifecycle's decision; this only delivers it."""

from __future__ import annotations

import logging
import os
from typing import Any

from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import SendFinish
from kvsm.handoff.pins import PinChannelClient, PinTarget

log = logging.getLogger("kvsm.scheduler")

# Tests and benchmarks only: send pins with the next step, as before the pin
# channel existed (reproduces an offline prefill engine's stuck pins).
PIN_VIA_STEP_ENV = "KVSM_PIN_VIA_STEP"


class PinHandoff:
    """The pin channel to the workers and the finishes waiting for this step's batch."""

    def __init__(self, event_log: EventLog | None) -> None:
        self.log = event_log
        self.channel: PinChannelClient | None = None
        self.via_step = os.environ.get(PIN_VIA_STEP_ENV, "") not in ("", "0")
        self.pending: list[SendFinish] = []
        self._warned_no_channel = False

    def connect(self, targets: list[PinTarget]) -> None:
        """Open the pin channel to this engine's workers (vLLM hands over what each
        worker published at start, once they all registered their KV caches)."""
        if self.channel is not None:
            self.channel.close()
        self.channel = PinChannelClient(targets) if targets else None
        self._note("sched.workers_connected", None, workers=len(targets),
                   via=self.channel.via if self.channel else None,
                   ranks=sorted(t.tp_rank for t in targets), pin_via_step=self.via_step,
                   **({"stages": sorted({t.pp_rank for t in targets})} if any(t.pp_rank for t in targets) else {}))

    @property
    def workers(self) -> int:
        return self.channel.workers if self.channel else 0

    def path(self) -> str:
        """How a finish decided now reaches the workers."""
        if self.channel is None or self.via_step:
            if self.channel is None and not self._warned_no_channel and not self.via_step:
                self._warned_no_channel = True
                log.warning("kvsm: no direct channel to this engine's workers (vLLM did not hand over their "
                            "handshake metadata); finished prefills reach them with the next engine step")
            return "next_step"
        return self.channel.via

    def hand(self, finishes: list[SendFinish]) -> list[SendFinish]:
        """Tell every worker now; returns what must go with the next step instead."""
        if not finishes:
            return []
        channel = self.channel
        if channel is None or self.via_step:
            return finishes
        failed = channel.send(finishes)
        if not failed:
            return []
        for finish in finishes:
            for rank, why in failed:
                self._note("sched.pin_handoff_failed", finish.req, worker_rank=rank, error=why)
        log.error("kvsm: could not hand %d finished request(s) (%s...) to workers %s directly (%s); they go "
                  "with the next engine step", len(finishes), finishes[0].req, [r for r, _ in failed], failed[0][1])
        return finishes

    def flush(self) -> list[SendFinish]:
        """The finishes of this step, in one hand-off per worker; returns what must
        go with the next step."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        return self.hand(pending)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _note(self, event: str, req: str | None, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)
