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
* exports a Perfetto / Chrome trace with one track per request (``--trace``),
* prints everything as JSON (``--json``).

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
from pathlib import Path
from typing import Any

from kvsm.eventlog import read_logs
from kvsm.eventlog.reader import expand_paths
from kvsm.eventlog.schema import HEADER_FIELDS
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.events import event_from_record
from kvsm.lifecycle.invariants import BlockLedger
from kvsm.lifecycle.machine import LifecycleTracker
from kvsm.lifecycle.table import LIFECYCLES

StreamKey = tuple[str, str, int, int]  # engine_id, role, rank, pid
MachineKey = tuple[str, str, int, int, str, str]  # stream + lifecycle, req

_MACHINE_KINDS = frozenset({"create", "transition", "violation"})


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
class Machine:
    """One request's lifecycle in one process, as the log tells it."""

    key: MachineKey
    records: list[dict[str, Any]] = field(default_factory=list)

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
    def lifecycle(self) -> str:
        return self.key[4]

    @property
    def req(self) -> str:
        return self.key[5]

    @property
    def final_state(self) -> str | None:
        """The destination of the last create/transition record (violations move nothing)."""
        for r in reversed(self.records):
            if r["kind"] != "violation" and r["dst"] is not None:
                return r["dst"]  # type: ignore[no-any-return]
        return None

    @property
    def terminal(self) -> bool:
        spec = LIFECYCLES.get(self.lifecycle)
        return spec is not None and self.final_state in spec.terminal

    @property
    def matched_input(self) -> dict[str, Any] | None:
        """The inputs of the recv side's ``matched`` transition: who the remote is."""
        for r in self.records:
            if r.get("event") == "matched" and r["kind"] == "transition":
                return r.get("input") or {}
        return None

    @property
    def remote(self) -> tuple[str, str] | None:
        inp = self.matched_input
        return None if inp is None else (inp.get("remote_engine", ""), inp.get("remote_req", ""))

    @property
    def duration_ns(self) -> int:
        if not self.records:
            return 0
        return self.records[-1]["t_mono_ns"] - self.records[0]["t_mono_ns"]

    def label(self) -> str:
        return f"{self.engine_id}/{self.role}#{self.rank} {self.lifecycle}:{self.req}"


@dataclass
class Report:
    files: list[str]
    num_records: int
    machines: list[Machine]
    findings: list[Finding]
    unreadable: list[Finding]
    streams: dict[StreamKey, int]
    # Diagnostic (kind "log") records that name a request, by (engine_id, req).
    notes: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)

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
            "streams": [{"engine_id": k[0], "role": k[1], "rank": k[2], "pid": k[3], "records": n}
                        for k, n in sorted(self.streams.items())],
            "summary": self.summary(),
            "requests": [
                {"engine_id": m.engine_id, "role": m.role, "rank": m.rank, "lifecycle": m.lifecycle,
                 "req": m.req, "final_state": m.final_state, "terminal": m.terminal,
                 "duration_ms": round(m.duration_ns / 1e6, 3), "events": len(m.records),
                 "remote": list(m.remote) if m.remote else None}
                for m in self.machines
            ],
            "violations": [asdict(f) for f in self.findings],
            "unreadable": [asdict(f) for f in self.unreadable],
            "exit_code": self.exit_code,
        }


# --- building the report ----------------------------------------------------


def _stream_key(r: dict[str, Any]) -> StreamKey:
    return (r["engine_id"], r["role"], r["rank"], r["pid"])  # the reader checked the header


