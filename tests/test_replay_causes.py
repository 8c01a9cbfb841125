"""Replay names the cause of every failed or stuck request, from the logs of both engines.

Each test writes a small run by hand: a decode worker's log (its recv machines,
its ``worker.claims_answered`` / ``worker.peer_dead`` / ``worker.claim_failed``
notes), a prefill scheduler's log (``sched.pinned``...) and a prefill worker's
log (its send machines), on one virtual clock started at 0, so every time in a
line is the clock's time: ``+0.120 s`` is ``clock.set(120 * MS)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvsm.eventlog import EventLog
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import LifecycleTracker
from kvsm.lifecycle.table import RECV, SEND
from kvsm.replay import analyse, main, render_text
from kvsm.replay.causes import RULES
from kvsm.replay.render import story

MS = 1_000_000
S = 1_000_000_000
PEER = "tcp://127.0.0.1:15600"


class Run:
    """The logs of one run: ``log(name)`` opens (once) the log of an engine's
    process; ``recv``/``send`` are the trackers of the worker logs."""

    def __init__(self, tmp: Path, stack: ExitStack, logs: tuple[str, ...]) -> None:
        self.tmp = tmp
        self.stack = stack
        self.clock = VirtualClock()
        self.logs: dict[str, EventLog] = {}
        self.trackers: dict[str, LifecycleTracker] = {}
        self.blocks = 0  # the last block id handed out
        for name in logs:  # opened at +0: the run's earliest records are their log_start
            engine, _, role = name.partition("/")
            self.log(engine, role or "worker")

    def log(self, engine: str, role: str = "worker", rank: int = 0) -> EventLog:
        name = f"{engine}.{role}{rank}"
        if name not in self.logs:
            self.logs[name] = self.stack.enter_context(
                EventLog(self.tmp / f"{name}.jsonl", role=role, engine_id=engine, rank=rank, clock=self.clock))
        return self.logs[name]

    def tracker(self, engine: str, spec=RECV, rank: int = 0) -> LifecycleTracker:
        name = f"{engine}.{spec.name}{rank}"
        if name not in self.trackers:
            self.trackers[name] = LifecycleTracker(spec, self.clock,
                                                   listener=self.log(engine, "worker", rank).record_outcome)
        return self.trackers[name]

    def at(self, ms: float) -> Run:
        self.clock.set(int(ms * MS))
        return self

    # -- the decode side ---------------------------------------------------

    def decode(self, req: str, remote_req: str, *, engine: str = "decode-0", remote: str = "prefill-0",
               to: str = "pending_handshake") -> LifecycleTracker:
        t = self.tracker(engine)
        t.create(req)
        t.apply(ev.Matched(req=req, num_tokens=32, remote_engine=remote, remote_req=remote_req,
                           remote_host="127.0.0.1", remote_port=15600))
        if to != "awaiting_blocks":
            self.blocks += 2
            t.apply(ev.Allocated(req=req, block_ids=(self.blocks - 1, self.blocks)))
        return t

    def claims(self, n: int, *, engine: str = "decode-0", **answers: list[str]) -> None:
        for _ in range(n):
            self.log(engine).emit("log", "worker.claims_answered", None, peer=PEER, engine="prefill-0", fetch=False,
                                  rtt_us=120, ok=answers.get("ok", []), unknown=answers.get("unknown", []),
                                  expired=answers.get("expired", []))

    # -- the prefill side --------------------------------------------------

    def pinned(self, req: str, via: str = "next_step", *, engine: str = "prefill-0", workers: int = 1) -> None:
        now = self.clock.monotonic_ns()
        self.log(engine, "scheduler").emit("log", "sched.pinned", req, block_ids=[5, 6], pinned_ns=now,
                                           lease_deadline_ns=now + 30 * S, via=via, workers=workers)

    def send(self, req: str, *, engine: str = "prefill-0", rank: int = 0, pin: bool = True,
             pinned_ms: float | None = None, via: str = "local_socket") -> LifecycleTracker:
        t = self.tracker(engine, SEND, rank)
        t.create(req)
        if pin:
            pinned = self.clock.monotonic_ns() if pinned_ms is None else int(pinned_ms * MS)
            t.apply(ev.FinishedOk(req=req, block_ids=(5, 6), lease_ns=30 * S, pinned_ns=pinned, via=via))
        return t


BOTH = ("decode-0", "prefill-0/scheduler", "prefill-0")


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``with run() as r:`` writes the logs (those of ``BOTH`` opened at +0, the
    rest when first written to) into ``tmp_path``, in time order."""
    @contextmanager
    def make(logs: tuple[str, ...] = BOTH) -> Iterator[Run]:
        with ExitStack() as stack:
            yield Run(tmp_path, stack, logs)
    yield make


