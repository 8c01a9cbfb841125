"""Replay over real log files: summary, violations, divergence, timeline, trace, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from conftest import examples
from kvsm.eventlog import EventLog, read_logs
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import LifecycleTracker
from kvsm.lifecycle.table import RECV, SEND
from kvsm.replay import _malformed, _record_ok, analyse, chrome_trace, main, render_text
from kvsm_testing.sim import Faults, SimConfig, run_simulation

ROOT = Path(__file__).resolve().parent.parent
CLEAN = ROOT / "tests" / "data" / "sample-clean"
PLANTED = ROOT / "tests" / "data" / "sample-violations"
# The simulation runs the real workers: one log per worker process (tools/make_sample_logs.py).
DECODE_LOG = "decode-0.worker.rank0.jsonl"
PREFILL_LOG = "prefill-0.worker.rank0.jsonl"


def replay_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "replay.py"), *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def kinds(report) -> set[str]:
    return {f.kind for f in report.findings}


def test_clean_sample_prints_summary_and_exits_0() -> None:
    proc = replay_cli(*sorted(CLEAN.glob("*.jsonl")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recv:" in proc.stdout and "send:" in proc.stdout
    assert "no violations" in proc.stdout


def test_line_removed_from_the_middle_exits_1_and_names_the_gap(tmp_path: Path) -> None:
    src = CLEAN / DECODE_LOG
    lines = src.read_bytes().splitlines(keepends=True)
    middle = len(lines) // 2
    lost_seq = orjson.loads(lines[middle])["seq"]
    (tmp_path / src.name).write_bytes(b"".join(lines[:middle] + lines[middle + 1:]))
    proc = replay_cli(tmp_path / src.name, CLEAN / PREFILL_LOG)
    assert proc.returncode == 1
    assert f"seq_gap: decode-0: 1 record(s) lost: seq {lost_seq} missing" in proc.stdout
    assert f"{src.name}:{middle + 1}]" in proc.stdout  # the line after the gap


def test_planted_violations_are_each_reported() -> None:
    report = analyse(sorted(PLANTED.glob("*.jsonl")))
    assert report.exit_code == 1
    found = kinds(report)
    for kind in ("seq_gap", "read_after_lease_expiry", "not_terminal_at_end", "divergence"):
        assert kind in found, (kind, found)
    cut = [f for f in report.findings if f.kind == "not_terminal_at_end"]
    assert [(f.req, f.engine_id) for f in cut] == [("d-cut", "decode-1")]
    assert "'transferring'" in cut[0].detail
    late = [f for f in report.findings if f.kind == "read_after_lease_expiry"]
    assert late[0].req == "p-late" and late[0].file.endswith("decode-1.worker.rank0.jsonl")
    # The lost line is decode-0's; the edited destination is prefill-0's (the gap
    # also makes decode-0 diverge where the lost record was needed).
    assert {f.engine_id for f in report.findings if f.kind == "seq_gap"} == {"decode-0"}
    edited = [f for f in report.findings if f.kind == "divergence" and f.engine_id == "prefill-0"]
    assert len(edited) == 1 and "recorded 'prefilling' -> 'released'" in edited[0].detail, edited


def test_truncated_and_garbage_lines_are_reported_and_the_rest_replays(tmp_path: Path) -> None:
    lines = (CLEAN / DECODE_LOG).read_bytes().splitlines(keepends=True)
    lines.insert(10, b"this is not json\n")
    body = b"".join(lines)
    log = tmp_path / "decode.jsonl"
    log.write_bytes(body[: len(body) - 25])  # cut inside the last record
    report = analyse([log])
    problems = {(f.kind, f.line) for f in report.findings if f.kind == "corrupt_line"}
    assert problems == {("corrupt_line", 11), ("corrupt_line", len(lines))}
    assert report.exit_code == 1
    clean = analyse([CLEAN / DECODE_LOG])
    # Every request but the one whose last record was cut replays to the same final state.
    want = {m.req: m.final_state for m in clean.machines}
    got = {m.req: m.final_state for m in report.machines}
    assert len([r for r in want if got.get(r) == want[r]]) >= len(want) - 1


def test_illegal_event_recorded_by_the_runtime_is_reported(tmp_path: Path) -> None:
    clock = VirtualClock()
    with EventLog(tmp_path / "p.jsonl", role="scheduler", engine_id="prefill-9", clock=clock) as log:
        t = LifecycleTracker(RECV, clock, listener=log.record_outcome)
        t.create("r1")
        t.apply(ev.ReadsPosted(req="r1"))  # illegal in 'new'
        t.apply(ev.Abort(req="r1"))
    report = analyse([tmp_path / "p.jsonl"])
    assert report.exit_code == 1
    illegal = [f for f in report.findings if f.kind == "illegal_transition"]
    assert len(illegal) == 1 and illegal[0].req == "r1"
    assert "in state 'new' got event 'reads_posted'" in illegal[0].detail
    assert "divergence" not in kinds(report)  # the violation itself replays identically


def test_blocks_never_freed_and_freed_twice(tmp_path: Path) -> None:
    clock = VirtualClock()
    path = tmp_path / "p.jsonl"
    with EventLog(path, role="worker", engine_id="decode-9", clock=clock) as log:
        t = LifecycleTracker(RECV, clock, listener=log.record_outcome)
        for req, blocks in (("a", (1, 2)), ("b", (2, 3))):  # block 2 is still a's to write into
            t.create(req)
            t.apply(ev.Matched(req=req, num_tokens=32, remote_engine="p", remote_req=f"p-{req}"))
            t.apply(ev.Allocated(req=req, block_ids=blocks))
        t.apply(ev.Abort(req="a"))
    report = analyse([path])
    found = kinds(report)
    assert "block_reused_while_held" in found
    assert "not_terminal_at_end" in found  # b never finished


def test_prefill_pins_may_share_blocks(tmp_path: Path) -> None:
    """The prefix cache lets two finished prefills pin one block: not a violation."""
    clock = VirtualClock()
    path = tmp_path / "p.jsonl"
    with EventLog(path, role="worker", engine_id="prefill-9", clock=clock) as log:
        t = LifecycleTracker(SEND, clock, listener=log.record_outcome)
        for req, blocks in (("a", (1, 2)), ("b", (1, 2, 3))):
            t.create(req)
            t.apply(ev.FinishedOk(req=req, block_ids=blocks, lease_ns=5))
        t.apply(ev.ReadNotif(req="a"))
        t.apply(ev.LeaseExpired(req="b"))
    report = analyse([path])
    assert report.exit_code == 0, [str(f) for f in report.findings]


def test_replay_detects_divergence_from_the_table(tmp_path: Path) -> None:
    lines = (CLEAN / PREFILL_LOG).read_bytes().splitlines(keepends=True)
    for i, line in enumerate(lines):
        rec = orjson.loads(line)
        if rec["kind"] == "transition" and rec.get("effects") == ["cancel_lease", "free_blocks"]:
            rec["effects"] = ["cancel_lease"]  # the runtime "forgot" to free
            lines[i] = orjson.dumps(rec) + b"\n"
            break
    else:
        pytest.fail("no release in the clean sample")
    (tmp_path / "p.jsonl").write_bytes(b"".join(lines))
    report = analyse([tmp_path / "p.jsonl"])
    div = [f for f in report.findings if f.kind == "divergence"]
    assert len(div) == 1 and div[0].line == i + 1
    assert "blocks_never_freed" in kinds(report)


def test_an_emptied_log_is_reported(tmp_path: Path) -> None:
    (tmp_path / DECODE_LOG).write_bytes(b"")
    (tmp_path / PREFILL_LOG).write_bytes((CLEAN / PREFILL_LOG).read_bytes())
    report = analyse([tmp_path])
    assert report.exit_code == 1
    assert [(f.kind, Path(f.file).name) for f in report.findings] == [("empty_log", DECODE_LOG)]


def test_unreadable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(empty)]) == 2
    assert "UNREADABLE" in capsys.readouterr().out


def test_request_timeline_spans_both_engines(tmp_path: Path) -> None:
    result = run_simulation(SimConfig(seed=2, num_requests=5, log_dir=tmp_path))
    report = analyse(result.log_paths)
    proc = replay_cli(*result.log_paths, "--request", "d-3")
    assert proc.returncode == 0
    out = proc.stdout
    assert "timeline of 'd-3' across 2 process(es)" in out
    # (Which process of each engine logs the machines is the simulation's choice.)
    decode = next(m for m in report.machines if m.req == "d-3")
    prefill = next(m for m in report.machines if m.req == "p-3")
    assert f"{prefill.engine_id}/{prefill.role}#0" in out and f"{decode.engine_id}/{decode.role}#0" in out
    assert "--finished_ok--> awaiting_pull" in out and "--all_reads_done--> done" in out
    assert f"final: {decode.label()} -> done" in out
    assert f"final: {prefill.label()} -> released" in out
    # Asking by the prefill id gives the same story.
    assert "recv:d-3 -> done" in replay_cli(*result.log_paths, "--request", "p-3").stdout
    assert len([m for m in report.machines if m.lifecycle in ("recv", "send")]) == 10


def test_json_and_trace_outputs(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    proc = replay_cli(CLEAN, "--json", "--trace", trace)
    assert proc.returncode == 0
    data = json.loads(proc.stdout)
    assert data["exit_code"] == 0 and data["violations"] == []
    # (The decode worker's peers are machines too: the peer lifecycle.)
    assert {r["lifecycle"] for r in data["requests"]} == {"recv", "send", "peer"}
    assert all(r["terminal"] for r in data["requests"])
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = [e for e in events if e.get("name") == "thread_name"]
    assert len(tracks) == len(data["requests"])  # one track per request
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {"prefill-0", "decode-0"}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] > 0 for e in spans)
    assert chrome_trace(analyse([CLEAN]))["traceEvents"]


def test_replay_of_a_planted_sample_via_directory_argument() -> None:
    proc = replay_cli(PLANTED)
    assert proc.returncode == 1
    assert "read_after_lease_expiry" in proc.stdout and "seq_gap" in proc.stdout


@pytest.mark.parametrize("faults", [Faults(), Faults.mixed(0.1)], ids=["healthy", "mixed"])
def test_sim_logs_replay_clean(tmp_path: Path, faults: Faults) -> None:
    result = run_simulation(SimConfig(seed=21, num_requests=200, faults=faults, log_dir=tmp_path))
    report = analyse(result.log_paths)
    assert report.exit_code == 0, [str(f) for f in report.findings][:5]
    assert {(m.engine_id, m.lifecycle, m.req): m.final_state for m in report.machines} == result.final_states


# --- planted faults, property-based ------------------------------------------

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _sim_logs(tmp: Path, seed: int, n: int) -> list[Path]:
    result = run_simulation(SimConfig(seed=seed, num_requests=n, faults=Faults.mixed(0.05), log_dir=tmp))
    assert analyse(result.log_paths).exit_code == 0
    return result.log_paths


_planted = settings(max_examples=examples(30), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@_planted
@given(seed=st.integers(0, 10_000), n=st.integers(3, 30), pick=st.floats(0, 1, exclude_max=True))
def test_any_dropped_line_is_reported(tmp_path_factory: pytest.TempPathFactory, seed: int, n: int,
                                      pick: float) -> None:
    paths = _sim_logs(tmp_path_factory.mktemp("drop"), seed, n)
    # (A log of one line, a decode engine nobody reached, has only its last line.)
    candidates = [p for p in paths if len(p.read_bytes().splitlines()) > 1]
    path = candidates[int(pick * len(candidates))]
    lines = path.read_bytes().splitlines(keepends=True)
    i = int(pick * (len(lines) - 1))  # any line but the last (a lost tail leaves no gap to see)
    lost = orjson.loads(lines[i])["seq"]
    path.write_bytes(b"".join(lines[:i] + lines[i + 1:]))
    report = analyse(paths)
    assert report.exit_code == 1
    gaps = [f for f in report.findings if f.kind == "seq_gap"]
    assert len(gaps) == 1 and f"seq {lost}" in gaps[0].detail


@_planted
@given(seed=st.integers(0, 10_000), n=st.integers(1, 30), pick=st.floats(0, 1, exclude_max=True),
       as_violation=st.booleans())
def test_any_planted_illegal_transition_is_reported(tmp_path_factory: pytest.TempPathFactory, seed: int, n: int,
                                                   pick: float, as_violation: bool) -> None:
    """A record of an event from a terminal state: as the runtime would record it
    (a violation record) or as a buggy runtime would (a transition record)."""
    paths = _sim_logs(tmp_path_factory.mktemp("illegal"), seed, n)
    path = paths[int(pick * len(paths))]
    recs = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    finals = [r for r in recs if r["kind"] == "transition"
              and r["dst"] in ("done", "failed", "aborted", "released", "expired")]
    if not finals:
        return  # this process saw no request finish (a decode engine nobody reached)
    victim = finals[int(pick * len(finals))]
    planted = {**recs[-1], "seq": recs[-1]["seq"] + 1, "kind": "transition", "req": victim["req"],
               "lifecycle": victim["lifecycle"], "event": "abort", "src": victim["dst"], "input": {},
               "t_mono_ns": recs[-1]["t_mono_ns"] + 1, "t_wall_ns": recs[-1]["t_wall_ns"] + 1}
    planted = {k: v for k, v in planted.items() if k not in ("effects", "blocks", "dropped", "total_dropped")}
    if as_violation:
        planted.update(kind="violation", dst=victim["dst"], violation="event_after_terminal")
    else:
        planted.update(dst="aborted", effects=["release_blocks"])
    with path.open("ab") as f:
        f.write(orjson.dumps(planted) + b"\n")
    report = analyse(paths)
    assert report.exit_code == 1
    mine = [f for f in report.findings if f.req == victim["req"]]
    want = "event_after_terminal" if as_violation else "divergence"
    assert want in {f.kind for f in mine}, [str(f) for f in report.findings]


@_planted
@given(seed=st.integers(0, 10_000), n=st.integers(1, 30), pick=st.floats(0, 1, exclude_max=True))
def test_any_request_left_mid_transfer_is_reported(tmp_path_factory: pytest.TempPathFactory, seed: int, n: int,
                                                  pick: float) -> None:
    """The decode engine's log ends right after some request posted its reads."""
    paths = _sim_logs(tmp_path_factory.mktemp("cut"), seed, n)
    decode = next(p for p in paths if p.name.startswith("decode"))
    lines = decode.read_bytes().splitlines(keepends=True)
    posted = [i for i, line in enumerate(lines) if b'"event":"reads_posted"' in line]
    if not posted:
        return  # every decode request failed or aborted before reading
    i = posted[int(pick * len(posted))]
    record = orjson.loads(lines[i])
    victim, state = record["req"], record["dst"]
    # (posted after the claims' answers: transferring; right behind the claims: reading_unclaimed)
    assert state in ("transferring", "reading_unclaimed")
    decode.write_bytes(b"".join(lines[: i + 1]))
    report = analyse(paths)
    assert report.exit_code == 1
    stuck = {f.req: f.detail for f in report.findings if f.kind == "not_terminal_at_end"}
    assert victim in stuck and f"'{state}'" in stuck[victim]


