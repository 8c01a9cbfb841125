"""Reading across tensor parallel sizes: the plan (pure) and the real workers on virtual time.

The plan is checked against a brute-force oracle for every pair of TP sizes
up to 8 and head counts up to 8: each decode rank gets each of its heads
exactly once, from a prefill rank that holds it; every prefill rank waits for
exactly the decode ranks that have business with it.

The workers: ``TPPair`` runs real prefill and decode ``WorkerHalf``s, one per
rank, reading real bytes (heads-major blocks) over the in-memory fabric; the
decode blocks must hold, head by head, the prefill engine's bytes, and every
prefill rank must free its blocks once all its readers are through, and not
before.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvsm.replay import analyse
from kvsm.transport.memory import Fault
from kvsm.worker.tp_map import heads_of, read_plan
from kvsm_testing.virtual_tp import DECODE, PREFILL, TPPair

SIZES = [1, 2, 4, 8]


def _valid(p: int, d: int, k: int) -> bool:
    ok = all((k >= t and k % t == 0) or (k < t and t % k == 0) for t in (p, d))
    return ok and (p % d == 0 or d % p == 0)


@pytest.mark.parametrize("p, d, k", [(p, d, k) for p, d, k in itertools.product(SIZES, SIZES, [1, 2, 4, 8])
                                     if _valid(p, d, k)])
def test_every_decode_head_is_read_once_from_a_prefill_rank_that_holds_it(p: int, d: int, k: int) -> None:
    readers = [0] * p
    told = [0] * p
    for r in range(d):
        plan = read_plan(r, d, p, k)
        lo, hi = heads_of(r, d, k)
        got: list[int] = []
        for s in plan.sources:
            r_lo, r_hi = heads_of(s.rank, p, k)
            assert s.remote.of == r_hi - r_lo and s.local.of == hi - lo
            remote = list(range(r_lo + s.remote.start, r_lo + s.remote.start + s.remote.count))
            local = list(range(lo + s.local.start, lo + s.local.start + s.local.count))
            assert remote == local, (plan, s)  # the same global heads on both sides
            got += local
            readers[s.rank] += 1
        assert sorted(got) == list(range(lo, hi)), plan  # each of its heads once
        for rank in plan.notify_only:
            told[rank] += 1
        assert plan.completions == read_plan(0, d, p, k).completions  # every rank agrees
    completions = read_plan(0, d, p, k).completions
    for rank in range(p):
        assert completions[rank] == max(1, readers[rank])
        assert told[rank] == (1 if readers[rank] == 0 else 0), (rank, readers, told)


def test_mla_reads_the_whole_latent_from_one_prefill_rank() -> None:
    for p, d in [(1, 2), (2, 1), (4, 2), (2, 4)]:
        plans = [read_plan(r, d, p, 16, replicated_layout=True) for r in range(d)]
        for plan in plans:
            assert len(plan.sources) == 1 and plan.sources[0].remote.whole and plan.sources[0].local.whole
        readers = {s.rank for plan in plans for s in plan.sources}
        told = {k for plan in plans for k in plan.notify_only}
        assert readers | told == set(range(p)) and not readers & told


@pytest.mark.parametrize("p, d, k, why", [
    (3, 2, 6, "one must divide the other"),
    (2, 1, 3, "do not split evenly"),
    (4, 1, 6, "do not split evenly"),
    (1, 4, 3, "cannot be replicated evenly"),
])
def test_an_impossible_plan_says_why(p: int, d: int, k: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        read_plan(0, d, p, k)


# --------------------------------------------------------------------------- the workers


@pytest.mark.parametrize("p, d, k, mla", [(1, 2, 2, False), (2, 1, 2, False), (1, 4, 2, False), (4, 2, 8, False),
                                         (2, 4, 1, False), (1, 2, 1, True), (2, 1, 1, True), (4, 2, 1, True)])
def test_decode_ranks_hold_the_prefill_heads_and_every_prefill_rank_frees_once(
        tmp_path: Path, p: int, d: int, k: int, mla: bool) -> None:
    """``mla``: every rank holds the whole latent; each decode rank reads it from one
    prefill rank, and the prefill ranks nobody reads are told so."""
    with TPPair(p, d, kv_heads=k, replicated=mla, log_dir=tmp_path) as pair:
        for i in range(3):
            pair.finish(f"p{i}", (3 * i + 1, 3 * i + 2))
            pair.start(f"d{i}", f"p{i}")
        pair.run(until=lambda: all(len(rec) == 3 for rec in pair.recving))
        for r in range(d):
            assert not pair.failed[r]
            assert all(pair.holds(f"d{i}", r) for i in range(3)), f"decode rank {r} holds wrong bytes"
        pair.run(until=lambda: all(len(s) == 3 for s in pair.sent))
        assert all(res["recv_machines"] == res["send_machines"] == 0 for res in pair.resources())
        # One side-channel port for the engine: rank 0 relayed every other rank's claims.
        first = pair.prefill[0]
        assert first is not None and first.server is not None
        assert first.server.stats().get("relayed", 0) >= (3 if p > 1 else 0)
        assert all(w is not None and w.server is not None and w.server.address.endswith(f"-tp{k}")
                   for k, w in enumerate(pair.prefill) if k), "ranks above 0 listen on private endpoints only"
        # The plan, per rank, in the event log.
        plans = {r: {rec["input"].get("plan") for rec in pair.records(DECODE, r)
                     if rec.get("kind") == "transition" and rec.get("event") == "matched"} for r in range(d)}
        assert all(len(v) == 1 and next(iter(v)).startswith(f"d{r}/{d}") for r, v in plans.items()), plans
    report = analyse(pair.log_paths)
    assert not report.findings, [str(f) for f in report.findings]


@pytest.mark.parametrize("p, d, k, mla", [(1, 2, 2, False), (2, 1, 2, False), (4, 2, 8, False), (1, 2, 1, True)])
def test_push_mode_writes_each_decode_rank_its_heads_and_every_prefill_rank_frees_once(
        tmp_path: Path, p: int, d: int, k: int, mla: bool) -> None:
    """Push mode across tensor parallel sizes: each prefill rank writes the heads
    each decode rank holds (the read plan's runs, from the other side), and frees
    its blocks once every decode rank it serves is through."""
    with TPPair(p, d, kv_heads=k, replicated=mla, log_dir=tmp_path) as pair:
        for i in range(3):
            pair.finish(f"p{i}", (3 * i + 1, 3 * i + 2))
            pair.start(f"d{i}", f"p{i}", push=True)
        pair.run(until=lambda: all(len(rec) == 3 for rec in pair.recving))
        for r in range(d):
            assert not pair.failed[r]
            assert all(pair.holds(f"d{i}", r) for i in range(3)), f"decode rank {r} holds wrong bytes"
        pair.run(until=lambda: all(len(s) == 3 for s in pair.sent))
        assert all(res["recv_machines"] == res["send_machines"] == 0 for res in pair.resources())
        landed = [rec for r in range(d) for rec in pair.records(DECODE, r)
                  if rec.get("kind") == "transition" and rec.get("event") == "writes_landed"]
        assert len(landed) == 3 * d
    report = analyse(pair.log_paths)
    assert not report.findings, [str(f) for f in report.findings]


def test_one_prefill_rank_waits_for_both_decode_readers(tmp_path: Path) -> None:
    """1 -> 2: the prefill rank frees its blocks only after the second decode rank's
    read, however late it comes (before it, the blocks stay pinned)."""
    with TPPair(1, 2, kv_heads=2, log_dir=tmp_path) as pair:
        pair.finish("p", (4, 5))
        pair.start("d", "p", ranks=[0])
        pair.run(until=lambda: "d" in pair.recving[0])
        pair.run(1.0)
        assert "p" not in pair.sent[0], "freed while the second decode rank had not read"
        pair.start("d", "p", ranks=[1])
        pair.run(until=lambda: "d" in pair.recving[1])
        assert pair.holds("d", 0) and pair.holds("d", 1)
        pair.run(until=lambda: "p" in pair.sent[0])


def test_an_abort_on_one_decode_rank_keeps_the_blocks_for_the_others_read(tmp_path: Path) -> None:
    """1 -> 2: decode rank 0 aborts (its abandon counts as its part), rank 1 still
    reads correct bytes; the blocks go after rank 1's read, not at rank 0's abandon."""
    with TPPair(1, 2, kv_heads=2, log_dir=tmp_path) as pair:
        pair.finish("p", (4, 5))
        pair.start("d", "p", ranks=[0])
        pair.abort("d", ranks=[0])
        pair.run(0.5)
        assert "p" not in pair.sent[0]
        pair.start("d", "p", ranks=[1])
        pair.run(until=lambda: "d" in pair.recving[1] and "p" in pair.sent[0])
        assert pair.holds("d", 1) and not pair.failed[1]
    assert not analyse(pair.log_paths).findings


def test_a_failed_read_from_one_of_two_prefill_ranks_fails_the_request_and_frees_both(tmp_path: Path) -> None:
    """2 -> 1: the read from prefill rank 1 fails; the request fails (its blocks
    reported invalid), rank 0 (read fine) and rank 1 (told by the abandon) both free."""
    with TPPair(2, 1, kv_heads=2, log_dir=tmp_path) as pair:
        pair.fault_of[("d", 1)] = Fault.ERROR
        pair.finish("p", (4, 5))
        pair.start("d", "p")
        pair.run(until=lambda: "d" in pair.failed[0])
        pair.run(until=lambda: "p" in pair.sent[0] and "p" in pair.sent[1])
    assert not analyse(pair.log_paths).findings


def test_kill_of_one_prefill_rank_mid_read_fails_fast_and_leaks_nothing(tmp_path: Path) -> None:
    """2 -> 1: prefill rank 1 is killed while both reads are in flight; the decode
    request fails (not delivered), the live rank frees its blocks, nothing is left."""
    with TPPair(2, 1, kv_heads=2, log_dir=tmp_path) as pair:
        pair.fault_of[("d", 0)] = Fault.HANG  # rank 0's read stays in flight
        pair.fault_of[("d", 1)] = Fault.HANG
        pair.finish("p", (4, 5))
        pair.start("d", "p")
        pair.run(0.01)
        pair.kill_prefill(1)
        pair.fault_of.clear()
        pair.run(until=lambda: "d" in pair.failed[0], limit_s=10)
        assert "d" in pair.recving[0]
        pair.run(until=lambda: "p" in pair.sent[0], limit_s=40)  # told, or its lease
        res = pair.resources()
        assert all(r["recv_machines"] == 0 and r["send_machines"] == 0 for r in res), res


def test_mismatched_sizes_the_model_cannot_read_across_fail_the_request_naming_why(tmp_path: Path) -> None:
    with TPPair(2, 1, kv_heads=3, log_dir=tmp_path) as pair:  # 3 heads do not split over 2 ranks
        pair.finish("p", (4,))
        pair.start("d", "p")
        pair.run(until=lambda: "d" in pair.failed[0])
        errors = [rec["input"] for rec in pair.records(DECODE, 0)
                  if rec.get("kind") == "transition" and rec.get("event") == "error"]
        assert errors and errors[0]["kind"] == "tp_mismatch" and "do not split evenly" in errors[0]["detail"]
        assert PREFILL  # (the prefill side frees by its lease; nothing was read)