def report_of(tmp: Path):
    return analyse(sorted(tmp.glob("*.jsonl")))


def cause(report, req: str):
    found = [c for c in report.causes if c.req == req]
    assert len(found) == 1, [str(c) for c in report.causes]
    return found[0]


def _handshake_times_out(r: Run) -> None:
    """d-1 (waiting on p-1 from +0.100 s) is answered unknown 1,250 times from
    +0.200 s; its handshake times out at +5.100 s."""
    r.at(200).claims(1_250, unknown=["d-1", "d-2"])
    r.claims(3, ok=["d-2"])
    r.at(5_100).tracker("decode-0").apply(ev.Timeout(req="d-1", what="handshake"))


# --- handshake timeout ----------------------------------------------------------


def test_handshake_timeout_pinned_never_received(run, tmp_path: Path) -> None:
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.at(120).pinned("p-1", via="next_step")
        _handshake_times_out(r)
    report = report_of(tmp_path)
    c = cause(report, "d-1")
    assert (c.engine_id, c.role, c.rank, c.lifecycle, c.final_state, c.rule) == (
        "decode-0", "worker", 0, "recv", "failed", "handshake_timeout")
    assert c.line == ("handshake timed out after 5.0 s: claims answered unknown 1,250 times; "
                      "the prefill scheduler pinned it at +0.120 s (via next_step), its worker never received it")
    assert report.exit_code == 0  # a failed request is a legal outcome, not a violation


@pytest.mark.parametrize(("prefill_worker", "want"), [
    ("received", "its worker received it at +0.130 s (via local_socket), held it awaiting_pull at the end of its log"),
    ("prefilling", "its worker had it still prefilling (never received the pin)"),
    ("released", "its worker received it at +0.130 s (via local_socket), released it at +5.200 s (remote_abandoned)"),
])
def test_handshake_timeout_says_what_the_prefill_worker_did(run, tmp_path: Path, prefill_worker: str,
                                                            want: str) -> None:
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.at(120).pinned("p-1", via="in_process")
        r.at(130).send("p-1", pin=prefill_worker != "prefilling")
        _handshake_times_out(r)
        if prefill_worker == "released":
            r.at(5_200).tracker("prefill-0", SEND).apply(ev.RemoteAbandoned(req="p-1", reason="timed out"))
    c = cause(report_of(tmp_path), "d-1")
    assert c.line.endswith("; the prefill scheduler pinned it at +0.120 s (via in_process), " + want), c.line


def test_handshake_timeout_with_older_logs_says_not_logged(run, tmp_path: Path) -> None:
    """No sched.pinned, no workers_connected, no claim records: say so."""
    with run() as r:
        r.log("prefill-0", "scheduler").emit("log", "sched.params_ignored", "p-9", reason="x")
        r.at(100).decode("d-1", "p-1")
        r.at(5_100).tracker("decode-0").apply(ev.Timeout(req="d-1", what="handshake"))
    assert cause(report_of(tmp_path), "d-1").line == (
        "handshake timed out after 5.0 s: claims answered: not logged; "
        "the prefill scheduler's pins: not logged, its worker never received it")


