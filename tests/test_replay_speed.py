"""Replay's fast path loses no check. (Nothing here is timed: the speed is
measured by ``tools/bench.py --only replay``.)

``analyse`` decodes lines straight into typed per-event records, takes a short
way for creates and legal transitions recorded as the table has them, and keeps
re-applies everything else with the runtime's own step. These tests plant each
kind of damage deep inside a large simulated log, where the fast path runs all
around it, and hold every fast piece to its slow reference: a
``LifecycleTracker`` fed each machine's recorded inputs, a plain model of the
block ledger's rules, the dict reader's rules (``decode_line`` + ``_record_ok``)
and ``event_from_record``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.eventlog import reader
from kvsm.eventlog.reader import decode_line, input_dict, scan_log
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.events import EVENT_TYPES, event_from_record
from kvsm.lifecycle.invariants import BlockLedger
from kvsm.lifecycle.machine import LifecycleTracker
from kvsm.lifecycle.table import EFFECTS, LIFECYCLES
from kvsm.replay import (
    _MACHINE_KINDS,
    Finding,
    Machine,
    _malformed,
    _record_ok,
    analyse,
)
from kvsm.replay.fold import _divergence
from kvsm.replay.model import _where
from kvsm_testing.sim import Faults, SimConfig, run_simulation

# ~3,000 requests, ~28,000 records: large enough that a planted line sits among
# thousands handled by the fast path on both sides of it.
LARGE = SimConfig(seed=11, num_requests=3_000, faults=Faults.mixed(0.03), num_blocks=1 << 14)


@pytest.fixture(scope="module")
def large_logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[bytes]]:
    result = run_simulation(SimConfig(**{**LARGE.__dict__, "log_dir": tmp_path_factory.mktemp("large")}))
    report = analyse(result.log_paths)
    assert report.exit_code == 0, [str(f) for f in report.findings][:5]
    assert {(m.engine_id, m.lifecycle, m.req): m.final_state for m in report.machines} == result.final_states
    return {p.name: p.read_bytes().splitlines(keepends=True) for p in result.log_paths}


def _log_named(logs: dict[str, list[bytes]], prefix: str) -> str:
    """The log whose name starts with ``prefix`` and holds the most lines."""
    return max((n for n in logs if n.startswith(prefix)), key=lambda n: len(logs[n]))


def _deep(lines: list[bytes], needle: bytes) -> int:
    """The index of the first line holding ``needle`` past the middle of the file."""
    for i in range(len(lines) // 2, len(lines)):
        if needle in lines[i]:
            return i
    raise AssertionError(f"no {needle!r} in the second half")


def _rewrite(lines: list[bytes], i: int, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> list[bytes]:
    rec = change(orjson.loads(lines[i]))
    return lines[:i] + ([] if rec is None else [orjson.dumps(rec) + b"\n"]) + lines[i + 1:]


# The engines' logs, by the start of their names (which process of each engine
# logs its machines is the simulation's choice).
PREFILL, DECODE = "prefill-0.", "decode-0."
HEARTBEAT = b'"event":"heartbeat"'  # a send self-loop with no block effect: replacing it disturbs nothing else


def _as_violation(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "kind": "violation", "event": "abort", "input": {}, "effects": [], "violation": "illegal_transition"}


def _as_overflow(r: dict[str, Any]) -> dict[str, Any]:
    header = {k: v for k, v in r.items() if k not in ("lifecycle", "input", "effects")}
    return {**header, "kind": "log_overflow", "event": "log_overflow", "req": None, "dropped": 7}


# name -> (file, line to change, change, (kind, on that line?) findings that must be there)
PLANTS: dict[str, tuple[str, bytes, Callable[..., Any], set[tuple[str, bool]]]] = {
    "effects_dropped": (PREFILL, b'"effects":["cancel_lease","free_blocks"]',
                        lambda r: {**r, "effects": ["cancel_lease"]},
                        {("divergence", True), ("blocks_never_freed", False)}),
    "illegal_event_recorded": (PREFILL, HEARTBEAT, _as_violation, {("illegal_transition", True)}),
    "line_lost": (PREFILL, HEARTBEAT, lambda r: None, {("seq_gap", False)}),
    "garbage_line": (PREFILL, HEARTBEAT, lambda r: "not json", {("corrupt_line", True), ("seq_gap", False)}),
    "input_of_wrong_type": (DECODE, b'"event":"matched"',
                            lambda r: {**r, "input": {**r["input"], "num_tokens": "many"}}, {("divergence", True)}),
    "header_of_wrong_type": (PREFILL, HEARTBEAT, lambda r: {**r, "seq": str(r["seq"])},
                             {("corrupt_line", True), ("seq_gap", False)}),
    "state_not_in_table": (DECODE, b'"event":"all_reads_done"', lambda r: {**r, "dst": "finished"},
                           # left mid-lifecycle: at a crash, or at a clean shutdown that says otherwise
                           {("divergence", True), ("not_terminal_at_end|shutdown_state_mismatch", False)}),
    "event_not_in_table": (PREFILL, HEARTBEAT, lambda r: {**r, "event": "poke"}, {("divergence", True)}),
    "other_process_in_file": (PREFILL, HEARTBEAT, lambda r: {**r, "pid": r["pid"] + 1}, {("seq_gap", True)}),
    "undeclared_lifecycle": (PREFILL, HEARTBEAT, lambda r: {**r, "lifecycle": "sendx"},
                             {("unknown_lifecycle", True)}),
    "duplicate_create": (PREFILL, HEARTBEAT, lambda r: {**r, "kind": "create", "event": "create", "src": None,
                                                        "dst": "prefilling", "blocks": [], "input": None},
                         {("divergence", True)}),
    "overflow_reported": (PREFILL, HEARTBEAT, _as_overflow, {("records_dropped", True)}),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_violation_planted_deep_in_a_large_log_is_found(large_logs: dict[str, list[bytes]], tmp_path: Path,
                                                          plant: str) -> None:
    prefix, needle, change, want = PLANTS[plant]
    name = _log_named(large_logs, prefix)
    lines = large_logs[name]
    i = _deep(lines, needle)
    if plant == "garbage_line":
        mutated = lines[:i] + [b"not json\n"] + lines[i + 1:]
    else:
        mutated = _rewrite(lines, i, change)
    for other, body in large_logs.items():
        (tmp_path / other).write_bytes(b"".join(mutated if other == name else body))
    report = analyse(sorted(tmp_path.glob("*.jsonl")))
    assert report.exit_code == 1
    found = {(f.kind, f.line == i + 1 and f.file is not None and f.file.endswith(name)) for f in report.findings}
    for kind, on_the_line in want:  # (a|b: either)
        assert (kind, True) in found if on_the_line else set(kind.split("|")) & {k for k, _ in found}, (
            plant, kind, [str(f) for f in report.findings][:8])
    # The damage is local: nothing is reported about requests the plant did not touch.
    touched = {orjson.loads(lines[i]).get("req")}
    assert {f.req for f in report.findings if f.req is not None} <= touched, [str(f) for f in report.findings][:8]


def test_blocks_taken_twice_deep_in_a_large_log(large_logs: dict[str, list[bytes]], tmp_path: Path) -> None:
    """Request A's allocation takes the blocks request B still holds (B allocated
    earlier and has not finished): the ledger says so, at A's line."""
    decode = _log_named(large_logs, DECODE)
    lines = large_logs[decode]
    recs = [orjson.loads(line) for line in lines]
    ended: dict[str, int] = {}
    for j, r in enumerate(recs):
        if r["kind"] == "transition" and r["dst"] in ("done", "failed", "aborted"):
            ended[r["req"]] = j
    live_b = None
    for i in range(len(recs) // 2, len(recs)):
        if recs[i]["event"] != "allocated":
            continue
        for j in range(i - 1, 0, -1):
            b = recs[j]
            if b["event"] == "allocated" and b["blocks"] and ended.get(b["req"], len(recs)) > i:
                live_b = b
                break
        if live_b is not None:
            break
    assert live_b is not None
    victim = recs[i]
    mutated = _rewrite(lines, i, lambda r: {**r, "blocks": live_b["blocks"]})
    for other, body in large_logs.items():
        (tmp_path / other).write_bytes(b"".join(mutated if other == decode else body))
    report = analyse(sorted(tmp_path.glob("*.jsonl")))
    clash = [f for f in report.findings if f.kind == "block_reused_while_held"]
    assert [(f.req, f.line) for f in clash] == [(victim["req"], i + 1)], [str(f) for f in report.findings][:8]
    assert live_b["req"] in clash[0].detail


def test_a_lifecycle_line_that_looks_like_a_diagnostic_one_replays_the_same(
        large_logs: dict[str, list[bytes]], tmp_path: Path) -> None:
    """The reader sends lines holding the bytes ``"kind":"log`` to the plain
    decoder (diagnostic lines fit no per-event variant). A lifecycle record that
    holds them inside its input takes that way too and must replay as before."""
    decode = _log_named(large_logs, DECODE)
    lines = large_logs[decode]
    i = _deep(lines, b'"event":"matched"')
    mutated = _rewrite(lines, i, lambda r: {**r, "input": {**r["input"], "note": {"kind": "log"}}})
    assert b'"kind":"log"' in mutated[i]
    for other, body in large_logs.items():
        (tmp_path / other).write_bytes(b"".join(mutated if other == decode else body))
    scan = scan_log(tmp_path / decode)
    assert [type(r) for r in scan.plain] == [reader.Record] and scan.plain[0].line == i + 1
    report = analyse(sorted(tmp_path.glob("*.jsonl")))
    assert report.exit_code == 0, [str(f) for f in report.findings][:5]
    assert report.num_records == sum(len(body) for body in large_logs.values())


# --- the fast pieces against their references --------------------------------

_STATES = sorted({s for spec in LIFECYCLES.values() for s in spec.states})
_TRIGGERS = sorted(EVENT_TYPES)
_field_values: dict[str, st.SearchStrategy[Any]] = {
    "kind": st.sampled_from(["create", "transition", "violation", "log", "bogus"]),
    "event": st.sampled_from([*_TRIGGERS, "create", "poke"]),
    "src": st.sampled_from([*_STATES, None, "limbo"]),
    "dst": st.sampled_from([*_STATES, None, "limbo"]),
    "lifecycle": st.sampled_from(["recv", "send", "sendx", None]),
    "violation": st.sampled_from([None, "illegal_transition", "unknown_request", 3]),
    "effects": st.lists(st.sampled_from([*EFFECTS, "explode"]), max_size=4) | st.just("free_blocks"),
    "blocks": st.lists(st.integers(0, 12), max_size=4) | st.just([True]),
    "input": st.dictionaries(st.sampled_from(["num_tokens", "block_ids", "reader", "kind", "what", "peer", "where",
                                              "lease_ns", "expected_reads", "req", "trigger", "zz"]),
                             st.none() | st.integers(-3, 2**70) | st.text(max_size=3)
                             | st.lists(st.integers(0, 9), max_size=3), max_size=4) | st.none() | st.just([1]),
    "seq": st.integers(0, 40) | st.just("7") | st.just(2**64),
    "req": st.sampled_from(["d-0", "d-1", "p-0", "p-1", None]) | st.integers(0, 3),
    "t_mono_ns": st.integers(0, 10**9) | st.just(1.5),
    "schema": st.just(1) | st.just(True) | st.just(1.0) | st.just(2),
}


@pytest.fixture(scope="module")
def small_logs(tmp_path_factory: pytest.TempPathFactory) -> list[list[bytes]]:
    result = run_simulation(SimConfig(seed=5, num_requests=30, faults=Faults.mixed(0.2),
                                      log_dir=tmp_path_factory.mktemp("small")))
    return [p.read_bytes().splitlines(keepends=True) for p in result.log_paths]


_fuzz = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fuzz
@given(mutations=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(sorted(_field_values)), st.data()),
                          min_size=1, max_size=8),
       shuffle=st.integers(0, 3))
