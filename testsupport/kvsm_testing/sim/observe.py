"""What the simulation sees of a real worker: every lifecycle outcome, as its event log does.

A ``WorkerHalf`` hands each outcome of its machines to its event log
(``record_outcome``). The simulation gives each worker a log that also tells
an ``EngineObserver``: a real ``EventLog`` that writes the file replay reads
(``ObservedLog``), or, with no log directory, a sink that only observes
(``ObserverSink``). Nothing here reads the worker's internals.

The observer keeps what the checks need: each request's current state (the
wire checks ask it at the moment a read lands), final states, illegal events,
and a ``BlockLedger`` fed by the effects, as replay keeps one from the log.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsm.eventlog import EventLog
from kvsm.lifecycle.invariants import BlockLedger, InvariantViolation
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import LIFECYCLES

OutcomeHook = Callable[[str, Outcome], None]
REQUEST_LIFECYCLES = ("recv", "send")


class EngineObserver:
    """One engine's outcomes: states, finals, ledger, illegal events (driver thread)."""

    def __init__(self, engine_id: str, hooks: list[OutcomeHook]) -> None:
        self.engine_id = engine_id
        self.ledger = BlockLedger(engine_id)
        self.live: dict[tuple[str, str], str] = {}  # (lifecycle, req) -> state
        self.finals: dict[tuple[str, str], str] = {}
        self.illegal: list[Outcome] = []
        self._hooks = hooks  # the simulation's list: tests append to it

    def requests_live(self) -> int:
        """Live request machines (recv, send); peer machines live as long as their peer."""
        return sum(1 for lifecycle, _ in self.live if lifecycle in REQUEST_LIFECYCLES)

    def state(self, lifecycle: str, req: str) -> str | None:
        key = (lifecycle, req)
        return self.live.get(key) or self.finals.get(key)

    def __call__(self, o: Outcome) -> None:
        if o.violation is not None:
            self.illegal.append(o)
        else:
            self._track(o)
        for hook in self._hooks:
            hook(self.engine_id, o)

    def _track(self, o: Outcome) -> None:
        key = (o.lifecycle, o.req)
        if o.stale and key not in self.live:
            return  # a declared late input after the end: nothing changed
        where = {"engine": self.engine_id, "t_ns": o.t_ns, "event": o.trigger}
        if o.trigger == "create":
            self.live[key] = o.dst  # type: ignore[assignment]
            self.finals.pop(key, None)
            if o.block_ids:
                self.ledger.hold(o.req, o.block_ids, where)
            return
        self.ledger.apply_effects(o.req, o.effects, o.block_ids, where)
        spec = LIFECYCLES.get(o.lifecycle)
        if spec is not None and o.dst in spec.terminal:
            self.live.pop(key, None)
            self.finals[key] = o.dst
            self.ledger.finish(o.req, o.dst, where)
        else:
            self.live[key] = o.dst  # type: ignore[assignment]

    def final_states(self) -> dict[tuple[str, str, str], str]:
        """Every machine's last state: terminal ones and (at the end of a run that
        went wrong) those still live."""
        out = {(self.engine_id, lc, req): s for (lc, req), s in self.finals.items()}
        out.update({(self.engine_id, lc, req): s for (lc, req), s in self.live.items()})
        return out

    def violations(self) -> list[InvariantViolation]:
        out = list(self.ledger.violations)
        for (lifecycle, req), state in sorted(self.live.items()):
            if lifecycle in REQUEST_LIFECYCLES:
                out.append(InvariantViolation("not_terminal_at_end", req,
                                              f"{self.engine_id} {lifecycle} request left in {state!r}"))
        return out


class ObservedLog(EventLog):
    """The worker's event log, on the simulation's clock, that also tells the observer."""

    def __init__(self, path: Path, observer: EngineObserver, **kwargs: Any) -> None:
        self._observer = observer
        super().__init__(path, **kwargs)

    def record_outcome(self, outcome: Outcome) -> None:
        super().record_outcome(outcome)
        self._observer(outcome)


class ObserverSink:
    """In place of an event log when the run writes none: outcomes go to the
    observer, notes nowhere (the calls a worker makes on its log)."""

    def __init__(self, observer: EngineObserver, *, role: str, engine_id: str, rank: int = 0) -> None:
        self._observer = observer
        self.role = role
        self.engine_id = engine_id
        self.rank = rank
        self.closed = False

    def record_outcome(self, outcome: Outcome) -> None:
        self._observer(outcome)

    def emit(self, kind: str, event: str, req: str | None = None, **fields: Any) -> int | None:
        return None

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> bool:
        self.closed = True
        return True

    def stats(self) -> dict[str, Any]:
        return {}
