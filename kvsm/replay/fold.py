"""The one pass over a log: records into machines, each machine re-applied.

``analyse`` reads the files (``kvsm.eventlog.reader.scan_log``: typed records),
groups them by process log (stream) and folds each stream once, in ``seq``
order: each (lifecycle, request) gets a ``Machine``, the stream's
``BlockLedger`` (``kvsm.lifecycle.invariants``) follows the recorded block
effects, and every recorded input is re-applied to a fresh machine of the
lifecycle's ``machine_cls`` by the runtime's own step
(``kvsm.lifecycle.machine``: ``create_step``, and ``apply_step`` or its legal
part ``step_rule``, which call ``take_step``; ``LifecycleTracker`` is built on
the same functions): the first record whose outcome differs is the machine's
divergence.

The short way. A step whose outcome cannot depend on the machine's data is not
re-run: the table's answer for (state, trigger) is compared with the record
and the machine moved (``move``). Which steps those are is read off the spec
(``_short_steps``), never off the names of callbacks, states or lifecycles:

* in a lifecycle none of whose rules has a condition, every step takes its
  pair's first rule whatever the data holds, so no step needs the data (and
  its ``prepare`` callbacks, which only fold inputs into the data, need not run);
* in a lifecycle with conditions, the data must be folded: only a pair with
  exactly one rule, with neither ``prepare`` nor conditions, is short.

Everything else (a ``prepare`` to run, a condition to judge, a violation, a
stale input after the end, a record whose input is not the decoded event) goes
through ``step_rule`` (a step recorded as legal) or ``apply_step`` (anything
else) with the record's input as the event (its ``req`` put back) and
``t_mono_ns`` as the time (kept monotone per machine).

Not modelled: the tracker remembers only its last ``remember_finished`` ended
requests; an input for one it forgot is recorded ``unknown_request``, which
replay (remembering every end) reports as a divergence.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from itertools import count
from operator import attrgetter, eq
from pathlib import Path
from typing import Any

import msgspec

from kvsm.eventlog.reader import Record, expand_paths, scan_log
from kvsm.lifecycle.events import event_from_record
from kvsm.lifecycle.invariants import BlockLedger
from kvsm.lifecycle.machine import apply_step, create_step, move, step_rule
from kvsm.lifecycle.table import LIFECYCLES, LifecycleSpec
from kvsm.replay.causes import NOTE_EVENTS, explain
from kvsm.replay.checks import (
    _check_listed,
    _check_machine,
    _check_reads_after_expiry,
    _check_seq,
    _check_shutdown,
    _well_formed,
)
from kvsm.replay.model import (
    _MACHINE_KINDS,
    SHUTDOWN_EVENT,
    Finding,
    Machine,
    OpenAtShutdown,
    Report,
    StreamKey,
    _where,
)

_STREAM_OF = attrgetter("engine_id", "role", "rank", "pid")
_SEQ_OF = attrgetter("seq")
_FIRST_WALL_AND_KEY = attrgetter("_first_wall", "key")  # machines in order of their first record

Specs = Mapping[str, LifecycleSpec]


def analyse(paths: Sequence[str | Path], lifecycles: Specs | None = None) -> Report:
    """Read, merge and check the logs; nothing is printed. ``lifecycles``: the
    declarations to re-apply the records to (default: the runtime's, ``LIFECYCLES``)."""
    # Millions of small objects and no cycles: the cyclic GC only costs time here
    # (about 40% of a large replay).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyse(paths, LIFECYCLES if lifecycles is None else lifecycles)
    finally:
        if was_enabled:
            gc.enable()


def _analyse(paths: Sequence[str | Path], specs: Specs) -> Report:
    files = expand_paths(paths)
    scans = [scan_log(p) for p in files]
    findings: list[Finding] = []
    unreadable: list[Finding] = []
    for scan in scans:
        for p in scan.problems:
            f = Finding("corrupt_line" if p.line > 0 else "unreadable_file", p.reason, file=p.path, line=p.line)
            (findings if p.line > 0 else unreadable).append(f)
    for scan in scans:
        if not scan.items and not scan.problems:  # every process log starts with a log_start record
            findings.append(Finding("empty_log", "the file holds no record at all (even its log_start is lost)",
                                    file=scan.path, line=0))

    # Records by process log (stream), in file order.
    num_records = 0
    streams: dict[StreamKey, list[Record]] = {}
    for scan in scans:
        items = scan.items
        num_records += len(items)
        # Typed per-event records have string req and lifecycle; plain ones and
        # dicts get the rest of the rules here.
        if scan.has_dicts or any((r.req is None or r.lifecycle is None) and r.kind in _MACHINE_KINDS
                                 for r in scan.plain):
            items = _well_formed(items, findings)
        if not items:
            continue
        keys = {scan.stream} if scan.stream is not None and not scan.has_dicts else set(map(_STREAM_OF, items))
        if len(keys) == 1:  # one process's log, the usual case
            key = keys.pop()
            if key in streams:
                streams[key].extend(items)
            else:
                streams[key] = items
        else:
            for r in items:
                k = _STREAM_OF(r)
                if k in streams:
                    streams[k].append(r)
                else:
                    streams[k] = [r]

    machines: list[Machine] = []
    notes: dict[tuple[str, str], list[Record]] = {}
    stream_notes: dict[StreamKey, list[Record]] = {}  # request-less notes the causes read
    log_events: dict[StreamKey, set[str]] = {}  # the diagnostic record names of each log
    by_req: dict[StreamKey, dict[str, dict[str, Machine]]] = {}  # each log: lifecycle -> req -> machine
    ledgers: dict[StreamKey, BlockLedger] = {}
    shutdowns: dict[StreamKey, Record] = {}
    live_at_shutdown: dict[StreamKey, dict[str, dict[str, str]]] = {}
    short: dict[str, Any] = {}  # lifecycle -> its short steps, for every stream
    for key, recs in streams.items():
        if not all(map(eq, map(_SEQ_OF, recs), count())):  # not already 0, 1, 2... in order
            recs.sort(key=_SEQ_OF)
            findings.extend(_check_seq(key, recs))
        folded, ledger, markers = _fold_stream(key, recs, findings, notes, stream_notes, log_events, by_req,
                                               specs, short)
        ledgers[key] = ledger
        machines += folded
        if markers:
            shutdowns[key] = markers[0]
            live = _check_shutdown(key, recs, markers[0], findings)
            if live is not None:
                live_at_shutdown[key] = live

    machines.sort(key=_FIRST_WALL_AND_KEY)
    open_at_shutdown: list[OpenAtShutdown] = []
    todo: list[Machine] = []  # failed, expired or stuck: each gets a cause line
    for m in machines:
        if _check_machine(m, findings, live_at_shutdown, shutdowns, ledgers, open_at_shutdown):
            todo.append(m)
    if live_at_shutdown:
        by_key = {m.key: m for m in machines}
        for key, live in live_at_shutdown.items():
            findings.extend(_check_listed(key, live, by_key, shutdowns[key]))
    findings.extend(_check_reads_after_expiry(machines))
    causes = explain(todo, by_req, notes, stream_notes, streams, log_events, shutdowns)
    return Report([str(p) for p in paths], num_records, machines, findings, unreadable,
                  {k: len(v) for k, v in streams.items()}, notes, open_at_shutdown, shutdowns, causes)


# (state, trigger) -> (dest, effects, stale, dest is terminal) of a short step.
ShortSteps = dict[tuple[str, str], tuple[str, tuple[str, ...], str, bool]]


def _short_steps(spec: LifecycleSpec) -> ShortSteps:
    """The steps of ``spec`` whose outcome, and the data later steps read, do
    not depend on the machine's data (see the module docstring): replay
    compares the record with the table's answer instead of re-running them."""
    folds_data = any(rule.conditions for rules in spec.rules.values() for rule in rules)
    short: ShortSteps = {}
    for key, rules in spec.rules.items():
        rule = rules[0]
        if folds_data and (len(rules) > 1 or rule.prepare or rule.conditions):
            continue
        short[key] = (rule.dest, rule.effects, rule.stale, rule.dest in spec.terminal)
    return short


def _start_machine(key: StreamKey, r: Record, spec: LifecycleSpec | None) -> Machine:
    m = Machine.__new__(Machine)
    m.key = (*key, r.lifecycle, r.req)  # type: ignore[assignment]
    m.records = [r]
    m.final_state = None
    m.matched = None
    m.spec = spec
    m.open_at_shutdown = False
    m._live = None
    m._final = None
    m._divergence = None
    m._illegal = None
    m._now = r.t_mono_ns
    m._first_wall = r.t_wall_ns
    return m



def _fold_stream(key: StreamKey, recs: list[Record], findings: list[Finding],
                 notes: dict[tuple[str, str], list[Record]],
                 stream_notes: dict[StreamKey, list[Record]] | None = None,
                 log_events: dict[StreamKey, set[str]] | None = None,
                 indexes: dict[StreamKey, dict[str, dict[str, Machine]]] | None = None,
                 specs: Specs = LIFECYCLES, short: dict[str, Any] | None = None,
                 ) -> tuple[list[Machine], BlockLedger, list[Record]]:
    """One pass over a process log in ``seq`` order (the order its records were
    written, and the order they lie in memory): the machine of each (lifecycle,
    request) with its records re-applied (a short step compared with the table,
    anything else through ``_reapply``), the block ledger, diagnostic notes (by
    request; those without one that the causes read in ``stream_notes``; the
    names of all in ``log_events``), the machines by lifecycle and request
    (``indexes``), dropped-record reports, and the clean-shutdown records
    (returned). ``short`` caches each lifecycle's short steps across streams."""
    engine = key[0]
    ledger = BlockLedger(f"{engine}/{key[1]}#{key[2]}")
    hold = ledger.hold
    apply_effects = ledger.apply_effects
    finish = ledger.finish
    machines: list[Machine] = []
    if short is None:
        short = {}
    # lifecycle -> (its machines by request, terminal states, short steps, spec);
    # an undeclared lifecycle (spec None) gets no re-apply.
    lifecycles: dict[str, tuple[dict[str, Machine], frozenset[str], ShortSteps, LifecycleSpec | None]] = {}
    markers: list[Record] = []
    events_seen: set[str] = set()
    mine: list[Record] = []  # request-less notes for the causes
    reapply = _reapply
    for r in recs:
        kind = r.kind
        if kind == "transition" or kind == "create" or kind == "violation":
            lifecycle = r.lifecycle
            info = lifecycles.get(lifecycle)  # type: ignore[arg-type]
            if info is None:
                spec = specs.get(lifecycle)  # type: ignore[arg-type]
                if spec is None:
                    info = ({}, frozenset(), {}, None)
                else:
                    steps = short.get(spec.name)
                    if steps is None:
                        steps = short[spec.name] = _short_steps(spec)
                    info = ({}, spec.terminal, steps, spec)
                lifecycles[lifecycle] = info  # type: ignore[index]
            by_req, terminal, steps, spec = info
            req = r.req
            m = by_req.get(req)  # type: ignore[arg-type]
            if m is None:
                m = by_req[req] = _start_machine(key, r, spec)  # type: ignore[index]
                machines.append(m)
            else:
                m.records.append(r)
            dst = r.dst
            if kind == "transition":
                # The ledger follows blocks through effects; an effect with no block
                # ids, or a transition with no block effect, changes nothing.
                effects = r.effects
                if effects and r.blocks:
                    apply_effects(req, effects, r.blocks, r)  # type: ignore[arg-type]
                if dst in terminal:
                    finish(req, dst, r)  # type: ignore[arg-type]
                if dst is not None:
                    m.final_state = dst
                trigger = r.event
                if trigger == "matched" and m.matched is None:
                    m.matched = r
                if m._divergence is not None or spec is None:
                    continue
                live = m._live
                if live is not None:
                    state = live.state
                    step = steps.get((state, trigger))
                    if (step is not None and dst == step[0] and r.src == state and effects == step[1]
                            and r.violation is None and r.stale == step[2] and type(r) is not Record):
                        # The table's answer, as recorded, and (a per-event record) its
                        # input decoded as its event.
                        t = r.t_mono_ns
                        if t > m._now:  # noqa: PLR1730 - max() is a call per record
                            m._now = t
                        move(live, dst, m._now)
                        if step[3]:
                            m._final = dst
                            m._live = None
                        continue
                reapply(m, r, spec)
            elif kind == "create":
                if r.blocks:
                    hold(req, r.blocks, r)  # type: ignore[arg-type]
                if dst is not None:
                    m.final_state = dst
                if m._divergence is None and spec is not None:
                    reapply(m, r, spec)
            else:
                if m._illegal is None:
                    m._illegal = [r]
                else:
                    m._illegal.append(r)
                if m._divergence is None and spec is not None:
                    reapply(m, r, spec)
        elif kind == "log":
            event = r.event
            events_seen.add(event)
            if event == SHUTDOWN_EVENT:
                markers.append(r)
            if r.req is not None:
                try:
                    notes.setdefault((engine, r.req), []).append(r)
                except TypeError:  # an unhashable 'req' on a diagnostic line: nothing to index it by
                    pass
            elif event in NOTE_EVENTS:
                mine.append(r)
        elif kind == "log_overflow":
            findings.append(Finding("records_dropped",
                                    f"the in-memory log buffer overflowed: {r.dropped} records lost",
                                    engine_id=engine, file=r.file, line=r.line))
    for v in ledger.violations:
        findings.append(Finding(v.kind, v.detail, req=v.req, engine_id=engine, file=v.where.file,
                                line=v.where.line))
    if log_events is not None:
        log_events[key] = events_seen
    if indexes is not None:
        indexes[key] = {name: info[0] for name, info in lifecycles.items() if info[3] is not None}
    if mine and stream_notes is not None:
        stream_notes[key] = mine
    return machines, ledger, markers


def _said(o: tuple[Any, ...]) -> str:
    """An outcome (src, dst, violation, effects, stale) in a divergence's words."""
    return f"{o[0]!r} -> {o[1]!r} violation={o[2]!r} effects={list(o[3])}" + (f" stale={o[4]!r}" if o[4] else "")


def _divergence(r: Record, req: str, want: tuple[Any, ...], got: tuple[Any, ...]) -> Finding:
    return Finding("divergence", f"re-applying {r.event!r}: recorded {_said(want)}, replayed {_said(got)}", req,
                   **_where(r))


_replace = msgspec.structs.replace


def _reapply(m: Machine, r: Record, spec: LifecycleSpec) -> None:
    """Re-apply one record to the machine's re-applied copy (``m._live``, or its
    end ``m._final``) with the runtime's own step: ``create_step`` for a
    create, ``step_rule`` for an input recorded as a legal step of a live
    machine, ``apply_step`` for any other, at the record's time (monotone
    per machine). A step whose outcome differs from the record sets
    ``m._divergence``, and the machine is re-applied no further."""
    t = r.t_mono_ns
    if t > m._now:  # noqa: PLR1730
        m._now = t
    now = m._now
    req = m.key[5]
    live = m._live
    if r.kind == "create":
        # The input of a create is its entry state, which the record keeps as
        # its dst; but a second create records the live machine's state
        # instead (its entry, legal, is not written): any legal entry gives
        # that outcome.
        entry = None if live is not None and r.violation == "duplicate_request" else r.dst
        new, out = create_step(spec, req, entry, r.blocks, now, live)
        if new is not None:
            m._live = new
            m._final = None
        src = r.src  # a creation has no prior state to compare
    else:
        # A per-event record's input is its Event struct (``Record.input`` is
        # typed as the plain record's dict): dynamic here, typed once rebuilt.
        event: Any = r.input
        if event is None or type(event) is dict:
            # Not decoded as its event (a line the per-event types did not fit,
            # or no input at all): rebuild it as the runtime's records are.
            try:
                event = event_from_record(r.event, req, event or {})
            except ValueError as exc:
                m._divergence = Finding("divergence", f"cannot rebuild the input of {r.event!r}: {exc}", req,
                                        **_where(r))
                return
        else:  # decoded without its req (the record holds it): callbacks may read it
            event = _replace(event, req=req)
        if live is not None and r.violation is None:  # recorded as a legal step: the rule it takes
            src = live.state
            rule = step_rule(spec, live, event, now)
            if rule is not None:
                if rule.dest in spec.terminal:
                    m._final = rule.dest
                    m._live = None
                if src != r.src or rule.dest != r.dst or rule.effects != r.effects or rule.stale != r.stale:
                    m._divergence = _divergence(r, req, (r.src, r.dst, r.violation, r.effects, r.stale),
                                                (src, rule.dest, None, rule.effects, rule.stale))
                return
        # Anything else (no live machine, no rule, a recorded violation): the whole outcome.
        out = apply_step(spec, live, m._final if live is None else None, event, now)
        if live is not None and out.violation is None and out.dst in spec.terminal:
            m._final = out.dst
            m._live = None
        src = out.src
    got = (src, out.dst, out.violation, out.effects, out.stale)
    want = (r.src, r.dst, r.violation, r.effects, r.stale)
    if got != want:
        m._divergence = _divergence(r, req, want, got)