def test_handshake_timeout_never_pinned_and_no_claim_answered(run, tmp_path: Path) -> None:
    with run() as r:
        r.log("prefill-0", "scheduler").emit("log", "sched.workers_connected", None, workers=1, via="local_socket",
                                             ranks=[0], pin_via_step=False)
        r.at(100).decode("d-1", "p-1")
        r.claims(2, ok=["d-7"])  # the engine logs its claims; none was about d-1
        r.at(150).log("decode-0").emit("log", "worker.claim_failed", None, peer=PEER, engine="prefill-0",
                                       fetch=True, error="timeout: no reply in 5.0 s", reqs=["d-1"])
        r.at(5_100).tracker("decode-0").apply(ev.Timeout(req="d-1", what="handshake"))
    assert cause(report_of(tmp_path), "d-1").line == (
        "handshake timed out after 5.0 s: no claim answered, a claim failed 1 time (last: timeout: no reply in 5.0 s); "
        "the prefill scheduler never pinned it, its worker never received it")


def test_handshake_timeout_without_prefill_logs(run, tmp_path: Path) -> None:
    with run(("decode-0",)) as r:
        r.at(100).decode("d-1", "p-1")
        _handshake_times_out(r)
    assert cause(report_of(tmp_path), "d-1").line == (
        "handshake timed out after 5.0 s: claims answered unknown 1,250 times; "
        "no log of prefill engine prefill-0 was given")


def test_handshake_timeout_handoff_failed_and_tensor_parallel_workers(run, tmp_path: Path) -> None:
    with run() as r:
        r.log("prefill-0", rank=1)
        r.at(100).decode("d-1", "p-1")
        r.at(120).pinned("p-1", via="next_step", workers=2)
        r.log("prefill-0", "scheduler").emit("log", "sched.pin_handoff_failed", "p-1", worker_rank=1,
                                             error="connection refused")
        r.at(130).send("p-1", rank=0, via="local_socket")
        r.claims(1, ok=["d-1"])  # once ok, too late
        _handshake_times_out(r)
    report = report_of(tmp_path)
    line = cause(report, "d-1").line
    assert line == ("handshake timed out after 5.0 s: claims answered unknown 1,250 times, ok 1 time; "
                    "the prefill scheduler pinned it at +0.120 s (via next_step), handing it to worker rank 1 failed "
                    "1 time (last: connection refused), worker rank 0 received it at +0.130 s (via local_socket), "
                    "held it awaiting_pull at the end of its log, worker rank 1 never received it")
    # Rank 0's pin, never read, is itself stuck: who matched it, and what its claims were answered.
    held = cause(report, "p-1")
    assert (held.engine_id, held.rank, held.final_state) == ("prefill-0", 0, "awaiting_pull")
    assert held.line == ("stuck in awaiting_pull since +0.130 s: last event finished_ok at +0.130 s, its log ends "
                         "at +0.130 s with no clean shutdown; decode-0 recv:d-1 (failed) matched it, claims answered "
                         "unknown 1,250 times, ok 1 time")


# --- peer dead, errors, internal errors -------------------------------------------


@pytest.mark.parametrize("noted", [True, False])
def test_peer_dead_names_the_why(run, tmp_path: Path, noted: bool) -> None:
    with run() as r:
        r.log("prefill-0")
        r.at(100).decode("d-1", "p-1")
        if noted:
            r.at(150).log("decode-0").emit("log", "worker.peer_dead", None, peer="tcp://127.0.0.1:9",
                                           engine="prefill-0", why="an older outage", retry_in_s=0.5, failures=1)
            r.log("decode-0").emit("log", "worker.peer_dead", None, peer=PEER, engine="prefill-0",
                                   why=f"connection refused by {PEER}", retry_in_s=1.0, failures=2)
        r.tracker("decode-0").apply(ev.PeerDead(req="d-1", peer=f"prefill-0@{PEER}"))
    c = cause(report_of(tmp_path), "d-1")
    assert c.rule == "peer_dead"
    assert c.line == (f"peer prefill-0@{PEER} dead: connection refused by {PEER}" if noted
                      else f"peer prefill-0@{PEER} dead (why: not logged)")