def test_timeline_includes_diagnostic_notes_of_the_request(tmp_path: Path) -> None:
    clock = VirtualClock()
    path = tmp_path / "d.jsonl"
    with EventLog(path, role="worker", engine_id="decode-9", clock=clock) as log:
        t = LifecycleTracker(RECV, clock, listener=log.record_outcome)
        t.create("d-1")
        t.apply(ev.Abort(req="d-1"))
        log.emit("log", "stale_handshake_reply", "d-1", state="aborted")
        log.emit("log", "other.note", "d-2", state="new")
    out = replay_cli(path, "--request", "d-1").stdout
    assert "d-1  # stale_handshake_reply" in out and '{"state":"aborted"}' in out
    assert "other.note" not in out


def test_records_with_wrong_types_are_reported_not_fatal(tmp_path: Path) -> None:
    lines = (CLEAN / PREFILL_LOG).read_bytes().splitlines(keepends=True)
    recs = [orjson.loads(line) for line in lines]
    # The first request's create and its first transition (after the worker's start notes).
    c = next(i for i, r in enumerate(recs) if r["kind"] == "create")
    t = c + 1
    assert recs[t]["kind"] == "transition" and recs[t]["req"] == recs[c]["req"], recs[t]
    bad = [
        {**recs[c], "seq": "seven"},
        {**recs[t], "lifecycle": None},
        {**recs[t], "input": [1, 2]},
        {**recs[t], "engine_id": 5},
    ]
    body = lines[:t + 1] + [orjson.dumps(b) + b"\n" for b in bad] + lines[t + 1:]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"".join(body))
    report = analyse([path])  # must not raise
    corrupt = sorted((f.line, f.detail) for f in report.findings if f.kind == "corrupt_line")
    assert [line for line, _ in corrupt] == [t + 2, t + 3, t + 4, t + 5]
    assert "'seq' is 'seven', not an integer" in corrupt[0][1]
    assert report.exit_code == 1
    assert "seq_duplicate" not in kinds(report) and "seq_gap" not in kinds(report)


