"""The simulation harness: many requests, random faults, virtual time, replay agreement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.lifecycle.table import RECV, RECV_TRANSITIONS, LifecycleSpec
from kvsm.replay import analyse
from kvsm.sim import Faults, SimConfig, run_simulation

fault_profiles = st.builds(
    Faults,
    **{name: st.sampled_from([0.0, 0.02, 0.1, 0.3]) for name in Faults.__dataclass_fields__
       if name != "transfer_corrupt"},
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), faults=fault_profiles, n=st.integers(1, 60))
def test_every_run_ends_terminal_clean_and_replays_exactly(tmp_path_factory: pytest.TempPathFactory, seed: int,
                                                           faults: Faults, n: int) -> None:
    log_dir = tmp_path_factory.mktemp("sim")
    result = run_simulation(SimConfig(seed=seed, num_requests=n, faults=faults, log_dir=log_dir))
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


def _broken_recv() -> LifecycleSpec:
    """A table with a classic bug: abort during a transfer frees the blocks at once."""
    transitions = []
    for t in RECV_TRANSITIONS:
        if t["trigger"] == "abort" and t["source"] == "transferring":
            t = {"trigger": "abort", "source": "transferring", "dest": "aborted",
                 "after": ["release_reads", "notify_abandon", "release_blocks", "cancel_timers"]}
        transitions.append(t)
    return LifecycleSpec("recv", RECV.states, RECV.initial, RECV.terminal, tuple(transitions),
                         entry_states=RECV.entry_states)


def test_freeing_blocks_under_a_posted_read_is_detected() -> None:
    """The write-safety check can fail: a table that frees under a read is caught."""
    faults = Faults(transfer_stuck=0.6, decode_abort=0.6)
    kinds: set[str] = set()
    for seed in range(5):
        result = run_simulation(SimConfig(seed=seed, num_requests=80, faults=faults, recv_spec=_broken_recv()))
        kinds |= {v.kind for v in result.violations}
    assert "write_into_released_block" in kinds
    # ... while the real table survives exactly the same faults.
    for seed in range(5):
        assert run_simulation(SimConfig(seed=seed, num_requests=80, faults=faults)).violations == []


def test_many_requests_through_one_simulation() -> None:
    result = run_simulation(SimConfig(seed=9, num_requests=5000, faults=Faults.mixed(0.02), num_blocks=8192))
    assert result.violations == [] and result.illegal_events == []
    assert sum(result.count("send").values()) == 5000


def test_the_simulation_executes_every_effect_of_the_table() -> None:
    """Every effect each lifecycle can emit is executed by the harness (it raises on an
    unknown one), and a run with mixed faults exercises all of them."""
    from kvsm.lifecycle.machine import Outcome
    from kvsm.lifecycle.table import SEND
    from kvsm.sim.harness import Simulation

    seen: dict[str, set[str]] = {"recv": set(), "send": set()}
    sim = Simulation(SimConfig(seed=8, num_requests=600, faults=Faults.mixed(0.08)))
    for engine in (sim.prefill, sim.decode):
        execute = engine.effects

        def spy(o: Outcome, execute=execute) -> None:
            seen[o.lifecycle].update(o.effects)
            execute(o)

        engine.effects = spy
    assert sim.run().violations == []
    for spec in (RECV, SEND):
        declared = {e for rules in spec.rules.values() for r in rules for e in r.effects}
        assert seen[spec.name] == declared, declared ^ seen[spec.name]
