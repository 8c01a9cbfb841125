"""The declaration run by the real ``transitions`` library, for cross-checks.

The runtime uses the compiled table (``machine.LifecycleTracker``); this
module drives the same declaration through ``transitions.Machine`` so tests can
show, on random event sequences, that both agree on every state and effect.
"""

from __future__ import annotations

from typing import Any

from kvsm.lifecycle.events import Event
from kvsm.lifecycle.table import CONDITIONS, EFFECTS, PREPARE, LifecycleSpec


class TransitionsModel:
    """A ``transitions`` model whose callbacks are the table's named functions.

    ``prepare`` and ``conditions`` names call the same functions the compiled
    table calls; ``after`` names (effects) are appended to ``effects``.
    """

    def __init__(self, spec: LifecycleSpec, req: str, entry: str | None = None) -> None:
        self.data = spec.machine_cls(req, spec.name, entry or spec.initial, 0)
        self.effects: list[str] = []
        self.machine = spec.machine(model=self, initial=entry or spec.initial)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set on the instance: the table's callbacks.
        if name in PREPARE:
            return lambda event, now_ns: PREPARE[name](self.data, event, now_ns)
        if name in CONDITIONS:
            return lambda event, now_ns: CONDITIONS[name](self.data, event)
        if name in EFFECTS:
            return lambda event, now_ns: self.effects.append(name)
        raise AttributeError(name)

    def fire(self, event: Event, now_ns: int) -> bool:
        """Trigger ``event``; False (state unchanged) when it is not legal here."""
        from transitions import MachineError

        try:
            return bool(self.trigger(event.trigger, event, now_ns))
        except (MachineError, AttributeError):
            return False
