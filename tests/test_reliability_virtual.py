"""The reliability scenarios whose point is a window, on virtual time.

``test_reliability_worker.py`` runs these faults over real NIXL between
processes on real time and checks that the right thing happens; here the same
faults (a handler raising, injected with the same ``inject_fault``) hit the
real workers of a ``kvsm_testing.virtual_pair.VirtualPair``, and the window
itself is asserted exactly: "fails at once" is the same virtual instant, "at
its handshake timeout" is that many nanoseconds, "released by its read, not
by the lease" is the read's own instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_worker_virtual import POLL_NS, make, polled, replayed

from worker_peer import inject_fault

from kvsm_testing.virtual_pair import MS, S, VirtualPair

FAST = {"handshake_timeout_s": 0.5, "peer_backoff_s": 1.0, "transfer_timeout_s": 1.0}


def loop_errors(vp: VirtualPair, engine_id: str = "decode-0") -> list[dict[str, Any]]:
    return [r for r in vp.records(engine_id) if r.get("event") == "worker.loop_error"]


def internal_errors(vp: VirtualPair, req: str) -> list[dict[str, Any]]:
    return [r["input"] for r in vp.records() if r.get("req") == req and r["event"] == "internal_error"
            and r["kind"] == "transition"]


def served(vp: VirtualPair, *reqs: str) -> None:
    vp.run(until=lambda: set(reqs) <= vp.recving.keys())
    for r in reqs:
        assert r not in vp.failed and vp.holds(r), r


def test_a_raising_claim_flush_fails_its_victim_at_that_instant(tmp_path: Path) -> None:
    vp = make(tmp_path, {"H": 30.0, "F": 30.0}, decode_cfg=FAST)
    vp.finish("H", {"p-warm": (1,), "p-victim": (2, 3), "p-after": (4,)})
    vp.finish("F", {"p-same": (5, 6)})
    vp.start("warm", "H", "p-warm", (1,))
    served(vp, "warm")  # H's agent is loaded: claims to H go as heartbeats from now on
    fault = inject_fault(vp.decode, "client.heartbeat", victim="p-victim", times=1)
    t0 = vp.now_ns
    vp.start("victim", "H", "p-victim", (2, 3))
    vp.start("same", "F", "p-same", (5, 6))
    served(vp, "same")
    assert fault.fired == 1
    assert vp.failed["victim"] == t0
    detail = "InjectedFault: injected into client.heartbeat for p-victim"
    assert internal_errors(vp, "victim") == [{"where": "claim flush", "detail": detail}]
    vp.start("after", "H", "p-after", (4,))
    served(vp, "after")
    vp.run(0.01)
    assert vp.sent("H")["p-victim"] == t0  # its abandon released it: no 30 s lease
    finals = replayed(vp)
    assert finals[("recv", "victim")] == "failed" and finals[("send", "p-victim")] == "released"


def test_a_raising_handshake_deadline_timer_still_fails_its_victim_at_the_timeout(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_cfg=FAST)
    vp.finish("A", {"p-other": (1, 2)})
    fault = inject_fault(vp.decode, "peers_and_claims._expire_client", times=1)
    t0 = vp.now_ns
    vp.start("victim", "silent", "p-victim", (5, 6))
    vp.start("other", "A", "p-other", (1, 2))
    served(vp, "other")
    vp.run(until=lambda: "victim" in vp.recving)
    assert vp.failed["victim"] - t0 == int(0.5 * S)  # the request's own handshake timer
    vp.run(1.0)  # the abandon the failure sent falls due too
    assert fault.fired == 1
    io = vp.decode.debug_state()["io"]
    assert io["claims"] == 0 and io["oneway"] == 0, f"handshakes left pending: {io}"
    assert replayed(vp)[("recv", "victim")] == "failed"


def test_a_lost_heartbeat_does_not_end_a_lease_the_next_ones_keep(tmp_path: Path) -> None:
    vp = make(tmp_path, {"F": 1.0, "H": 30.0}, decode_cfg=FAST)
    vp.finish("F", {"p-pinned": (1, 2)})
    t0 = vp.now_ns
    fault = inject_fault(vp.decode, "peers_and_claims._send_heartbeat", times=1)
    vp.heartbeat("F", ("p-pinned",))  # lost
    assert fault.fired == 1
    assert [(e["req"], e["label"]) for e in loop_errors(vp)] == [(None, "_send_heartbeat")]
    for _ in range(12):  # every 150 ms for 1.8 s: past the lease had only the first been counted
        vp.run(0.15)
        vp.heartbeat("F", ("p-pinned",))
    assert vp.now_ns - t0 == int(1.8 * S)
    assert "p-pinned" not in vp.sent("F"), "the lease expired despite the later heartbeats"
    vp.start("pinned", "F", "p-pinned", (1, 2))
    served(vp, "pinned")
    assert set(replayed(vp).values()) == {"done", "released"}


def test_a_raising_read_poll_timer_comes_back_at_its_next_interval(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_cfg=FAST)
    vp.finish("A", {"p-first": (1, 2), "p-second": (3,)})
    vp.delay_of["first"] = 3 * POLL_NS + POLL_NS // 2  # in flight across a few polls
    fault = inject_fault(vp.decode, "receiver.reads._poll_reads", times=1)
    t0 = vp.now_ns
    vp.start("first", "A", "p-first", (1, 2))
    served(vp, "first")
    assert fault.fired == 1
    assert loop_errors(vp)[0]["label"] == "poll reads"
    # The raising poll (the first, at t0 + 1 ms) is not repeated: the timer is re-armed
    # after it, and the read is seen at the first poll after it landed.
    assert vp.recving["first"] == polled(t0, 3 * POLL_NS + POLL_NS // 2)
    vp.start("second", "A", "p-second", (3,))
    served(vp, "second")
    assert set(replayed(vp).values()) == {"done", "released"}


def test_a_raising_prefill_notification_poll_still_releases_by_the_read(tmp_path: Path) -> None:
    vp = make(tmp_path, {"F": 1.0}, decode_cfg=FAST)
    vp.finish("F", {"p-victim": (1, 2), "p-other": (3,)})
    worker = vp.prefills["F"].worker
    assert worker is not None
    fault = inject_fault(worker, "transport.get_notifs", victim="p-victim", times=1, hold=True)
    t0 = vp.now_ns
    vp.start("victim", "F", "p-victim", (1, 2))
    vp.start("other", "F", "p-other", (3,))
    served(vp, "victim", "other")
    vp.run(until=lambda: {"p-victim", "p-other"} <= vp.sent("F").keys())
    assert fault.fired == 1
    # Read and notified at t0 + one wire latency; the raising poll keeps the
    # notification for the next one, a poll interval (1 ms) later: far from the 1 s lease.
    late = {r: vp.sent("F")[r] - t0 for r in ("p-victim", "p-other")}
    assert max(late.values()) <= 2 * MS + 200_000, late
    finals = replayed(vp)
    assert finals[("send", "p-victim")] == finals[("send", "p-other")] == "released"


def test_a_raising_claim_result_fails_its_victim_at_the_answer(tmp_path: Path) -> None:
    vp = make(tmp_path, decode_cfg=FAST)
    vp.finish("A", {"p-victim": (1, 2), "p-other": (3,), "p-after": (4,)})
    fault = inject_fault(vp.decode, "peers_and_claims._on_claim_result", victim="victim", times=1)
    t0 = vp.now_ns
    vp.start("victim", "A", "p-victim", (1, 2))
    vp.start("other", "A", "p-other", (3,))
    served(vp, "other")
    assert fault.fired == 1 and vp.failed["victim"] == t0
    detail = "InjectedFault: injected into peers_and_claims._on_claim_result for victim"
    assert internal_errors(vp, "victim") == [{"where": "claim result", "detail": detail}]
    vp.start("after", "A", "p-after", (4,))
    served(vp, "after")
    vp.run(0.01)
    assert vp.sent("A")["p-victim"] == t0  # its abandon, not the 30 s lease
    assert replayed(vp)[("recv", "victim")] == "failed"


def test_a_raising_prefill_claims_handler_fails_the_claim_at_once_and_the_lease_frees_it(tmp_path: Path) -> None:
    vp = make(tmp_path, {"F": 1.0}, decode_cfg=FAST)
    vp.finish("F", {"p-victim": (1, 2), "p-other": (3,)})
    worker = vp.prefills["F"].worker
    assert worker is not None and worker.server is not None
    fault = inject_fault(worker, "server._on_claims", victim="p-victim")
    t0 = vp.now_ns
    vp.start("victim", "F", "p-victim", (1, 2))
    vp.start("other", "F", "p-other", (3,))
    served(vp, "other")
    assert fault.fired >= 1 and vp.failed["victim"] == t0
    [e] = [r["input"] for r in vp.records() if r.get("req") == "victim" and r["event"] == "error"]
    assert e["kind"] == "handshake" and "injected into server._on_claims" in e["detail"], e
    vp.run(2.0)
    # Its abandon hits the same raising handler: the lease frees the blocks, at its end.
    assert vp.sent("F")["p-victim"] - t0 == 1 * S
    finals = replayed(vp)
    assert finals[("send", "p-victim")] == "expired" and finals[("recv", "victim")] == "failed"