@pytest.mark.parametrize("kind", ["incompatible", "engine_mismatch", "transfer", "bad_params", "tp_mismatch"])
def test_error_kind_and_clipped_detail(run, tmp_path: Path, kind: str) -> None:
    detail = f"{PEER}: " + "x" * 400
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.tracker("decode-0").apply(ev.Error(req="d-1", kind=kind, detail=detail))
    c = cause(report_of(tmp_path), "d-1")
    assert c.rule == "error"
    assert c.line == f"error {kind}: {detail[:197]}..."


def test_lease_expired_error_says_what_the_prefill_side_did(run, tmp_path: Path) -> None:
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.at(120).pinned("p-1")
        r.send("p-1")
        r.at(30_120).tracker("prefill-0", SEND).apply(ev.LeaseExpired(req="p-1"))
        r.at(30_200).tracker("decode-0").apply(ev.Error(req="d-1", kind="lease_expired", detail="p-1 no longer pinned"))
    report = report_of(tmp_path)
    assert cause(report, "d-1").line == (
        "error lease_expired: p-1 no longer pinned; the prefill scheduler pinned it at +0.120 s (via next_step), "
        "its worker received it at +0.120 s (via local_socket), its lease expired at +30.120 s")


def test_internal_error(run, tmp_path: Path) -> None:
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.tracker("decode-0").apply(ev.InternalError(req="d-1", where="claim result", detail="KeyError: 'p-1'"))
    c = cause(report_of(tmp_path), "d-1")
    assert (c.rule, c.line) == ("internal_error", "internal error in claim result: KeyError: 'p-1'")


def test_transfer_timeout(run, tmp_path: Path) -> None:
    with run() as r:
        t = r.at(100).decode("d-1", "p-1")
        r.at(120).send("p-1")
        t.apply(ev.HandshakeOk(req="d-1", remote_engine="prefill-0"))
        r.at(200)
        t.apply(ev.ReadsPosted(req="d-1", num_blocks=2, num_descs=4))
        r.at(5_200)
        t.apply(ev.Timeout(req="d-1", what="transfer"))
        t.apply(ev.ReadsQuiesced(req="d-1"))
    c = cause(report_of(tmp_path), "d-1")
    assert (c.rule, c.final_state) == ("transfer_timeout", "failed")
    assert c.line == ("transfer timed out after 5.0 s: reads of 2 block(s) posted at +0.200 s; "
                      "its worker received it at +0.120 s (via local_socket), held it awaiting_pull at the end of "
                      "its log")


def _pushed(r: Run) -> LifecycleTracker:
    """d-1 in push mode: claimed at +0.100 s, p-1 pinned at +0.120 s, the write asked at +0.200 s."""
    t = r.tracker("decode-0")
    r.at(100)
    t.create("d-1")
    t.apply(ev.Matched(req="d-1", num_tokens=32, remote_engine="prefill-0", remote_req="p-1",
                       remote_host="127.0.0.1", remote_port=15600, push=True))
    t.apply(ev.Allocated(req="d-1", block_ids=(1, 2)))
    s = r.at(120).send("p-1")
    t.apply(ev.HandshakeOk(req="d-1", remote_engine="prefill-0"))
    r.at(200)
    t.apply(ev.WritesAsked(req="d-1", num_blocks=2, deadline_wall_ns=5_200 * MS))
    s.apply(ev.WriteAsked(req="p-1", reader="decode-0", num_blocks=2))
    return t