_json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=6)


@_planted
@given(mutations=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(
    ["kind", "event", "src", "dst", "lifecycle", "req", "input", "effects", "blocks", "violation", "seq",
     "t_mono_ns", "rank", "dropped"]), _json_values), max_size=6))
def test_replay_never_crashes_on_mutated_records(tmp_path_factory: pytest.TempPathFactory,
                                                 mutations: list[tuple[int, str, object]]) -> None:
    lines = (CLEAN / DECODE_LOG).read_bytes().splitlines()
    recs = [orjson.loads(line) for line in lines]
    for index, key, value in mutations:
        recs[index % len(recs)][key] = value
    path = tmp_path_factory.mktemp("fuzz") / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    report = analyse([path])  # any finding is fine; an exception is not
    assert report.exit_code in (0, 1)
    # The fast check and the explaining one are two spellings of one rule set.
    for r in read_logs([path]).records:
        assert _record_ok(r) == (_malformed(r) is None), r
    if mutations:
        render_text(report, request=str(mutations[0][2]))
        chrome_trace(report)


# -- a clean shutdown record ---------------------------------------------------------


def _log_with_shutdown(path: Path, live: dict, *, clean: bool = True, after: bool = False) -> Path:
    """A prefill worker log: 'a' released, 'b' still pinned on 2 blocks, then
    (optionally) the worker's clean-shutdown record saying what was ``live``."""
    clock = VirtualClock()
    with EventLog(path, role="worker", engine_id="prefill-9", clock=clock) as log:
        t = LifecycleTracker(SEND, clock, listener=log.record_outcome)
        for req, blocks in (("a", (1,)), ("b", (2, 3))):
            t.create(req)
            t.apply(ev.FinishedOk(req=req, block_ids=blocks, lease_ns=10**12))
        t.apply(ev.ReadNotif(req="a"))
        if live is not None:
            log.emit("log", "worker.shutdown", None, clean=clean, live=live)
        if after:
            log.emit("log", "late.note", "b")
    return path


