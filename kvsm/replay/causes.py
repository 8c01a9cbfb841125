"""Why a request failed or got stuck, from the logs of both engines: one line each.

``kvsm.replay.fold`` hands over the machines that ended ``failed`` (recv),
``expired`` (send) or ``closed_at_shutdown`` (a clean stop let them go), and
those left mid-lifecycle without a clean shutdown that listed them;
everything else is never looked at. Each is sorted to one rule of
``RULES`` by what its own log shows (a failure trigger, an expiry, no end), and
the rule's explainer reads what the other side's logs say about it:

* the decode worker's ``worker.claims_answered`` records (one per request when
  its claim phase ends, ``{status: {req: count}}``; older logs: one per reply
  with lists of requests), i.e. how often the prefill
  side answered "unknown", "ok", "expired" for the request),
  ``worker.claim_failed`` and ``worker.peer_dead`` notes;
* the prefill scheduler's ``sched.pinned`` / ``sched.pin_handoff_failed`` /
  ``sched.prefill_finished`` notes for the remote request, and its workers'
  ``send`` machines (``finished_ok``: the worker received the pin).

A record kind an older log does not have is said to be "not logged". Times
are seconds after the earliest record of the run (wall clock, so engines on
different hosts line up; a monotonic stamp inside a record is moved onto the
wall clock by that record's own offset).

The typed records replay folds do not keep a log record's own fields; the few
lines a cause needs are read again from their files (``_Lines``), and only for
the engines a cause asks about.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from kvsm.eventlog.reader import Record
from kvsm.replay.evidence import (
    CAUSE_STATES,
    CLOSED_AT_SHUTDOWN,
    FAILURES,
    HANDOFF_FAILED,
    HELD,
    NOTE_EVENTS,
    PEER_DEAD_LOGGING,
    PIN_LOGGING,
    PINNED,
    PREFILL_FINISHED,
    Context,
    clip,
    inp,
    n_times,
    secs,
)
from kvsm.replay.model import Cause, Machine, StreamKey

__all__ = ["CAUSE_STATES", "NOTE_EVENTS", "RULES", "Cause", "explain"]


# --- the pieces a line is made of -----------------------------------------------


def _first_failure(m: Machine) -> Record | None:
    for r in m.records:
        if r.kind == "transition" and r.event in FAILURES:
            return r
    return None


def _armed(m: Machine, effect: str, before: Record) -> Record:
    """The last record before ``before`` that armed ``effect`` (else the first)."""
    found = m.records[0]
    for r in m.records:
        if r is before:
            break
        if effect in r.effects:
            found = r
    return found


def _claims_said(ctx: Context, m: Machine) -> str:
    """What the claim replies logged by a decode machine's process said about it."""
    c = ctx.claims(m.stream)
    req = m.req
    if not c.logged:
        return "claims answered: not logged"
    unknown, ok, expired = c.answers.get(req, (0, 0, 0))
    said = [f"{name} {n_times(n)}" for name, n in (("ok", ok), ("expired", expired)) if n]
    if unknown or not said:
        said.insert(0, f"unknown {n_times(unknown)}")
    text = "claims answered " + ", ".join(said) if unknown or ok or expired else "no claim answered"
    fails = c.failed.get(req)
    if fails:
        text += f", a claim failed {n_times(fails[0])} (last: {clip(fails[1], 160)})"
    return text


