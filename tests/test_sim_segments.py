"""Block sizes that differ, on virtual time: the simulation's prefill and decode
engines keep blocks of different sizes (tokens laid out like vLLM-CPU's vec
kernel: a transposed K plane, a token-major V plane), the decode side pairs
its blocks with the prefill's by kvsm's own pairing (``kvsm.scheduler.block_pairing``,
the function kvsm's scheduler half calls) and the real decode worker reads
them in segments through the in-memory transport, which builds each read's
byte runs with the real layout code. Every delivered block is checked token
by token against what the prefill computed; with faults, nothing is lost.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.table import RECV
from kvsm.replay import analyse
from kvsm.transport.layout import Segments
from kvsm.transport.memory import InMemoryAgent, InMemoryFabric, token_layout_of
from kvsm_testing.sim import Faults, SimConfig, run_simulation
from kvsm_testing.sim import engines as sim_engines
from kvsm_testing.sim.engines import SIM_HEADS, SIM_PLANES, token_block

SIZES = [(16, 32), (32, 16), (16, 64), (64, 16), (32, 64)]

fault_profiles = st.builds(
    Faults,
    **{name: st.sampled_from([0.0, 0.05, 0.2]) for name in Faults.__dataclass_fields__ if name != "transfer_corrupt"},
)


@pytest.mark.parametrize("push", [0.0, 1.0], ids=["read", "pushed"])
@pytest.mark.parametrize("sizes", SIZES, ids=[f"p{p}-d{d}" for p, d in SIZES])
def test_every_prompt_arrives_token_for_token_in_segments(sizes: tuple[int, int], push: float) -> None:
    """Read by the decode worker, or written by the prefill worker (push mode: the
    same segments from the other side)."""
    result = run_simulation(SimConfig(seed=11, num_requests=40, block_tokens=sizes, push=push))
    assert result.violations == []
    assert result.illegal_events == []
    assert result.count("recv") == {"done": 40}
    assert result.count("send") == {"released": 40}


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), faults=fault_profiles, n=st.integers(1, 40), sizes=st.sampled_from(SIZES),
       push=st.sampled_from([0.0, 0.5]))
def test_any_faults_across_block_sizes_end_terminal_clean_and_replay_exactly(
        tmp_path_factory: pytest.TempPathFactory, seed: int, faults: Faults, n: int, sizes: tuple[int, int],
        push: float) -> None:
    log_dir = tmp_path_factory.mktemp("sim-seg")
    result = run_simulation(SimConfig(seed=seed, num_requests=n, faults=faults, log_dir=log_dir, block_tokens=sizes,
                                      push=push))
    assert result.violations == []
    assert result.illegal_events == []
    for (_engine, lifecycle, _req), state in result.final_states.items():
        if lifecycle == "recv":
            assert state in RECV.terminal
    report = analyse(result.log_paths)
    assert report.exit_code == 0, [str(f) for f in report.findings]
    assert {(m.engine_id, m.lifecycle, m.req): m.final_state for m in report.machines} == result.final_states


@pytest.mark.parametrize("push", [0.0, 1.0], ids=["read", "pushed"])
def test_a_flipped_byte_in_a_segment_is_caught(push: float) -> None:
    result = run_simulation(SimConfig(seed=5, num_requests=30, faults=Faults(transfer_corrupt=0.3),
                                      block_tokens=(16, 32), push=push))
    kinds = {v.kind for v in result.violations}
    assert kinds == {"corrupt_delivery"}, kinds


def test_a_pairing_that_reads_the_wrong_segments_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a planted pairing bug (each prefill segment index
    shifted by one, wrapping) delivers other tokens, and the simulation says so."""
    real = sim_engines.pair_segments

    def shifted(*args: Any) -> Any:
        local, remote, fields, problem = real(*args)
        per = max(args[2], args[3]) // fields["segment_tokens"]
        if args[3] > args[2]:  # several segments per prefill block: read the next one
            fields = {**fields, "remote_segments": tuple((k + 1) % per for k in fields["remote_segments"])}
        return local, remote, fields, problem

    monkeypatch.setattr(sim_engines, "pair_segments", shifted)
    result = run_simulation(SimConfig(seed=5, num_requests=20, block_tokens=(32, 16)))
    assert result.violations and {v.kind for v in result.violations} == {"corrupt_delivery"}


# -- the in-memory transport's segments ---------------------------------------

def _pair(p_tokens: int, d_tokens: int, layouts: bool = True) -> tuple[InMemoryAgent, InMemoryAgent, str]:
    fabric = InMemoryFabric(VirtualClock(), latency_ns=0)
    agents = []
    for name, tokens in (("p", p_tokens), ("d", d_tokens)):
        layout = token_layout_of(name, 8, tokens, SIM_PLANES, SIM_HEADS) if layouts else None
        block_bytes = SIM_HEADS * SIM_PLANES.head_bytes(tokens)
        agents.append(InMemoryAgent(fabric, name, 8, block_bytes, layout=layout))
    p, d = agents
    return p, d, d.add_peer(p.metadata())


def test_a_segment_read_moves_exactly_the_tokens_of_the_segment() -> None:
    p, d, peer = _pair(16, 32)
    p.write_block(3, token_block(7, 0, 16))
    p.write_block(5, token_block(7, 1, 16))
    # Decode block 2 holds tokens 0..31: segment 0 from prefill block 3, segment 1 from block 5.
    h = d.post_read(peer, [2, 2], [3, 5], b"n", segments=Segments(16, (0, 1), (0, 0), 32, 16))
    d.fabric.step()
    assert d.check(h).name == "DONE"
    assert d.read_block(2) == token_block(7, 0, 32)


def test_segments_are_refused_where_they_cannot_be_read() -> None:
    p, d, peer = _pair(16, 32, layouts=False)
    with pytest.raises(ValueError, match="opaque bytes"):
        d.post_read(peer, [0], [0], b"", segments=Segments(16, (0,), (0,), 32, 16))
    with pytest.raises(ValueError, match="must go in segments"):
        d.post_read(peer, [0], [0], b"")
    p, d, peer = _pair(16, 32)
    with pytest.raises(ValueError, match="segments for 1 block pairs"):
        d.post_read(peer, [0], [0], b"", segments=Segments(16, (0, 1), (0, 0), 32, 16))
    with pytest.raises(ValueError, match="hold 32 tokens, not 16"):
        d.post_read(peer, [0], [0], b"", segments=Segments(16, (0,), (0,), 16, 16))
    with pytest.raises(ValueError, match="segment index out of range"):
        d.post_read(peer, [0], [0], b"", segments=Segments(16, (2,), (0,), 32, 16))
    with pytest.raises(ValueError, match="one region"):
        InMemoryAgent(d.fabric, "x", 8, 10, layout=token_layout_of("x", 8, 16, SIM_PLANES, SIM_HEADS))


def test_the_simulation_refuses_segments_with_several_groups() -> None:
    with pytest.raises(ValueError, match="one KV cache group"):
        run_simulation(dataclasses.replace(SimConfig(num_requests=1, block_tokens=(16, 32)), kv_groups=2))
