"""The workers' timing logic on virtual time: windows asserted exactly.

The real ``WorkerHalf``s (prefill and decode) run in this process on one
virtual clock (``kvsm_testing.virtual_pair``: driven loops, inproc side
channel, in-memory transport moving real bytes). Each scenario here is one of
``test_worker_nixl.py`` or ``test_reliability_worker.py`` whose point is a
window (a lease, a timeout, a back-off, "at once"): there it runs over real
NIXL between processes, on real time, and checks that it happens; here the
window itself is checked, to the nanosecond where the table decides it, on
any machine and under any load. Every log is replayed at the end of each test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsm.lifecycle.table import LEASE_MARGIN_NS
from kvsm.replay import analyse
from kvsm.transport.memory import Fault
from kvsm.worker.context import NOTIF_POLL_MAX_NS
from kvsm.worker.peers import CLAIM_RETRY_NS
from kvsm_testing.virtual_pair import BLOCK_TOKENS, DECODE, MS, S, VirtualPair

WIRE_NS = 200_000  # the fabric's read latency (VirtualPair)
POLL_NS = 1 * MS  # the decode loop polls reads in flight this often (notif_poll_interval_s)


def polled(posted_ns: int, takes_ns: int = WIRE_NS) -> int:
    """When the decode worker sees a read posted at ``posted_ns`` that takes
    ``takes_ns``: at its first poll after the read landed."""
    return posted_ns + -(-takes_ns // POLL_NS) * POLL_NS


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[VirtualPair]:
    vp = VirtualPair({"A": 30.0, "S": 0.3}, log_dir=tmp_path)
    try:
        yield vp
    finally:
        vp.close()


def make(tmp_path: Path, prefill: dict[str, float] | None = None, **kw: Any) -> VirtualPair:
    return VirtualPair(prefill or {"A": 30.0}, log_dir=tmp_path, **kw)


def replayed(vp: VirtualPair, findings: frozenset[tuple[str, str | None]] | set[tuple[str, str | None]] = frozenset(),
             ) -> dict[tuple[str, str], str]:
    """Close the pair, replay every log: exactly these (kind, request) findings,
    and each machine's final state."""
    vp.close()
    report = analyse(vp.log_paths)
    assert {(f.kind, f.req) for f in report.findings} == findings, [str(f) for f in report.findings]
    return {(m.lifecycle, m.req): m.final_state for m in report.machines if m.lifecycle != "peer"}


def errors(vp: VirtualPair, req: str) -> list[dict[str, Any]]:
    return [r["input"] for r in vp.records() if r.get("req") == req and r["event"] == "error"
            and r["kind"] == "transition"]


def failed_by(vp: VirtualPair, req: str) -> list[tuple[str, str]]:
    """(event, from state) of each transition of ``req`` into ``failed``."""
    return [(r["event"], r["src"]) for r in vp.records() if r.get("req") == req and r["kind"] == "transition"
            and r["dst"] == "failed"]


def test_happy_path_is_done_one_round_trip_and_one_read_after_the_start(pair: VirtualPair) -> None:
    pair.finish("A", {"p-1": (3, 5, 7)})
    t0 = pair.now_ns
    pair.start("d-1", "A", "p-1", (3, 5, 7))
    pair.run(until=lambda: "d-1" in pair.recving)
    # inproc delivery takes no time: the claim is answered at t0, the read lands one
    # wire latency later, and the next poll sees it.
    assert pair.recving["d-1"] == polled(t0)
    assert pair.holds("d-1") and not pair.failed
    pair.run(0.01)
    assert pair.sent("A")["p-1"] == pair.recving["d-1"]  # the read's notification releases at once
    # Nothing is read any more: no timer is left to fire on nothing (the read poll and the
    # stalled-read probe went with the last read, not 0.5 s later).
    assert pair.decode.resources()["loop_timers"] == 0, pair.decode.resources()
    assert replayed(pair) == {("recv", "d-1"): "done", ("send", "p-1"): "released"}


