"""The sans-I/O core: the declaration, the compiled table, illegal events, timers."""

from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import IllegalEventPolicy, IllegalTransition, LifecycleTracker
from kvsm.lifecycle.reference import TransitionsModel
from kvsm.lifecycle.table import (
    CLAIM_ANSWERS,
    EFFECTS,
    LIFECYCLES,
    PEER_FETCH_STATES,
    PEER_READABLE_STATES,
    PEER_UNREACHABLE_STATES,
    RECV,
    SEND,
    LifecycleDeclarationError,
    LifecycleSpec,
)
from kvsm.lifecycle.timers import TimerHeap

ROOT = pathlib.Path(__file__).resolve().parent.parent

# One example event per trigger, so random sequences can use every trigger of every lifecycle.
SAMPLE_EVENTS: dict[str, ev.Event] = {
    "matched": ev.Matched(req="r", num_tokens=40, remote_engine="p0", remote_req="pr", remote_blocks=1),
    "allocated": ev.Allocated(req="r", block_ids=(1, 2), num_external_tokens=40),
    "handshake_ok": ev.HandshakeOk(req="r", remote_engine="p0"),
    "reads_posted": ev.ReadsPosted(req="r", num_blocks=2, num_descs=2),
    "nothing_to_read": ev.NothingToRead(req="r"),
    "all_reads_done": ev.AllReadsDone(req="r", num_bytes=128),
    "error": ev.Error(req="r", kind="transfer", detail="x"),
    "timeout": ev.Timeout(req="r", what="transfer"),
    "peer_dead": ev.PeerDead(req="r", peer="p0"),
    "internal_error": ev.InternalError(req="r", where="timer", detail="ZeroDivisionError"),
    "abort": ev.Abort(req="r"),
    "reads_quiesced": ev.ReadsQuiesced(req="r"),
    "writes_asked": ev.WritesAsked(req="r", num_blocks=2, deadline_wall_ns=5_000),
    "writes_landed": ev.WritesLanded(req="r"),
    "writes_stopped": ev.WritesStopped(req="r", why="the deadline passed"),
    "write_asked": ev.WriteAsked(req="r", reader="d0", readers=2, num_blocks=2),
    "stream_asked": ev.StreamAsked(req="r", reader="d0", num_blocks=2),
    "stream_claimed": ev.StreamClaimed(req="r", reader="d0"),
    "stream_joined": ev.StreamJoined(req="r", joined="p"),
    "stream_preempted": ev.StreamPreempted(req="r", at_ns=5, unsure=("d0",)),
    "write_done": ev.WriteDone(req="r", reader="d0", readers=2),
    "finished_ok": ev.FinishedOk(req="r", block_ids=(5, 6), expected_reads=2, lease_ns=1_000),
    "finished_abnormally": ev.FinishedAbnormally(req="r", reason="length"),
    "heartbeat": ev.Heartbeat(req="r", lease_ns=1_000),
    "read_notif": ev.ReadNotif(req="r", reader="d0"),
    "lease_expired": ev.LeaseExpired(req="r"),
    "release_asked": ev.ReleaseAsked(req="r", reason="budget", lease_ns=1_000_000_000),
    "remote_abandoned": ev.RemoteAbandoned(req="r"),
    "abandon_expired": ev.AbandonExpired(req="r"),
    "agent_added": ev.AgentAdded(req="p", agent="a1"),
    "answered": ev.Answered(req="p", sent_ns=5),
    "died": ev.Died(req="p", reason="refused", sent_ns=0),
    "read_failed": ev.ReadFailed(req="p", why="EIO"),
    "probe_sent": ev.ProbeSent(req="p", probe=7),
    "backoff_over": ev.BackoffOver(req="p"),
    "closed": ev.Closed(req="p"),
    "shutdown": ev.Shutdown(req="r"),
    "drain_over": ev.DrainOver(req="r"),
}


def test_every_trigger_has_a_typed_event() -> None:
    triggers = set().union(*(spec.triggers for spec in LIFECYCLES.values()))
    assert triggers <= set(ev.EVENT_TYPES), triggers - set(ev.EVENT_TYPES)
    assert set(SAMPLE_EVENTS) == set().union(*(spec.triggers for spec in (RECV, SEND, LIFECYCLES["peer"])))


