"""What the logs hold that a cause line reads, indexed once (``Context``), and
the formatting the lines share. ``kvsm.replay.causes`` holds the rules that
read it; apart so that each stays one concern (the index, the rules).

The typed records replay folds do not keep a log record's own fields; the few
lines a cause needs are read again from their files (``Lines``), and only for
the engines a cause asks about.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsm.eventlog.reader import Record, read_back
from kvsm.lifecycle.events import Event
from kvsm.replay.model import Machine, StreamKey

# Final states whose machines get a cause line (besides every non-terminal one).
# (closed at shutdown: a clean stop let it go; terminal, and its line says so.)
CLOSED_AT_SHUTDOWN = "closed_at_shutdown"
CAUSE_STATES = frozenset({"failed", "expired", CLOSED_AT_SHUTDOWN})
# Diagnostic records with no request that causes read (collected by replay's fold).
CLAIMS_ANSWERED = "worker.claims_answered"
CLAIM_FAILED = "worker.claim_failed"
PEER_DEAD = "worker.peer_dead"
STREAM_KEY_NOTE = "worker.stream_key"  # a streamed prefill request's join key (kvsm.worker.push_stream)
NOTE_EVENTS = frozenset({CLAIMS_ANSWERED, CLAIM_FAILED, PEER_DEAD})
PINNED = "sched.pinned"
HELD = "sched.held"  # a decode engine's hold for a next turn (bidirectional_kv_xfer)
HANDOFF_FAILED = "sched.pin_handoff_failed"
PREFILL_FINISHED = "sched.prefill_finished"
# A scheduler log that writes either has the pin records (a newer scheduler).
PIN_LOGGING = frozenset({PINNED, "sched.workers_connected"})
PEER_DEAD_LOGGING = frozenset({PEER_DEAD})
FAILURES = ("error", "timeout", "peer_dead", "internal_error", "writes_stopped")
ANSWERS = ("unknown", "ok", "expired")
CLIP = 200  # characters of an error's detail kept in a line
NONE: dict[str, Any] = {}


# --- formatting ---------------------------------------------------------------


def n_times(n: int) -> str:
    return f"{n:,} time" if n == 1 else f"{n:,} times"


def secs(ns: int) -> str:
    s = ns / 1e9
    return f"{s:.1f} s" if abs(s) >= 1 else f"{s:.3f} s"


def clip(value: Any, n: int = CLIP) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def inp(r: Record, name: str, default: Any = None) -> Any:
    value = r.input
    if isinstance(value, Event):
        return getattr(value, name, default)
    return value.get(name, default) if type(value) is dict else default


class Lines:
    """A log record's own fields, read again from its file (the typed records
    keep only the header): one read per file, one parse per record asked for."""

    def __init__(self) -> None:
        self._files: dict[str, list[bytes] | None] = {}
        self._fields: dict[int, dict[str, Any]] = {}

    def fields(self, r: Record, keep: bool = True) -> dict[str, Any]:
        """``r``'s line as written (``{}`` if it is gone or changed since);
        ``keep``: remember the parse for the next caller."""
        got = self._fields.get(id(r))
        if got is not None:
            return got
        d = read_back(r, self._files) or {}  # gone or changed since: nothing beyond the header
        if keep:
            self._fields[id(r)] = d
        return d


@dataclass
class Claims:
    """What one decode engine's claim replies said about each of its requests."""

    answers: dict[str, list[int]]  # local req -> [unknown, ok, expired]
    failed: dict[str, list[Any]]  # local req -> [count, last error]
    logged: bool  # the engine's logs have claim records at all


# --- what the logs hold, indexed once -----------------------------------------


