"""Replay: fold event logs back into request lifecycles, check them, show them.

``tools/replay.py LOG...`` (also the ``kvsm-replay`` console script) merges the
logs of several processes of several engines and:

* lists requests with their final state and duration,
* shows one request's timeline across processes (``--request ID``; the id of
  either side: a decode request pulls in the prefill request it read from),
* reports violations: requests not terminal at the end of the log, illegal
  events the runtime recorded, blocks freed twice or never, reads after a
  lease expired, ``seq`` gaps (lost lines), dropped records, corrupt lines,
* re-applies each machine's recorded inputs to a fresh machine from the same
  table and reports the first divergence from the recorded transitions,
* honours a clean shutdown: a process whose log ends with a ``worker.shutdown``
  record (``clean: true``) listing what was still live may leave exactly those
  requests, in exactly those states, mid-lifecycle: they are reported as *open
  at a clean shutdown* (information, not a violation). A request the record
  does not list, or lists in another state, and any record after it, are
  violations; a log without the record (a crash) keeps ``not_terminal_at_end``,
* names the cause of every failed, expired or stuck request in one line, from
  the logs of both engines (``kvsm.replay_causes``: claim answers, the prefill
  scheduler's pin, its workers' receipt, a dead peer's reason...): information,
  not violations (a failed request is a legal outcome),
* exports a Perfetto / Chrome trace with one track per request (``--trace``),
* prints everything as JSON (``--json``).

Speed (1M records in a few seconds; ``tools/bench.py --only replay``): lines
are decoded straight into typed ``Record`` structs (``kvsm.eventlog.reader``);
a file that is one process's log in ``seq`` order is grouped without sorting;
each stream is folded in one pass (machines, block ledger, notes) and each
machine in one pass (re-apply, final state, the decode side's remote). The
re-apply runs the lifecycle table's compiled rules, prepare callbacks and
conditions directly; ``_reapply_reference`` is the same check through a
``LifecycleTracker`` and the tests hold the two to the same answers.

Exit status: 0 clean, 1 violations found, 2 unreadable input.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import count
from operator import attrgetter, eq
from pathlib import Path
from typing import Any

import msgspec

from kvsm.eventlog.reader import (
    RECORD_FIELDS,
    Record,
    expand_paths,
    input_dict,
    read_back,
    record_from_dict,
    scan_log,
)
from kvsm.eventlog.schema import HEADER_FIELDS
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.events import Event, event_from_record
from kvsm.lifecycle.machine import LifecycleTracker, RequestMachine
from kvsm.lifecycle.table import (
    BLOCK_HOLDING_EFFECTS,
    BLOCK_RELEASING_EFFECTS,
    CONDITIONS,
    LIFECYCLES,
    PREPARE,
    SHARED_HOLDING_EFFECTS,
    LifecycleSpec,
)
from kvsm.replay_causes import CAUSE_STATES, NOTE_EVENTS, Cause, explain

StreamKey = tuple[str, str, int, int]  # engine_id, role, rank, pid
MachineKey = tuple[str, str, int, int, str, str]  # stream + lifecycle, req

_MACHINE_KINDS = frozenset({"create", "transition", "violation"})
# The last record a worker writes before it closes its log at a clean stop.
SHUTDOWN_EVENT = "worker.shutdown"


@dataclass
class Finding:
    """One violation found in the logs, with where to look."""

    kind: str
    detail: str
    req: str | None = None
    engine_id: str | None = None
    file: str | None = None
    line: int | None = None

    def __str__(self) -> str:
        where = f" [{self.file}:{self.line}]" if self.file else ""
        who = f" {self.engine_id}" if self.engine_id else ""
        req = f" request {self.req!r}" if self.req else ""
        return f"{self.kind}:{who}{req}: {self.detail}{where}"


@dataclass
class OpenAtShutdown:
    """A request its process still held mid-lifecycle when it shut down cleanly,
    listed by the shutdown record in the state replay computed: not a violation
    (the process said so before it went), but worth knowing."""

    engine_id: str
    role: str
    rank: int
    pid: int
    lifecycle: str
    req: str
    state: str
    blocks: int  # blocks it still held (taken or pinned) at the stop
    file: str | None = None  # the shutdown record
    line: int | None = None

    def __str__(self) -> str:
        return (f"{self.engine_id}/{self.role}#{self.rank} {self.lifecycle}:{self.req} in {self.state!r}"
                f" holding {self.blocks} block(s)")


def _final_state_of(records: Sequence[Record]) -> str | None:
    for r in reversed(records):
        if r.kind != "violation" and r.dst is not None:
            return r.dst
    return None


def _matched_of(records: Sequence[Record]) -> Record | None:
    for r in records:
        if r.event == "matched" and r.kind == "transition":
            return r
    return None


def _input_get(value: Any, name: str, default: Any) -> Any:
    """One field of a record's ``input`` (a decoded event or a plain object)."""
    if isinstance(value, Event):
        return getattr(value, name, default)
    return value.get(name, default) if type(value) is dict else default


_UNSET: Any = object()