def test_lifecycles_of_design() -> None:
    assert RECV.initial == "new" and RECV.terminal == {"done", "failed", "aborted", "closed_at_shutdown"}
    assert SEND.initial == "prefilling" and SEND.terminal == {"released", "expired", "hold_expired", "forgotten",
                                                              "refused_early", "closed_at_shutdown"}
    # The happy paths of docs/design.md.
    t = LifecycleTracker(RECV, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    t.create("r")
    path = [t.apply(SAMPLE_EVENTS[n]).dst for n in
            ("matched", "allocated", "handshake_ok", "reads_posted", "all_reads_done")]
    assert path == ["awaiting_blocks", "pending_handshake", "remote_known", "transferring", "done"]
    s = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    s.create("r")
    assert s.apply(SAMPLE_EVENTS["finished_ok"]).effects == ("pin_blocks", "arm_lease")
    assert s.apply(SAMPLE_EVENTS["read_notif"]).dst == "awaiting_pull"  # 1 of 2 readers
    assert s.apply(SAMPLE_EVENTS["read_notif"]).dst == "awaiting_pull"  # the same reader again: still 1
    out = s.apply(ev.ReadNotif(req="r", reader="d1"))
    assert (out.dst, out.effects) == ("released", ("cancel_lease", "count_served", "free_blocks"))


def test_a_preempted_stream_is_written_again_where_unsure_and_failed_where_notified() -> None:
    """The send table's three answers to a preemption while streaming: every write
    seen over (restart from the new blocks), a write unsure (that rank written again
    whole once it is over), and an unsure write that carried the landed notification
    (that rank failed first: it may hold the bytes already)."""
    answers = []
    for unsure, notified in (((), ()), (("d0",), ()), (("d0", "d1"), ("d1",))):
        s = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
        s.create("r")
        s.apply(SAMPLE_EVENTS["stream_claimed"])
        assert s.apply(SAMPLE_EVENTS["stream_asked"]).dst == "streaming"
        out = s.apply(ev.StreamPreempted(req="r", at_ns=5, unsure=unsure, notified=notified))
        answers.append((out.dst, out.effects))
    assert answers == [("streaming", ("restart_stream",)),
                       ("streaming", ("rewrite_unsure_streams", "restart_stream")),
                       ("streaming", ("fail_notified_streams", "rewrite_unsure_streams", "restart_stream"))]


def test_reads_posted_with_their_claims() -> None:
    """A decode worker that knows every prefill worker posts the reads right behind
    the claims; reads that complete first wait for the grants, and are served
    only inside the lease those grants give (judged by when they completed)."""
    clock = VirtualClock()
    t = LifecycleTracker(RECV, clock, policy=IllegalEventPolicy.RAISE)
    t.create("r")
    t.apply(SAMPLE_EVENTS["matched"])
    out = t.apply(ev.Allocated(req="r", block_ids=(1, 2), num_external_tokens=40, early=True))
    assert (out.dst, out.effects) == ("reading_unclaimed", ("take_blocks", "arm_handshake_timer",
                                                            "start_handshake", "post_early_reads"))
    assert t.apply(SAMPLE_EVENTS["reads_posted"]).effects == ("arm_transfer_timer",)
    clock.advance(1_000)
    assert t.apply(SAMPLE_EVENTS["all_reads_done"]).dst == "read_unclaimed"
    clock.advance(10_000_000_000)  # the grant comes late; the reads were done long before
    out = t.apply(ev.HandshakeOk(req="r", claim_sent_ns=0, lease_window_ns=2_000_000_000))
    assert (out.dst, out.effects) == ("done", ("cancel_handshake_timer", "release_reads", "deliver_blocks",
                                               "cancel_timers"))
    # Two prefill ranks: the first grant is not enough; completed past the lease: invalid.
    t.create("q")
    t.apply(ev.Matched(req="q", num_tokens=40, remote_engine="p0", remote_req="pq", remote_blocks=1, sources=2))
    t.apply(ev.Allocated(req="q", block_ids=(3,), num_external_tokens=40, early=True))
    t.apply(ev.ReadsPosted(req="q"))
    assert t.apply(ev.HandshakeOk(req="q", claim_sent_ns=clock.monotonic_ns(), lease_window_ns=2_000_000_000,
                                  source=1)).dst == "reading_unclaimed"
    clock.advance(3_000_000_000)
    assert t.apply(ev.AllReadsDone(req="q")).dst == "read_unclaimed"
    assert t.apply(ev.HandshakeOk(req="q", claim_sent_ns=0, lease_window_ns=2_000_000_000,
                                  source=1)).dst == "read_unclaimed"  # that rank again: still one of two
    out = t.apply(ev.HandshakeOk(req="q", claim_sent_ns=0, lease_window_ns=60_000_000_000, source=0))
    assert out.dst == "failed" and "report_invalid" in out.effects
    assert t.final_state("q") == "failed"
    # A claim refused while the reads are in flight: they settle first.
    t.create("x")
    t.apply(ev.Matched(req="x", num_tokens=1, remote_engine="p0", remote_req="px"))
    t.apply(ev.Allocated(req="x", block_ids=(4,), early=True))
    out = t.apply(ev.Error(req="x", kind="lease_expired"))
    assert (out.dst, out.effects) == ("failing", ("cancel_reads",))
    out = t.apply(ev.ReadsQuiesced(req="x", completed=1))
    assert out.dst == "failed" and out.effects[0] == "notify_abandon"  # (its read's notification is held there)


def test_the_table_refuses_early_inputs_beyond_the_bound() -> None:
    """The admission limit is the table's: an early input that finds
    MAX_EARLY_INPUTS waiting (the count recorded with it) ends its machine in
    refused_early, counted; below the bound it waits. A finish afterwards begins
    anew, and further early inputs for it are stale."""
    from kvsm.lifecycle.table import MAX_EARLY_INPUTS

    s = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    s.create("w")
    out = s.apply(ev.RemoteAbandoned(req="w", reader="d0", early_waiting=MAX_EARLY_INPUTS - 1))
    assert (out.dst, out.effects) == ("abandoned_early", ("arm_abandon_timer",))
    s.create("a")
    out = s.apply(ev.RemoteAbandoned(req="a", reader="d0", early_waiting=MAX_EARLY_INPUTS))
    assert (out.dst, out.effects) == ("refused_early", ("count_refused_abandon",))
    s.create("r")
    out = s.apply(ev.ReadNotif(req="r", reader="d0", early=True, early_waiting=MAX_EARLY_INPUTS))
    assert (out.dst, out.effects) == ("refused_early", ("count_refused_read",))
    assert s.apply(ev.ReadNotif(req="r", reader="d0")).stale and s.apply(ev.RemoteAbandoned(req="r")).stale
    assert s.may_begin("r") and s.verdict("r", CLAIM_ANSWERS) == "unknown"
    s.create("r")
    assert s.apply(ev.FinishedOk(req="r", block_ids=(3,), lease_ns=1_000)).dst == "awaiting_pull"


def test_a_read_notification_before_its_claim_is_held() -> None:
    """The prefill side counts a read once its rank has claimed the request: a
    notification that overtook its claim is held until the claim, and one that
    overtook the finish too waits with the machine in read_early."""
    s = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    s.create("r")
    s.apply(ev.FinishedOk(req="r", block_ids=(5,), lease_ns=1_000))
    assert s.apply(ev.ReadNotif(req="r", reader="d0", early=True)).dst == "awaiting_pull"
    assert s.get("r").reads_held == {"d0"} and s.get("r").reads_seen == 0
    out = s.apply(ev.Heartbeat(req="r", lease_ns=1_000, reader="d0"))
    assert (out.dst, out.effects) == ("released", ("cancel_lease", "count_served", "free_blocks"))
    # Before the finish: the notification makes the machine, the finish pins, the claim releases.
    s.create("q")
    out = s.apply(ev.ReadNotif(req="q", reader="d0", early=True))
    assert (out.dst, out.effects) == ("read_early", ("arm_abandon_timer",))
    out = s.apply(ev.FinishedOk(req="q", block_ids=(6,), lease_ns=1_000))
    assert (out.dst, out.effects) == ("awaiting_pull", ("cancel_abandon_timer", "pin_blocks", "arm_lease"))
    assert s.apply(ev.Heartbeat(req="q", lease_ns=1_000, reader="d0")).dst == "released"
    # Its reader gave up (an abandon counts without a claim): the finish frees at once.
    s.create("a")
    s.apply(ev.ReadNotif(req="a", reader="d0", early=True))
    assert s.apply(ev.RemoteAbandoned(req="a", reader="d0")).dst == "read_early"
    out = s.apply(ev.FinishedOk(req="a", block_ids=(7,), lease_ns=1_000))
    assert (out.dst, out.effects) == ("released", ("cancel_abandon_timer", "pin_blocks", "count_served", "free_blocks"))
    # The finish never comes: forgotten after a lease; its late notification is stale.
    s.create("f")
    s.apply(ev.ReadNotif(req="f", reader="d0", early=True))
    assert s.apply(ev.AbandonExpired(req="f")).dst == "forgotten"
    assert s.apply(ev.ReadNotif(req="f", reader="d0", early=True)).stale
    # A read posted after its claim's grant counts at once (and so does every read of
    # a log written before reads were posted early).
    s.create("n")
    s.apply(ev.FinishedOk(req="n", block_ids=(8,), lease_ns=1_000))
    assert s.apply(ev.ReadNotif(req="n", reader="d0")).dst == "released"


def test_blocks_are_never_handed_back_while_a_read_may_write() -> None:
    """After reads are posted, only quiescence (or a finished/errored read) releases blocks
    (or the clean stop: the process ends, and vLLM takes nothing back after it)."""
    releasing = {"deliver_blocks", "report_invalid", "release_blocks"}
    checked = set()
    for (src, trigger), rules in RECV.rules.items():
        if trigger == "shutdown":
            continue
        for rule in rules:
            if src in ("transferring", "failing", "aborting") and releasing & set(rule.effects):
                assert trigger in ("all_reads_done", "error", "reads_quiesced"), (src, trigger)
                checked.add(src)
            if src == "reading_unclaimed" and releasing & set(rule.effects):  # (nothing was to be read)
                assert trigger == "nothing_to_read", (src, trigger)
                checked.add(src)
    # Each of those states does release blocks somewhere (else the checks above saw nothing).
    assert checked == {"transferring", "failing", "aborting", "reading_unclaimed"}, checked


def test_a_drain_s_end_closes_only_what_is_pinned() -> None:
    """A draining engine's time is up (``drain_over``): a pin waiting for its reader
    closes and frees its blocks; a request still prefilling, or known only by an
    early input, is not concerned (its finish pins it, and the next step closes it):
    the tracker's ``live_accepting`` picks exactly the machines the table names."""
    t = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    for req in ("pinned", "prefilling", "early"):
        t.create(req)
    t.apply(ev.FinishedOk(req="pinned", block_ids=(1, 2)))
    t.apply(ev.RemoteAbandoned(req="early"))
    assert [m.req for m in t.live_accepting("drain_over")] == ["pinned"]
    o = t.apply(ev.DrainOver(req="pinned"))
    assert (o.src, o.dst, o.effects) == ("awaiting_pull", "closed_at_shutdown", ("cancel_lease", "free_blocks"))
    assert t.live_accepting("drain_over") == []
    t.apply(ev.FinishedOk(req="prefilling", block_ids=(3,)))
    assert [m.req for m in t.live_accepting("drain_over")] == ["prefilling"]


def test_a_clean_stop_ends_every_live_request_and_hands_back_what_it_holds() -> None:
    """Every live state of recv and send has a ``shutdown`` rule to the terminal
    ``closed_at_shutdown``; whatever holds blocks there releases them, so a log that
    ends with a clean stop balances the block ledger."""
    for spec in (RECV, SEND):
        assert "closed_at_shutdown" in spec.terminal
        for state in set(spec.states) - spec.terminal:
            (rule,) = spec.rules[(state, "shutdown")]
            assert rule.dest == "closed_at_shutdown" and not rule.conditions, (spec.name, state)
    t = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    t.create("p")
    t.apply(ev.FinishedOk(req="p", block_ids=(1, 2)))
    o = t.apply(ev.Shutdown(req="p"))
    assert (o.src, o.dst, o.effects) == ("awaiting_pull", "closed_at_shutdown", ("cancel_lease", "free_blocks"))
    assert t.final_state("p") == "closed_at_shutdown"
    r = LifecycleTracker(RECV, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    r.create("r")
    for name in ("matched", "allocated", "handshake_ok", "reads_posted"):
        r.apply(SAMPLE_EVENTS[name])
    o = r.apply(ev.Shutdown(req="r"))
    assert (o.src, o.dst) == ("transferring", "closed_at_shutdown") and "release_blocks" in o.effects


def test_a_request_reading_early_that_fails_before_its_reads_leave_ends_at_once() -> None:
    """The worker posts early reads after the claims' flush only for a request still
    live: the table must end every request that failed or was aborted in
    ``reading_unclaimed`` before a read was posted (its reads quiesce at once)."""
    for trigger in ("error", "timeout", "peer_dead", "internal_error", "abort"):
        rule = RECV.rules[("reading_unclaimed", trigger)][-1]
        quiesced = RECV.rules[(rule.dest, "reads_quiesced")][-1].dest if rule.dest not in RECV.terminal else rule.dest
        assert quiesced in RECV.terminal, (trigger, rule.dest, quiesced)
        if rule.dest not in RECV.terminal:
            assert "cancel_reads" in rule.effects, (trigger, rule.effects)  # (no read out: quiesced at once)
    claim_refused = RECV.rules[("reading_unclaimed", "error")][0]
    assert claim_refused.conditions == ("answers_a_claim",) and "cancel_reads" in claim_refused.effects


PEER_TRIGGERS = sorted(LIFECYCLES["peer"].triggers - {"closed"})


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.sampled_from(PEER_TRIGGERS), max_size=12))
def test_what_a_peer_allows_is_folded_by_its_transitions(triggers: list[str]) -> None:
    """The worker reads what a peer allows from the machine's data, never its state:
    the transitions' folds must agree with the table's sets in every state reached."""
    t = LifecycleTracker(LIFECYCLES["peer"], VirtualClock())
    t.create("p")
    for trigger in ["", *triggers]:
        if trigger:
            t.apply(SAMPLE_EVENTS[trigger])
        m = t.get("p")
        assert m is not None
        state = t.states()["p"]
        assert m.needs_metadata == (state in PEER_FETCH_STATES), (triggers, state)
        assert m.agent_readable == (state in PEER_READABLE_STATES), (triggers, state)
        assert m.unreachable == (state in PEER_UNREACHABLE_STATES), (triggers, state)
        # A liveness probe is out only while reads may go to it, until an answer or a death.
        assert m.probe == -1 or state in PEER_READABLE_STATES, (triggers, state)