def analyse(paths: Sequence[str | Path]) -> Report:
    """Read, merge and check the logs; nothing is printed."""
    # Millions of small dicts and no cycles: the cyclic GC only costs time here
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
    result = read_logs(files)
    findings: list[Finding] = []
    unreadable: list[Finding] = []
    for p in result.problems:
        f = Finding("corrupt_line" if p.line > 0 else "unreadable_file", p.reason, file=p.path, line=p.line)
        (findings if p.line > 0 else unreadable).append(f)
    seen = {r["_file"] for r in result.records} | {p.path for p in result.problems}
    for path in map(str, files):
        if path not in seen:  # every process log starts with a log_start record
            findings.append(Finding("empty_log", "the file holds no record at all (even its log_start is lost)",
                                    file=path, line=0))

    streams: dict[StreamKey, list[dict[str, Any]]] = defaultdict(list)
    for r in result.records:
        if not _record_ok(r):
            findings.append(Finding("corrupt_line", _malformed(r) or "malformed record",
                                    file=r["_file"], line=r["_line"]))
            continue
        streams[_stream_key(r)].append(r)
    machines: dict[MachineKey, Machine] = {}
    notes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for key, recs in streams.items():
        recs.sort(key=lambda r: r["seq"])
        findings.extend(_check_seq(key, recs))
        mine: dict[tuple[str, str], Machine] = {}
        for r in recs:
            kind = r["kind"]
            if kind == "log_overflow":
                findings.append(Finding("records_dropped",
                                        f"the in-memory log buffer overflowed: {r.get('dropped')} records lost",
                                        engine_id=key[0], file=r["_file"], line=r["_line"]))
            if r["req"] is None:
                continue
            if kind == "log":
                notes.setdefault((key[0], r["req"]), []).append(r)
                continue
            if kind not in _MACHINE_KINDS:
                continue
            lk = (r.get("lifecycle"), r["req"])
            machine = mine.get(lk)
            if machine is None:
                machine = mine[lk] = machines[(*key, str(lk[0]), str(lk[1]))] = Machine((*key, str(lk[0]), str(lk[1])))
            machine.records.append(r)
        findings.extend(_check_blocks(key, recs))

    ordered = sorted(machines.values(), key=lambda m: (m.records[0]["t_wall_ns"], m.key))
    for m in ordered:
        findings.extend(_check_machine(m))
    findings.extend(_check_reads_after_expiry(ordered))
    return Report([str(p) for p in paths], len(result.records), ordered, findings, unreadable,
                  {k: len(v) for k, v in streams.items()}, notes)


_INT_FIELDS = ("seq", "t_mono_ns", "t_wall_ns", "pid", "rank")
_STR_FIELDS = ("engine_id", "role", "kind", "event")


