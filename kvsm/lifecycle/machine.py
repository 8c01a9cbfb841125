"""Applying events to requests: the compiled-table runtime of the lifecycles.

One ``LifecycleTracker`` per (process, lifecycle) holds every live request as
a plain ``RequestMachine`` object and moves it with the table compiled in
``table.py``. Every call returns an ``Outcome`` and hands it to the
listener (the event log), so each input and the transition it caused are
recorded in one place.

An event that is not legal in the request's current state is never a silent
no-op and never an exception in the caller: the tracker records a
*violation* naming the lifecycle, request, state and event, leaves the state
as it was, and returns it (``IllegalEventPolicy.RECORD``). Tests can ask for
``IllegalEventPolicy.RAISE`` to stop at the first one.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.events import Event
from kvsm.lifecycle.table import CONDITIONS, PREPARE, LifecycleSpec, Rule


class IllegalEventPolicy(enum.Enum):
    RECORD = "record"  # record the violation, keep the state, return it
    RAISE = "raise"  # also raise IllegalTransition (tests, simulation)


class IllegalTransition(RuntimeError):
    """Raised only under ``IllegalEventPolicy.RAISE``; carries the outcome."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.describe())
        self.outcome = outcome


class Outcome:
    """What one input did: a creation, a transition, or a violation."""

    __slots__ = ("lifecycle", "req", "trigger", "src", "dst", "effects", "violation", "event", "t_ns", "block_ids",
                 "stale")

    def __init__(
        self,
        lifecycle: str,
        req: str,
        trigger: str,
        src: str | None,
        dst: str | None,
        effects: tuple[str, ...] = (),
        violation: str | None = None,
        event: Event | None = None,
        t_ns: int = 0,
        block_ids: tuple[int, ...] = (),
        stale: str = "",
    ) -> None:
        self.lifecycle = lifecycle
        self.req = req
        self.trigger = trigger
        self.src = src
        self.dst = dst
        self.effects = effects
        self.violation = violation
        self.event = event
        self.t_ns = t_ns
        self.block_ids = block_ids
        # Non-empty: a declared stale input (why it no longer applies); nothing changed.
        self.stale = stale

    @property
    def ok(self) -> bool:
        return self.violation is None

    def describe(self) -> str:
        if self.violation:
            return (f"{self.violation}: lifecycle {self.lifecycle!r} request {self.req!r} "
                    f"in state {self.src!r} got event {self.trigger!r}")
        return f"{self.lifecycle}:{self.req} {self.src} --{self.trigger}--> {self.dst}"

    def __repr__(self) -> str:
        return f"<Outcome {self.describe()} effects={list(self.effects)}>"


Listener = Callable[[Outcome], None]


def take_step(rules: tuple[Rule, ...], m: RequestMachine, event: Event, now_ns: int) -> Rule:
    """The one implementation of a step: fold ``event`` into ``m``'s data with
    each rule's ``prepare`` callbacks, in order, and return the first rule whose
    conditions hold (the last rule of a pair is unconditional). The runtime's
    tracker and replay both call this, so they cannot disagree."""
    for rule in rules:
        for name in rule.prepare:
            PREPARE[name](m, event, now_ns)
        if all(CONDITIONS[c](m, event) for c in rule.conditions):
            return rule
    return rule  # unreachable for a validated declaration: its last rule has no condition


