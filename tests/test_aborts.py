"""Aborts in every state, on both sides, over the simulation (issue 5, item 5).

The simulation runs the real prefill and decode workers on virtual time with
real bytes through the in-memory transport and checks, as reads land and at
the end, that no block is freed while a posted read may still write into it
and that every block returns to its pool. These tests drive clients that go
away at every point of a request's life (vLLM aborts the request; the worker
hears of it with the next step) and show that each abortable state was in
fact reached.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import RECV, SEND
from kvsm_testing.sim import Faults, SimConfig, Simulation

# Aborts everywhere, and the faults that hold a request in the states an abort
# can otherwise not reach (a silent handshake, a read that hangs or lands late,
# a dead peer that sends a transfer into `failing`).
ABORT_HEAVY = Faults(prefill_abort=0.15, decode_abort=0.6, handshake_silent=0.15, transfer_hang=0.15,
                     transfer_stuck=0.35, peer_dead=0.1, transfer_error=0.05, decode_late=0.05, pin_late=0.1)


ABORTABLE = {(spec.name, state) for spec in (RECV, SEND) for (state, trigger), rules in spec.rules.items()
             if trigger == "abort" and not any(r.stale for r in rules)}
"""Every (lifecycle, state) in which ``abort`` does something (not a declared stale input)."""


# States the worker leaves in the loop callback that entered them, so no input can
# land there: `new` and `awaiting_blocks` of a started request (`matched` and
# `allocated` are applied together; an abort reaches `awaiting_blocks` as the
# abandon of a request vLLM never allocated, which is in `wanted`), and
# `remote_known` (`handshake_ok` posts the reads at once). `failing` is left at
# once too, unless a read in flight cannot be cancelled: a stuck read that lands
# only after the transfer timeout keeps it there (ABORT_HEAVY has those).
TRANSIENT = {("recv", "new"), ("recv", "remote_known")}
# A prefill whose decode side read it (`read_early`) before its worker heard of
# its finish has finished, normally: vLLM handed out its kv_transfer_params. No
# consistent vLLM aborts it afterwards. (One whose decode side gave up early,
# `abandoned_early`, may still be computing: a streamed one, whose decode leg
# came with it.)
UNREACHABLE = {("send", "read_early")}
# Entered by few requests (a stuck read past the transfer timeout, not aborted
# before): aborted on entry ten times as often.
RARE = {("recv", "failing"), ("recv", "stopping_writes")}


def run_and_watch(cfg: SimConfig, abort_on_entry: float = 0.0) -> tuple[Simulation, set[tuple[str, str]]]:
    """Set up one simulation; return it and the states its aborts hit (filled by its run).

    ``abort_on_entry``: the chance that vLLM aborts a decode request the moment
    its machine enters a state (the abort goes with a step taken at once, so it
    is the worker's next input), so that states the random abort times rarely
    hit (`remote_known` lasts zero virtual time, `failing` starts seconds in)
    are aborted in too.
    """
    sim = Simulation(cfg)
    hit: set[tuple[str, str]] = set()
    rng = random.Random(cfg.seed)
    ours: set[str] = set()

    def watch(engine_id: str, o: Outcome) -> None:
        if o.trigger == "abort" and o.src is not None and o.violation is None and not o.stale:
            hit.add((o.lifecycle, o.src))
        if (engine_id == sim.decode.engine_id and o.lifecycle == "recv" and o.violation is None and not o.stale
                and o.dst != o.src and (o.lifecycle, o.dst) in ABORTABLE and o.req not in ours
                and rng.random() < abort_on_entry * (10 if (o.lifecycle, o.dst) in RARE else 1)):
            ours.add(o.req)
            sim.abort_decode(o.req)

    sim.observers.append(watch)
    return sim, hit


def test_aborts_reach_every_abortable_state_and_lose_nothing() -> None:
    assert {("recv", s) for s in ("awaiting_blocks", "pending_handshake", "remote_known", "transferring", "failing",
                                  "reading_unclaimed", "read_unclaimed")} | {("send", "prefilling")} <= ABORTABLE
    wanted = ABORTABLE - TRANSIENT - UNREACHABLE
    seen: set[tuple[str, str]] = set()
    for seed in range(40):
        sim, hit = run_and_watch(SimConfig(seed=seed, num_requests=150, faults=ABORT_HEAVY, push=0.3, stream=0.2),
                                 abort_on_entry=0.05)
        result = sim.run()
        # No write into a released block, no leaked block, no illegal event.
        assert result.violations == [], (seed, [str(v) for v in result.violations[:5]])
        assert result.illegal_events == [], (seed, result.illegal_events[:5])
        for (_engine, lifecycle, _req), state in result.final_states.items():
            if lifecycle in ("recv", "send"):
                assert state in (RECV if lifecycle == "recv" else SEND).terminal, (seed, lifecycle, _req, state)
        seen |= hit
        if seen >= wanted:
            break
    assert wanted <= seen, f"states never aborted in: {sorted(wanted - seen)}"


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 80),
       decode_abort=st.sampled_from([0.2, 0.6, 1.0]), prefill_abort=st.sampled_from([0.0, 0.3]),
       stuck=st.sampled_from([0.0, 0.3, 0.8]), hang=st.sampled_from([0.0, 0.3]))
def test_any_mix_of_aborts_frees_every_block_once_no_read_can_write(
        seed: int, n: int, decode_abort: float, prefill_abort: float, stuck: float, hang: float) -> None:
    faults = Faults(decode_abort=decode_abort, prefill_abort=prefill_abort, transfer_stuck=stuck, transfer_hang=hang,
                    handshake_silent=0.1, peer_dead=0.05)
    sim, _ = run_and_watch(SimConfig(seed=seed, num_requests=n, faults=faults, push=0.3), abort_on_entry=0.1)
    result = sim.run()
    assert result.violations == [] and result.illegal_events == []
    assert sum(result.count("send").values()) == n
