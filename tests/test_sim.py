"""The simulation: the real prefill and decode workers, many requests, random
faults through their real inputs, virtual time, replay agreement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import RECV, SEND
from kvsm.replay import analyse
from kvsm_testing.sim import Faults, SimConfig, Simulation, run_simulation
from kvsm_testing.sim.config import S

fault_profiles = st.builds(
    Faults,
    **{name: st.sampled_from([0.0, 0.02, 0.1, 0.3]) for name in Faults.__dataclass_fields__
       if name != "transfer_corrupt"},
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), faults=fault_profiles, n=st.integers(1, 60), groups=st.sampled_from([1, 2, 3]))
def test_every_run_ends_terminal_clean_and_replays_exactly(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                                           faults: Faults, n: int, groups: int) -> None:
    """Any faults, any number of KV cache groups (vLLM's hybrid KV cache manager)."""
    log_dir = tmp_path_factory.mktemp("sim")
    result = run_simulation(SimConfig(seed=seed, num_requests=n, faults=faults, log_dir=log_dir, kv_groups=groups))
    assert result.violations == []
    assert result.illegal_events == []
    # Every prefill request, and every decode request that came, ended in a terminal state.
    sends = [k for k in result.final_states if k[1] == "send"]
    assert len(sends) == n
    for (_engine, lifecycle, _req), state in result.final_states.items():
        spec = {"recv": RECV}.get(lifecycle)
        if spec is not None:
            assert state in spec.terminal

    report = analyse(result.log_paths)
    assert report.exit_code == 0, [str(f) for f in report.findings]
    replayed = {(m.engine_id, m.lifecycle, m.req): m.final_state for m in report.machines}
    assert replayed == result.final_states


def test_same_seed_same_run(tmp_path: Path) -> None:
    cfg = SimConfig(seed=1234, num_requests=80, faults=Faults.mixed(0.1))
    a = run_simulation(dataclasses.replace(cfg, log_dir=tmp_path / "a"))
    b = run_simulation(dataclasses.replace(cfg, log_dir=tmp_path / "b"))
    assert a.final_states == b.final_states and a.end_ns == b.end_ns

    def records(d: Path) -> list[dict]:
        out = []
        for p in sorted(d.glob("*.jsonl")):
            for line in p.read_bytes().splitlines():
                rec = orjson.loads(line)
                rec.pop("path", None)
                rec.pop("pin_channel", None)  # worker.started: an ipc path in a fresh temp directory
                out.append(rec)
        return out

    assert records(tmp_path / "a") == records(tmp_path / "b")


def test_mixed_faults_reach_every_terminal_state() -> None:
    result = run_simulation(SimConfig(seed=3, num_requests=400, faults=Faults.mixed(0.08)))
    assert result.violations == []
    assert set(result.count("recv")) == {"done", "failed", "aborted"}
    assert set(result.count("send")) == {"released", "expired"}


def test_corrupted_transfer_is_detected() -> None:
    """The delivery check can fail: flipped bytes on the wire are caught."""
    result = run_simulation(SimConfig(seed=5, num_requests=100, faults=Faults(transfer_corrupt=0.2)))
    kinds = {v.kind for v in result.violations}
    assert kinds == {"corrupt_delivery"}


def test_a_read_landing_in_released_blocks_is_detected() -> None:
    """The write-safety check can fail: a transport whose cancel lies (it says a
    read in flight was cancelled, and the read lands later) is caught writing
    into blocks vLLM got back."""
    faults = Faults(transfer_stuck=0.6, decode_abort=0.6)
    kinds: set[str] = set()
    for seed in range(5):
        sim = Simulation(SimConfig(seed=seed, num_requests=80, faults=faults))
        sim.fabric.cancel_lies = True
        kinds |= {v.kind for v in sim.run().violations}
        if "write_into_released_block" in kinds:
            break
    assert "write_into_released_block" in kinds
    # ... while the honest transport survives exactly the same faults.
    for seed in range(5):
        assert run_simulation(SimConfig(seed=seed, num_requests=80, faults=faults)).violations == []


def test_heartbeats_keep_the_pin_of_a_request_queued_past_its_lease() -> None:
    """Decode requests that wait for blocks longer than a lease still read: the
    decode scheduler's heartbeats extend the prefill side's leases."""
    result = run_simulation(SimConfig(seed=2, num_requests=20, faults=Faults(decode_queued=1.0)))
    assert result.violations == [] and result.illegal_events == []
    assert result.count("send") == {"released": 20}
    assert result.count("recv") == {"done": 20}
    assert result.end_ns > SimConfig().lease_ns


def test_late_pins_are_claimed_again_until_they_land() -> None:
    """A pin that reaches the prefill worker only with a later step: the decode
    side's claims are answered "unknown" and retried until it lands."""
    result = run_simulation(SimConfig(seed=6, num_requests=30, faults=Faults(pin_late=1.0)))
    assert result.violations == [] and result.illegal_events == []
    assert result.count("recv") == {"done": 30}


def test_many_requests_through_one_simulation() -> None:
    result = run_simulation(SimConfig(seed=9, num_requests=5000, faults=Faults.mixed(0.02), num_blocks=8192))
    assert result.violations == [] and result.illegal_events == []
    assert sum(result.count("send").values()) == 5000


# A lease shorter than the reads take: what a prefill clock running ahead of the
# decode side's would do. Claims extend it; heartbeats are not needed here.
SHORT_LEASE = SimConfig(seed=4, num_requests=40, lease_ns=2 * S, heartbeat_ns=S // 4,
                        faults=Faults(transfer_stuck=1.0))


def test_reads_completing_past_the_lease_are_never_served() -> None:
    """Reads that may have overlapped the prefill side's lease expiry are failed
    (the blocks may have been reused), never delivered: the only trace is the
    prefill side recording a read after the lease expired."""
    seen: set[str] = set()
    sim = Simulation(SHORT_LEASE)
    sim.observers.append(lambda engine_id, o: seen.update(o.effects))
    result = sim.run()
    assert result.violations == []
    assert {(o.lifecycle, o.violation) for o in result.illegal_events} == {("send", "read_after_lease_expiry")}
    assert "count_late_reads" in seen
    assert {"done", "failed"} <= set(result.count("recv"))


def test_the_workers_emit_every_effect_of_the_table() -> None:
    """Every effect each lifecycle can emit is emitted by the real workers' machines
    in a run with mixed faults (and, for the late-read one, with a short lease):
    the simulation reaches every corner of the table (the worker carrying them
    out is tested in test_connector_worker)."""
    seen: dict[str, set[str]] = {"recv": set(), "send": set()}

    def spy(engine_id: str, o: Outcome) -> None:
        if o.lifecycle in seen:
            seen[o.lifecycle].update(o.effects)

    sim = Simulation(SimConfig(seed=8, num_requests=600, faults=Faults.mixed(0.08), push=0.3, stream=0.2,
                               stream_preempt=0.2))
    sim.observers.append(spy)
    assert sim.run().violations == []
    short = Simulation(SHORT_LEASE)
    short.observers.append(spy)
    short.run()
    # Writes (push mode) that hang past a short lease: the lease's end cancels them.
    hung = Simulation(SimConfig(seed=4, num_requests=20, lease_ns=2 * S, heartbeat_ns=S // 4, push=1.0,
                                faults=Faults(transfer_hang=1.0)))
    hung.observers.append(spy)
    assert hung.run().violations == []
    # The admission bound's refusals need MAX_EARLY_INPUTS early inputs waiting, far
    # beyond a simulated run: the real worker emits them in tests/test_worker_bounds.py.
    beyond_the_bound = {"count_refused_abandon", "count_refused_read"}
    # The simulation runs no decode engine's holds for next turns: the real worker's
    # hold endings are in tests/test_holds.py.
    beyond_the_bound.add("count_hold_ended")
    # A stream is notified only once its prompt is complete, and the simulation's prefill
    # legs then finish at once, never preempted: the table's choice is in test_lifecycle.py.
    beyond_the_bound.add("fail_notified_streams")
    for spec in (RECV, SEND):
        declared = {e for rules in spec.rules.values() for r in rules for e in r.effects} - beyond_the_bound
        assert seen[spec.name] == declared, declared ^ seen[spec.name]


def test_several_kv_cache_groups_deliver_every_group_and_a_split_mismatch_fails(tmp_path: Path) -> None:
    """Three groups: every request is read group by group and delivered intact.
    A decode engine whose KV cache has another number of groups than its facts
    say fails each request as bad_params (never a read split wrongly)."""
    result = run_simulation(SimConfig(seed=5, num_requests=40, kv_groups=3, max_blocks_per_request=9,
                                      log_dir=tmp_path / "three"))
    assert result.violations == [] and set(result.count("recv")) == {"done"}
    # The decode log says how many blocks of each group every request read, and replays clean.
    allocated = [orjson.loads(line)["input"] for p in result.log_paths if p.name.startswith("decode")
                 for line in p.read_bytes().splitlines() if b'"event":"allocated"' in line]
    assert len(allocated) == 40
    assert all(len(a["group_sizes"]) == 3 and sum(a["group_sizes"]) == len(a["block_ids"]) for a in allocated)
    assert analyse(result.log_paths).exit_code == 0
    sim = Simulation(SimConfig(seed=5, num_requests=10, kv_groups=2, log_dir=tmp_path))
    sim.decode.agent.num_groups = 3  # the engine's layout disagrees with its scheduler's facts
    bad = sim.run()
    assert set(bad.count("recv")) == {"failed"}
    errors = [orjson.loads(line) for p in bad.log_paths if p.name.startswith("decode")
              for line in p.read_bytes().splitlines() if b'"event":"error"' in line]
    assert errors and {e["input"]["kind"] for e in errors} == {"bad_params"}
    assert "KV cache groups" in errors[0]["input"]["detail"]