def _scheduler_said(ctx: Context, engine: str, req: str) -> str:
    """What the prefill scheduler's log says about ``req``: pinned, when, how."""
    if not ctx.streams_of(engine, "scheduler"):
        return f"no scheduler log of {engine} was given"
    notes = [r for r in ctx.notes.get((engine, req), ()) if r.role == "scheduler"]
    parts: list[str] = []
    for r in notes:
        if r.event == HELD:
            f = ctx.lines.fields(r)
            return (f"the decode engine held it for a next turn at {ctx.at(r)} ({f.get('blocks', '?')} blocks, "
                    f"{f.get('held_blocks', '?')} held of decoder_kv_hold_blocks {f.get('budget', '?')})")
        if r.event == PINNED:
            f = ctx.lines.fields(r)
            pinned = f.get("pinned_ns")
            when = ctx.at_mono(pinned, r) if type(pinned) is int else ctx.at(r)
            parts.append(f"the prefill scheduler pinned it at {when} (via {f.get('via', '?')})")
            break
    for r in notes:
        if r.event == PREFILL_FINISHED:
            f = ctx.lines.fields(r)
            if f.get("ok") is False:
                parts.append(f"the prefill scheduler finished it abnormally at {ctx.at(r)} ({f.get('status', '?')})")
                break
    failed = [ctx.lines.fields(r) for r in notes if r.event == HANDOFF_FAILED]
    if failed:
        # ("rank" is a header field: the scheduler's own.)
        ranks = sorted({str(f.get("worker_rank", f.get("tp_rank", "?"))) for f in failed})
        parts.append(f"handing it to worker rank {', '.join(ranks)} failed {n_times(len(failed))} "
                     f"(last: {clip(failed[-1].get('error'), 120)})")
    if parts:
        return ", ".join(parts)
    if ctx.logs(engine, PIN_LOGGING, "scheduler"):
        return "the prefill scheduler never pinned it"
    return "the prefill scheduler's pins: not logged"


def _send_said(ctx: Context, m: Machine, who: str) -> str:
    """What one prefill send machine shows: received (the pin), and how it ended."""
    got = next((r for r in m.records if r.kind == "transition" and r.event == "finished_ok"), None)
    last = m.records[-1]
    state = m.final_state
    streamed = next((r for r in m.records if r.kind == "transition" and r.event == "stream_asked"), None)
    if got is None and streamed is not None:  # streamed push: asked for while it computed
        return _stream_said(ctx, m, who, streamed)
    if got is None:
        if state == "prefilling" or state is None:
            return f"{who} had it still prefilling (never received the pin)"
        reason = inp(last, "reason", "") or ""
        why = f": {clip(reason, 80)}" if reason else ""
        return f"{who} released it unpinned at {ctx.at(last)} ({last.event}{why})"
    via = inp(got, "via", "") or ""
    text = f"{who} received it at {ctx.at(got)}" + (f" (via {via})" if via else "")
    released = next((r for r in m.records if r.kind == "transition" and r.event == "release_asked"), None)
    if released is not None:  # a hold, released over its budget
        return text + f", {clip(inp(released, 'reason', '') or 'released', 200)} (at {ctx.at(released)})"
    if state == "hold_expired":
        return text + f", its hold's time to live ran out at {ctx.at(last)}"
    if state == "expired":
        return text + f", its lease expired at {ctx.at(last)}"
    wrote = next((r for r in reversed(m.records) if r.kind == "transition" and r.event == "write_done"), None)
    if wrote is not None and inp(wrote, "ok", True) is False:  # push mode: its write did not complete
        text += f", its write ended at {ctx.at(wrote)} ({clip(inp(wrote, 'detail', '') or 'failed', 120)})"
    if state == "released":
        return text + f", released it at {ctx.at(last)} ({last.event})"
    return text + f", held it {state} at the end of its log"


def _stream_said(ctx: Context, m: Machine, who: str, asked: Record) -> str:
    """A streamed request's prefill side, asked to stream before its finish."""
    text = f"{who} streamed it from {ctx.at(asked)}"
    wrote = next((r for r in reversed(m.records) if r.kind == "transition" and r.event == "write_done"), None)
    if wrote is not None:
        ok = inp(wrote, "ok", True) is not False
        text += (f", its writes {'all landed' if ok else 'ended'} at {ctx.at(wrote)}"
                 + ("" if ok else f" ({clip(inp(wrote, 'detail', '') or 'failed', 120)})"))
    last = m.records[-1]
    if m.final_state in ("streaming", "streamed"):
        return text + f", held it {m.final_state} at the end of its log"
    return text + f", {m.final_state} at {ctx.at(last)} ({last.event})"