def test_push_writes_not_over_by_their_deadline(run, tmp_path: Path) -> None:
    with run() as r:
        t = _pushed(r)
        r.at(5_200).tracker("prefill-0", SEND).apply(ev.WriteDone(
            req="p-1", reader="decode-0", ok=False, detail="cancelled in flight at its deadline"))
        r.at(5_700)
        t.apply(ev.WritesStopped(req="d-1", why="the deadline every write was bound by passed"))
    c = cause(report_of(tmp_path), "d-1")
    assert (c.rule, c.final_state) == ("writes_stopped", "failed")
    assert c.line == ("the writes asked at +0.200 s did not land: the deadline every write was bound by passed "
                      "(at +5.700 s); its worker received it at +0.120 s (via local_socket), its write ended at "
                      "+5.200 s (cancelled in flight at its deadline), released it at +5.200 s (write_done)")


def test_push_transfer_timeout_names_the_writes(run, tmp_path: Path) -> None:
    with run() as r:
        t = _pushed(r)
        r.at(5_200)
        t.apply(ev.Timeout(req="d-1", what="transfer"))
        r.at(5_300)
        t.apply(ev.WritesStopped(req="d-1", why="every write settled: failed"))
    c = cause(report_of(tmp_path), "d-1")
    assert (c.rule, c.final_state) == ("transfer_timeout", "failed")
    assert c.line.startswith("transfer timed out after 5.0 s: writes of 2 block(s) asked at +0.200 s; its worker "
                             "received it at +0.120 s (via local_socket), held it writing"), c.line


def test_a_streamed_request_is_joined_to_its_prefill_by_the_join_key(run, tmp_path: Path) -> None:
    """Streamed push: the decode request names the router's join key, not the prefill
    request; the prefill worker's note joins them, so the cause line tells what the
    prefill side did (streaming while it computed, its writes cancelled at the deadline)."""
    key = "kvsm-stream-9f"
    with run() as r:
        t = r.tracker("decode-0")
        r.at(100)
        t.create("d-s")
        t.apply(ev.Matched(req="d-s", num_tokens=32, remote_engine="prefill-0", remote_req=key,
                           remote_host="127.0.0.1", remote_port=15600, push=True))
        t.apply(ev.Allocated(req="d-s", block_ids=(1, 2)))
        s = r.tracker("prefill-0", SEND)
        r.at(110)
        s.create("p-s")
        r.log("prefill-0").emit("log", "worker.stream_key", "p-s", key=key)
        s.apply(ev.StreamClaimed(req="p-s", reader="decode-0"))
        t.apply(ev.HandshakeOk(req="d-s", remote_engine="prefill-0"))
        r.at(200)
        t.apply(ev.WritesAsked(req="d-s", num_blocks=2, deadline_wall_ns=5_200 * MS))
        s.apply(ev.StreamAsked(req="p-s", reader="decode-0", num_blocks=2))
        r.at(5_200)
        s.apply(ev.WriteDone(req="p-s", reader="decode-0", ok=False, detail="cancelled in flight at its deadline"))
        r.at(5_700)
        t.apply(ev.WritesStopped(req="d-s", why="the deadline every write was bound by passed"))
    report = report_of(tmp_path)
    c = cause(report, "d-s")
    assert (c.rule, c.final_state) == ("writes_stopped", "failed")
    # Its story (``tools/replay.py --request``) takes in the prefill request, from either side.
    assert {(m.engine_id, m.req) for m in story(report, "d-s")} == {("decode-0", "d-s"), ("prefill-0", "p-s")}
    assert {(m.engine_id, m.req) for m in story(report, "p-s")} == {("decode-0", "d-s"), ("prefill-0", "p-s")}
    assert c.line == ("the writes asked at +0.200 s did not land: the deadline every write was bound by passed "
                      "(at +5.700 s); its worker streamed it from +0.200 s, its writes ended at +5.200 s (cancelled "
                      "in flight at its deadline), held it streamed at the end of its log"), c.line


# --- the prefill side: a lease that expired unread ------------------------------------