class Machine:
    """One request's lifecycle in one process, as the log tells it.

    ``analyse`` works out ``final_state`` (the destination of the last
    create/transition record: violations move nothing) and ``matched`` (the
    recv side's ``matched`` transition: who the remote is) in the pass that
    re-applies the records; built by hand, they are worked out from ``records``.
    """

    __slots__ = ("_data", "_divergence", "_final", "_first_wall", "_illegal", "_now", "_state",
                 "final_state", "key", "matched", "open_at_shutdown", "records")

    def __init__(self, key: MachineKey, records: list[Record] | None = None, *,
                 final_state: str | None = _UNSET, matched: Record | None = _UNSET) -> None:
        self.key = key
        self.records: list[Record] = [] if records is None else records
        self.final_state: str | None = _final_state_of(self.records) if final_state is _UNSET else final_state
        self.matched: Record | None = _matched_of(self.records) if matched is _UNSET else matched
        # Listed, in this state, by its process's clean-shutdown record.
        self.open_at_shutdown = False
        # Re-apply state while analyse folds the records (see _reapply_step).
        self._state: str | None = None
        self._final: str | None = None
        self._data: RequestMachine | None = None
        self._divergence: Finding | None = None
        self._illegal: list[Record] | None = None
        self._now = self.records[0].t_mono_ns if self.records else 0
        self._first_wall = self.records[0].t_wall_ns if self.records else 0

    @property
    def engine_id(self) -> str:
        return self.key[0]

    @property
    def role(self) -> str:
        return self.key[1]

    @property
    def rank(self) -> int:
        return self.key[2]

    @property
    def stream(self) -> StreamKey:
        return self.key[:4]  # type: ignore[return-value]

    @property
    def lifecycle(self) -> str:
        return self.key[4]

    @property
    def req(self) -> str:
        return self.key[5]

    @property
    def terminal(self) -> bool:
        spec = LIFECYCLES.get(self.lifecycle)
        return spec is not None and self.final_state in spec.terminal

    @property
    def matched_input(self) -> dict[str, Any] | None:
        """The inputs of the recv side's ``matched`` transition."""
        return None if self.matched is None else (input_dict(self.matched.input) or {})

    @property
    def remote(self) -> tuple[str, str] | None:
        if self.matched is None:
            return None
        inp = self.matched.input
        return (_input_get(inp, "remote_engine", ""), _input_get(inp, "remote_req", ""))

    @property
    def duration_ns(self) -> int:
        if not self.records:
            return 0
        return self.records[-1].t_mono_ns - self.records[0].t_mono_ns

    def label(self) -> str:
        return f"{self.engine_id}/{self.role}#{self.rank} {self.lifecycle}:{self.req}"

    def __repr__(self) -> str:
        return f"<Machine {self.label()} -> {self.final_state} ({len(self.records)} records)>"


@dataclass
class Report:
    files: list[str]
    num_records: int
    machines: list[Machine]
    findings: list[Finding]
    unreadable: list[Finding]
    streams: dict[StreamKey, int]
    # Diagnostic (kind "log") records that name a request, by (engine_id, req).
    notes: dict[tuple[str, str], list[Record]] = field(default_factory=dict)
    # Requests left mid-lifecycle by a clean shutdown that listed them (not violations).
    open_at_shutdown: list[OpenAtShutdown] = field(default_factory=list)
    # The first worker.shutdown record of each process log that has one.
    shutdowns: dict[StreamKey, Record] = field(default_factory=dict)
    # One line per failed, expired or stuck machine: what the logs of both engines
    # show for it (kvsm.replay_causes). Information: a failure is a legal outcome.
    causes: list[Cause] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.unreadable or self.num_records == 0:
            return 2
        return 1 if self.findings else 0

    def summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for m in self.machines:
            out[m.lifecycle][m.final_state or "?"] += 1
        return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "records": self.num_records,
            "streams": [{"engine_id": k[0], "role": k[1], "rank": k[2], "pid": k[3], "records": n,
                         "clean_shutdown": k in self.shutdowns and self.shutdowns[k].clean is True}
                        for k, n in sorted(self.streams.items())],
            "summary": self.summary(),
            "requests": [
                {"engine_id": m.engine_id, "role": m.role, "rank": m.rank, "lifecycle": m.lifecycle,
                 "req": m.req, "final_state": m.final_state, "terminal": m.terminal,
                 "open_at_shutdown": m.open_at_shutdown,
                 "duration_ms": round(m.duration_ns / 1e6, 3), "events": len(m.records),
                 "remote": list(m.remote) if m.remote else None}
                for m in self.machines
            ],
            "open_at_shutdown": [asdict(o) for o in self.open_at_shutdown],
            "causes": [asdict(c) for c in self.causes],
            "violations": [asdict(f) for f in self.findings],
            "unreadable": [asdict(f) for f in self.unreadable],
            "exit_code": self.exit_code,
        }


# --- building the report ----------------------------------------------------

_STREAM_OF = attrgetter("engine_id", "role", "rank", "pid")
_SEQ_OF = attrgetter("seq")
_FIRST_WALL_AND_KEY = attrgetter("_first_wall", "key")  # machines in order of their first record
_TERMINAL: dict[str, frozenset[str]] = {name: spec.terminal for name, spec in LIFECYCLES.items()}


def _stream_key(r: Record) -> StreamKey:
    return (r.engine_id, r.role, r.rank, r.pid)


def analyse(paths: Sequence[str | Path]) -> Report:
    """Read, merge and check the logs; nothing is printed."""
    # Millions of small objects and no cycles: the cyclic GC only costs time here
    # (about 40% of a large replay).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyse(paths)
    finally:
        if was_enabled:
            gc.enable()


def _analyse(paths: Sequence[str | Path]) -> Report:
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
                streams[key].extend(items)  # type: ignore[arg-type]
            else:
                streams[key] = items  # type: ignore[assignment]
        else:
            for r in items:
                k = _STREAM_OF(r)
                if k in streams:
                    streams[k].append(r)  # type: ignore[arg-type]
                else:
                    streams[k] = [r]  # type: ignore[list-item]

    machines: list[Machine] = []
    notes: dict[tuple[str, str], list[Record]] = {}
    stream_notes: dict[StreamKey, list[Record]] = {}  # request-less notes the causes read
    log_events: dict[StreamKey, set[str]] = {}  # the diagnostic record names of each log
    by_req: dict[StreamKey, dict[str, dict[str, Machine]]] = {}  # each log: lifecycle -> req -> machine
    ledgers: dict[StreamKey, _Ledger] = {}
    shutdowns: dict[StreamKey, Record] = {}
    live_at_shutdown: dict[StreamKey, dict[str, dict[str, str]]] = {}
    for key, recs in streams.items():
        if not all(map(eq, map(_SEQ_OF, recs), count())):  # not already 0, 1, 2... in order
            recs.sort(key=_SEQ_OF)
            findings.extend(_check_seq(key, recs))
        folded, ledger, markers = _fold_stream(key, recs, findings, notes, stream_notes, log_events, by_req)
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


