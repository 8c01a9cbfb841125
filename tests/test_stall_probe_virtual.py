"""Partitions on virtual time with the real workers. The stalled-read probe: a
read that a partition stalls (its prefill worker cut off, the read neither
completing nor failing) fails within ``stall_timeout`` and a bit, settled by
dropping the peer's agent; a read that is only slow, from a peer that answers,
goes on. A partition between a read and its notification: the request is
served, and the prefill side's blocks come back when the lease ends. (All
three on real servers across two network namespaces: test_two_hosts.py.)
"""

from __future__ import annotations

from pathlib import Path

from kvsm.replay import analyse
from kvsm.transport.memory import Fault
from kvsm_testing.virtual_pair import S, VirtualPair

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


def test_a_decode_loop_that_wakes_late_takes_the_answer_that_came_in_time(tmp_path: Path) -> None:
    """The decode worker's loop starved (its process compiling a first forward
    on the same cores: seen on TP 2 servers here) while its liveness probe is
    out: the prefill's answer arrives in time, but the loop next runs after the
    probe's deadline, with both waiting. The answer wins (the handshake client
    reads what its sockets hold before it times a request out): the peer is not
    taken for dead, and the slow read is delivered."""
    vp = make(tmp_path)
    vp.finish("A", {"p-4": (7, 8)})
    vp.delay_of["d-4"] = 6 * S
    vp.start("d-4", "A", "p-4", (7, 8))
    vp.run(0.05)
    vp.freeze("A")  # the probe, sent at the watch's tick, goes unanswered for now
    vp.run(1.0)
    assert peer_deaths(vp) == [] and vp.state("d-4") == "transferring"
    decode_loop = id(vp.decode.loop)
    vp.loops.frozen.add(decode_loop)  # the decode loop stops running ...
    vp.freeze("A", False)  # ... as the prefill answers: the answer waits in its socket
    vp.run(STALL_S * 1.5)  # past the probe's deadline
    vp.loops.frozen.discard(decode_loop)
    vp.run(until=lambda: "d-4" in vp.recving or "d-4" in vp.failed, limit_s=60)
    assert peer_deaths(vp) == []
    assert "d-4" in vp.recving and "d-4" not in vp.failed


def test_a_partition_between_the_read_and_its_notification(tmp_path: Path) -> None:
    """The read completes, its notification is lost with the network: the decode
    request is served (done); the prefill worker, never told, frees the blocks
    when its lease (3 s) ends, counted as expired; both logs replay clean."""
    vp = VirtualPair({"A": 3.0}, log_dir=tmp_path)
    vp.finish("A", {"p-3": (5, 6)})
    vp.fault_of["d-3"] = Fault.NOTIF_LOST
    t0 = vp.now_ns
    vp.start("d-3", "A", "p-3", (5, 6))
    vp.run(until=lambda: "d-3" in vp.recving, limit_s=10)
    assert "d-3" not in vp.failed and vp.holds("d-3")  # served, the bytes right
    assert "p-3" not in vp.sent("A")  # the prefill side was not told
    vp.run(until=lambda: "p-3" in vp.sent("A"), limit_s=10)
    assert 3 * S <= vp.sent("A")["p-3"] - t0 <= 4 * S  # freed when the lease ended
    vp.close()
    report = analyse(vp.log_paths)
    assert not report.findings, [str(f) for f in report.findings]
    finals = {(m.lifecycle, m.req): m.final_state for m in report.machines if m.lifecycle != "peer"}
    assert finals == {("recv", "d-3"): "done", ("send", "p-3"): "expired"}, finals
