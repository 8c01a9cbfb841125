"""The scheduler half's lifecycle (``sched``, kvsm/lifecycle/sched.py): the real
SchedulerHalf, driven by vLLM's real scheduler, moves one machine per request
through the declared table and logs it like the workers' machines; replay folds
that log clean and catches a tampered one; its indexes follow the machines.
(That the scheduler's code decides nothing from a state is
tests/test_worker_decides_nothing.py's check.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import require
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import IllegalEventPolicy, LifecycleTracker
from kvsm.lifecycle.sched import (
    SCHED_CONDITIONS,
    SCHED_EFFECTS,
    SCHED_PREPARE,
    BlocksAllocated,
    ParamsIgnored,
    ParamsRead,
    PrefillFinished,
    RemoteTokensCounted,
    RequestFinished,
)
from kvsm.lifecycle.table import LIFECYCLES, PEER, RECV, SCHED, SEND
from kvsm.replay import analyse

# ---------------------------------------------------------------- the declaration


def test_the_scheduler_lifecycle_is_declared_beside_the_others() -> None:
    assert LIFECYCLES["sched"] is SCHED
    assert SCHED.entry_states == {"new", "prefill_queued", "running_to_hold"}
    for state in SCHED.states:  # every live state ends at a clean stop
        if state not in SCHED.terminal:
            assert SCHED.rules[(state, "scheduler_stopped")][0].dest == "closed_at_shutdown"


def test_its_callbacks_and_effects_are_its_own() -> None:
    """The tables are shared by name: no name of the scheduler's means something else."""
    others = [r for spec in (RECV, SEND, PEER) for rules in spec.rules.values() for r in rules]
    assert not {n for r in others for n in r.prepare} & set(SCHED_PREPARE)
    assert not {n for r in others for n in r.conditions} & set(SCHED_CONDITIONS)
    assert not {n for r in others for n in r.effects} & set(SCHED_EFFECTS)
    assert not {t for spec in (RECV, SEND, PEER) for t in spec.triggers} & SCHED.triggers