def _malformed(r: dict[str, Any]) -> str | None:
    """Why a record that parsed as JSON still cannot be replayed, or None.

    The reader checks only that the header keys exist (it must stay fast);
    replay sorts, folds and indexes by these values, so their types matter.
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


def _where(r: dict[str, Any]) -> dict[str, Any]:
    return {"file": r.get("_file"), "line": r.get("_line"), "engine_id": r.get("engine_id")}


def _check_seq(key: StreamKey, recs: list[dict[str, Any]]) -> Iterable[Finding]:
    expected = 0  # seq starts at 0 in every process
    for r in recs:
        seq = r["seq"]
        if seq < expected:
            yield Finding("seq_duplicate", f"seq {seq} appears twice", **_where(r))
            continue
        if seq > expected:
            missing = f"{expected}" if seq == expected + 1 else f"{expected}..{seq - 1}"
            yield Finding("seq_gap", f"{seq - expected} record(s) lost: seq {missing} missing in the log of "
                                     f"{key[1]}#{key[2]} (pid {key[3]})", **_where(r))
        expected = seq + 1


def _check_blocks(key: StreamKey, recs: list[dict[str, Any]]) -> Iterable[Finding]:
    ledger = BlockLedger(f"{key[0]}/{key[1]}#{key[2]}")
    for r in recs:
        if r["kind"] == "create":
            ledger.hold(r["req"], r.get("blocks") or (), _where(r))
        elif r["kind"] == "transition":
            ledger.apply_effects(r["req"], r.get("effects") or (), r.get("blocks") or (), _where(r))
            spec = LIFECYCLES.get(r.get("lifecycle", ""))
            if spec is not None and r.get("dst") in spec.terminal:
                ledger.finish(r["req"], r["dst"], _where(r))
    for v in ledger.violations:
        yield Finding(v.kind, v.detail, req=v.req, engine_id=key[0], file=v.where.get("file"),
                      line=v.where.get("line"))


def _check_machine(m: Machine) -> Iterable[Finding]:
    spec = LIFECYCLES.get(m.lifecycle)
    last = m.records[-1]
    if spec is None:
        yield Finding("unknown_lifecycle", f"lifecycle {m.lifecycle!r} is not declared", m.req, **_where(last))
        return
    for r in m.records:
        if r["kind"] == "violation":
            yield Finding(r.get("violation") or "illegal_transition",
                          f"{m.lifecycle} request in state {r.get('src')!r} got event {r.get('event')!r}",
                          m.req, **_where(r))
    if m.final_state not in spec.terminal:
        yield Finding("not_terminal_at_end", f"{m.lifecycle} request left in state {m.final_state!r} at the end "
                                             f"of the log ({m.label()})", m.req, **_where(last))
    divergence = _reapply(m)
    if divergence is not None:
        yield divergence


def _reapply(m: Machine) -> Finding | None:
    """Re-apply the recorded inputs to a fresh machine; the first divergence, if any."""
    spec = LIFECYCLES[m.lifecycle]
    first = m.records[0]
    clock = VirtualClock(first["t_mono_ns"])
    tracker = LifecycleTracker(spec, clock)
    for r in m.records:
        if r["t_mono_ns"] > clock.monotonic_ns():
            clock.set(r["t_mono_ns"])
        live = tracker.get(m.req)
        before = live.state if live is not None else tracker.final_state(m.req)
        if r["kind"] == "create":
            out = tracker.create(m.req, entry=r.get("dst"), block_ids=tuple(r.get("blocks") or ()))
            before = r.get("src")  # a creation has no prior state to compare
        else:
            try:
                event = event_from_record(r["event"], m.req, r.get("input") or {})
            except ValueError as exc:
                return Finding("divergence", f"cannot rebuild the input of {r['event']!r}: {exc}", m.req,
                               **_where(r))
            out = tracker.apply(event)
        want = (r.get("src"), r.get("dst"), r.get("violation"), tuple(r.get("effects") or ()))
        got = (before, out.dst, out.violation, tuple(out.effects))
        if want != got:
            return Finding("divergence",
                           f"re-applying {r['event']!r}: recorded {want[0]!r} -> {want[1]!r} "
                           f"violation={want[2]!r} effects={list(want[3])}, replayed {got[0]!r} -> {got[1]!r} "
                           f"violation={got[2]!r} effects={list(got[3])}", m.req, **_where(r))
    return None


def _check_reads_after_expiry(machines: Sequence[Machine]) -> Iterable[Finding]:
    expired_at: dict[tuple[str, str], int] = {}
    for m in machines:
        if m.lifecycle == "send" and m.final_state == "expired":
            expired_at[(m.engine_id, m.req)] = m.records[-1]["t_wall_ns"]
    for m in machines:
        if m.lifecycle != "recv":
            continue
        remote = m.remote
        deadline = (m.matched_input or {}).get("remote_expiry_ns") or None
        if remote is not None and remote in expired_at:
            deadline = min(deadline or expired_at[remote], expired_at[remote])
        if deadline is None:
            continue
        for r in m.records:
            if r.get("event") == "reads_posted" and r["kind"] == "transition" and r["t_wall_ns"] > deadline:
                yield Finding("read_after_lease_expiry",
                              f"reads of {remote[1] if remote else '?'} on {remote[0] if remote else '?'} posted "
                              f"{(r['t_wall_ns'] - deadline) / 1e6:.3f} ms after its lease expired",
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


def timeline(report: Report, req: str) -> list[dict[str, Any]]:
    """Every record of the request's story, in wall-clock order across processes."""
    machines = story(report, req)
    rows = [r for m in machines for r in m.records]
    for key in {(m.engine_id, m.req) for m in machines}:
        rows.extend(report.notes.get(key, ()))
    rows.sort(key=lambda r: (r["t_wall_ns"], r["t_mono_ns"], r["seq"]))
    return rows