class LifecycleTracker:
    """Live requests of one lifecycle in one process, moved only by events.

    Finished requests leave the live table at once (memory returns to its
    baseline) but their final state is remembered in a bounded ring, so a late
    event (a read notification after lease expiry, say) is reported as what it
    is rather than as an unknown request.
    """

    def __init__(
        self,
        spec: LifecycleSpec,
        clock: Clock = SYSTEM_CLOCK,
        listener: Listener | None = None,
        policy: IllegalEventPolicy = IllegalEventPolicy.RECORD,
        remember_finished: int = 4096,
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.listener = listener
        self.policy = policy
        self._live: dict[str, RequestMachine] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._remember_finished = remember_finished
        self.violations = 0
        self.transitions = 0
        self._rules = spec.rules
        self._terminal = spec.terminal

    # -- queries -------------------------------------------------------------

    def get(self, req: str) -> RequestMachine | None:
        return self._live.get(req)

    def __contains__(self, req: str) -> bool:
        return req in self._live

    def __len__(self) -> int:
        return len(self._live)

    def live(self) -> Iterator[RequestMachine]:
        return iter(list(self._live.values()))

    def compact(self) -> None:
        """Drop the live table's spare capacity once nothing is live. A dict keeps
        the size of its peak: after a burst of 10,000 requests that is ~400 KiB
        per tracker, held for the life of the process unless rebuilt."""
        if not self._live:
            self._live = {}

    def final_state(self, req: str) -> str | None:
        """The terminal state of a recently finished request, if remembered."""
        return self._finished.get(req)

    def count_by_state(self) -> dict[str, int]:
        counts = dict.fromkeys(self.spec.states, 0)
        for m in self._live.values():
            counts[m.state] += 1
        return counts

    # -- inputs --------------------------------------------------------------

    def create(self, req: str, entry: str | None = None, block_ids: tuple[int, ...] = ()) -> Outcome:
        """Start tracking ``req`` in ``entry`` (default: the initial state)."""
        state = entry or self.spec.initial
        now = self.clock.monotonic_ns()
        if state not in self.spec.entry_states and state != self.spec.initial:
            return self._violate(req, "create", state, "illegal_entry_state", None, now)
        if req in self._live:
            return self._violate(req, "create", self._live[req].state, "duplicate_request", None, now)
        m = self.spec.machine_cls(req, self.spec.name, state, now)
        m.block_ids = tuple(block_ids)
        self._live[req] = m
        self._finished.pop(req, None)
        outcome = Outcome(self.spec.name, req, "create", None, state, t_ns=now, block_ids=m.block_ids)
        if self.listener is not None:
            self.listener(outcome)
        return outcome

    def apply(self, event: Event) -> Outcome:
        """Move ``event.req``'s machine by ``event``; record and return what happened."""
        req = event.req
        trigger = event.trigger
        now = self.clock.monotonic_ns()
        m = self._live.get(req)
        if m is None:
            final = self._finished.get(req)
            if final is None:
                return self._violate(req, trigger, None, "unknown_request", event, now)
            why = self.spec.stale_after_end.get((final, trigger))
            if why is not None:  # a declared late input: recorded, changes nothing
                outcome = Outcome(self.spec.name, req, trigger, final, final, (), None, event, now, (), why)
                if self.listener is not None:
                    self.listener(outcome)
                return outcome
            kind = self.spec.named_violations.get((final, trigger), "event_after_terminal")
            return self._violate(req, trigger, final, kind, event, now)
        src = m.state
        rules = self._rules.get((src, trigger))
        if rules is None:
            kind = self.spec.named_violations.get((src, trigger), "illegal_transition")
            return self._violate(req, trigger, src, kind, event, now)
        rule = take_step(rules, m, event, now)
        m.state = rule.dest
        m.updated_ns = now
        m.num_events += 1
        self.transitions += 1
        outcome = Outcome(self.spec.name, req, trigger, src, rule.dest, rule.effects, None, event, now, m.block_ids,
                          rule.stale)
        if rule.dest in self._terminal:
            del self._live[req]
            self._finished[req] = rule.dest
            if len(self._finished) > self._remember_finished:
                self._finished.popitem(last=False)
        if self.listener is not None:
            self.listener(outcome)
        return outcome

    def _violate(self, req: str, trigger: str, state: str | None, kind: str, event: Event | None,
                 now: int) -> Outcome:
        self.violations += 1
        outcome = Outcome(self.spec.name, req, trigger, state, state, (), kind, event, now)
        if self.listener is not None:
            self.listener(outcome)
        if self.policy is IllegalEventPolicy.RAISE:
            raise IllegalTransition(outcome)
        return outcome