def test_fast_path_agrees_with_its_references_on_mutated_logs(
        small_logs: list[list[bytes]], tmp_path_factory: pytest.TempPathFactory,
        mutations: list[tuple[int, str, st.DataObject]], shuffle: int) -> None:
    """On logs with damaged records: every machine's divergence is the tracker's,
    every typed record is what the dict reader makes of its line, and the
    findings name every damaged line that the dict rules reject."""
    d = tmp_path_factory.mktemp("mut")
    paths = []
    dict_rejects: set[tuple[str, int]] = set()
    for n, lines in enumerate(small_logs):
        recs = [orjson.loads(line) for line in lines]
        for index, key, data in mutations:
            if index % 2 == n:
                recs[index % len(recs)][key] = data.draw(_field_values[key])
        if shuffle == n + 1:  # out of seq order: the sort and the seq check run
            random.Random(n).shuffle(recs)
        path = d / f"log-{n}.jsonl"
        body = [msgspec.json.encode(r) + b"\n" for r in recs]  # (orjson cannot write a 70-bit integer)
        path.write_bytes(b"".join(body))
        paths.append(path)
        for lineno, raw in enumerate(body, 1):
            item = decode_line(str(path), lineno, raw)
            if type(item) is not dict or not _record_ok(item):
                dict_rejects.add((str(path), lineno))
            _typed_matches_dict(raw, item)
    report = analyse(paths)
    assert report.exit_code in (0, 1)
    for m in report.machines:
        if m.lifecycle in LIFECYCLES:
            assert str(m._divergence) == str(_tracker_divergence(m)), m.label()
    # A line the dict rules reject is never folded: it is reported as corrupt.
    corrupt = {(f.file, f.line) for f in report.findings if f.kind == "corrupt_line"}
    assert dict_rejects <= corrupt
    assert not ({(r.file, r.line) for m in report.machines for r in m.records} & dict_rejects)