def chrome_trace(report: Report) -> dict[str, Any]:
    """Chrome / Perfetto trace JSON: a process per engine, a track per request."""
    events: list[dict[str, Any]] = []
    if not report.machines:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = min(m.records[0]["t_wall_ns"] for m in report.machines)
    pids: dict[str, int] = {}
    for tid, m in enumerate(report.machines, start=1):
        if m.engine_id not in pids:
            pids[m.engine_id] = len(pids) + 1
            events.append({"ph": "M", "name": "process_name", "pid": pids[m.engine_id],
                           "args": {"name": m.engine_id}})
        pid = pids[m.engine_id]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"{m.lifecycle}:{m.req} ({m.role}#{m.rank})"}})
        spans = [r for r in m.records if r["kind"] in ("create", "transition")]
        for a, b in zip(spans, spans[1:] + [None]):
            start = (a["t_wall_ns"] - t0) / 1000
            end = (b["t_wall_ns"] - t0) / 1000 if b is not None else start
            events.append({"ph": "X", "name": a["dst"], "cat": m.lifecycle, "pid": pid, "tid": tid,
                           "ts": start, "dur": max(end - start, 0.001),
                           "args": {"event": a["event"], "effects": a.get("effects", []),
                                    "input": a.get("input", {})}})
        for r in m.records:
            if r["kind"] == "violation":
                events.append({"ph": "i", "s": "t", "name": f"VIOLATION {r.get('violation')}: {r['event']}",
                               "pid": pid, "tid": tid, "ts": (r["t_wall_ns"] - t0) / 1000})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _fmt_row(r: dict[str, Any], t0: int) -> str:
    who = f"{r['engine_id']}/{r['role']}#{r['rank']}"
    if r["kind"] == "log":
        fields = {k: v for k, v in r.items() if k not in HEADER_FIELDS and not k.startswith("_")}
        return (f"{(r['t_wall_ns'] - t0) / 1e6:10.3f} ms  {who:28} {'log':5} {r['req']:>10}  # {r['event']}"
                + (f"  {json.dumps(fields, separators=(',', ':'), default=str)}" if fields else ""))
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
    files = {r["_file"] for m in report.machines for r in m.records[:1]}
    lines.append(f"{report.num_records} records from {len(files) or len(report.files)} file(s), "
                 f"{len(report.streams)} process log(s), {len(report.machines)} request machine(s)")
    for lc, counts in report.summary().items():
        lines.append(f"  {lc}: " + ", ".join(f"{state} {n}" for state, n in counts.items()))
    if request is not None:
        rows = timeline(report, request)
        lines.append("")
        if not rows:
            lines.append(f"no request {request!r} in these logs")
        else:
            lines.append(f"timeline of {request!r} across {len({_stream_key(r) for r in rows})} process(es):")
            t0 = rows[0]["t_wall_ns"]
            lines.extend(_fmt_row(r, t0) for r in rows)
            for m in story(report, request):
                lines.append(f"  final: {m.label()} -> {m.final_state}"
                             f"{'' if m.terminal else '  (NOT TERMINAL)'}")
    else:
        lines.append("")
        lines.append(f"{'request':>12}  {'engine':>12} {'side':5} {'final':12} {'ms':>9}  events")
        for m in report.machines[:limit]:
            lines.append(f"{m.req:>12}  {m.engine_id:>12} {m.lifecycle:5} {str(m.final_state):12} "
                         f"{m.duration_ns / 1e6:9.3f}  {len(m.records)}")
        if len(report.machines) > limit:
            lines.append(f"  ... {len(report.machines) - limit} more (use --limit or --json)")
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
            out["timeline"] = [{k: v for k, v in r.items()} for r in timeline(report, args.request)]
        print(json.dumps(out, indent=1, default=str))
    else:
        print(render_text(report, args.request, args.limit))
        if args.trace is not None:
            print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