def _prefill_said(ctx: Context, remote: tuple[str, str] | None, scheduler: bool = True) -> str:
    """What the prefill engine's logs (scheduler and workers) show for a remote request."""
    if remote is None or not remote[0]:
        return "no remote known (never matched)"
    engine, req = remote
    if engine not in ctx.by_engine:
        return f"no log of prefill engine {engine} was given"
    parts = [_scheduler_said(ctx, engine, req)] if scheduler else []
    found = ctx.send_of(remote)
    workers = ctx.streams_of(engine, "worker")
    if not found and not workers:
        parts.append(f"no worker log of {engine} was given")
    elif len(workers) <= 1 and len(found) <= 1:
        if found:
            m = found[0]
            parts.append(_send_said(ctx, m, "its worker" if m.role == "worker" else f"its {m.role}"))
        else:
            parts.append("its worker never received it")
    else:  # tensor-parallel ranks: each says for itself
        by_rank = {(m.role, m.rank): m for m in found}
        told = [_send_said(ctx, by_rank.pop((k[1], k[2])), f"worker rank {k[2]}") if (k[1], k[2]) in by_rank
                else f"worker rank {k[2]} never received it" for k in sorted(workers, key=lambda k: k[2])]
        told += [_send_said(ctx, m, f"{m.role} rank {m.rank}") for m in by_rank.values()]
        parts.append(", ".join(told))
    return ", ".join(parts)


def _decode_said(ctx: Context, m: Machine) -> str:
    """Which decode requests read (claimed) a prefill request, and what they were answered."""
    readers = ctx.recv_of.get((m.engine_id, m.req), [])
    if not readers:
        if ctx.any_recv or ctx.stream_notes:
            return "no decode request in the given logs matched it"
        return "no decode log was given"
    told = []
    for d in readers:
        told.append(f"{d.engine_id} recv:{d.req} ({d.final_state}) matched it, {_claims_said(ctx, d)}")
    return "; ".join(told)


# --- the rules ----------------------------------------------------------------


def _handshake_timeout(ctx: Context, m: Machine, fail: Record | None) -> str:
    assert fail is not None
    start = _armed(m, "arm_handshake_timer", fail)
    return (f"handshake timed out after {secs(fail.t_mono_ns - start.t_mono_ns)}: "
            f"{_claims_said(ctx, m)}; {_prefill_said(ctx, m.remote)}")


def _transfer_timeout(ctx: Context, m: Machine, fail: Record | None) -> str:
    assert fail is not None
    start = _armed(m, "arm_transfer_timer", fail)
    what = "writes" if start.event == "writes_asked" else "reads"  # (push mode: the prefill side writes)
    blocks = inp(start, "num_blocks", 0) if start.event in ("reads_posted", "writes_asked") else 0
    verb = "asked" if what == "writes" else "posted"
    posted = (f"{what} of {blocks:,} block(s) {verb} at {ctx.at(start)}" if blocks
              else f"{what} {verb} at {ctx.at(start)}")
    return (f"transfer timed out after {secs(fail.t_mono_ns - start.t_mono_ns)}: {posted}; "
            f"{_prefill_said(ctx, m.remote, scheduler=False)}")


def _other_timeout(ctx: Context, m: Machine, fail: Record | None) -> str:
    assert fail is not None
    what = inp(fail, "what", "?")
    return (f"{what} timer fired after {secs(fail.t_mono_ns - m.records[0].t_mono_ns)} in {fail.src}; "
            f"{_prefill_said(ctx, m.remote, scheduler=False)}")


def _peer_dead(ctx: Context, m: Machine, fail: Record | None) -> str:
    assert fail is not None
    peer = str(inp(fail, "peer", "") or "?")
    engine, _, address = peer.partition("@")
    # The note that says why: from the failed request's own log, the last one
    # before the failure (else its first after); from the engine's other logs,
    # the last one before it on the wall clock (else their last).
    same, times, other = ctx.peer_dead_said(m.engine_id, m.stream, address, engine)
    said: dict[str, Any] | None = None
    if same:
        if times is not None:
            i = bisect_right(times, fail.t_mono_ns)
            said = same[i - 1][1] if i else same[-1][1]
        else:  # not in time order: the last one before it, by a scan
            said = next((f for r, f in reversed(same) if r.t_mono_ns <= fail.t_mono_ns), same[-1][1])
    elif other:
        said = next((f for r, f in reversed(other) if r.t_wall_ns <= fail.t_wall_ns), other[-1][1])
    if said is not None:
        return f"peer {peer} dead: {clip(said.get('why', '?'))}"
    if ctx.logs(m.engine_id, PEER_DEAD_LOGGING):
        return f"peer {peer} dead (no worker.peer_dead note names it)"
    return f"peer {peer} dead (why: not logged)"