def test_a_clean_shutdown_record_turns_open_requests_into_information(tmp_path: Path) -> None:
    report = analyse([_log_with_shutdown(tmp_path / "p.jsonl", {"recv": {}, "send": {"b": "awaiting_pull"}})])
    assert report.exit_code == 0, [str(f) for f in report.findings]
    (o,) = report.open_at_shutdown
    assert (o.engine_id, o.lifecycle, o.req, o.state, o.blocks) == ("prefill-9", "send", "b", "awaiting_pull", 2)
    assert "open at a clean shutdown" in render_text(report).lower()


@pytest.mark.parametrize(("live", "clean", "after", "kind", "names"), [
    (None, True, False, "not_terminal_at_end", "b"),  # no record: a crash
    ({"recv": {}, "send": {"b": "awaiting_pull"}}, False, False, "not_terminal_at_end", "b"),  # says not clean
    ({"recv": {}, "send": {}}, True, False, "shutdown_state_mismatch", "b"),  # does not list b
    ({"recv": {}, "send": {"b": "releasing"}}, True, False, "shutdown_state_mismatch", "b"),  # wrong state
    ({"recv": {}, "send": {"b": "awaiting_pull", "a": "awaiting_pull"}}, True, False,
     "shutdown_state_mismatch", "a"),  # lists a request that had ended
    ({"recv": {}, "send": {"b": "awaiting_pull", "zz": "awaiting_pull"}}, True, False,
     "shutdown_state_mismatch", "zz"),  # lists a request the log never had
    ({"recv": {}, "send": {"b": "awaiting_pull"}}, True, True, "record_after_shutdown", "b"),
    ({"send": ["b"]}, True, False, "bad_shutdown_record", None),
])
def test_a_shutdown_record_that_does_not_match_the_log_is_a_violation(
        tmp_path: Path, live: dict | None, clean: bool, after: bool, kind: str, names: str | None) -> None:
    report = analyse([_log_with_shutdown(tmp_path / "p.jsonl", live, clean=clean, after=after)])
    assert report.exit_code == 1
    assert report.open_at_shutdown == [] or kind == "shutdown_state_mismatch"
    found = [f for f in report.findings if f.kind == kind]
    assert found, [str(f) for f in report.findings]
    assert names is None or found[0].req == names, [str(f) for f in found]