def _tracker_divergence(m: Machine) -> Finding | None:
    """The reference: the machine's recorded inputs fed to a fresh
    ``LifecycleTracker`` on a clock set to each record's time; the first
    outcome that differs from its record, in replay's words."""
    spec = LIFECYCLES[m.lifecycle]
    clock = VirtualClock(m.records[0].t_mono_ns)
    tracker = LifecycleTracker(spec, clock)
    for r in m.records:
        if r.t_mono_ns > clock.monotonic_ns():
            clock.set(r.t_mono_ns)
        if r.kind == "create":
            duplicate = r.violation == "duplicate_request" and m.req in tracker  # its entry is not recorded
            out = tracker.create(m.req, entry=None if duplicate else r.dst, block_ids=tuple(r.blocks or ()))
            src = r.src  # a creation has no prior state to compare
        else:
            try:
                event = event_from_record(r.event, m.req, input_dict(r.input) or {})
            except ValueError as exc:
                return Finding("divergence", f"cannot rebuild the input of {r.event!r}: {exc}", m.req,
                               **_where(r))
            out = tracker.apply(event)
            src = out.src
        want = (r.src, r.dst, r.violation, tuple(r.effects or ()), r.stale)
        got = (src, out.dst, out.violation, tuple(out.effects), out.stale)
        if want != got:
            return _divergence(r, m.req, want, got)
    return None