def _error(ctx: Context, m: Machine, fail: Record | None) -> str:
    assert fail is not None
    kind = inp(fail, "kind", "?")
    detail = inp(fail, "detail", "")
    line = f"error {kind}" + (f": {clip(detail)}" if detail else "")
    if kind == "lease_expired":
        said = _prefill_said(ctx, m.remote)
        if said.startswith("the decode engine held it"):  # a next turn's read of a decode engine's hold
            matched = next((r for r in m.records if r.kind == "transition" and r.event == "matched"), None)
            tokens = inp(matched, "num_tokens", 0) if matched is not None else 0
            engine, req = m.remote or ("?", "?")
            return (f"{tokens:,} held tokens recomputed here (kv_load_failure_policy recompute): the hold of "
                    f"request {req} on {engine} was gone: {said}")
        line += f"; {said}"
    return line


def _writes_stopped(ctx: Context, m: Machine, fail: Record | None) -> str:
    """Push mode: the writes ended without all landing (each failed or was refused),
    or their deadline passed."""
    assert fail is not None
    asked = _armed(m, "arm_transfer_timer", fail)
    return (f"the writes asked at {ctx.at(asked)} did not land: {clip(inp(fail, 'why', '') or '?')} "
            f"(at {ctx.at(fail)}); {_prefill_said(ctx, m.remote, scheduler=False)}")


def _internal_error(ctx: Context, m: Machine, fail: Record | None) -> str:
    assert fail is not None
    detail = inp(fail, "detail", "")
    return f"internal error in {inp(fail, 'where', '?')}" + (f": {clip(detail)}" if detail else "")


def _failed_unexplained(ctx: Context, m: Machine, fail: Record | None) -> str:
    last = m.records[-1]
    return f"failed on {last.event} at {ctx.at(last)} (no failure event in its log)"


def _lease_expired(ctx: Context, m: Machine, fail: Record | None) -> str:
    last = m.records[-1]
    got = next((r for r in m.records if r.kind == "transition" and r.event == "finished_ok"), None)
    if got is None:
        return f"expired at {ctx.at(last)} without a recorded pin; {_decode_said(ctx, m)}"
    pinned = inp(got, "pinned_ns", 0) or 0
    start_mono = min(pinned, got.t_mono_ns) if pinned > 0 else got.t_mono_ns
    return (f"lease expired unread after {secs(last.t_mono_ns - start_mono)} "
            f"(pinned at {ctx.at_mono(start_mono, got)}, expired at {ctx.at(last)}); {_decode_said(ctx, m)}")


def _closed_at_shutdown(ctx: Context, m: Machine, fail: Record | None) -> str:
    """A clean stop let it go (terminal, not a violation): what it was doing then,
    and for a pin still awaiting its reader, whether a decode request had come."""
    closed = next((r for r in reversed(m.records) if r.kind == "transition" and r.dst == CLOSED_AT_SHUTDOWN
                   and r.src != CLOSED_AT_SHUTDOWN), m.records[-1])
    state = closed.src
    since = next((r for r in reversed(m.records) if r.t_mono_ns <= closed.t_mono_ns and r is not closed
                  and (r.kind == "create" or r.dst == state)), m.records[0])
    line = f"closed at shutdown at {ctx.at(closed)}: its process stopped cleanly while it was {state} " \
           f"(since {ctx.at(since)})"
    if m.lifecycle == "send":
        if state == "awaiting_pull":
            line += f", its pinned blocks freed; {_decode_said(ctx, m)}"
    elif m.matched is not None:
        line += "; " + _prefill_said(ctx, m.remote, scheduler=False)
    return line


