"""Reads posted right behind their claims (``early_reads``), on virtual time.

A decode worker that knows every prefill worker a request reads from (their
agents are loaded) posts the request's reads as soon as its claims have left,
so the claims' round trip overlaps the reads. The real ``WorkerHalf``s run as
in ``test_worker_virtual.py`` (``kvsm_testing.virtual_pair``: driven loops on
one virtual clock, inproc side channel, in-memory transport moving real
bytes); freezing the prefill worker holds its answers back, so each ordering
of read, claim and finish is played on purpose. Every log is replayed.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import test_worker_virtual

from kvsm.replay import analyse
from kvsm_testing.virtual_pair import MS, S, VirtualPair

pair = test_worker_virtual.pair  # the fixture: prefill engines A (lease 30 s) and S (0.3 s)


def transitions(vp: VirtualPair, req: str, engine: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    return [(r["event"], r["src"], r["dst"], r.get("input", {})) for r in vp.records(engine)
            if r.get("req") == req and r["kind"] == "transition"]


def replayed(vp: VirtualPair, findings: set[tuple[str, str | None]] | None = None) -> dict[tuple[str, str], str]:
    vp.close()
    report = analyse(vp.log_paths)
    assert {(f.kind, f.req) for f in report.findings} == (findings or set()), [str(f) for f in report.findings]
    return {(m.lifecycle, m.req): m.final_state for m in report.machines if m.lifecycle != "peer"}


def served(vp: VirtualPair, w: str) -> int:
    """Prefill engine ``w``'s reads_served counter (what its metrics say)."""
    worker = vp.prefills[w].worker
    assert worker is not None
    return int(worker.stats.totals()["reads_served"])


def know(vp: VirtualPair, w: str) -> None:
    """A first request to ``w``: its claim fetches the agent (reads wait for it)."""
    vp.finish(w, {f"p-first-{w}": (9,)})
    vp.start(f"d-first-{w}", w, f"p-first-{w}", (9,))
    vp.run(until=lambda: f"d-first-{w}" in vp.recving)
    assert [t[2] for t in transitions(vp, f"d-first-{w}", "decode-0")][1] == "pending_handshake"


def test_a_known_peer_is_read_while_its_claim_is_out(pair: VirtualPair) -> None:
    know(pair, "A")
    pair.finish("A", {"p-1": (3, 5, 7)})
    pair.freeze("A")  # the claim waits there: the read does not (the fabric reads memory)
    t0 = pair.now_ns
    pair.start("d-1", "A", "p-1", (3, 5, 7))
    pair.run(0.05)
    # The bytes are here, but nothing is reported before the claim is granted.
    assert pair.state("d-1") == "read_unclaimed" and pair.holds("d-1") and "d-1" not in pair.recving
    assert "p-1" not in pair.sent("A")
    pair.freeze("A", False)
    pair.run(until=lambda: "d-1" in pair.recving)
    assert pair.recving["d-1"] - t0 < 60 * MS and pair.holds("d-1") and not pair.failed
    pair.run(0.01)
    assert "p-1" in pair.sent("A")  # released by the read, not by its lease
    path = [(ev, dst) for ev, _, dst, _ in transitions(pair, "d-1", "decode-0")]
    assert path == [("matched", "awaiting_blocks"), ("allocated", "reading_unclaimed"),
                    ("reads_posted", "reading_unclaimed"), ("all_reads_done", "read_unclaimed"),
                    ("handshake_ok", "done")]
    # The prefill worker held the read's notification (it says it was posted early)
    # until the claim came, whichever of the two it took first.
    sends = transitions(pair, "p-1", "prefill-A")
    notif = next(inp for ev, _, _, inp in sends if ev == "read_notif")
    assert notif["early"] is True and sends[-1][2] == "released"
    assert {ev for ev, _, _, _ in sends} == {"finished_ok", "heartbeat", "read_notif"}
    assert replayed(pair)[("recv", "d-1")] == "done"


