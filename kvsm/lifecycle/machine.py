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
from collections.abc import Callable, Iterator, Mapping

from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.events import Event
from kvsm.lifecycle.spec import LifecycleSpec, Rule
from kvsm.lifecycle.vocabulary import CONDITIONS, PREPARE


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
    tracker and replay both call this (through ``apply_step``), so they cannot
    disagree."""
    for rule in rules:
        for name in rule.prepare:
            PREPARE[name](m, event, now_ns)
        for c in rule.conditions:
            if not CONDITIONS[c](m, event):
                break
        else:
            return rule
    return rule  # unreachable for a validated declaration: its last rule has no condition


def move(m: RequestMachine, dest: str, now_ns: int) -> None:
    """What a taken rule does to the machine's own bookkeeping (conditions may read it)."""
    m.state = dest
    m.updated_ns = now_ns
    m.num_events += 1


def step_rule(spec: LifecycleSpec, m: RequestMachine, event: Event, now_ns: int) -> Rule | None:
    """The legal part of a step: the rule ``event`` takes from the live machine's
    state (``take_step``), the machine moved by it; None (nothing done) when the
    state has no rule for the trigger. ``apply_step`` wraps it in an outcome;
    replay calls it alone for an input recorded as a legal transition."""
    rules = spec.rules.get((m.state, event.trigger))
    if rules is None:
        return None
    rule = take_step(rules, m, event, now_ns)
    move(m, rule.dest, now_ns)
    return rule


def create_step(spec: LifecycleSpec, req: str, entry: str | None, block_ids: tuple[int, ...], now_ns: int,
                live: RequestMachine | None) -> tuple[RequestMachine | None, Outcome]:
    """One whole creation, as ``LifecycleTracker.create`` and replay do it: the
    new machine (``spec.machine_cls``, in ``entry`` or the initial state) and its
    outcome, or None and the violation (an entry the spec does not allow; ``live``:
    the request already has a live machine)."""
    state = entry or spec.initial
    if state not in spec.entry_states and state != spec.initial:
        return None, Outcome(spec.name, req, "create", state, state, (), "illegal_entry_state", None, now_ns)
    if live is not None:
        return None, Outcome(spec.name, req, "create", live.state, live.state, (), "duplicate_request", None,
                             now_ns)
    m = spec.machine_cls(req, spec.name, state, now_ns)
    m.block_ids = tuple(block_ids)
    return m, Outcome(spec.name, req, "create", None, state, t_ns=now_ns, block_ids=m.block_ids)


def apply_step(spec: LifecycleSpec, m: RequestMachine | None, final: str | None, event: Event,
               now_ns: int) -> Outcome:
    """One whole step of one request, as ``LifecycleTracker.apply`` and replay do
    it: ``event`` moves the live machine ``m`` (``take_step``, then ``move``), or,
    with no live machine, is judged against ``final``, the state it ended in (None:
    never known). Illegal inputs come back as violations named by the spec
    (``named_violations``), declared late ones after the end as stale outcomes
    (``stale_after_end``: src == dst == ``final``, no effects). The machine has
    ended when it was live and the outcome's ``dst`` is terminal: the caller
    drops it then and remembers ``dst`` as its ``final``."""
    req = event.req
    trigger = event.trigger
    if m is None:
        if final is None:
            return Outcome(spec.name, req, trigger, None, None, (), "unknown_request", event, now_ns)
        why = spec.stale_after_end.get((final, trigger))
        if why is not None:  # a declared late input: recorded, changes nothing
            return Outcome(spec.name, req, trigger, final, final, (), None, event, now_ns, (), why)
        kind = spec.named_violations.get((final, trigger), "event_after_terminal")
        return Outcome(spec.name, req, trigger, final, final, (), kind, event, now_ns)
    src = m.state
    rule = step_rule(spec, m, event, now_ns)
    if rule is None:
        kind = spec.named_violations.get((src, trigger), "illegal_transition")
        return Outcome(spec.name, req, trigger, src, src, (), kind, event, now_ns)
    return Outcome(spec.name, req, trigger, src, rule.dest, rule.effects, None, event, now_ns, m.block_ids,
                   rule.stale)


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

    def known(self, req: str) -> bool:
        """Live, or finished recently enough to be remembered: an input for it is
        judged by the table (a creation would make a second life of it)."""
        return req in self._live or req in self._finished

    def may_begin(self, req: str) -> bool:
        """Whether an input for ``req`` starts a new machine: none is live, and it
        was never known or ended in a state after which it may begin again
        (``spec.new_after_end``)."""
        if req in self._live:
            return False
        final = self._finished.get(req)
        return final is None or final in self.spec.new_after_end

    def verdict(self, req: str, answers: Mapping[str | None, str]) -> str:
        """A per-state answer the table declares (``CLAIM_ANSWERS``), for ``req``'s
        current or final state (None: not known here)."""
        m = self._live.get(req)
        return answers[m.state if m is not None else self._finished.get(req)]

    def live_accepting(self, trigger: str) -> list[RequestMachine]:
        """The live machines whose state the table gives a rule for ``trigger``:
        who an engine-wide input (a drain's end) concerns, as the table says."""
        rules = self.spec.rules
        return [m for m in self._live.values() if (m.state, trigger) in rules]

    def states(self) -> dict[str, str]:
        """Each live machine's state (introspection: the clean-stop record, debug snapshots)."""
        return {req: m.state for req, m in self._live.items()}

    def count_by_state(self) -> dict[str, int]:
        counts = dict.fromkeys(self.spec.states, 0)
        for m in self._live.values():
            counts[m.state] += 1
        return counts

    # -- inputs --------------------------------------------------------------

    def create(self, req: str, entry: str | None = None, block_ids: tuple[int, ...] = ()) -> Outcome:
        """Start tracking ``req`` in ``entry`` (default: the initial state)."""
        m, outcome = create_step(self.spec, req, entry, block_ids, self.clock.monotonic_ns(), self._live.get(req))
        if m is None:
            return self._violated(outcome)
        self._live[req] = m
        self._finished.pop(req, None)
        if self.listener is not None:
            self.listener(outcome)
        return outcome

    def apply(self, event: Event) -> Outcome:
        """Move ``event.req``'s machine by ``event``; record and return what happened."""
        req = event.req
        m = self._live.get(req)
        outcome = apply_step(self.spec, m, None if m is not None else self._finished.get(req), event,
                             self.clock.monotonic_ns())
        if outcome.violation is not None:
            return self._violated(outcome)
        if m is not None:
            self.transitions += 1
            if outcome.dst in self._terminal:
                del self._live[req]
                self._finished[req] = outcome.dst
                if len(self._finished) > self._remember_finished:
                    self._finished.popitem(last=False)
        if self.listener is not None:
            self.listener(outcome)
        return outcome

    def _violated(self, outcome: Outcome) -> Outcome:
        self.violations += 1
        if self.listener is not None:
            self.listener(outcome)
        if self.policy is IllegalEventPolicy.RAISE:
            raise IllegalTransition(outcome)
        return outcome