# -- re-applying any declaration: random runs, a custom lifecycle -------------------------

import random
import typing

import msgspec

from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.events import EVENT_TYPES
from kvsm.lifecycle.table import CONDITIONS, LIFECYCLES, PREPARE, LifecycleSpec


def _random_event(trigger: str, req: str, rnd: random.Random, now: int) -> ev.Event:
    """An event of ``trigger`` whose fields are drawn by type alone (no field is
    known by name): ints near 0 or near ``now`` (times), short strings, block ids."""
    cls = EVENT_TYPES[trigger]
    hints = typing.get_type_hints(cls)
    fields: dict[str, typing.Any] = {"req": req}
    for f in msgspec.structs.fields(cls):
        if f.name == "req" or (not f.required and rnd.random() < 0.3):
            continue
        tp = hints[f.name]
        if tp is bool:
            fields[f.name] = rnd.random() < 0.5
        elif tp is int:
            fields[f.name] = rnd.choice([0, 1, 2, 3, max(0, now - rnd.randrange(2_000)), now + rnd.randrange(2_000),
                                         rnd.randrange(10**10)])
        elif tp is str:
            fields[f.name] = rnd.choice(["", "x", "refused", "transfer"])
        elif tp == tuple[int, ...]:  # block ids
            fields[f.name] = tuple(rnd.sample(range(64), rnd.randrange(0, 4)))
        elif f.required:
            raise AssertionError(f"no random values for {cls.__name__}.{f.name}: {tp}")
    return cls(**fields)