def test_without_a_freeze_the_read_and_its_claim_end_as_one(pair: VirtualPair) -> None:
    """Inproc answers take no virtual time: the claim is granted before the read
    lands, and the request is reported at the poll after it, as before."""
    know(pair, "A")
    pair.finish("A", {"p-2": (1, 2)})
    t0 = pair.now_ns
    pair.start("d-2", "A", "p-2", (1, 2))
    pair.run(until=lambda: "d-2" in pair.recving)
    assert pair.recving["d-2"] == t0 + 1 * MS and pair.holds("d-2")
    path = [dst for _, _, dst, _ in transitions(pair, "d-2", "decode-0")]
    assert path == ["awaiting_blocks", "reading_unclaimed", "reading_unclaimed", "transferring", "done"]
    assert replayed(pair)[("send", "p-2")] == "released"


def test_a_nixl_error_as_a_claim_is_answered_fails_nothing(pair: VirtualPair, monkeypatch: Any) -> None:
    """The prefill worker polls its NIXL notifications as it answers a claim (a small
    read completes only once its agent makes progress). An error there is the loop's
    logged error, not the claim's: the claim is answered and the request is done."""
    know(pair, "A")
    agent = pair.prefills["A"].agent
    assert agent is not None
    real = agent.get_notifs
    errors_raised: list[int] = []

    def once_broken() -> list[tuple[str, bytes]]:
        """The first poll made while answering a claim fails (the poll timer's do not)."""
        if not errors_raised and any(f.function == "_on_claims" for f in inspect.stack()):
            errors_raised.append(pair.now_ns)
            raise RuntimeError("NIXL broke once")
        return real()

    monkeypatch.setattr(agent, "get_notifs", once_broken)
    pair.finish("A", {"p-nixl-error": (4,)})
    pair.start("d-nixl-error", "A", "p-nixl-error", (4,))
    pair.run(until=lambda: "d-nixl-error" in pair.recving or "d-nixl-error" in pair.failed)
    assert "d-nixl-error" in pair.recving and pair.holds("d-nixl-error") and not pair.failed
    pair.run(0.01)
    assert "p-nixl-error" in pair.sent("A") and len(errors_raised) == 1
    errors = [r for r in pair.records("prefill-A") if r["event"] == "worker.loop_error"]
    assert len(errors) == 1 and "NIXL broke once" in str(errors[0]), errors
    assert errors[0]["label"] == "_poll_notifs", errors
    finals = replayed(pair)
    assert finals[("recv", "d-nixl-error")] == "done" and finals[("send", "p-nixl-error")] == "released"


def test_a_refused_claim_serves_nothing_an_early_read_brought(pair: VirtualPair) -> None:
    know(pair, "S")  # lease 0.3 s
    pair.finish("S", {"p-3": (4, 5), "p-3b": (6,)})
    pair.run(1.0)
    assert {"p-3", "p-3b"} <= set(pair.sent("S"))  # both expired unread
    # Params without an expiry time: the read goes out with the claim, which is refused.
    pair.start("d-3", "S", "p-3", (4, 5))
    pair.run(until=lambda: "d-3" in pair.recving)
    assert "d-3" in pair.failed and set(pair.local_of["d-3"]) <= pair.invalid
    assert [e for e, _, dst, _ in transitions(pair, "d-3", "decode-0") if dst in ("failing", "failed")] == [
        "error", "reads_quiesced"]
    # With the params' expiry time past, the claim asks first: nothing is read.
    wall_s = pair.clock.wall_ns() / S
    pair.start("d-3b", "S", "p-3b", (6,), expiry_s=wall_s - 0.5)
    pair.run(until=lambda: "d-3b" in pair.recving)
    assert "d-3b" in pair.failed
    assert [dst for _, _, dst, _ in transitions(pair, "d-3b", "decode-0")] == [
        "awaiting_blocks", "pending_handshake", "failed"]
    # The early read of d-3 went out after the lease: replay says so (its data was never
    # served: the claim decides; the refusal came first, so the read was cancelled and
    # the prefill side was told by an abandon, stale there).
    finals = replayed(pair, {("read_after_lease_expiry", "d-3")})
    assert finals[("recv", "d-3")] == finals[("recv", "d-3b")] == "failed"