def test_a_tracker_answers_from_what_the_table_declares() -> None:
    """Existence, a new beginning after a forgotten early abandon, and the claim's
    answer come from the tracker (the worker reads no state)."""
    t = LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    assert not t.known("p") and t.may_begin("p") and t.verdict("p", CLAIM_ANSWERS) == "unknown"
    t.create("p")
    assert t.known("p") and not t.may_begin("p") and t.verdict("p", CLAIM_ANSWERS) == "unknown"
    t.apply(ev.FinishedOk(req="p", block_ids=(1,)))
    assert t.verdict("p", CLAIM_ANSWERS) == "ok" and t.states() == {"p": "awaiting_pull"}
    t.apply(ev.ReadNotif(req="p", reader="d0"))
    assert t.known("p") and not t.may_begin("p") and t.verdict("p", CLAIM_ANSWERS) == "expired"
    t.create("f")
    t.apply(ev.RemoteAbandoned(req="f", reader="d0"))
    t.apply(ev.AbandonExpired(req="f"))
    assert t.known("f") and t.may_begin("f")  # forgotten: a finish begins anew


def test_a_live_machines_claim_answer_is_its_heartbeat_step() -> None:
    """For a live send machine the claim is applied as a heartbeat and the step
    answers (a transition grants, a declared stale input says unknown): in every
    live state that agrees with CLAIM_ANSWERS, which answers ended requests."""
    for state in set(SEND.states) - SEND.terminal:
        rules = SEND.rules[(state, "heartbeat")]
        step_answer = "unknown" if any(r.stale for r in rules) else "ok"
        assert all(bool(r.stale) == (step_answer == "unknown") for r in rules), state
        assert step_answer == CLAIM_ANSWERS[state], state
    for state in SEND.terminal:  # nothing recorded: the table's answer
        assert CLAIM_ANSWERS[state] in ("unknown", "expired")