@pytest.mark.parametrize("decode", ["claimed", "none", "no_log"])
def test_expired_send_says_whether_a_decode_log_claimed_it(run, tmp_path: Path, decode: str) -> None:
    with run(BOTH[1:] if decode == "no_log" else BOTH) as r:
        r.at(100).send("p-1", pinned_ms=90)  # told 10 ms after the pin: the lease runs from the pin
        if decode == "claimed":
            r.at(200).decode("d-1", "p-1")
            r.claims(1, unknown=["d-1"])
            r.claims(2, expired=["d-1"])
            r.tracker("decode-0").apply(ev.Error(req="d-1", kind="lease_expired", detail="gone"))
        elif decode == "none":
            r.at(200).decode("d-5", "p-5", to="awaiting_blocks")
            r.tracker("decode-0").apply(ev.Abort(req="d-5"))
        r.at(30_090).tracker("prefill-0", SEND).apply(ev.LeaseExpired(req="p-1"))
    c = cause(report_of(tmp_path), "p-1")
    assert (c.engine_id, c.lifecycle, c.final_state, c.rule) == ("prefill-0", "send", "expired", "lease_expired")
    head = "lease expired unread after 30.0 s (pinned at +0.090 s, expired at +30.090 s); "
    assert c.line == head + {
        "claimed": "decode-0 recv:d-1 (failed) matched it, claims answered unknown 1 time, expired 2 times",
        "none": "no decode request in the given logs matched it",
        "no_log": "no decode log was given"}[decode]


# --- stuck ------------------------------------------------------------------------


def test_stuck_requests_say_state_since_last_event_and_the_pin(run, tmp_path: Path) -> None:
    with run() as r:
        r.at(100).send("p-1", pin=False)  # the worker knew of it, the pin never came
        r.decode("d-1", "p-1")
        r.at(110).pinned("p-1", via="local_socket")
        r.at(300).claims(3, unknown=["d-1"])
        r.at(900).log("decode-0").emit("log", "some.note", None)
    report = report_of(tmp_path)
    assert report.exit_code == 1  # stuck requests stay violations
    assert {f.kind for f in report.findings} == {"not_terminal_at_end"}
    p = cause(report, "p-1")
    assert (p.rule, p.final_state) == ("stuck", "prefilling")
    assert p.line == ("stuck in prefilling since +0.100 s: last event create at +0.100 s, its log ends at +0.100 s "
                      "with no clean shutdown; the prefill scheduler pinned it at +0.110 s (via local_socket)")
    d = cause(report, "d-1")
    assert d.line == ("stuck in pending_handshake since +0.100 s: last event allocated at +0.100 s, its log ends at "
                      "+0.900 s with no clean shutdown; claims answered unknown 3 times; the prefill scheduler pinned "
                      "it at +0.110 s (via local_socket), its worker had it still prefilling (never received the pin)")


def test_a_request_stuck_with_its_reads_out_ahead_of_its_claims_names_the_claims(run, tmp_path: Path) -> None:
    """Reads posted right behind the claims (the peer known): stuck there, the
    claims are what the request waits for, as in pending_handshake."""
    with run() as r:
        r.at(100).send("p-1")
        t = r.decode("d-1", "p-1", to="awaiting_blocks")
        t.apply(ev.Allocated(req="d-1", block_ids=(1, 2), early=True))
        t.apply(ev.ReadsPosted(req="d-1", num_blocks=2, num_descs=2))
        r.at(120)
        t.apply(ev.AllReadsDone(req="d-1", num_bytes=128))
        r.at(300).claims(2, unknown=["d-1"])
    d = cause(report_of(tmp_path), "d-1")
    assert d.line.startswith("stuck in read_unclaimed since +0.120 s: last event all_reads_done at +0.120 s, "), d.line
    assert "claims answered unknown 2 times" in d.line and "prefill scheduler" in d.line, d.line