def test_the_params_expiry_holds_early_reads_back_within_the_one_lease_margin(pair: VirtualPair) -> None:
    """The params' expiry time is advisory: within LEASE_MARGIN_NS of it the claim
    asks first (the same margin the claim's lease is judged by); further from it the
    reads go out with the claims. Either way the claim decides: both are served."""
    from kvsm.lifecycle.folds import LEASE_MARGIN_NS

    know(pair, "A")
    pair.finish("A", {"p-m1": (2,), "p-m2": (3,)})
    wall_s = pair.clock.wall_ns() / S
    pair.start("d-m1", "A", "p-m1", (2,), expiry_s=wall_s + LEASE_MARGIN_NS / 2 / S)
    pair.start("d-m2", "A", "p-m2", (3,), expiry_s=wall_s + 2 * LEASE_MARGIN_NS / S)
    pair.run(until=lambda: {"d-m1", "d-m2"} <= set(pair.recving))
    assert [dst for _, _, dst, _ in transitions(pair, "d-m1", "decode-0")][1] == "pending_handshake"
    assert [dst for _, _, dst, _ in transitions(pair, "d-m2", "decode-0")][1] == "reading_unclaimed"
    finals = replayed(pair)
    assert finals[("recv", "d-m1")] == finals[("recv", "d-m2")] == "done"


def test_an_abort_while_the_claim_is_out_lets_the_prefill_go_at_once(pair: VirtualPair) -> None:
    know(pair, "A")
    pair.finish("A", {"p-4": (2, 3)})
    pair.freeze("A")
    pair.start("d-4", "A", "p-4", (2, 3))
    pair.run(0.05)
    assert pair.state("d-4") == "read_unclaimed"
    pair.abort("d-4")
    assert "d-4" in pair.recving and "d-4" not in pair.failed  # aborted: its blocks go back
    pair.freeze("A", False)
    t1 = pair.now_ns
    pair.run(0.05)
    # The held notification counts with the claim (or the abandon that follows it):
    # released now, not a lease (30 s) later.
    assert pair.sent("A")["p-4"] - t1 < 10 * MS
    finals = replayed(pair)
    assert finals[("recv", "d-4")] == "aborted" and finals[("send", "p-4")] == "released"


def test_a_read_before_the_prefill_worker_heard_of_the_finish_waits_for_it(pair: VirtualPair) -> None:
    """vLLM holds a finished request's blocks until finished_sending, so a read
    that reaches them before the pin reached the worker is sound: the worker
    keeps its notification (read_early) until the finish pins the blocks, and
    counts it when the claim, asked again meanwhile, is granted."""
    know(pair, "A")
    served_before = served(pair, "A")
    pair.start("d-5", "A", "p-5", (6, 7))
    pair.run(0.02)
    assert pair.state("d-5") == "read_unclaimed"  # claims answered "unknown", asked again
    # Each claim asked meanwhile is recorded there, as the stale heartbeat that answered it "unknown".
    sends = [r for r in pair.records("prefill-A") if r.get("req") == "p-5" and r["kind"] == "transition"]
    assert [r["dst"] for r in sends if not r.get("stale")] == ["read_early"]
    assert {(r["event"], r["dst"]) for r in sends if r.get("stale")} == {("heartbeat", "read_early")}
    pair.finish("A", {"p-5": (6, 7)})
    pair.run(until=lambda: "d-5" in pair.recving)
    assert pair.holds("d-5") and not pair.failed
    pair.run(0.01)
    assert [(ev, dst) for ev, src, dst, _ in transitions(pair, "p-5", "prefill-A") if src != dst or ev != "heartbeat"
            ] == [("read_notif", "read_early"), ("finished_ok", "awaiting_pull"), ("heartbeat", "released")]
    # Served, in the metrics too: the held read counted when its claim did.
    assert served(pair, "A") - served_before == 1
    assert replayed(pair)[("send", "p-5")] == "released"


def test_early_reads_can_be_turned_off(tmp_path: Path) -> None:
    vp = VirtualPair({"A": 30.0}, log_dir=tmp_path, decode_cfg={"early_reads": False})
    try:
        know(vp, "A")
        vp.finish("A", {"p-6": (1,)})
        vp.start("d-6", "A", "p-6", (1,))
        vp.run(until=lambda: "d-6" in vp.recving)
        assert [dst for _, _, dst, _ in transitions(vp, "d-6", "decode-0")][1] == "pending_handshake"
    finally:
        vp.close()
