"""What replay makes of the logs: findings, machines, the report."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsm.eventlog.reader import Record, input_dict
from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.events import Event
from kvsm.lifecycle.table import LIFECYCLES, LifecycleSpec

StreamKey = tuple[str, str, int, int]  # engine_id, role, rank, pid
MachineKey = tuple[str, str, int, int, str, str]  # stream + lifecycle, req

_MACHINE_KINDS = frozenset({"create", "transition", "violation"})
# The last record a worker writes before it closes its log at a clean stop.
SHUTDOWN_EVENT = "worker.shutdown"


@dataclass
class Cause:
    """One failed or stuck machine and what the logs of both engines show for it."""

    engine_id: str
    role: str
    rank: int
    pid: int
    lifecycle: str
    req: str
    final_state: str | None
    rule: str  # the RULES entry that explained it
    line: str

    def __str__(self) -> str:
        return f"{self.engine_id}/{self.role}#{self.rank} {self.lifecycle}:{self.req} {self.final_state}: {self.line}"


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


def _where(r: Record) -> dict[str, Any]:
    return {"file": r.file, "line": r.line, "engine_id": r.engine_id}


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
    ``spec`` is its lifecycle's declaration (None: not declared).
    """

    __slots__ = ("_divergence", "_final", "_first_wall", "_illegal", "_live", "_now",
                 "final_state", "key", "matched", "open_at_shutdown", "records", "spec")

    def __init__(self, key: MachineKey, records: list[Record] | None = None, *,
                 final_state: str | None = _UNSET, matched: Record | None = _UNSET,
                 spec: LifecycleSpec | None = _UNSET) -> None:
        self.key = key
        self.records: list[Record] = [] if records is None else records
        self.final_state: str | None = _final_state_of(self.records) if final_state is _UNSET else final_state
        self.matched: Record | None = _matched_of(self.records) if matched is _UNSET else matched
        self.spec: LifecycleSpec | None = LIFECYCLES.get(key[4]) if spec is _UNSET else spec
        # Listed, in this state, by its process's clean-shutdown record.
        self.open_at_shutdown = False
        # The re-apply while analyse folds the records (kvsm.replay.fold): the
        # machine the table moves (``spec.machine_cls``; None before its create
        # and after its end), the final state it ended in, the first divergence.
        self._live: RequestMachine | None = None
        self._final: str | None = None
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
        return self.key[:4]

    @property
    def lifecycle(self) -> str:
        return self.key[4]

    @property
    def req(self) -> str:
        return self.key[5]

    @property
    def terminal(self) -> bool:
        spec = self.spec
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
    # show for it (kvsm.replay.causes). Information: a failure is a legal outcome.
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