def _well_formed(items: Sequence[Record | dict[str, Any]], findings: list[Finding]) -> list[Record]:
    """The records replay can fold (typed), the rest reported as corrupt lines."""
    out: list[Record] = []
    for it in items:
        if type(it) is dict:
            if not _record_ok(it):
                findings.append(Finding("corrupt_line", _malformed(it) or "malformed record",
                                        file=it["_file"], line=it["_line"]))
                continue
            it = record_from_dict(it)
        elif (it.req is None or it.lifecycle is None) and it.kind in _MACHINE_KINDS:  # type: ignore[union-attr]
            # The typed decode checked every other rule of _malformed.
            findings.append(Finding("corrupt_line", f"{it.kind} record without a string 'req' and 'lifecycle'",  # type: ignore[union-attr]
                                    file=it.file, line=it.line))  # type: ignore[union-attr]
            continue
        out.append(it)  # type: ignore[arg-type]
    return out


_INT_FIELDS = ("seq", "t_mono_ns", "t_wall_ns", "pid", "rank")
_STR_FIELDS = ("engine_id", "role", "kind", "event")


def _malformed(r: dict[str, Any]) -> str | None:
    """Why a record that parsed as JSON still cannot be replayed, or None.

    The reader checks only that the header keys exist (it must stay fast);
    replay sorts, folds and indexes by these values, so their types matter.
    (Records decoded into ``Record`` had these rules checked by the decoder;
    this and ``_record_ok`` judge the lines that did not fit it.)
    """
    for name in _INT_FIELDS:
        if type(r[name]) is not int:
            return f"header field {name!r} is {r[name]!r}, not an integer"
    for name in _STR_FIELDS:
        if type(r[name]) is not str:
            return f"header field {name!r} is {r[name]!r}, not a string"
    if r["kind"] in _MACHINE_KINDS:
        if type(r["req"]) is not str or type(r.get("lifecycle")) is not str:
            return f"{r['kind']} record without a string 'req' and 'lifecycle'"
        if r["kind"] != "create" and type(r.get("input", {})) is not dict:
            return f"{r['kind']} record whose 'input' is not an object"
        for name in ("src", "dst", "violation"):
            if type(r.get(name)) not in _STR_OR_NONE:
                return f"{r['kind']} record whose {name!r} is {r.get(name)!r}, not a state name"
        effects, blocks = r.get("effects", []), r.get("blocks", [])
        if type(effects) is not list or not all(type(e) is str for e in effects):
            return f"{r['kind']} record whose 'effects' is not a list of names"
        if type(blocks) is not list or not all(type(b) is int for b in blocks):
            return f"{r['kind']} record whose 'blocks' is not a list of block ids"
    return None


_STR_OR_NONE = (str, type(None))


def _record_ok(r: dict[str, Any]) -> bool:
    """The rules of ``_malformed`` as one expression: the per-record fast path.

    Two spellings of one rule set, kept for speed (the loop in ``_malformed``
    costs ~2 us a record); the fuzz test in tests/test_replay.py asserts they
    agree on every record it generates.
    """
    if not (type(r["seq"]) is int and type(r["t_mono_ns"]) is int and type(r["t_wall_ns"]) is int
            and type(r["pid"]) is int and type(r["rank"]) is int and type(r["engine_id"]) is str
            and type(r["role"]) is str and type(r["kind"]) is str and type(r["event"]) is str):
        return False
    if r["kind"] not in _MACHINE_KINDS:
        return True
    effects = r.get("effects", _EMPTY_LIST)
    blocks = r.get("blocks", _EMPTY_LIST)
    return (type(r["req"]) is str and type(r.get("lifecycle")) is str
            and type(r["src"]) in _STR_OR_NONE and type(r["dst"]) in _STR_OR_NONE
            and type(r.get("violation")) in _STR_OR_NONE
            and (r["kind"] == "create" or type(r.get("input", _EMPTY_DICT)) is dict)
            and type(effects) is list and all(type(e) is str for e in effects)
            and type(blocks) is list and all(type(b) is int for b in blocks))


_EMPTY_DICT: dict[str, Any] = {}
_EMPTY_LIST: list[Any] = []


def _where(r: Record) -> dict[str, Any]:
    return {"file": r.file, "line": r.line, "engine_id": r.engine_id}


def _check_seq(key: StreamKey, recs: list[Record]) -> Iterable[Finding]:
    expected = 0  # seq starts at 0 in every process
    for r in recs:
        seq = r.seq
        if seq < expected:
            yield Finding("seq_duplicate", f"seq {seq} appears twice", **_where(r))
            continue
        if seq > expected:
            missing = f"{expected}" if seq == expected + 1 else f"{expected}..{seq - 1}"
            yield Finding("seq_gap", f"{seq - expected} record(s) lost: seq {missing} missing in the log of "
                                     f"{key[1]}#{key[2]} (pid {key[3]})", **_where(r))
        expected = seq + 1