def test_declaration_errors_name_the_problem() -> None:
    with pytest.raises(LifecycleDeclarationError, match="terminal state 'b'"):
        LifecycleSpec("x", ("a", "b"), "a", frozenset({"b"}),
                      ({"trigger": "go", "source": "a", "dest": "b"}, {"trigger": "back", "source": "b", "dest": "a"}))
    with pytest.raises(LifecycleDeclarationError, match="unknown effect 'explode'"):
        LifecycleSpec("x", ("a", "b"), "a", frozenset({"b"}),
                      ({"trigger": "go", "source": "a", "dest": "b", "after": "explode"},))
    with pytest.raises(LifecycleDeclarationError, match="last rule .* is conditional"):
        LifecycleSpec("x", ("a", "b"), "a", frozenset({"b"}),
                      ({"trigger": "go", "source": "a", "dest": "b", "conditions": "all_reads_in"},))
    with pytest.raises(LifecycleDeclarationError, match="never reached"):
        LifecycleSpec("x", ("a", "b", "c"), "a", frozenset({"b", "c"}),
                      ({"trigger": "go", "source": "a", "dest": "b"},))


def test_illegal_event_is_recorded_with_lifecycle_request_state_and_event() -> None:
    seen = []
    t = LifecycleTracker(RECV, VirtualClock(), listener=seen.append)
    t.create("r")
    out = t.apply(SAMPLE_EVENTS["all_reads_done"])
    assert not out.ok and out.violation == "illegal_transition"
    assert "lifecycle 'recv' request 'r' in state 'new' got event 'all_reads_done'" in out.describe()
    assert t.get("r").state == "new" and t.violations == 1 and seen[-1] is out
    assert t.apply(ev.Abort(req="ghost")).violation == "unknown_request"
    strict = LifecycleTracker(RECV, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    strict.create("r")
    with pytest.raises(IllegalTransition, match="in state 'new' got event 'reads_posted'"):
        strict.apply(SAMPLE_EVENTS["reads_posted"])
    assert strict.get("r").state == "new"


def test_late_events_after_terminal_are_named() -> None:
    clock = VirtualClock()
    s = LifecycleTracker(SEND, clock)
    s.create("r")
    s.apply(ev.FinishedOk(req="r", block_ids=(1,), lease_ns=10))
    clock.advance(10)
    assert s.apply(ev.LeaseExpired(req="r")).dst == "expired"
    assert "r" not in s and len(s) == 0  # finished machines leave the live table
    assert s.apply(ev.ReadNotif(req="r")).violation == "read_after_lease_expiry"
    assert s.final_state("r") == "expired"


def test_finished_requests_are_remembered_in_bounded_memory() -> None:
    t = LifecycleTracker(SEND, VirtualClock(), remember_finished=10)
    for i in range(100):
        t.create(f"r{i}")
        t.apply(ev.Abort(req=f"r{i}"))
    assert len(t) == 0 and len(t._finished) == 10
    assert t.final_state("r99") == "released" and t.final_state("r0") is None


def test_duplicate_create_and_bad_entry_state_are_violations() -> None:
    t = LifecycleTracker(RECV, VirtualClock())
    t.create("r")
    assert t.create("r").violation == "duplicate_request"
    assert t.create("q", entry="transferring").violation == "illegal_entry_state"
    assert t.create("w", entry="pending_handshake", block_ids=(3,)).dst == "pending_handshake"


def _run_both(spec: LifecycleSpec, triggers: list[str], entry: str) -> list[str]:
    """The compiled table and the real transitions.Machine agree step by step
    (state, legality and the exact effects of each step); returns the effects."""
    clock = VirtualClock()
    tracker = LifecycleTracker(spec, clock)
    tracker.create("r", entry=entry)
    model = TransitionsModel(spec, "r", entry=entry)
    effects: list[str] = []
    for trigger in triggers:
        clock.advance(7)
        event = SAMPLE_EVENTS[trigger]
        m = tracker.get("r")
        before = m.state if m else tracker.final_state("r")
        before_snapshot = m.snapshot() if m else None
        model_effects_before = len(model.effects)
        out = tracker.apply(event)
        legal = model.fire(event, clock.monotonic_ns())
        assert legal == out.ok, (before, trigger)
        after = tracker.get("r")
        state_now = after.state if after else tracker.final_state("r")
        assert state_now == model.state, (before, trigger)
        # This step's effects, in order, whether or not there are any.
        assert list(out.effects) == model.effects[model_effects_before:], (before, trigger)
        effects += out.effects
        if not legal:
            # An illegal event changes nothing: state and data are as before.
            assert state_now == before
            if before_snapshot is not None:
                assert after is not None and after.snapshot() == before_snapshot
    return effects


def test_compared_runs_see_the_effects_of_the_happy_paths() -> None:
    """The comparison below is not vacuous: on these paths both sides emit
    effects, step by step, and they are the ones the table declares."""
    recv = _run_both(RECV, ["matched", "allocated", "handshake_ok", "reads_posted", "all_reads_done"], "new")
    assert recv == ["take_blocks", "arm_handshake_timer", "start_handshake", "cancel_handshake_timer", "post_reads",
                    "arm_transfer_timer", "release_reads", "deliver_blocks", "cancel_timers"]
    # One of two readers, then the lease runs out.
    send = _run_both(SEND, ["finished_ok", "read_notif", "lease_expired"], "prefilling")
    assert send == ["pin_blocks", "arm_lease", "count_expired_lease", "free_blocks"]


@settings(max_examples=examples(500), deadline=None)
@given(st.data())
def test_compiled_table_matches_transitions_library(data: st.DataObject) -> None:
    spec = data.draw(st.sampled_from([RECV, SEND]))
    entry = data.draw(st.sampled_from(sorted(spec.entry_states | {spec.initial})))
    pool = sorted(spec.triggers | {"matched", "read_notif", "lease_expired"})
    triggers = data.draw(st.lists(st.sampled_from(pool), max_size=25))
    _run_both(spec, triggers, entry)


def test_every_effect_is_used_and_documented() -> None:
    used = {e for spec in LIFECYCLES.values() for rules in spec.rules.values() for r in rules for e in r.effects}
    assert used == set(EFFECTS), set(EFFECTS) ^ used


def test_timer_heap_orders_cancels_and_stays_bounded() -> None:
    heap: TimerHeap[str] = TimerHeap()
    handles = [heap.schedule(d, f"k{d}", f"p{d}") for d in (50, 10, 30, 20, 40)]
    assert heap.next_deadline_ns() == 10
    assert heap.cancel(handles[1]) and not heap.cancel(handles[1])
    assert heap.next_deadline_ns() == 20
    assert [h.payload for h in heap.pop_due(35)] == ["p20", "p30"]
    assert not heap.cancel(handles[2])  # already fired
    assert len(heap) == 2
    many = [heap.schedule(1000 + i, i, i) for i in range(1000)]
    for h in many:
        heap.cancel(h)
    assert len(heap) == 2 and len(heap._heap) <= 2 * 64 + 4
    assert [h.payload for h in heap.pop_due(10_000)] == ["p40", "p50"]
    assert heap.next_deadline_ns() is None


FORBIDDEN = {"vllm", "nixl", "zmq", "torch"}


@pytest.mark.parametrize("path", sorted((ROOT / "kvsm" / "lifecycle").rglob("*.py")), ids=lambda p: p.name)
def test_lifecycle_core_imports_no_io_library(path: pathlib.Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_lifecycle_core_loads_without_io_libraries() -> None:
    """Importing the core in a fresh interpreter pulls in none of vllm/nixl/zmq/torch."""
    import subprocess
    import sys

    code = ("import sys, kvsm.lifecycle, kvsm.lifecycle.invariants, kvsm.lifecycle.timers, kvsm.lifecycle.reference;"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'vllm','nixl','zmq','torch'});"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