class Context:
    def __init__(self, todo: Sequence[Machine], by_req: dict[StreamKey, dict[str, dict[str, Machine]]],
                 notes: dict[tuple[str, str], list[Record]], stream_notes: dict[StreamKey, list[Record]],
                 streams: dict[StreamKey, list[Record]], log_events: dict[StreamKey, set[str]],
                 shutdowns: dict[StreamKey, Record]) -> None:
        self.notes = notes
        self.stream_notes = stream_notes
        self.streams = streams
        self.log_events = log_events
        self.shutdowns = shutdowns
        self.lines = Lines()
        self.t0 = min((recs[0].t_wall_ns for recs in streams.values() if recs), default=0)
        self.by_engine: dict[str, list[StreamKey]] = {}
        for key in streams:
            self.by_engine.setdefault(key[0], []).append(key)
        self._claims: dict[StreamKey, Claims] = {}
        self._peer_dead: dict[str, dict[Any, list[tuple[Record, dict[str, Any]]]]] = {}
        self._peer_dead_said: dict[tuple[Any, ...], Any] = {}
        self._streams_of: dict[tuple[str, str | None], list[StreamKey]] = {}
        self._logs: dict[tuple[str, frozenset[str], str | None], bool] = {}
        self.by_req = by_req
        self.any_recv = any(d.get("recv") for d in by_req.values())
        # Streamed push: a decode request names its prefill request by the router's join
        # key; the prefill worker's ``worker.stream_key`` note says which request that is.
        self.stream_reqs: dict[tuple[str, str], str] = {}
        for (engine, req), recs in notes.items():
            for r in recs:
                if r.event == STREAM_KEY_NOTE:
                    join = self.lines.fields(r).get("key")
                    if isinstance(join, str):
                        self.stream_reqs[(engine, join)] = req
        # The decode requests that read from the failed prefill ones: one pass over
        # the recv machines, only when a send machine needs it.
        want = {(m.engine_id, m.req) for m in todo if m.lifecycle == "send"}
        self.recv_of: dict[tuple[str, str], list[Machine]] = {}
        if want:
            recv_of = self.recv_of
            for lifecycles in by_req.values():
                for m in lifecycles.get("recv", NONE).values():
                    matched = m.matched
                    if matched is None:
                        continue
                    given = matched.input
                    try:  # the decoded Matched event, as nearly always
                        remote = (given.remote_engine, given.remote_req)
                    except AttributeError:
                        remote = (inp(matched, "remote_engine", ""), inp(matched, "remote_req", ""))
                    remote = (remote[0], self.stream_reqs.get(remote, remote[1]))
                    if remote in want:
                        recv_of.setdefault(remote, []).append(m)

    def send_of(self, remote: tuple[str, str]) -> list[Machine]:
        """The send machines of a prefill request, one per log of its engine holding it."""
        found = []
        remote = (remote[0], self.stream_reqs.get(remote, remote[1]))
        for key in self.by_engine.get(remote[0], ()):
            m = self.by_req.get(key, NONE).get("send", NONE).get(remote[1])
            if m is not None:
                found.append(m)
        return found

    def at(self, r: Record) -> str:
        return f"+{(r.t_wall_ns - self.t0) / 1e9:.3f} s"

    def at_mono(self, mono_ns: int, ref: Record) -> str:
        """A monotonic stamp of ``ref``'s process, on the run's clock."""
        return f"+{(mono_ns + ref.t_wall_ns - ref.t_mono_ns - self.t0) / 1e9:.3f} s"

    def streams_of(self, engine: str, role: str | None = None) -> list[StreamKey]:
        got = self._streams_of.get((engine, role))
        if got is None:
            got = self._streams_of[(engine, role)] = [
                k for k in self.by_engine.get(engine, ()) if role is None or k[1] == role]
        return got

    def logs(self, engine: str, events: frozenset[str], role: str | None = None) -> bool:
        """Whether any log of ``engine`` (of ``role``) holds a record of one of ``events``."""
        got = self._logs.get((engine, events, role))
        if got is None:
            got = self._logs[(engine, events, role)] = any(
                not events.isdisjoint(self.log_events.get(k, ())) for k in self.streams_of(engine, role))
        return got

    def peer_dead_said(self, engine_id: str, stream: StreamKey, address: str, engine: str,
                       ) -> tuple[list[tuple[Record, dict[str, Any]]], list[int] | None,
                                  list[tuple[Record, dict[str, Any]]]]:
        """The ``worker.peer_dead`` notes of ``engine_id``'s logs about the peer
        at ``address`` (of ``engine``, when named): those of ``stream``, their
        monotonic times (None unless in order) and those of its other logs."""
        key = (engine_id, stream, address, engine)
        got = self._peer_dead_said.get(key)
        if got is None:
            mine: list[tuple[Record, dict[str, Any]]] = []
            others: list[tuple[Record, dict[str, Any]]] = []
            for r, f in self.peer_dead_notes(engine_id).get(address, ()):
                if engine and f.get("engine") not in (engine, None):
                    continue
                (mine if stream_of(r) == stream else others).append((r, f))
            mono = [r.t_mono_ns for r, _ in mine]
            times: list[int] | None = None if any(a > b for a, b in zip(mono, mono[1:])) else mono
            got = self._peer_dead_said[key] = (mine, times, others)
        return got

    def peer_dead_notes(self, engine: str) -> dict[Any, list[tuple[Record, dict[str, Any]]]]:
        """The ``worker.peer_dead`` notes of ``engine``'s logs, with their fields,
        by the peer address they name, in log order (indexed once per engine:
        a run with a dead peer fails thousands of requests on it)."""
        got = self._peer_dead.get(engine)
        if got is None:
            got = self._peer_dead[engine] = {}
            for k in self.streams_of(engine):
                for r in self.stream_notes.get(k, ()):
                    if r.event == PEER_DEAD:
                        f = self.lines.fields(r)
                        try:
                            got.setdefault(f.get("peer"), []).append((r, f))
                        except TypeError:  # an unhashable 'peer': it names no address
                            pass
        return got

    def claims(self, stream: StreamKey) -> Claims:
        """The claim replies one decode process logged (each worker rank claims for itself)."""
        got = self._claims.get(stream)
        if got is not None:
            return got
        answers: dict[str, list[int]] = {}
        failed: dict[str, list[Any]] = {}
        logged = False
        for r in self.stream_notes.get(stream, ()):
            if r.event == CLAIMS_ANSWERED:
                logged = True
                f = self.lines.fields(r, keep=False)  # read once, here: there may be many
                for i, name in enumerate(ANSWERS):
                    reqs = f.get(name)
                    if type(reqs) is list:  # one reply: the requests it answered so
                        for req in reqs:
                            if type(req) is str:
                                answers.setdefault(req, [0, 0, 0])[i] += 1
                    elif type(reqs) is dict:  # aggregated replies: request -> how many times
                        for req, n in reqs.items():
                            if type(n) is int:
                                answers.setdefault(req, [0, 0, 0])[i] += n
            elif r.event == CLAIM_FAILED:
                logged = True
                f = self.lines.fields(r)
                reqs = f.get("reqs")
                for req in reqs if type(reqs) is list else ():
                    if type(req) is str:
                        entry = failed.setdefault(req, [0, None])
                        entry[0] += 1
                        worker = f.get("worker")  # (one port per engine: which worker it asked)
                        entry[1] = f.get("error") if not worker else f"{f.get('error')}, asking {worker}"
        got = self._claims[stream] = Claims(answers, failed, logged)
        return got


def stream_of(r: Record) -> StreamKey:
    return (r.engine_id, r.role, r.rank, r.pid)
