"""The one effect runner: step a tracker, then carry out the effects the table
returned, through that lifecycle's effect table.

Every lifecycle is run the same way; what differs between them is data
(``EffectTable``): the effects by name, what they act on (a decode request's
I/O, a prefill request, a peer), and what is dropped once a machine ends.
An event raised while another transition's effects run (a follow-up: a read
posted inside ``handshake_ok``'s effects, a peer's death failing its requests)
is queued and applied right after, in order, on the same loop turn: nothing is
handed to the loop again, so nothing can be dropped on the way.

Effects of a transition that does not end its machine stop at the first that
raises (the rest are moot: the request fails, see ``Recovery``). Effects of a
machine's last transition all run even if one raises, so whatever holds blocks
hands them back, and ``on_end_failed`` then says what was cut short.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvsm.lifecycle import events as ev
from kvsm.lifecycle.machine import LifecycleTracker, Outcome
from kvsm.runtime.loop import LoopError

# An effect: what it acts on (the lifecycle's ``subject``) and the outcome that asked for it.
Effect = Callable[[Any, Outcome], None]


@dataclass(frozen=True, slots=True)
class EffectTable:
    """How one lifecycle's effects are carried out."""

    effects: Mapping[str, Effect]
    # What the effects act on, looked up once per transition (None: nothing is).
    subject: Callable[[str], Any]
    # A machine ended: drop what the worker kept beside it.
    on_end: Callable[[str, Any], None]
    # Effects of a machine's last transition raised: say so, make good what they missed.
    on_end_failed: Callable[[str, Any, Outcome, list[tuple[str, Exception]]], None]
    # Before the effects of a transition that moved the machine (optional).
    on_moved: Callable[[Any, Outcome], None] | None = None


class EffectRunner:
    """Applies events to the trackers and runs their effects (loop thread only)."""

    def __init__(self, on_error: Callable[[LoopError], None]) -> None:
        self._on_error = on_error
        self._tables: dict[int, tuple[EffectTable, frozenset[str]]] = {}
        self._followups: deque[tuple[LifecycleTracker, ev.Event]] = deque()
        self._applying = False

    def register(self, tracker: LifecycleTracker, table: EffectTable) -> None:
        self._tables[id(tracker)] = (table, tracker.spec.terminal)

    def table(self, tracker: LifecycleTracker) -> EffectTable:
        return self._tables[id(tracker)][0]

    def apply(self, tracker: LifecycleTracker, event: ev.Event) -> Outcome | None:
        """Apply ``event`` and carry out its effects; an event applied while another
        transition's effects run is queued and applied right after it (None)."""
        if self._applying:
            self._followups.append((tracker, event))
            return None
        self._applying = True
        try:
            return self.step(tracker, event)
        finally:
            try:
                self._drain()
            finally:
                self._applying = False

    def _drain(self) -> None:
        """Apply the queued follow-ups; one that raises fails its own request only."""
        queue = self._followups
        while queue:
            tracker, event = queue.popleft()
            try:
                self.step(tracker, event)
            except Exception as e:  # noqa: BLE001 - fail that request, go on with the rest
                self._on_error(LoopError(e, event.req, f"follow-up {event.trigger}", "post"))

    def step(self, tracker: LifecycleTracker, event: ev.Event) -> Outcome:
        """One transition and its effects."""
        table, terminal = self._tables[id(tracker)]
        o = tracker.apply(event)
        if o.violation is not None or o.stale:  # warned by the listener, or a stale input: nothing to do
            return o
        req = o.req
        subject = table.subject(req)
        if table.on_moved is not None and o.src != o.dst:
            table.on_moved(subject, o)
        effects = table.effects
        if o.dst not in terminal:
            for name in o.effects:
                try:
                    effects[name](subject, o)
                except Exception as e:  # noqa: BLE001 - fails this request only (the rest are moot)
                    self._on_error(LoopError(e, req, f"effect {name}", "post"))
                    break
            return o
        failed: list[tuple[str, Exception]] = []
        try:
            for name in o.effects:
                try:
                    effects[name](subject, o)
                except Exception as e:  # noqa: BLE001 - reported below, the rest still runs
                    failed.append((name, e))
        finally:
            table.on_end(req, subject)
        if failed:
            table.on_end_failed(req, subject, o, failed)
        return o