def test_clean_shutdown_listing_a_request_gives_no_cause_and_one_not_listing_it_does(run, tmp_path: Path) -> None:
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.decode("d-2", "p-2")
        r.at(400).log("decode-0").emit("log", "worker.shutdown", None, clean=True,
                                       live={"recv": {"d-1": "pending_handshake"}, "send": {}})
    report = report_of(tmp_path)
    assert [o.req for o in report.open_at_shutdown] == ["d-1"]
    assert [c.req for c in report.causes] == ["d-2"]
    assert report.causes[0].line.startswith(
        "stuck in pending_handshake since +0.100 s: last event allocated at +0.100 s, "
        "its clean shutdown at +0.400 s does not list it; ")


# --- where the causes show -------------------------------------------------------


def test_causes_in_text_request_view_and_json(run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with run() as r:
        r.at(100).decode("d-1", "p-1")
        r.decode("d-3", "p-3")
        r.at(120).pinned("p-1")
        r.tracker("decode-0").apply(ev.Error(req="d-3", kind="incompatible", detail="block size 16 != 32"))
        _handshake_times_out(r)
    paths = sorted(map(str, tmp_path.glob("*.jsonl")))
    report = analyse(paths)
    text = render_text(report)
    assert "causes (2 failed or stuck; not violations unless stuck):" in text
    assert "  decode-0/worker#0 recv:d-3 failed: error incompatible: block size 16 != 32" in text
    assert "  decode-0/worker#0 recv:d-1 failed: handshake timed out after 5.0 s: " in text
    view = render_text(report, request="p-1")  # the prefill id pulls in the decode request and its cause
    assert "final: decode-0/worker#0 recv:d-1 -> failed" in view
    assert "    cause: handshake timed out after 5.0 s: claims answered unknown 1,250 times" in view
    assert "error incompatible" not in view

    assert main([*paths, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exit_code"] == 0 and data["violations"] == []
    by_req = {c["req"]: c for c in data["causes"]}
    assert set(by_req) == {"d-1", "d-3"}
    assert set(by_req["d-3"]) == {"engine_id", "role", "rank", "pid", "lifecycle", "req", "final_state", "rule",
                                  "line"}
    assert by_req["d-3"]["rule"] == "error" and by_req["d-3"]["final_state"] == "failed"
    assert set(c["rule"] for c in data["causes"]) <= set(RULES)


def test_an_aborted_or_done_request_gets_no_cause(run, tmp_path: Path) -> None:
    with run() as r:
        r.at(100).send("p-1")
        r.tracker("prefill-0", SEND).apply(ev.ReadNotif(req="p-1"))
        t = r.decode("d-1", "p-1")
        t.apply(ev.HandshakeOk(req="d-1"))
        t.apply(ev.NothingToRead(req="d-1"))
        r.decode("d-2", "p-2")
        r.tracker("decode-0").apply(ev.Abort(req="d-2"))
    report = report_of(tmp_path)
    assert report.causes == [] and report.exit_code == 0
    assert "causes" not in render_text(report)


def test_the_recorded_offline_failure_is_named() -> None:
    """tests/data/unpinned-offline: the logs of a real offline pair with the pins sent
    only with the next step (KVSM_PIN_VIA_STEP=1, tools/make_unpinned_fixture.py), the
    failure this project once shipped: the prefill engine never stepped again, so
    its worker never learned of the pins and every claim was answered unknown."""
    from kvsm.replay import analyse

    data = Path(__file__).resolve().parent / "data" / "unpinned-offline"
    report = analyse(sorted(data.glob("*.jsonl")))
    assert report.exit_code == 0 and not report.findings
    assert len(report.causes) == 2 and {c.final_state for c in report.causes} == {"failed"}
    for cause in report.causes:
        assert cause.rule == "handshake_timeout" and cause.engine_id == "decode-0"
        assert re.search(r"claims answered unknown \d{2,} times", cause.line), cause.line
        assert "the prefill scheduler pinned it at +" in cause.line and "(via next_step)" in cause.line
        assert "its worker had it still prefilling (never received the pin)" in cause.line