def random_run(path: Path, specs: typing.Mapping[str, LifecycleSpec], seed: int, steps: int,
               capacity: int = 65536) -> dict[tuple[str, str], str | None]:
    """Drive one tracker per lifecycle with random inputs, mostly legal ones
    (any trigger of the lifecycle now and then, inputs after the end, second
    creates, entries mid-way) and log every outcome: what a runtime could have
    written. Returns each machine's state (live) or final state (ended)."""
    rnd = random.Random(seed)
    clock = VirtualClock(1_000_000)
    states: dict[tuple[str, str], str | None] = {}
    with EventLog(path, role="worker", engine_id="e-0", clock=clock, capacity=capacity) as log:
        trackers = {name: LifecycleTracker(spec, clock, listener=log.record_outcome) for name, spec in specs.items()}
        live: dict[str, list[str]] = {name: [] for name in specs}
        ended: dict[str, list[str]] = {name: [] for name in specs}
        made = 0
        for _ in range(steps):
            clock.advance(rnd.randrange(0, 500))
            name = rnd.choice(sorted(specs))
            spec, tracker = specs[name], trackers[name]
            roll = rnd.random()
            if not live[name] or roll < 0.08:
                made += 1
                req = f"{name[0]}-{made}"
                if rnd.random() < 0.02 and live[name]:
                    req = rnd.choice(live[name])  # a second create
                entry = rnd.choice(sorted(spec.entry_states | {spec.initial}))
                blocks = tuple(rnd.sample(range(64), 2)) if rnd.random() < 0.3 else ()
                if tracker.create(req, entry, blocks).ok:
                    live[name].append(req)
                continue
            if roll < 0.12 and ended[name]:
                req = rnd.choice(ended[name])  # late: stale after the end, or a violation
                tracker.apply(_random_event(rnd.choice(sorted(spec.triggers)), req, rnd, clock.monotonic_ns()))
                continue
            req = rnd.choice(live[name])
            m = tracker.get(req)
            assert m is not None
            legal = spec.legal_triggers(m.state)
            trigger = rnd.choice(legal if legal and roll > 0.15 else sorted(spec.triggers))
            tracker.apply(_random_event(trigger, req, rnd, clock.monotonic_ns()))
            if tracker.get(req) is None:
                live[name].remove(req)
                ended[name].append(req)
        for name, tracker in trackers.items():
            for req in live[name]:
                states[(name, req)] = tracker.get(req).state  # type: ignore[union-attr]
            for req in ended[name]:
                states[(name, req)] = tracker.final_state(req)
    return states


