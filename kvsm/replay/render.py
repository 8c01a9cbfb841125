"""Replay's views: one request's story and timeline, the text report, the
Chrome / Perfetto trace."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from kvsm.eventlog.reader import RECORD_FIELDS, Record, input_dict, read_back
from kvsm.eventlog.schema import HEADER_FIELDS
from kvsm.replay.evidence import STREAM_KEY_NOTE
from kvsm.replay.model import _MACHINE_KINDS, SHUTDOWN_EVENT, Machine, Report


def _stream_key(r: Record) -> tuple[str, str, int, int]:
    return (r.engine_id, r.role, r.rank, r.pid)


def _joined(report: Report) -> dict[tuple[str, str], str]:
    """Streamed push: (prefill engine, join key) -> the prefill request the key
    names there (its worker's ``worker.stream_key`` note): a decode request names
    its prefill request by the key."""
    lines_of: dict[str, list[bytes] | None] = {}
    out: dict[tuple[str, str], str] = {}
    for (engine, req), recs in report.notes.items():
        for r in recs:
            if r.event == STREAM_KEY_NOTE:
                key = (read_back(r, lines_of) or {}).get("key")
                if isinstance(key, str):
                    out[(engine, key)] = req
    return out


def story(report: Report, req: str) -> list[Machine]:
    """The machines of one request across processes: its own, and the other side's."""
    joined = _joined(report)

    def remote_of(m: Machine) -> tuple[str, str] | None:
        remote = m.remote
        return (remote[0], joined.get(remote, remote[1])) if remote else None

    picked = [m for m in report.machines if m.req == req]
    linked: set[tuple[str, str]] = set()
    for m in list(picked):
        remote = remote_of(m)
        if remote:
            linked.add(remote)
    for m in report.machines:
        remote = remote_of(m)
        if remote and remote[1] == req and m not in picked:
            picked.append(m)
            linked.add(remote)
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
    got = r.get("live")
    live: dict[Any, Any] = got if type(got) is dict else {}
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


def _closed_at_shutdown(report: Report) -> dict[str, int]:
    """How many machines a clean stop closed, by lifecycle and the state it found
    them in (their last transition's source)."""
    by: dict[str, int] = defaultdict(int)
    for m in report.machines:
        if m.final_state == "closed_at_shutdown":
            by[f"{m.lifecycle} {m.records[-1].src}"] += 1
    return by


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
    closed = _closed_at_shutdown(report)
    if closed:
        lines.append(f"  closed at shutdown (a clean stop let them go; not violations): {sum(closed.values())}: "
                     + ", ".join(f"{k} {n}" for k, n in sorted(closed.items())))
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
            what = "failed, stuck or closed at shutdown" if closed else "failed or stuck"
            lines.append(f"causes ({len(report.causes):,} {what}; not violations unless stuck):")
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
    elif closed:
        lines.append(f"no violations: every request terminal ({sum(closed.values())} closed at shutdown), "
                     "replay matches the recorded transitions")
    else:
        lines.append("no violations: every request terminal, replay matches the recorded transitions")
    return "\n".join(lines)