class _Ledger:
    """``BlockLedger``'s rules (kvsm.lifecycle.invariants: shared pins, exclusive
    takes, double frees, blocks never freed) for one process log, pointing at
    the record instead of a dict built per call: replay feeds it ~600k times a
    million records. Same verdicts, same words; the tests hold the two together.
    Violations are (kind, req, detail, record)."""

    __slots__ = ("held_by", "holders", "pool", "violations")

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.holders: dict[int, dict[str, bool]] = {}  # block -> {request: shared?}
        self.held_by: dict[str, set[int]] = {}
        self.violations: list[tuple[str, str, str, Record]] = []

    def held(self, req: str) -> set[int]:
        return set(self.held_by.get(req, ()))

    def hold(self, req: str, blocks: Iterable[int], where: Record, shared: bool) -> None:
        holders = self.holders
        mine = self.held_by.get(req)
        if mine is None:
            mine = set()
        clashes: dict[int, list[str]] | None = None
        for b in blocks:
            h = holders.get(b)
            if h is None:
                holders[b] = {req: shared}
                mine.add(b)
                continue
            others = [o for o, s in h.items() if o != req and not (shared and s)]
            if others:
                if clashes is None:
                    clashes = {}
                clashes[b] = others
                continue
            h[req] = shared
            mine.add(b)
        if mine:
            self.held_by[req] = mine
        if clashes:
            owners = sorted({o for os in clashes.values() for o in os})
            self.violations.append((
                "block_reused_while_held", req,
                (f"blocks {sorted(clashes)} of pool {self.pool!r} taken while other requests still hold them "
                f"({', '.join(owners)})"), where))

    def release(self, req: str, blocks: Iterable[int], where: Record) -> None:
        mine = self.held_by.get(req)
        not_held = []
        for b in blocks:
            if mine is None or b not in mine:
                not_held.append(b)
                continue
            mine.discard(b)
            h = self.holders[b]
            del h[req]
            if not h:
                del self.holders[b]
        if not_held:
            self.violations.append((
                "block_freed_twice", req,
                (f"blocks {sorted(not_held)} of pool {self.pool!r} handed back but not held by this request "
                "(freed before, or never taken)"), where))
        if mine is not None and not mine:
            del self.held_by[req]

    def finish(self, req: str, final_state: str, where: Record) -> None:
        left = self.held_by.pop(req, None)
        if not left:
            return
        for b in left:
            h = self.holders.get(b)
            if h is not None:
                h.pop(req, None)
                if not h:
                    del self.holders[b]
        self.violations.append((
            "blocks_never_freed", req,
            f"ended {final_state!r} still holding blocks {sorted(left)} of pool {self.pool!r}", where))


# effects -> what they do to the request's blocks, in order: (takes?, shared?)
# per block effect, as BlockLedger.apply_effects reads them (filled as met).
_BLOCK_OPS: dict[tuple[str, ...], tuple[tuple[bool, bool], ...]] = {}


def _block_ops(effects: tuple[str, ...]) -> tuple[tuple[bool, bool], ...]:
    return tuple((e in BLOCK_HOLDING_EFFECTS, e in SHARED_HOLDING_EFFECTS) for e in effects
                 if e in BLOCK_HOLDING_EFFECTS or e in BLOCK_RELEASING_EFFECTS)


def _start_machine(key: StreamKey, r: Record) -> Machine:
    m = Machine.__new__(Machine)
    m.key = (*key, r.lifecycle, r.req)  # type: ignore[assignment]
    m.records = [r]
    m.final_state = None
    m.matched = None
    m.open_at_shutdown = False
    m._state = None
    m._final = None
    m._data = None
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
                 ) -> tuple[list[Machine], _Ledger, list[Record]]:
    """One pass over a process log in ``seq`` order (the order its records were
    written, and the order they lie in memory): the machine of each (lifecycle,
    request) with its records re-applied (``_reapply_step``; a create or a legal
    transition recorded as the table has it, most records, takes the short way
    here: a lookup and a few comparisons), the block ledger, diagnostic notes
    (by request; those without one that the causes read in ``stream_notes``;
    the names of all in ``log_events``), the machines by
    lifecycle and request (``indexes``), dropped-record reports, and the
    clean-shutdown records (returned)."""
    engine = key[0]
    ledger = _Ledger(f"{engine}/{key[1]}#{key[2]}")
    hold = ledger.hold
    release = ledger.release
    finish = ledger.finish
    machines: list[Machine] = []
    # lifecycle -> (its machines by request, terminal states, plain steps, entry
    # states, reads its data); an undeclared lifecycle gets no re-apply.
    lifecycles: dict[str, tuple[dict[str, Machine], frozenset[str], Any, frozenset[str], bool] | None] = {}
    markers: list[Record] = []
    events_seen: set[str] = set()
    mine: list[Record] = []  # request-less notes for the causes
    block_ops = _BLOCK_OPS
    reapply = _reapply_step
    for r in recs:
        kind = r.kind
        if kind == "transition" or kind == "create" or kind == "violation":
            lifecycle = r.lifecycle
            info = lifecycles.get(lifecycle)  # type: ignore[arg-type]
            if info is None:
                info = lifecycles[lifecycle] = _lifecycle_info(lifecycle)  # type: ignore[index]
            by_req, terminal, steps, entry, uses_data = info
            req = r.req
            m = by_req.get(req)  # type: ignore[arg-type]
            if m is None:
                m = by_req[req] = _start_machine(key, r)  # type: ignore[index]
                machines.append(m)
            else:
                m.records.append(r)
            dst = r.dst
            if kind == "transition":
                # The ledger follows blocks through effects; an effect with no block
                # ids, or a transition with no block effect, changes nothing.
                effects = r.effects
                if effects and r.blocks:
                    ops = block_ops.get(effects)
                    if ops is None:
                        ops = block_ops[effects] = _block_ops(effects)
                    for holds, shared in ops:
                        if holds:
                            hold(req, r.blocks, r, shared)  # type: ignore[arg-type]
                        else:
                            release(req, r.blocks, r)  # type: ignore[arg-type]
                if dst in terminal:
                    finish(req, dst, r)  # type: ignore[arg-type]
                if dst is not None:
                    m.final_state = dst
                trigger = r.event
                if trigger == "matched" and m.matched is None:
                    m.matched = r
                if m._divergence is not None or steps is None:
                    continue
                state = m._state
                step = steps.get((state, trigger))
                if (step is not None and dst == step[0] and r.src == state and effects == step[1]
                        and r.violation is None and type(r) is not Record):
                    # Legal, as recorded, and (a per-event record) its input decoded as its event.
                    if uses_data:  # keep the clock the data's callbacks read
                        t = r.t_mono_ns
                        if t > m._now:  # noqa: PLR1730 - max() is a call per record
                            m._now = t
                    if step[2]:
                        m._final = dst
                        m._state = None
                        m._data = None
                    else:
                        m._state = dst
                        if m._data is not None:
                            m._data.state = dst
                    continue
                reapply(m, r)
            elif kind == "create":
                if r.blocks:
                    hold(req, r.blocks, r, False)  # type: ignore[arg-type]
                if dst is not None:
                    m.final_state = dst
                if m._divergence is not None or steps is None:
                    continue
                if (m._state is None and dst in entry and r.src is None and r.violation is None
                        and not r.effects and not uses_data):
                    m._state = dst  # a legal entry, as recorded
                    m._final = None
                    continue
                reapply(m, r)
            else:
                if m._illegal is None:
                    m._illegal = [r]
                else:
                    m._illegal.append(r)
                if m._divergence is None and steps is not None:
                    reapply(m, r)
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
    for kind, req, detail, where in ledger.violations:
        findings.append(Finding(kind, detail, req=req, engine_id=engine, file=where.file, line=where.line))
    if log_events is not None:
        log_events[key] = events_seen
    if indexes is not None:
        indexes[key] = {name: info[0] for name, info in lifecycles.items() if info is not None}
    if mine and stream_notes is not None:
        stream_notes[key] = mine
    return machines, ledger, markers