_ALLOWED = {"illegal_transition", "event_after_terminal", "unknown_request", "duplicate_request",
            "read_after_lease_expiry", "heartbeat_after_lease_expiry", "not_terminal_at_end",
            "block_reused_while_held", "block_freed_twice", "blocks_never_freed"}


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32), steps=st.integers(1, 400))
def test_what_the_runtime_records_for_any_lifecycle_replays_without_divergence(
        tmp_path_factory: pytest.TempPathFactory, seed: int, steps: int) -> None:
    """Every declared lifecycle (recv, send, peer: conditions, prepare callbacks
    reading inputs and the time, stale inputs live and after the end), driven at
    random and logged: replay re-applies every record to the same outcome, and
    ends every machine where the tracker did."""
    path = tmp_path_factory.mktemp("any") / "w.jsonl"
    states = random_run(path, LIFECYCLES, seed, steps)
    report = analyse([path])
    assert {f.kind for f in report.findings} <= _ALLOWED, [str(f) for f in report.findings][:5]
    assert {(m.lifecycle, m.req): m.final_state for m in report.machines} == states


# A lifecycle of its own: callbacks that read an input field, the time and the
# data; a condition on the data; a stale rule; a stale input after the end.

class ToyMachine(RequestMachine):
    __slots__ = ("score", "last_ns")

    def __init__(self, req: str, lifecycle: str, state: str, now_ns: int) -> None:
        super().__init__(req, lifecycle, state, now_ns)
        self.score = 0
        self.last_ns = 0


def _toy_add(m: ToyMachine, e: typing.Any, now_ns: int) -> None:
    m.score += e.lease_ns
    m.last_ns = now_ns


def _toy_enough(m: ToyMachine, e: typing.Any) -> bool:
    return m.score >= 10 and m.last_ns > m.created_ns and e.req == m.req


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> LifecycleSpec:
    monkeypatch.setitem(PREPARE, "toy_add", _toy_add)  # type: ignore[arg-type]
    monkeypatch.setitem(CONDITIONS, "toy_enough", _toy_enough)  # type: ignore[arg-type]
    return LifecycleSpec(
        name="toy", states=("idle", "busy", "done", "gone"), initial="idle", terminal=frozenset({"done", "gone"}),
        transitions=(
            {"trigger": "heartbeat", "source": "idle", "dest": "busy", "prepare": "toy_add"},
            {"trigger": "heartbeat", "source": "busy", "dest": "done", "prepare": "toy_add",
             "conditions": "toy_enough", "after": "cancel_timers"},
            {"trigger": "heartbeat", "source": "busy", "dest": "="},
            {"trigger": "read_notif", "source": "busy", "dest": "=", "after": "extend_lease"},
            {"trigger": "abort", "source": ["idle", "busy"], "dest": "gone", "after": "cancel_timers"},
        ),
        entry_states=frozenset({"idle"}),
        stale_inputs=(
            {"trigger": "read_notif", "source": "idle", "why": "nothing to read yet"},
            {"trigger": ["abort", "heartbeat"], "source": "done", "why": "over already"},
        ),
        machine_cls=ToyMachine,
    )


