"""Replay's checks: which records can be folded, ``seq`` order, clean
shutdowns, each machine's end, reads after a lease expired."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvsm.eventlog.reader import Record, record_from_dict
from kvsm.lifecycle.invariants import BlockLedger
from kvsm.replay.causes import CAUSE_STATES
from kvsm.replay.model import (
    _MACHINE_KINDS,
    Finding,
    Machine,
    MachineKey,
    OpenAtShutdown,
    StreamKey,
    _input_get,
    _where,
)


def _well_formed(items: Sequence[Record | dict[str, Any]], findings: list[Finding]) -> list[Record]:
    """The records replay can fold (typed), the rest reported as corrupt lines."""
    out: list[Record] = []
    for it in items:
        if type(it) is dict:
            if not _record_ok(it):
                findings.append(Finding("corrupt_line", _malformed(it) or "malformed record",
                                        file=it["_file"], line=it["_line"]))
                continue
            out.append(record_from_dict(it))
            continue
        if (it.req is None or it.lifecycle is None) and it.kind in _MACHINE_KINDS:  # type: ignore[union-attr]
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
    return live


def _check_machine(m: Machine, findings: list[Finding], live_at_shutdown: dict[StreamKey, dict[str, dict[str, str]]],
                   shutdowns: dict[StreamKey, Record], ledgers: dict[StreamKey, BlockLedger],
                   open_at_shutdown: list[OpenAtShutdown]) -> bool:
    """Report what is wrong with one machine; True when it needs a cause line
    (it failed, expired, or is stuck: not terminal and not open at a clean
    shutdown that listed it)."""
    spec = m.spec
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
    if final not in spec.terminal and not spec.lives_with_process:
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


def _check_reads_after_expiry(machines: Sequence[Machine]) -> Iterable[Finding]:
    expired_at: dict[tuple[str, str], int] = {}
    for m in machines:
        if m.final_state == "expired" and m.key[4] == "send":
            # When it expired (late inputs after that are recorded too: not their time).
            expired_at[(m.key[0], m.req)] = next(
                (r.t_wall_ns for r in m.records if r.dst == "expired" and r.src != "expired"),
                m.records[-1].t_wall_ns)
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