def _lifecycle_info(name: str) -> tuple[dict[str, Machine], frozenset[str], Any, frozenset[str], bool]:
    spec = LIFECYCLES.get(name)
    if spec is None:
        return ({}, frozenset(), None, frozenset(), False)
    return ({}, spec.terminal, _PLAIN_STEPS[name], spec.entry_states | {spec.initial}, _USES_DATA[name])


def _check_shutdown(key: StreamKey, recs: list[Record], marker: Record,
                    findings: list[Finding]) -> dict[str, dict[str, str]] | None:
    """What a process's shutdown record says was live, if replay may take its word:
    it is clean, its 'live' is well formed, and it is the log's last record."""
    if marker is not recs[-1]:
        at = len(recs) - 1
        while recs[at] is not marker:
            at -= 1
        after = recs[at + 1:]
        findings.append(Finding(
            "record_after_shutdown",
            f"{len(after)} record(s) after {key[1]}#{key[2]} (pid {key[3]}) logged its clean shutdown "
            f"(seq {marker.seq}, line {marker.line}); the first: {after[0].kind} {after[0].event!r}",
            after[0].req if type(after[0].req) is str else None, **_where(after[0])))
        return None
    if marker.clean is not True:
        return None  # a shutdown that says it was not clean: judged like a crash
    live = marker.live
    if not (type(live) is dict and all(
            type(lc) is str and type(reqs) is dict
            and all(type(req) is str and type(state) is str for req, state in reqs.items())
            for lc, reqs in live.items())):
        findings.append(Finding("bad_shutdown_record",
                                f"its 'live' is not {{lifecycle: {{request: state}}}}: {live!r}"[:300],
                                **_where(marker)))
        return None
    return live  # type: ignore[no-any-return]


def _check_machine(m: Machine, findings: list[Finding], live_at_shutdown: dict[StreamKey, dict[str, dict[str, str]]],
                   shutdowns: dict[StreamKey, Record], ledgers: dict[StreamKey, _Ledger],
                   open_at_shutdown: list[OpenAtShutdown]) -> bool:
    """Report what is wrong with one machine; True when it needs a cause line
    (it failed, expired, or is stuck: not terminal and not open at a clean
    shutdown that listed it)."""
    spec = LIFECYCLES.get(m.lifecycle)
    last = m.records[-1]
    if spec is None:
        findings.append(Finding("unknown_lifecycle", f"lifecycle {m.lifecycle!r} is not declared", m.req,
                                **_where(last)))
        return False
    for r in m._illegal or ():
        findings.append(Finding(r.violation or "illegal_transition",
                                f"{m.lifecycle} request in state {r.src!r} got event {r.event!r}",
                                m.req, **_where(r)))
    final = m.final_state
    needs_cause = final in CAUSE_STATES
    if final not in spec.terminal:
        needs_cause = True
        stream = m.stream
        live = live_at_shutdown.get(stream)
        if live is None:
            findings.append(Finding("not_terminal_at_end", f"{m.lifecycle} request left in state {final!r} at the "
                                                           f"end of the log ({m.label()})", m.req, **_where(last)))
        else:
            marker = shutdowns[stream]
            listed = live.get(m.lifecycle, {}).get(m.req)
            if listed is not None and listed == final:
                m.open_at_shutdown = True
                needs_cause = False
                open_at_shutdown.append(OpenAtShutdown(*stream, m.lifecycle, m.req, final,
                                                       len(ledgers[stream].held(m.req)), marker.file, marker.line))
            else:
                said = "does not list it" if listed is None else f"lists it in state {listed!r}"
                findings.append(Finding("shutdown_state_mismatch",
                                        f"{m.lifecycle} request left in state {final!r} at a clean shutdown whose "
                                        f"record {said} ({m.label()})", m.req, **_where(marker)))
    if m._divergence is not None:
        findings.append(m._divergence)
    return needs_cause


def _check_listed(key: StreamKey, live: dict[str, dict[str, str]], by_key: dict[MachineKey, Machine],
                  marker: Record) -> Iterable[Finding]:
    """Requests a clean-shutdown record lists that its own log does not leave live."""
    for lifecycle, reqs in live.items():
        for req, state in reqs.items():
            m = by_key.get((*key, lifecycle, req))
            if m is None:
                yield Finding("shutdown_state_mismatch",
                              f"the clean-shutdown record lists {lifecycle} request in state {state!r}, "
                              f"but the log of {key[1]}#{key[2]} (pid {key[3]}) has no such request", req,
                              **_where(marker))
            elif m.terminal:
                yield Finding("shutdown_state_mismatch",
                              f"the clean-shutdown record lists {lifecycle} request in state {state!r}, but "
                              f"it had ended {m.final_state!r} ({m.label()})", req, **_where(marker))


