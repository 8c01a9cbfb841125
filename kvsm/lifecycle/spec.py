"""Compiling a lifecycle declaration: ``LifecycleSpec`` and its rules.

A declaration is written in the ``transitions`` library's vocabulary (see
``table.py``); ``LifecycleSpec`` checks it at import time (every state
declared and reachable, every callback, condition and effect named in
``vocabulary.py``, a terminal state reachable from each live one, the last
rule of each (state, trigger) pair unconditional) and compiles it into the
dict lookup the hot path uses.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.vocabulary import CONDITIONS, EFFECTS, PREPARE


def each(triggers: Sequence[str], **rest: Any) -> list[dict[str, Any]]:
    """One ``transitions`` dict per trigger (the library takes one trigger each)."""
    return [{"trigger": t, **rest} for t in triggers]


def names_of(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """A declaration field (one name, a list of names, or nothing) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled transition for one (source state, trigger) pair."""

    trigger: str
    source: str
    dest: str
    prepare: tuple[str, ...] = ()
    conditions: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    # Non-empty: a declared stale input (the text says why it no longer
    # applies): the machine stays where it is and nothing is done.
    stale: str = ""


class LifecycleDeclarationError(ValueError):
    """The declaration itself is inconsistent (caught at import time)."""


@dataclass(frozen=True)
class LifecycleSpec:
    """A named lifecycle: its states, its transitions, and their compiled form."""

    name: str
    states: tuple[str, ...]
    initial: str
    terminal: frozenset[str]
    transitions: tuple[Mapping[str, Any], ...]
    # States a machine may be created in: a process that learns of a request
    # mid-way (a worker seeing the scheduler's metadata) starts there.
    entry_states: frozenset[str] = frozenset()
    # Illegal (state, trigger) pairs that have a specific name in reports.
    named_violations: Mapping[tuple[str, str], str] = field(default_factory=dict)
    # Inputs that may arrive after they stopped mattering (a reply to a claim
    # whose request already failed, a second finish): ``{"trigger", "source",
    # "why"}``. From a live state they are rules that stay and do nothing; from
    # a terminal state they are recorded instead of being a violation.
    stale_inputs: tuple[Mapping[str, Any], ...] = ()
    # The class of the data each machine carries.
    machine_cls: type[RequestMachine] = RequestMachine
    # Machines that last as long as their process (peers): one still live where a
    # log ends (a running or crashed process) is not stuck; a clean stop ends it.
    lives_with_process: bool = False
    # Terminal states after which an input for the same request begins a new
    # machine (``LifecycleTracker.may_begin``): a finish whose early abandon was forgotten.
    new_after_end: frozenset[str] = frozenset()
    rules: Mapping[tuple[str, str], tuple[Rule, ...]] = field(init=False, repr=False)
    stale_after_end: Mapping[tuple[str, str], str] = field(init=False, repr=False)
    triggers: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        rules = _compile(self)
        after_end: dict[tuple[str, str], str] = {}
        for t in self.stale_inputs:
            unknown_keys = set(t) - {"trigger", "source", "why"}
            if unknown_keys or not t.get("why"):
                raise LifecycleDeclarationError(
                    f"{self.name}: a stale input needs exactly trigger, source and why: {t}")
            for trigger in names_of(t["trigger"]):
                for source in names_of(t["source"]):
                    if (source, trigger) in rules:
                        raise LifecycleDeclarationError(
                            f"{self.name}: ({source!r}, {trigger!r}) is declared both as a transition and stale")
                    if source in self.terminal:
                        after_end[(source, trigger)] = t["why"]
                    else:
                        rules[(source, trigger)] = (Rule(trigger, source, source, stale=t["why"]),)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "stale_after_end", after_end)
        object.__setattr__(self, "triggers", frozenset(t for (_, t) in rules))
        _validate(self)

    def legal_triggers(self, state: str) -> list[str]:
        return sorted(t for (s, t) in self.rules if s == state)

    def machine(self, model: Any = "self", **kwargs: Any) -> Any:
        """A real ``transitions.Machine`` built from this declaration.

        Used by the tests (run side by side with the compiled table) and by the
        statecharts tool (``machine_cls=GraphMachine``). Not used on the hot path.
        """
        from transitions import Machine

        logging.getLogger("transitions").setLevel(logging.WARNING)
        machine_cls = kwargs.pop("machine_cls", Machine)
        initial = kwargs.pop("initial", self.initial)
        # Stale inputs from live states are internal transitions (dest None):
        # legal, and they change nothing.
        stale = [{"trigger": r.trigger, "source": r.source, "dest": None}
                 for rules in self.rules.values() for r in rules if r.stale]
        stale += [{"trigger": trigger, "source": source, "dest": None} for source, trigger in self.stale_after_end]
        return machine_cls(
            model=model,
            states=list(self.states),
            initial=initial,
            transitions=[dict(t) for t in self.transitions] + stale,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=False,
            **kwargs,
        )


def _compile(spec: LifecycleSpec) -> dict[tuple[str, str], tuple[Rule, ...]]:
    table: dict[tuple[str, str], list[Rule]] = {}
    for t in spec.transitions:
        unknown_keys = set(t) - {"trigger", "source", "dest", "prepare", "conditions", "after"}
        if unknown_keys:
            raise LifecycleDeclarationError(f"{spec.name}: unsupported keys {sorted(unknown_keys)} in {t}")
        for trigger in names_of(t["trigger"]):
            for source in names_of(t["source"]):
                dest = source if t["dest"] == "=" else t["dest"]
                rule = Rule(trigger, source, dest, names_of(t.get("prepare")), names_of(t.get("conditions")),
                            names_of(t.get("after")))
                table.setdefault((source, trigger), []).append(rule)
    return {k: tuple(v) for k, v in table.items()}


def _validate(spec: LifecycleSpec) -> None:
    states = set(spec.states)
    where = f"lifecycle {spec.name!r}"
    if spec.initial not in states:
        raise LifecycleDeclarationError(f"{where}: initial state {spec.initial!r} is not declared")
    for s in spec.terminal | spec.entry_states:
        if s not in states:
            raise LifecycleDeclarationError(f"{where}: state {s!r} is not declared")
    for (source, trigger) in spec.stale_after_end:
        if source not in states:
            raise LifecycleDeclarationError(f"{where}: source {source!r} of stale {trigger!r} is not declared")
    for (source, trigger), rules in spec.rules.items():
        if source not in states:
            raise LifecycleDeclarationError(f"{where}: source {source!r} of {trigger!r} is not declared")
        if source in spec.terminal:
            raise LifecycleDeclarationError(f"{where}: terminal state {source!r} has a transition on {trigger!r}")
        for r in rules:
            if r.dest not in states:
                raise LifecycleDeclarationError(f"{where}: dest {r.dest!r} of {trigger!r} is not declared")
            for name in r.prepare:
                if name not in PREPARE:
                    raise LifecycleDeclarationError(f"{where}: unknown prepare callback {name!r}")
            for name in r.conditions:
                if name not in CONDITIONS:
                    raise LifecycleDeclarationError(f"{where}: unknown condition {name!r}")
            for name in r.effects:
                if name not in EFFECTS:
                    raise LifecycleDeclarationError(f"{where}: unknown effect {name!r}")
        if rules[-1].conditions:
            raise LifecycleDeclarationError(
                f"{where}: the last rule for ({source!r}, {trigger!r}) is conditional; "
                "a legal event must always move the machine")
    reachable = _reachable(spec.initial, spec.rules) | {
        s for e in spec.entry_states for s in _reachable(e, spec.rules)}
    unreachable = states - reachable
    if unreachable:
        raise LifecycleDeclarationError(f"{where}: states never reached: {sorted(unreachable)}")
    for s in states - spec.terminal:
        if not (_reachable(s, spec.rules) & spec.terminal):
            raise LifecycleDeclarationError(f"{where}: no terminal state is reachable from {s!r}")


def _reachable(start: str, rules: Mapping[tuple[str, str], Iterable[Rule]]) -> set[str]:
    seen = {start}
    frontier = [start]
    while frontier:
        s = frontier.pop()
        for (source, _), rs in rules.items():
            if source == s:
                for r in rs:
                    if r.dest not in seen:
                        seen.add(r.dest)
                        frontier.append(r.dest)
    return seen