def test_a_claim_before_the_finish_is_asked_again_every_retry_interval(pair: VirtualPair) -> None:
    pair.start("d-2", "A", "p-2", (1, 2))
    t0 = pair.now_ns
    pair.run(0.2)
    assert pair.state("d-2") == "pending_handshake" and not pair.recving
    sent_before = pair.decode.debug_state()["client"]["sent"]
    assert sent_before == 1 + 200 * MS // CLAIM_RETRY_NS  # the first claim, then one per retry interval
    pair.finish("A", {"p-2": (1, 2)})
    t1 = pair.now_ns
    pair.run(until=lambda: "d-2" in pair.recving)
    # The retry due at the pin's instant ran before it: answered at the one after.
    next_retry = t0 + ((t1 - t0) // CLAIM_RETRY_NS + 1) * CLAIM_RETRY_NS
    assert pair.recving["d-2"] == polled(next_retry)
    assert pair.holds("d-2")
    assert replayed(pair) == {("recv", "d-2"): "done", ("send", "p-2"): "released"}


def test_the_lease_expires_at_its_end_and_a_later_read_fails(pair: VirtualPair) -> None:
    pair.finish("S", {"p-3": (4, 5, 6)})
    t0 = pair.now_ns
    pair.run(1.0)
    assert pair.sent("S")["p-3"] - t0 == int(0.3 * S)
    pair.start("d-3", "S", "p-3", (4, 5, 6))
    t1 = pair.now_ns
    pair.run(until=lambda: "d-3" in pair.recving)
    assert pair.failed["d-3"] == t1  # answered "expired" at once
    assert pair.invalid == set(pair.local_of["d-3"])
    assert not any(pair.decode_agent.read_block(b) != bytes(pair.block_bytes) for b in pair.local_of["d-3"])
    assert [e["kind"] for e in errors(pair, "d-3")] == ["lease_expired"]
    assert replayed(pair) == {("recv", "d-3"): "failed", ("send", "p-3"): "expired"}


def test_heartbeats_keep_a_short_lease_alive_and_stopping_them_ends_it(pair: VirtualPair) -> None:
    pair.finish("S", {"p-4": (1, 2), "p-4-dropped": (3,)})
    t0 = pair.now_ns
    for _ in range(10):  # every 0.1 s for 1 s, the lease being 0.3 s
        pair.heartbeat("S", ("p-4", "p-4-dropped") if pair.now_ns - t0 < int(0.5 * S) else ("p-4",))
        last = pair.now_ns
        pair.run(0.1)
    assert "p-4" not in pair.sent("S")
    # The one no longer named expired a lease after its last heartbeat.
    dropped_last = t0 + int(0.4 * S)
    assert pair.sent("S")["p-4-dropped"] == dropped_last + int(0.3 * S)
    pair.start("d-4", "S", "p-4", (1, 2))
    pair.run(until=lambda: "d-4" in pair.recving)
    assert not pair.failed and pair.holds("d-4")
    assert last - t0 == int(0.9 * S)
    assert replayed(pair) == {("recv", "d-4"): "done", ("send", "p-4"): "released",
                              ("send", "p-4-dropped"): "expired"}


def test_an_incompatible_peer_fails_at_once_and_the_prefill_is_released(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_compat={"block_size": 2 * BLOCK_TOKENS})
    vp.finish("A", {"p-5": (1, 2)})
    t0 = vp.now_ns
    vp.start("d-5", "A", "p-5", (1, 2))
    vp.run(until=lambda: "d-5" in vp.recving)
    assert vp.failed["d-5"] == t0
    [e] = errors(vp, "d-5")
    assert e["kind"] == "incompatible" and f"block_size: {2 * BLOCK_TOKENS} here, {BLOCK_TOKENS} on the peer" in (
        e["detail"])
    vp.run(0.01)
    assert vp.sent("A")["p-5"] == t0  # the abandon unpins it now, not after the 30 s lease
    assert replayed(vp) == {("recv", "d-5"): "failed", ("send", "p-5"): "released"}


def test_a_silent_peer_times_out_exactly_and_does_not_delay_a_healthy_one(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_cfg={"handshake_timeout_s": 1.0})
    vp.finish("A", {"p-6": (1, 2)})
    t0 = vp.now_ns
    vp.start("d-6-silent", "silent", "p-6-silent", (8, 9))
    vp.start("d-6", "A", "p-6", (1, 2))
    vp.run(until=lambda: {"d-6", "d-6-silent"} <= vp.recving.keys())
    assert vp.recving["d-6"] == polled(t0) and "d-6" not in vp.failed
    assert vp.failed["d-6-silent"] - t0 == 1 * S
    assert vp.invalid == set(vp.local_of["d-6-silent"])
    assert replayed(vp) == {("recv", "d-6"): "done", ("recv", "d-6-silent"): "failed", ("send", "p-6"): "released"}


def test_an_abort_while_the_handshake_waits_ends_it_now(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_cfg={"handshake_timeout_s": 0.5})
    vp.start("d-7", "silent", "p-7", (3, 4, 5))
    vp.run(0.05)
    assert vp.state("d-7") == "pending_handshake"
    t0 = vp.now_ns
    vp.abort("d-7")
    assert vp.recving["d-7"] == t0 and not vp.failed and not vp.invalid
    vp.run(1.0)  # past the handshake timeout it no longer has
    assert set(vp.recving) == {"d-7"} and not vp.failed
    assert replayed(vp) == {("recv", "d-7"): "aborted"}


def test_an_abandon_releases_the_prefill_now_also_before_its_finish(pair: VirtualPair) -> None:
    pair.finish("A", {"p-8": (1, 2)})
    t0 = pair.now_ns
    pair.abandon("d-8", "A", "p-8")
    assert pair.sent("A")["p-8"] == t0
    pair.abandon("d-8-early", "A", "p-8-early")  # the prefill has not finished yet
    pair.run(0.5)
    t1 = pair.now_ns
    pair.finish("A", {"p-8-early": (3, 4)})
    assert pair.sent("A")["p-8-early"] == t1
    assert not pair.recving and not pair.failed and not pair.invalid
    assert replayed(pair) == {("recv", "d-8"): "aborted", ("recv", "d-8-early"): "aborted",
                              ("send", "p-8"): "released", ("send", "p-8-early"): "released"}


def test_an_early_abandon_whose_finish_never_comes_is_forgotten_after_a_lease(pair: VirtualPair) -> None:
    pair.abandon("d-8b", "S", "p-8b")
    t0 = pair.now_ns
    pair.run(until=lambda: "p-8b" not in pair.prefills["S"].worker.debug_state()["send"])  # type: ignore[union-attr]
    assert pair.now_ns - t0 == int(0.3 * S)
    assert replayed(pair) == {("recv", "d-8b"): "aborted", ("send", "p-8b"): "forgotten"}


def test_a_full_local_prefix_hit_releases_the_prefill_now(pair: VirtualPair) -> None:
    pair.finish("A", {"p-9": (1, 2)})
    t0 = pair.now_ns
    pair.start("d-9", "A", "p-9", (), local=())  # the first contact with the peer
    pair.run(0.1)
    assert pair.sent("A")["p-9"] == t0
    assert not pair.recving and not pair.failed
    assert replayed(pair) == {("recv", "d-9"): "done", ("send", "p-9"): "released"}


def test_a_read_landing_after_the_lease_is_failed_not_delivered(pair: VirtualPair) -> None:
    """The read completes 0.4 s after the pin of a 0.3 s lease (it may have read
    reused blocks): the decode side fails it, whatever the bytes say."""
    pair.finish("S", {"p-10": (1, 2)})
    t0 = pair.now_ns
    pair.delay_of["d-10"] = int(0.4 * S)
    pair.start("d-10", "S", "p-10", (1, 2))
    pair.run(until=lambda: "d-10" in pair.recving)
    assert pair.failed["d-10"] == polled(t0, int(0.4 * S))
    # The table's lease verdict on the completed read, not an error from the wire.
    assert failed_by(pair, "d-10") == [("all_reads_done", "transferring")]
    assert not errors(pair, "d-10")
    assert pair.sent("S")["p-10"] - t0 == int(0.3 * S)
    assert replayed(pair)[("recv", "d-10")] == "failed"


def test_a_read_within_the_lease_less_its_margin_is_delivered(pair: VirtualPair) -> None:
    """The lease verdict: a read that completes before the lease minus the margin
    (min(LEASE_MARGIN_NS, lease / 4)) counts; one just after does not."""
    margin = min(LEASE_MARGIN_NS, int(0.3 * S) // 4)
    pair.finish("S", {"p-11": (1,), "p-11-late": (2,)})
    pair.delay_of["d-11"] = int(0.3 * S) - margin - 1 * MS
    pair.delay_of["d-11-late"] = int(0.3 * S) - margin + 1 * MS
    pair.start("d-11", "S", "p-11", (1,))
    pair.start("d-11-late", "S", "p-11-late", (2,))
    pair.run(until=lambda: {"d-11", "d-11-late"} <= pair.recving.keys())
    assert "d-11" not in pair.failed and pair.holds("d-11")
    assert "d-11-late" in pair.failed
    finals = replayed(pair)
    assert finals[("recv", "d-11")] == "done" and finals[("recv", "d-11-late")] == "failed"


def test_a_hung_read_fails_at_the_transfer_timeout(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_cfg={"transfer_timeout_s": 0.5})
    vp.finish("A", {"p-12": (1, 2)})
    vp.fault_of["d-12"] = Fault.HANG
    t0 = vp.now_ns
    vp.start("d-12", "A", "p-12", (1, 2))
    vp.run(until=lambda: "d-12" in vp.recving)
    assert vp.failed["d-12"] - t0 == int(0.5 * S)
    assert vp.invalid == set(vp.local_of["d-12"])
    assert replayed(vp)[("recv", "d-12")] == "failed"


def test_a_dead_peer_is_failed_fast_during_its_back_off_then_probed_again(tmp_path: Path) -> None:
    """A read fails as the peer's agent disconnects (the engine died mid-read): the
    peer is dead for its back-off (1 s), requests to it fail at once meanwhile,
    and the first one after it reaches the restarted engine."""
    vp = make(tmp_path, decode_cfg={"peer_backoff_s": 1.0, "handshake_timeout_s": 0.5})
    vp.finish("A", {"p-13-1": (1, 2)})
    vp.start("d-13-1", "A", "p-13-1", (1, 2))
    vp.run(until=lambda: "d-13-1" in vp.recving)
    assert vp.holds("d-13-1")
    vp.finish("A", {"p-13-2": (3, 4)})
    vp.fault_of["d-13-2"] = Fault.DISCONNECT
    t0 = vp.now_ns
    vp.start("d-13-2", "A", "p-13-2", (3, 4))
    vp.run(until=lambda: "d-13-2" in vp.recving)
    assert vp.failed["d-13-2"] == polled(t0)
    vp.kill("A")
    t1 = vp.now_ns
    vp.start("d-13-3", "A", "p-13-3", (5,))
    assert vp.failed["d-13-3"] == t1, "a request to a dead peer waited"
    assert [(r["event"], r["input"]["reason"]) for r in vp.records() if r.get("req") == "d-13-3"
            and r.get("dst") == "failed"] == [("peer_dead", "known_dead")]
    vp.restart("A")
    vp.finish("A", {"p-13-4": (6, 7)})
    vp.run(until=lambda: vp.decode.debug_state()["peers"]["prefill-A@inproc://prefill-A-5600"]["state"] == "probing")
    assert vp.now_ns == vp.failed["d-13-2"] + 1 * S  # the back-off runs from the death
    vp.start("d-13-4", "A", "p-13-4", (6, 7))
    vp.run(until=lambda: "d-13-4" in vp.recving)
    assert "d-13-4" not in vp.failed and vp.holds("d-13-4"), "not the new incarnation's bytes"
    # The killed engine's log ends as a crash leaves it: its last request still pinned.
    finals = replayed(vp, {("not_terminal_at_end", "p-13-2")})
    assert {r: s for (lc, r), s in finals.items() if lc == "recv"} == {
        "d-13-1": "done", "d-13-2": "failed", "d-13-3": "failed", "d-13-4": "done"}


def test_every_decode_log_here_names_its_engine(tmp_path: Path) -> None:
    """The harness's logs are the workers' own (a replay that found nothing
    because nothing was logged would pass the tests above)."""
    vp = make(tmp_path)
    vp.finish("A", {"p-14": (1,)})
    vp.start("d-14", "A", "p-14", (1,))
    vp.run(until=lambda: "d-14" in vp.recving)
    recs = vp.records(DECODE)
    assert {r["engine_id"] for r in recs} == {DECODE}
    assert [r["event"] for r in recs if r.get("req") == "d-14" and r["kind"] == "transition"] == [
        "matched", "allocated", "handshake_ok", "reads_posted", "all_reads_done"]
    assert replayed(vp) == {("recv", "d-14"): "done", ("send", "p-14"): "released"}


def test_reads_completing_in_the_lease_margin_fail_and_send_no_abandon(tmp_path: Path) -> None:
    """Prefill lease 2 s: the decode side accepts reads that complete within 1.5 s
    of the claim (min(0.5 s, lease / 4) kept as margin). This one completes at
    1.6 s: it is failed by the table's lease verdict; its read's notification
    released the prefill (inside its lease), and nothing else reaches it: no
    abandon after a completed read, no violation on either side."""
    vp = make(tmp_path, {"Y": 2.0})
    vp.finish("Y", {"p-15": (1, 2)})
    t0 = vp.now_ns
    vp.delay_of["d-15"] = int(1.6 * S)
    vp.start("d-15", "Y", "p-15", (1, 2))
    vp.run(until=lambda: "d-15" in vp.recving)
    assert vp.failed["d-15"] == polled(t0, int(1.6 * S))
    assert failed_by(vp, "d-15") == [("all_reads_done", "transferring")]
    vp.run(1.0)
    # By the read's notification (seen at the prefill's next poll, which backs off to
    # NOTIF_POLL_MAX_NS while nothing happens), not by the lease (2 s).
    assert int(1.6 * S) <= vp.sent("Y")["p-15"] - t0 <= int(1.6 * S) + NOTIF_POLL_MAX_NS
    assert replayed(vp) == {("recv", "d-15"): "failed", ("send", "p-15"): "released"}