def _divergence(r: Record, req: str, want: tuple[Any, ...], got: tuple[Any, ...]) -> Finding:
    return Finding("divergence",
                   f"re-applying {r.event!r}: recorded {want[0]!r} -> {want[1]!r} "
                   f"violation={want[2]!r} effects={list(want[3])}, replayed {got[0]!r} -> {got[1]!r} "
                   f"violation={got[2]!r} effects={list(got[3])}", req, **_where(r))


# Events decoded from a log carry req "" (the record holds it); a callback that
# read it would need the real one put back (checked once, here).
_CALLBACKS_READ_REQ = any("req" in f.__code__.co_names for f in (*PREPARE.values(), *CONDITIONS.values()))
# The request's data (what prepare callbacks fold in) only matters to a
# condition; a lifecycle with none needs neither the data nor the callbacks.
_USES_DATA: dict[str, bool] = {
    name: any(rule.conditions for rules in spec.rules.values() for rule in rules) for name, spec in LIFECYCLES.items()}


def _plain_steps(spec: LifecycleSpec) -> dict[tuple[str, str], tuple[str, tuple[str, ...], bool, bool]]:
    """(state, trigger) -> (dest, effects, dest is terminal, the lifecycle reads
    its data) where the step needs nothing but the table: one rule with neither
    prepare nor conditions (or, in a lifecycle without conditions, the first
    rule: the data it would prepare is never read)."""
    uses_data = _USES_DATA[spec.name]
    plain = {}
    for key, rules in spec.rules.items():
        rule = rules[0]
        if not uses_data or (len(rules) == 1 and not rule.prepare and not rule.conditions):
            plain[key] = (rule.dest, rule.effects, rule.dest in spec.terminal, uses_data)
    return plain


_PLAIN_STEPS = {name: _plain_steps(spec) for name, spec in LIFECYCLES.items()}


def _reapply_step(m: Machine, r: Record) -> None:
    """Re-apply one record to the machine's fresh copy (``m._state``...): what
    ``LifecycleTracker.create``/``apply`` do for one request, with the same
    compiled rules, ``PREPARE`` callbacks and ``CONDITIONS``, but no tracker,
    clock and ``Outcome`` per record. A step that differs from the record sets
    ``m._divergence`` (and the machine is re-applied no further).
    ``_reapply_reference`` is the tracker spelling; the tests hold the two to
    the same findings."""
    spec = LIFECYCLES[m.key[4]]
    req = m.key[5]
    uses_data = _USES_DATA[spec.name]
    t = r.t_mono_ns
    m._now = max(m._now, t)
    now = m._now
    state = m._state
    dst = r.dst
    got: tuple[Any, ...]
    if r.kind == "create":
        entry = dst or spec.initial
        if entry not in spec.entry_states and entry != spec.initial:
            got = (r.src, entry, "illegal_entry_state", ())
        elif state is not None:
            got = (r.src, state, "duplicate_request", ())
        else:
            m._state = entry
            m._final = None
            if uses_data:
                m._data = RequestMachine(req, spec.name, entry, now)
                m._data.block_ids = tuple(r.blocks)
            got = (r.src, entry, None, ())
    else:
        trigger = r.event
        event = r.input
        if event is None or type(event) is dict:
            # Not decoded as its event (a line the per-event types did not fit,
            # or no input at all): rebuild it as the runtime's records are.
            try:
                event = event_from_record(trigger, req, event or {})
            except ValueError as exc:
                m._divergence = Finding("divergence", f"cannot rebuild the input of {trigger!r}: {exc}", req,
                                        **_where(r))
                return
        elif _CALLBACKS_READ_REQ and uses_data:
            event = msgspec.structs.replace(event, req=req)
        if state is None:
            final = m._final
            if final is None:
                got = (None, None, "unknown_request", ())
            else:
                got = (final, final, spec.named_violations.get((final, trigger), "event_after_terminal"), ())
        else:
            rules = spec.rules.get((state, trigger))
            if rules is None:
                got = (state, state, spec.named_violations.get((state, trigger), "illegal_transition"), ())
            else:
                data = m._data
                if uses_data:
                    for rule in rules:
                        for name in rule.prepare:
                            PREPARE[name](data, event, now)
                        if all(CONDITIONS[c](data, event) for c in rule.conditions):
                            break
                else:  # no condition reads the data: the first rule is unconditional and taken
                    rule = rules[0]
                dest = rule.dest
                got = (state, dest, None, rule.effects)
                if dest in spec.terminal:
                    m._final = dest
                    m._state = None
                    m._data = None
                else:
                    m._state = dest
                    if data is not None:
                        data.state = dest
    if got != (r.src, dst, r.violation, r.effects):
        m._divergence = _divergence(r, req, (r.src, dst, r.violation, r.effects), got)


def _reapply_reference(m: Machine) -> Finding | None:
    """Re-apply the recorded inputs through a fresh ``LifecycleTracker``: the
    first divergence, if any. ``_reapply_step`` must agree with it
    (the tests compare them); too slow for a million records."""
    spec = LIFECYCLES[m.lifecycle]
    first = m.records[0]
    clock = VirtualClock(first.t_mono_ns)
    tracker = LifecycleTracker(spec, clock)
    for r in m.records:
        if r.t_mono_ns > clock.monotonic_ns():
            clock.set(r.t_mono_ns)
        live = tracker.get(m.req)
        before = live.state if live is not None else tracker.final_state(m.req)
        if r.kind == "create":
            out = tracker.create(m.req, entry=r.dst, block_ids=tuple(r.blocks or ()))
            before = r.src  # a creation has no prior state to compare
        else:
            try:
                event = event_from_record(r.event, m.req, input_dict(r.input) or {})
            except ValueError as exc:
                return Finding("divergence", f"cannot rebuild the input of {r.event!r}: {exc}", m.req,
                               **_where(r))
            out = tracker.apply(event)
        want = (r.src, r.dst, r.violation, tuple(r.effects or ()))
        got = (before, out.dst, out.violation, tuple(out.effects))
        if want != got:
            return _divergence(r, m.req, want, got)
    return None