_DEFAULTS = {f.name: (f.default if f.default is not msgspec.NODEFAULT else f.default_factory())
             for f in msgspec.structs.fields(reader.Record) if not f.required}


def _typed_matches_dict(raw: bytes, item: Any) -> None:
    """If the typed decoder takes a line, the dict reader takes it too, the
    replay rules accept it, and both read the same values (the input as the
    event ``event_from_record`` rebuilds)."""
    rec = None
    for decode in (reader._decode_typed, reader._decode_record):
        try:
            rec = decode(raw)
            break
        except msgspec.DecodeError:
            continue
    if rec is None:
        return
    assert type(item) is dict, (raw, item)
    variant = type(rec) is not reader.Record
    if not _record_ok(item):
        # Only a plain Record may still break a rule: replay applies it to those.
        assert not variant and rec.kind in _MACHINE_KINDS and (rec.req is None or rec.lifecycle is None), raw
        assert _malformed(item) == f"{rec.kind} record without a string 'req' and 'lifecycle'"
    for name in reader.RECORD_FIELDS:
        if variant and name in ("dropped", "clean", "live"):
            continue  # not read from a lifecycle record
        got = rec.get(name)
        if variant and name == "input":
            if rec.event == "create":
                assert got == item.get("input"), raw
            else:  # the event itself, as event_from_record builds it from the line
                want = event_from_record(item["event"], item["req"], item.get("input") or {})
                assert msgspec.structs.asdict(rec.input) | {"req": item["req"]} == msgspec.structs.asdict(want)
            continue
        want = item[name] if name in item else _DEFAULTS[name]
        if name in ("effects", "blocks") and type(want) is list:
            want = tuple(want)
        assert got == want and type(got) is type(want), (name, got, want, raw)


