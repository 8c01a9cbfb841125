"""The stalled-read probe, on virtual time with the real workers: a read that a
partition stalls (its prefill worker cut off, the read neither completing nor
failing) fails within ``stall_timeout`` and a bit, settled by dropping the
peer's agent; a read that is only slow, from a peer that answers, goes on.
(The same on real servers across two network namespaces: test_two_hosts.py.)
"""

from __future__ import annotations

from pathlib import Path

from kvsm.testing.virtual_pair import S, VirtualPair

STALL_S = 2.0


def make(tmp_path: Path) -> VirtualPair:
    return VirtualPair({"A": 30.0}, log_dir=tmp_path,
                       decode_cfg={"transfer_timeout_s": 30.0, "stall_timeout_s": STALL_S})


def peer_deaths(vp: VirtualPair) -> list[str]:
    return [str(r["input"]["why"]) for r in vp.records() if r.get("lifecycle") == "peer"
            and r.get("event") == "died" and r.get("dst") == "dead"]


def test_a_read_stalled_by_a_partition_fails_within_the_stall_timeout(tmp_path: Path) -> None:
    vp = make(tmp_path)
    vp.finish("A", {"p-1": (1, 2)})
    vp.delay_of["d-1"] = 600 * S  # the read would take ten minutes: it stalls
    vp.start("d-1", "A", "p-1", (1, 2))
    vp.run(0.05)
    assert vp.state("d-1") == "transferring"
    t0 = vp.now_ns
    vp.freeze("A")
    vp.run(until=lambda: "d-1" in vp.failed, limit_s=60)
    took = (vp.failed["d-1"] - t0) / S
    # Probed once the read is STALL_S / 4 old (at the watch's next tick), failed
    # when that probe has gone unanswered for STALL_S.
    assert STALL_S <= took <= STALL_S * 1.5 + 0.1, took
    (why,) = peer_deaths(vp)
    assert "stalled" in why, why
    fail = [(r["event"], r["src"]) for r in vp.records() if r.get("req") == "d-1" and r["kind"] == "transition"]
    assert ("peer_dead", "transferring") in fail and fail[-1] == ("reads_quiesced", "failing"), fail
    assert vp.fabric.in_flight() == 0  # the agent dropped: the read can no longer write
    vp.freeze("A", False)


def test_a_slow_read_from_a_peer_that_answers_goes_on(tmp_path: Path) -> None:
    """Five seconds of read (a saturated link): probed every half second of it,
    answered each time, delivered, and no peer is taken for dead."""
    vp = make(tmp_path)
    vp.finish("A", {"p-2": (3, 4)})
    vp.delay_of["d-2"] = 5 * S
    vp.start("d-2", "A", "p-2", (3, 4))
    vp.run(until=lambda: "d-2" in vp.recving or "d-2" in vp.failed, limit_s=60)
    assert "d-2" in vp.recving and "d-2" not in vp.failed
    assert vp.state("d-2") in ("done", None)
    assert peer_deaths(vp) == []