def _check_reads_after_expiry(machines: Sequence[Machine]) -> Iterable[Finding]:
    expired_at: dict[tuple[str, str], int] = {}
    for m in machines:
        if m.final_state == "expired" and m.key[4] == "send":
            expired_at[(m.key[0], m.req)] = m.records[-1].t_wall_ns
    for m in machines:
        if m.matched is None or m.key[4] != "recv":
            continue
        deadline = _input_get(m.matched.input, "remote_expiry_ns", None) or None
        remote = m.remote
        if remote is not None and remote in expired_at:
            deadline = min(deadline or expired_at[remote], expired_at[remote])
        if deadline is None:
            continue
        for r in m.records:
            if r.event == "reads_posted" and r.kind == "transition" and r.t_wall_ns > deadline:
                yield Finding("read_after_lease_expiry",
                              f"reads of {remote[1] if remote else '?'} on {remote[0] if remote else '?'} posted "
                              f"{(r.t_wall_ns - deadline) / 1e6:.3f} ms after its lease expired",
                              m.req, **_where(r))


# --- views ------------------------------------------------------------------


def story(report: Report, req: str) -> list[Machine]:
    """The machines of one request across processes: its own, and the other side's."""
    picked = [m for m in report.machines if m.req == req]
    linked: set[tuple[str, str]] = set()
    for m in list(picked):
        if m.remote:
            linked.add(m.remote)
    for m in report.machines:
        remote = m.remote
        if remote and remote[1] == req and m not in picked:
            picked.append(m)
            linked.add((remote[0], remote[1]))
    for m in report.machines:
        if (m.engine_id, m.req) in linked and m not in picked:
            picked.append(m)
    return picked


def full_records(rows: Sequence[Record]) -> list[dict[str, Any]]:
    """The records as the dicts they were written as (every field, with
    ``_file``/``_line``): each line is read again from its file. A line that is
    gone or changed since is rebuilt from the typed fields."""
    lines_of: dict[str, list[bytes] | None] = {}
    out: list[dict[str, Any]] = []
    for r in rows:
        d = read_back(r, lines_of)
        if d is None:
            d = {name: r.get(name) for name in RECORD_FIELDS}
        d["_file"] = r.file
        d["_line"] = r.line
        out.append(d)
    return out


def _timeline_records(report: Report, req: str) -> list[Record]:
    machines = story(report, req)
    rows = [r for m in machines for r in m.records]
    for key in {(m.engine_id, m.req) for m in machines}:
        rows.extend(report.notes.get(key, ()))
    # A clean shutdown that left a request of the story open (or lists it) ends its timeline.
    markers: dict[int, Record] = {}
    for m in machines:
        marker = report.shutdowns.get(m.stream)
        if marker is None:
            continue
        live = marker.live if type(marker.live) is dict else {}
        listed = type(live.get(m.lifecycle)) is dict and m.req in live[m.lifecycle]
        if listed or not m.terminal:
            markers[id(marker)] = marker
    rows.extend(markers.values())
    rows.sort(key=lambda r: (r.t_wall_ns, r.t_mono_ns, r.seq))
    return rows


def timeline(report: Report, req: str) -> list[dict[str, Any]]:
    """Every record of the request's story, in wall-clock order across processes."""
    return full_records(_timeline_records(report, req))


def chrome_trace(report: Report) -> dict[str, Any]:
    """Chrome / Perfetto trace JSON: a process per engine, a track per request."""
    events: list[dict[str, Any]] = []
    if not report.machines:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = min(m.records[0].t_wall_ns for m in report.machines)
    pids: dict[str, int] = {}
    for tid, m in enumerate(report.machines, start=1):
        if m.engine_id not in pids:
            pids[m.engine_id] = len(pids) + 1
            events.append({"ph": "M", "name": "process_name", "pid": pids[m.engine_id],
                           "args": {"name": m.engine_id}})
        pid = pids[m.engine_id]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"{m.lifecycle}:{m.req} ({m.role}#{m.rank})"}})
        spans = [r for r in m.records if r.kind in ("create", "transition")]
        for a, b in zip(spans, [*spans[1:], None]):
            start = (a.t_wall_ns - t0) / 1000
            end = (b.t_wall_ns - t0) / 1000 if b is not None else start
            events.append({"ph": "X", "name": a.dst, "cat": m.lifecycle, "pid": pid, "tid": tid,
                           "ts": start, "dur": max(end - start, 0.001),
                           "args": {"event": a.event, "effects": list(a.effects),
                                    "input": input_dict(a.input) or {}}})
        for r in m.records:
            if r.kind == "violation":
                events.append({"ph": "i", "s": "t", "name": f"VIOLATION {r.violation}: {r.event}",
                               "pid": pid, "tid": tid, "ts": (r.t_wall_ns - t0) / 1000})
        if m.open_at_shutdown:
            marker = report.shutdowns[m.stream]
            events.append({"ph": "i", "s": "t", "name": f"open at clean shutdown in {m.final_state}",
                           "pid": pid, "tid": tid, "ts": (marker.t_wall_ns - t0) / 1000})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _fmt_shutdown(r: dict[str, Any], request: str | None) -> str:
    """A clean-shutdown record in a timeline: what it says about this request,
    not its whole (possibly long) list of live requests."""
    live = r.get("live") if type(r.get("live")) is dict else {}
    counts = {lc: len(reqs) for lc, reqs in live.items() if type(reqs) is dict}
    said = [f"{lc} {request} listed {reqs[request]!r}" for lc, reqs in live.items()
            if type(reqs) is dict and request in reqs]
    return (f"clean={r.get('clean')!r}; "
            + ("; ".join(said) if said else f"{request!r} not listed")
            + "; live: " + ", ".join(f"{lc} {n}" for lc, n in counts.items()))