_inputs = st.dictionaries(
    st.sampled_from(["num_tokens", "remote_engine", "remote_req", "remote_port", "block_ids", "num_external_tokens",
                     "reader", "kind", "detail", "what", "peer", "where", "lease_ns", "expected_reads", "reason",
                     "num_bytes", "num_blocks", "num_descs", "req", "trigger", "zz"]),
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False) | st.text(max_size=3)
    | st.lists(st.integers(-3, 2**64) | st.booleans(), max_size=3) | st.sampled_from(_TRIGGERS),
    max_size=5)


@settings(max_examples=examples(300), deadline=None)
@given(trigger=st.sampled_from(_TRIGGERS), inputs=_inputs)
def test_input_types_are_never_looser_than_event_from_record(trigger: str, inputs: dict[str, Any]) -> None:
    """The per-event ``input`` types accept only what ``event_from_record`` builds
    from the same object, and build the same event (but ``req``)."""
    logged = reader._EVENT_INPUTS[trigger][1]
    try:
        raw = orjson.dumps(inputs)
    except orjson.JSONEncodeError:
        return  # an integer orjson cannot write: no log holds it
    try:
        fast = msgspec.json.decode(raw, type=logged)
    except msgspec.DecodeError:
        return
    slow = event_from_record(trigger, "r-1", orjson.loads(raw))  # raises if the fast type was looser
    assert msgspec.structs.asdict(fast) | {"req": "r-1"} == msgspec.structs.asdict(slow)
    assert fast.trigger == slow.trigger and isinstance(fast, EVENT_TYPES[trigger])


_ops = st.lists(st.tuples(st.sampled_from(["hold", "pin", "release", "finish"]), st.sampled_from("abcd"),
                          st.lists(st.integers(0, 6), max_size=4)), max_size=40)


@settings(max_examples=examples(300), deadline=None)
@given(ops=_ops)
def test_block_ledger_keeps_its_rules(ops: list[tuple[str, str, list[int]]]) -> None:
    """``BlockLedger`` (the simulation's and replay's one ledger) against a plain
    model of its rules, op for op: a take is exclusive, a pin shared with other
    pins; handing back what one does not hold is a double free; a request that
    ends holding blocks never freed them. ``where`` comes back as it was given."""
    ledger = BlockLedger("pool")
    holders: dict[int, dict[str, bool]] = {}  # block -> {request: shared?}
    want: list[tuple[str, str, list[int], int]] = []
    for n, (op, req, blocks) in enumerate(ops):
        where = {"line": n}
        if op in ("hold", "pin"):
            shared = op == "pin"
            ledger.hold(req, blocks, where, shared=shared)
            clash = sorted({b for b in blocks if any(o != req and not (shared and s)
                                                     for o, s in holders.get(b, {}).items())})
            for b in blocks:
                if b not in clash:
                    holders.setdefault(b, {})[req] = shared
            if clash:
                want.append(("block_reused_while_held", req, clash, n))
        elif op == "release":
            ledger.release(req, blocks, where)
            not_held = sorted(b for i, b in enumerate(blocks)
                              if req not in holders.get(b, {}) or b in blocks[:i])
            for b in blocks:
                holders.get(b, {}).pop(req, None)
            if not_held:
                want.append(("block_freed_twice", req, not_held, n))
        else:
            ledger.finish(req, "done", where)
            left = sorted(b for b, h in holders.items() if req in h)
            for b in left:
                del holders[b][req]
            if left:
                want.append(("blocks_never_freed", req, left, n))
        for h in [b for b, h in holders.items() if not h]:
            del holders[h]
        assert [(v.kind, v.req, v.where["line"]) for v in ledger.violations] == [(k, r, w) for k, r, _, w in want]
        assert all(str(blocks_) in v.detail for v, (_, _, blocks_, _) in zip(ledger.violations, want))
        assert {r: ledger.held(r) for r in "abcd"} == {r: {b for b, h in holders.items() if r in h} for r in "abcd"}
        assert ledger.held() == set(holders)