def test_one_reader_per_prefill_request_is_the_tables_decision() -> None:
    t = LifecycleTracker(SCHED, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    read = {"remote_engine": "p", "remote_req": "pr", "remote_port": 1}
    t.create("a")
    out = t.apply(ParamsRead(req="a", **read))
    assert (out.dst, out.effects) == ("claiming", ("keep_params", "take_reader", "start_heartbeat"))
    t.create("b")
    out = t.apply(ParamsRead(req="b", reader="a", **read))
    assert (out.dst, out.effects) == ("ignored", ("warn_ignored",))
    assert "request a of this engine already reads prefill request 'pr'" in t.get("b").why  # type: ignore[union-attr]
    # vLLM's stand-in for a rejected request: nothing read, the reader keeps the params.
    t.create("c")
    assert t.apply(ParamsRead(req="c", reader="a", rejected=True, **read)).dst == "left_to_reader"
    t.create("d")
    assert t.apply(ParamsRead(req="d", rejected=True, **read)).dst == "rejected"
    assert t.apply(RequestFinished(req="d", status="FINISHED_ABORTED")).effects == ("abandon_remote",)
    out = t.apply(BlocksAllocated(req="a", num_external_tokens=0))  # a full local prefix hit
    assert (out.dst, out.effects) == ("loaded", ("stop_heartbeat", "start_notify_only"))
    assert t.apply(BlocksAllocated(req="a", num_external_tokens=0)).stale  # allocated again: one start


@pytest.mark.parametrize(("status", "blocks", "past", "held_back", "dest", "why"), [
    ("FINISHED_LENGTH_CAPPED", 3, 0, 0, "pinned", ""),
    ("FINISHED_STOPPED", 3, 4, 0, "pinned", ""),  # past the prompt: the prompt's part is read
    ("FINISHED_ABORTED", 3, 0, 0, "not_pinned", "FINISHED_ABORTED"),
    ("FINISHED_LENGTH_CAPPED", 0, 0, 0, "not_pinned", "FINISHED_LENGTH_CAPPED"),
    ("FINISHED_LENGTH_CAPPED", 3, 4, 1, "not_pinned", "4 generated token(s) computed after the prompt"),
])
def test_what_a_prefill_finish_pins(status: str, blocks: int, past: int, held_back: int, dest: str,
                                    why: str) -> None:
    t = LifecycleTracker(SCHED, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    t.create("p", "prefill_queued")
    assert t.apply(BlocksAllocated(req="p")).effects == ("start_send",)
    m = t.get("p")
    out = t.apply(PrefillFinished(req="p", status=status, blocks=blocks, past_prompt=past, held_back=held_back))
    assert out.dst == dest and m is not None and m.why.startswith(why)  # type: ignore[attr-defined]


def test_fewer_remote_tokens_than_the_recompute_threshold_are_computed_here() -> None:
    """kv_recompute_threshold (upstream's key): the table decides, on the counted
    tokens and the threshold in the event, so replay re-checks the arithmetic."""
    t = LifecycleTracker(SCHED, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    read = {"remote_engine": "p", "remote_req": "pr", "remote_port": 1}
    for req in ("few", "many", "gone"):
        t.create(req)
        t.apply(ParamsRead(req=req, **{**read, "remote_req": f"pr-{req}"}))
    out = t.apply(RemoteTokensCounted(req="many", tokens=64, threshold=64))  # not fewer: read as usual
    assert (out.dst, out.effects) == ("claiming", ())
    assert t.apply(BlocksAllocated(req="many", num_external_tokens=64)).dst == "loading"
    out = t.apply(RemoteTokensCounted(req="few", tokens=63, threshold=64))
    assert (out.dst, out.effects) == ("recomputing", ("recompute_locally",))
    m = t.get("few")
    assert m is not None and m.recompute_tokens == 63  # type: ignore[attr-defined]
    assert "63 remote token(s) computed here: fewer than kv_recompute_threshold (64)" in m.why  # type: ignore[attr-defined]
    assert t.apply(RemoteTokensCounted(req="few", tokens=63, threshold=64)).stale  # asked again
    out = t.apply(BlocksAllocated(req="few", num_external_tokens=0))
    assert (out.dst, out.effects) == ("computing_locally", ("stop_heartbeat", "start_notify_only"))
    assert t.apply(RequestFinished(req="few", status="FINISHED_LENGTH_CAPPED")).dst == "ran_locally"
    # Finished before vLLM allocated: the prefill side is told, as for a claiming request.
    t.apply(RemoteTokensCounted(req="gone", tokens=1, threshold=2))
    out = t.apply(RequestFinished(req="gone", status="FINISHED_ABORTED"))
    assert (out.dst, out.effects) == ("abandoned", ("stop_heartbeat", "drop_reader", "abandon_remote"))


def test_an_ignored_request_runs_locally() -> None:
    t = LifecycleTracker(SCHED, VirtualClock(), policy=IllegalEventPolicy.RAISE)
    t.create("x")
    assert t.apply(ParamsIgnored(req="x", reason="bad")).effects == ("warn_ignored",)
    assert t.apply(BlocksAllocated(req="x", num_external_tokens=0)).stale
    assert t.apply(RequestFinished(req="x")).dst == "ran_locally"


# ---------------------------------------------------------------- a real scheduler's log


def _run_every_path(tmp_path: Path) -> dict[str, Any]:
    """A kv_both engine's scheduler through every path of the table; returns what
    its indexes held while requests were live (checked against the machines)."""
    require("vllm")
    from kvsm_testing.scheduler import make_scheduler, remote_decode_params, remote_prefill_params

    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": 23457, "event_log_dir": str(tmp_path / "logs")}
    seen: dict[str, Any] = {}
    with make_scheduler(kv_role="kv_both", extra_config=extra, engine_id="both-e") as h:
        half = h.connector.scheduler_half
        params = remote_prefill_params(remote_block_ids=[1, 2, 3], remote_request_id="p-x", remote_num_tokens=40)
        prompt = h.make_prompt(40)
        h.add_request(prompt, kv_transfer_params=dict(params), max_tokens=2, request_id="d-ok")
        h.add_request(prompt, kv_transfer_params=dict(params), max_tokens=2, request_id="d-second")
        h.add_request(40, kv_transfer_params={**params, "transfer_mode": "push"}, request_id="d-bad")
        rejected = remote_prefill_params(remote_block_ids=[4, 5], remote_request_id="p-r", remote_num_tokens=40)
        h.add_request([0], kv_transfer_params=rejected, request_id="d-rejected", abort_immediately=True)
        aborted = remote_prefill_params(remote_block_ids=[6, 7], remote_request_id="p-a", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=aborted, request_id="d-aborted")
        left = remote_prefill_params(remote_block_ids=[8, 9], remote_request_id="p-left", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=left, request_id="d-left")
        h.add_request(40, kv_transfer_params=remote_decode_params(), request_id="p-ok")
        h.add_request(40, kv_transfer_params=remote_decode_params(), request_id="p-aborted")
        h.abort("p-aborted")
        seen["readers_before"] = dict(half._reader_of)
        seen["machines_before"] = {m.req: (m.state, m.source) for m in half.requests.live()}
        h.step()
        seen["claims_after_alloc"] = {k: set(v) for k, v in half._claims.items()}
        h.abort("d-aborted")
        h.step(finished_recving={"d-ok"})
        h.step(finished_recving={"d-aborted"}, finished_sending={"p-ok"})
        for _ in range(4):  # d-ok runs to its end; d-left waits for a worker that never reports
            h.step()
        seen["pending"] = half.pending_counts()
        seen["live"] = {m.req: m.state for m in half.requests.live()}
        half.log.flush()
    return seen


def test_a_scheduler_log_replays_clean_and_each_request_ends_as_declared(tmp_path: Path) -> None:
    seen = _run_every_path(tmp_path)
    # The indexes are the machines': a reader per claiming request, its claim heartbeated
    # until vLLM allocated (the full-hit or loading request no longer heartbeats).
    claiming = {src: req for req, (state, src) in seen["machines_before"].items() if state == "claiming"}
    assert seen["readers_before"] == claiming and set(claiming.values()) == {"d-ok", "d-aborted", "d-left"}
    assert seen["claims_after_alloc"] == {}
    assert seen["live"] == {"d-left": "loading"}  # no worker runs here to report its load
    assert seen["pending"]["loading"] == 1 and seen["pending"]["readers"] == 1
    report = analyse(sorted((tmp_path / "logs").glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    finals = {m.req: m.final_state for m in report.machines if m.lifecycle == "sched"}
    assert finals == {"d-ok": "done", "d-second": "ran_locally", "d-bad": "ran_locally", "d-rejected": "abandoned",
                      "d-aborted": "aborted_loading", "d-left": "closed_at_shutdown", "p-ok": "pinned",
                      "p-aborted": "not_pinned"}, finals


def _tamper(src: Path, dst: Path, req: str, event: str, change: Any) -> None:
    dst.mkdir()
    for f in src.glob("*.jsonl"):
        lines = []
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("lifecycle") == "sched" and r["req"] == req and r["event"] == event:
                change(r)
                lines.append(json.dumps(r))
            else:
                lines.append(line)
        (dst / f.name).write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("req", "event", "change", "needle"), [
    # The second reader's input says nobody read the prefill request: the table would
    # have made it the reader, not left it to run locally.
    ("d-second", "params_read", lambda r: r["input"].update(reader=""), "'claiming'"),
    # A load that never started: the table's effects for it were not carried out.
    ("d-ok", "blocks_allocated", lambda r: r.update(effects=["stop_heartbeat"]), "start_load"),
    # A prefill pinned though it was aborted.
    ("p-aborted", "prefill_finished", lambda r: r.update(dst="pinned", effects=["queue_pin"]), "'not_pinned'"),
])
def test_replay_catches_a_tampered_scheduler_log(tmp_path: Path, req: str, event: str, change: Any,
                                                 needle: str) -> None:
    _run_every_path(tmp_path)
    _tamper(tmp_path / "logs", tmp_path / "tampered", req, event, change)
    report = analyse(sorted((tmp_path / "tampered").glob("*.jsonl")))
    divergences = [f for f in report.findings if f.kind == "divergence"]
    assert [f.req for f in divergences] == [req], [str(f) for f in report.findings]
    assert needle in divergences[0].detail, divergences[0].detail