def _toy_log(path: Path, toy: LifecycleSpec) -> Path:
    clock = VirtualClock(1_000)
    with EventLog(path, role="worker", engine_id="toy-0", clock=clock) as log:
        t = LifecycleTracker(toy, clock, listener=log.record_outcome)
        t.create("a")
        for lease in (4, 0, 4, 4):  # busy: 4, then a read, 8, then 12: done
            clock.advance(10)
            t.apply(ev.Heartbeat(req="a", lease_ns=lease) if lease else ev.ReadNotif(req="a"))
        assert t.final_state("a") == "done"
        clock.advance(10)
        assert t.apply(ev.Abort(req="a")).stale == "over already"
        t.create("b")
        assert t.apply(ev.ReadNotif(req="b")).stale == "nothing to read yet"
        t.apply(ev.Abort(req="b"))
    return path


def _edit(path: Path, pick: typing.Callable[[dict], bool], change: typing.Callable[[dict], dict]) -> int:
    lines = path.read_bytes().splitlines(keepends=True)
    for i, line in enumerate(lines):
        rec = orjson.loads(line)
        if pick(rec):
            lines[i] = orjson.dumps(change(rec)) + b"\n"
            path.write_bytes(b"".join(lines))
            return i + 1
    raise AssertionError("no such record")


def test_a_custom_lifecycle_replays_clean(tmp_path: Path, toy: LifecycleSpec) -> None:
    path = _toy_log(tmp_path / "toy.jsonl", toy)
    stale = [orjson.loads(line)["stale"] for line in path.read_bytes().splitlines() if b'"stale"' in line]
    assert stale == ["over already", "nothing to read yet"]
    report = analyse([path], lifecycles={"toy": toy})
    assert report.exit_code == 0, [str(f) for f in report.findings]
    assert {m.req: m.final_state for m in report.machines} == {"a": "done", "b": "gone"}
    # Without its declaration there is nothing to re-apply it to.
    assert kinds(analyse([path])) == {"unknown_lifecycle"}


def _last_heartbeat(r: dict) -> bool:
    return r["event"] == "heartbeat" and r["dst"] == "done"


@pytest.mark.parametrize("tamper", ["dst", "input", "stale", "effects"])
def test_a_tampered_custom_lifecycle_log_diverges(tmp_path: Path, toy: LifecycleSpec, tamper: str) -> None:
    """A recorded destination changed; an input changed so that the condition
    judges otherwise (12 reads as 9: not enough); a stale input's reason dropped;
    an effect dropped: each is a divergence on its line."""
    path = _toy_log(tmp_path / "toy.jsonl", toy)
    line = {
        "dst": lambda: _edit(path, lambda r: r["event"] == "read_notif" and r["req"] == "a",
                             lambda r: {**r, "dst": "idle"}),
        "input": lambda: _edit(path, _last_heartbeat, lambda r: {**r, "input": {"lease_ns": 1}}),
        "stale": lambda: _edit(path, lambda r: "stale" in r, lambda r: {k: v for k, v in r.items() if k != "stale"}),
        "effects": lambda: _edit(path, _last_heartbeat, lambda r: {**r, "effects": []}),
    }[tamper]()
    report = analyse([path], lifecycles={"toy": toy})
    div = [f for f in report.findings if f.kind == "divergence"]
    assert [(f.req, f.line) for f in div] == [("a", line)], [str(f) for f in report.findings]
    if tamper == "input":
        assert "recorded 'busy' -> 'done'" in div[0].detail and "replayed 'busy' -> 'busy'" in div[0].detail