def _stuck(ctx: Context, m: Machine, fail: Record | None) -> str:
    state = m.final_state
    last = m.records[-1]
    since = m.records[0]
    for r in reversed(m.records):
        if r.kind == "create" or (r.dst == state and r.src != state and r.kind == "transition"):
            since = r
            break
    stream = m.stream
    recs = ctx.streams.get(stream) or [last]
    marker = ctx.shutdowns.get(stream)
    if marker is not None and marker.clean is True and marker is recs[-1]:
        live = marker.live if type(marker.live) is dict else {}
        listed = live.get(m.lifecycle, {}).get(m.req) if type(live.get(m.lifecycle)) is dict else None
        ending = (f"its clean shutdown at {ctx.at(marker)} does not list it" if listed is None
                  else f"its clean shutdown at {ctx.at(marker)} lists it as {listed!r}")
    else:
        ending = f"its log ends at {ctx.at(recs[-1])} with no clean shutdown"
    line = f"stuck in {state} since {ctx.at(since)}: last event {last.event} at {ctx.at(last)}, {ending}"
    extra = _STUCK_DETAIL.get((m.lifecycle, state or ""))
    if extra is not None:
        line += "; " + extra(ctx, m)
    elif m.lifecycle == "recv":
        fail = _first_failure(m)
        if fail is not None:  # failing / aborting after a failure: say which
            line += "; after: " + _EXPLAIN[_failure_rule(fail)](ctx, m, fail)
        elif m.matched is not None:
            line += "; " + _prefill_said(ctx, m.remote, scheduler=False)
    return line


_STUCK_DETAIL: dict[tuple[str, str], Callable[[Context, Machine], str]] = {
    ("send", "prefilling"): lambda ctx, m: _scheduler_said(ctx, m.engine_id, m.req),
    ("send", "awaiting_pull"): _decode_said,
    ("recv", "pending_handshake"): lambda ctx, m: f"{_claims_said(ctx, m)}; "
                                                  f"{_prefill_said(ctx, m.remote)}",
}
# Reads posted right behind the claims: stuck there, the claims are what it waits for.
_STUCK_DETAIL[("recv", "reading_unclaimed")] = _STUCK_DETAIL[("recv", "read_unclaimed")] = (
    _STUCK_DETAIL[("recv", "pending_handshake")])
# A read's notification before the finish: what the scheduler said of the pin.
_STUCK_DETAIL[("send", "read_early")] = _STUCK_DETAIL[("send", "prefilling")]

# rule -> explainer(context, machine, the deciding record); _rule_of picks the rule.
_EXPLAIN: dict[str, Callable[[Context, Machine, Record | None], str]] = {
    "handshake_timeout": _handshake_timeout,
    "transfer_timeout": _transfer_timeout,
    "timeout": _other_timeout,
    "peer_dead": _peer_dead,
    "error": _error,
    "writes_stopped": _writes_stopped,
    "internal_error": _internal_error,
    "failed": _failed_unexplained,
    "lease_expired": _lease_expired,
    "closed_at_shutdown": _closed_at_shutdown,
    "stuck": _stuck,
}
RULES = tuple(_EXPLAIN)


def _rule_of(m: Machine, fail: Record | None) -> str:
    if not m.terminal:
        return "stuck"
    if m.final_state == "expired":
        return "lease_expired"
    if m.final_state == CLOSED_AT_SHUTDOWN:
        return "closed_at_shutdown"
    return _failure_rule(fail)


def _failure_rule(fail: Record | None) -> str:
    if fail is None:
        return "failed"
    if fail.event == "timeout":
        what = inp(fail, "what", "")
        return f"{what}_timeout" if f"{what}_timeout" in _EXPLAIN else "timeout"
    return fail.event


def explain(todo: Sequence[Machine], by_req: dict[StreamKey, dict[str, dict[str, Machine]]],
            notes: dict[tuple[str, str], list[Record]], stream_notes: dict[StreamKey, list[Record]],
            streams: dict[StreamKey, list[Record]], log_events: dict[StreamKey, set[str]],
            shutdowns: dict[StreamKey, Record]) -> list[Cause]:
    """One ``Cause`` per machine of ``todo`` (failed, expired or stuck), in its order."""
    if not todo:
        return []
    ctx = Context(todo, by_req, notes, stream_notes, streams, log_events, shutdowns)
    out: list[Cause] = []
    for m in todo:
        fail = None if m.lifecycle != "recv" else _first_failure(m)
        rule = _rule_of(m, fail)
        try:
            line = _EXPLAIN[rule](ctx, m, fail)
        except Exception as e:  # noqa: BLE001 - a damaged log must not take the report down
            line = f"(cannot explain: {type(e).__name__}: {clip(e, 120)})"
        out.append(Cause(*m.stream, m.lifecycle, m.req, m.final_state, rule, line))
    return out