def test_block_ledger_reads_the_tables_effect_sets() -> None:
    """``apply_effects`` takes, shares and hands back blocks as the table's
    effect sets say, in the order of the effects."""
    from kvsm.lifecycle.table import BLOCK_HOLDING_EFFECTS, BLOCK_RELEASING_EFFECTS, SHARED_HOLDING_EFFECTS

    take = sorted(BLOCK_HOLDING_EFFECTS - SHARED_HOLDING_EFFECTS)[0]
    pin = sorted(SHARED_HOLDING_EFFECTS)[0]
    free = sorted(BLOCK_RELEASING_EFFECTS)[0]
    other = sorted(set(EFFECTS) - BLOCK_HOLDING_EFFECTS - BLOCK_RELEASING_EFFECTS)[0]
    ledger = BlockLedger("pool")
    ledger.apply_effects("a", [other, pin], (1, 2))
    ledger.apply_effects("b", (pin,), (2,))
    assert ledger.held("a") == {1, 2} and ledger.held("b") == {2} and not ledger.violations
    ledger.apply_effects("c", (take,), [2, 3], where="here")
    assert [(v.kind, v.where) for v in ledger.violations] == [("block_reused_while_held", "here")]
    ledger.apply_effects("a", (free, other), (1, 2))
    ledger.apply_effects("b", (free, free), (2,))
    assert [v.kind for v in ledger.violations] == ["block_reused_while_held", "block_freed_twice"]
    assert ledger.held() == {3}


def test_scan_of_a_file_with_two_processes_and_misfits(tmp_path: Path) -> None:
    """A file that is not one process's log, with lines that fit no per-event
    type: the scan says it does not know the stream, keeps every line's number."""
    lines = [
        {"schema": 1, "seq": 0, "t_mono_ns": 0, "t_wall_ns": 0, "pid": 1, "role": "worker", "engine_id": "e",
         "rank": 0, "kind": "log_start", "req": None, "event": "log_start", "src": None, "dst": None},
        {"schema": 1, "seq": 1, "t_mono_ns": 1, "t_wall_ns": 1, "pid": 1, "role": "worker", "engine_id": "e",
         "rank": 0, "kind": "create", "req": "a", "event": "create", "src": None, "dst": "new",
         "lifecycle": "recv", "blocks": []},
        {"schema": 1, "seq": 0, "t_mono_ns": 2, "t_wall_ns": 2, "pid": 2, "role": "worker", "engine_id": "e",
         "rank": 0, "kind": "create", "req": "b", "event": "create", "src": None, "dst": "new",
         "lifecycle": "recv", "blocks": []},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines) + b"\n" + b'{"half":')
    scan = scan_log(path)
    assert scan.stream is None
    assert [(type(r).__name__, r.line, r.pid) for r in scan.items] == [
        ("Record", 1, 1), ("Record_create", 2, 1), ("Record_create", 3, 2)]
    assert [(p.line, p.reason.split(" (")[0]) for p in scan.problems] == [(4, "empty line"),
                                                                         (5, "truncated last line")]
    one = tmp_path / "one.jsonl"
    one.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines[:2]))
    assert scan_log(one).stream == ("e", "worker", 0, 1)