def _fmt_row(r: dict[str, Any], t0: int, request: str | None = None) -> str:
    who = f"{r['engine_id']}/{r['role']}#{r['rank']}"
    if r["kind"] not in _MACHINE_KINDS:
        if r["event"] == SHUTDOWN_EVENT:
            detail = "  " + _fmt_shutdown(r, request)
        else:
            fields = {k: v for k, v in r.items() if k not in HEADER_FIELDS and not k.startswith("_")}
            detail = f"  {json.dumps(fields, separators=(',', ':'), default=str)}" if fields else ""
        return (f"{(r['t_wall_ns'] - t0) / 1e6:10.3f} ms  {who:28} {'log':5} {r['req'] or '-'!s:>10}  "
                f"# {r['event']}{detail}")
    if r["kind"] == "create":
        what = f"create -> {r['dst']}"
    elif r["kind"] == "violation":
        what = f"!! {r.get('violation')}: {r['event']} in {r['src']}"
    else:
        what = f"{r['src']} --{r['event']}--> {r['dst']}"
    extra = []
    if r.get("input"):
        extra.append(json.dumps(r["input"], separators=(",", ":")))
    if r.get("effects"):
        extra.append("effects=" + ",".join(r["effects"]))
    return f"{(r['t_wall_ns'] - t0) / 1e6:10.3f} ms  {who:28} {r.get('lifecycle', ''):5} {r['req']:>10}  {what}" + (
        "  " + " ".join(extra) if extra else "")


def render_text(report: Report, request: str | None = None, limit: int = 50) -> str:
    lines: list[str] = []
    files = {m.records[0].file for m in report.machines}
    lines.append(f"{report.num_records} records from {len(files) or len(report.files)} file(s), "
                 f"{len(report.streams)} process log(s), {len(report.machines)} request machine(s)")
    for lc, counts in report.summary().items():
        lines.append(f"  {lc}: " + ", ".join(f"{state} {n}" for state, n in counts.items()))
    if report.open_at_shutdown:
        by: dict[str, int] = defaultdict(int)
        for o in report.open_at_shutdown:
            by[f"{o.lifecycle} {o.state}"] += 1
        lines.append(f"  open at a clean shutdown (listed by it; not violations): {len(report.open_at_shutdown)}: "
                     + ", ".join(f"{k} {n}" for k, n in sorted(by.items()))
                     + f", holding {sum(o.blocks for o in report.open_at_shutdown)} block(s)")
    if request is not None:
        recs = _timeline_records(report, request)
        lines.append("")
        if not recs:
            lines.append(f"no request {request!r} in these logs")
        else:
            lines.append(f"timeline of {request!r} across {len({_stream_key(r) for r in recs})} process(es):")
            rows = full_records(recs)
            t0 = rows[0]["t_wall_ns"]
            lines.extend(_fmt_row(r, t0, request) for r in rows)
            cause_of = {(c.engine_id, c.role, c.rank, c.pid, c.lifecycle, c.req): c for c in report.causes}
            for m in story(report, request):
                state = ("" if m.terminal else "  (open at a clean shutdown)" if m.open_at_shutdown
                         else "  (NOT TERMINAL)")
                lines.append(f"  final: {m.label()} -> {m.final_state}{state}")
                cause = cause_of.get(m.key)
                if cause is not None:
                    lines.append(f"    cause: {cause.line}")
    else:
        lines.append("")
        lines.append(f"{'request':>12}  {'engine':>12} {'side':5} {'final':12} {'ms':>9}  events")
        for m in report.machines[:limit]:
            lines.append(f"{m.req:>12}  {m.engine_id:>12} {m.lifecycle:5} {m.final_state!s:12} "
                         f"{m.duration_ns / 1e6:9.3f}  {len(m.records)}"
                         + ("  (open at a clean shutdown)" if m.open_at_shutdown else ""))
        if len(report.machines) > limit:
            lines.append(f"  ... {len(report.machines) - limit} more (use --limit or --json)")
        if report.causes:
            lines.append("")
            lines.append(f"causes ({len(report.causes):,} failed or stuck; not violations unless stuck):")
            lines.extend(f"  {c}" for c in report.causes[:limit])
            if len(report.causes) > limit:
                lines.append(f"  ... {len(report.causes) - limit} more (use --limit or --json)")
    lines.append("")
    for f in report.unreadable:
        lines.append(f"UNREADABLE {f}")
    if report.findings:
        lines.append(f"{len(report.findings)} violation(s):")
        by_kind: dict[str, int] = defaultdict(int)
        for f in report.findings:
            by_kind[f.kind] += 1
        lines.append("  " + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())))
        lines.extend(f"  {f}" for f in report.findings[:limit])
        if len(report.findings) > limit:
            lines.append(f"  ... {len(report.findings) - limit} more")
    elif report.open_at_shutdown:
        lines.append(f"no violations: every request terminal or open at a clean shutdown that listed it "
                     f"({len(report.open_at_shutdown)}), replay matches the recorded transitions")
    else:
        lines.append("no violations: every request terminal, replay matches the recorded transitions")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsm-replay", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit status: 0 clean, 1 violations found, 2 unreadable input")
    parser.add_argument("logs", nargs="+", help="JSONL event logs (files or directories)")
    parser.add_argument("--request", "-r", help="show this request's timeline across processes")
    parser.add_argument("--trace", type=Path, help="write a Perfetto/Chrome trace JSON here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--limit", type=int, default=50, help="rows of requests and violations to print")
    args = parser.parse_args(argv)

    report = analyse(args.logs)
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        args.trace.write_text(json.dumps(chrome_trace(report)))
    if args.json:
        out = report.to_json()
        if args.request is not None:
            out["timeline"] = timeline(report, args.request)
        print(json.dumps(out, indent=1, default=str))
    else:
        print(render_text(report, args.request, args.limit))
        if args.trace is not None:
            print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
