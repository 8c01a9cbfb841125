"""Streamed push on virtual time: the in-memory transport's layer writes, and the
simulation's streamed requests (``kvsm_testing.sim.stream``): the prefill engine
computes each prompt in steps, layer by layer, and the real prefill worker writes
each layer into the decode worker's blocks as it is done. Every delivered prompt
token of every layer is checked against what the prefill computed."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import Outcome
from kvsm.replay import analyse
from kvsm.transport.base import TransferState
from kvsm.transport.memory import POISON, Fault, InMemoryAgent, InMemoryFabric
from kvsm.worker.push_stream import Streamer
from kvsm_testing.sim import Faults, SimConfig, Simulation, run_simulation

# -- the transport ----------------------------------------------------------------------------


def _pair(layers: int = 4, block_bytes: int = 16, fault: Fault = Fault.NONE,
          theirs: dict | None = None) -> tuple[InMemoryFabric, InMemoryAgent, InMemoryAgent]:
    clock = VirtualClock()
    fabric = InMemoryFabric(clock, latency_ns=1000, fault_for=lambda h: fault)
    a = InMemoryAgent(fabric, "a", 8, block_bytes, layers=layers)
    b = InMemoryAgent(fabric, "b", 8, **({"block_bytes": block_bytes, "layers": layers} | (theirs or {})))
    a.add_peer(b.metadata())
    return fabric, a, b


def _land(fabric: InMemoryFabric) -> None:
    """The virtual clock moves to the next transfer's end, which lands."""
    clock, at = fabric.clock, fabric.next_completion_ns()
    assert isinstance(clock, VirtualClock) and at is not None
    clock.jump_to(at)
    fabric.step()


def test_an_agent_has_layers_only_when_asked() -> None:
    fabric = InMemoryFabric(VirtualClock())
    assert InMemoryAgent(fabric, "plain", 4, 32).layers() is None
    assert InMemoryAgent(fabric, "n", 4, 32, layers=2).layers() == ("layer.0", "layer.1")
    named = InMemoryAgent(fabric, "named", 4, 32, layers=("q", "k", "v", "o"))
    assert named.layers() == ("q", "k", "v", "o") and named.layer_span("v") == (16, 8)
    with pytest.raises(ValueError, match="evenly"):
        InMemoryAgent(fabric, "odd", 4, 30, layers=4)
    with pytest.raises(ValueError, match="not in"):
        named.layer_span("x")


def test_a_layer_write_moves_that_layer_only_as_it_was_when_posted() -> None:
    fabric, a, b = _pair()
    a.memory[:] = bytes(range(128))
    b.memory[:] = b"\xee" * 128
    h = a.post_layer_write("b", "layer.2", [1, 3], [5, 0], b"landed", tag="d-1")
    a.memory[:] = bytes(128)  # the source changes after the post: the write carries what it read then
    assert a.check(h) is TransferState.PENDING and b.get_notifs() == []
    _land(fabric)
    assert a.check(h) is TransferState.DONE
    assert b.read_block(5) == b"\xee" * 8 + bytes(range(24, 28)) + b"\xee" * 4
    assert b.read_block(0) == b"\xee" * 8 + bytes(range(56, 60)) + b"\xee" * 4
    assert all(b.read_block(x) == b"\xee" * 16 for x in (1, 2, 3, 4, 6, 7))
    assert b.get_notifs() == [("a", b"landed")]
    assert a.release(h) and a.resources()["handles"] == 0


def test_a_layer_write_from_a_block_freed_in_flight_lands_bytes_that_are_not_the_requests() -> None:
    """As an RDMA write may read its source after vLLM freed (and reused) it."""
    fabric, a, b = _pair()
    a.memory[:] = bytes(range(128))
    h = a.post_layer_write("b", "layer.0", [1, 3], [5, 0], b"", tag="d-1")
    a.freed([3])
    _land(fabric)
    assert a.check(h) is TransferState.DONE
    assert b.read_block(5)[:4] == bytes(range(16, 20)) and b.read_block(0)[:4] == POISON * 4
    h = a.post_layer_write("b", "layer.0", [3], [0], b"", tag="d-1")  # posted after the free: as it is
    _land(fabric)
    assert b.read_block(0)[:4] == bytes(range(48, 52))


def test_a_layer_write_goes_through_the_fabric_faults() -> None:
    fabric, a, b = _pair(fault=Fault.ERROR)
    a.memory[:] = b"\x01" * 128
    h = a.post_layer_write("b", "layer.0", [0], [0], b"n")
    _land(fabric)
    assert a.check(h) is TransferState.ERROR and b.memory == bytes(128) and b.get_notifs() == []
    fabric, a, b = _pair(fault=Fault.CORRUPT)
    a.memory[:] = b"\x01" * 128
    h = a.post_layer_write("b", "layer.1", [0], [0])
    _land(fabric)
    assert b.read_block(0)[4:8] == b"\xfe\x01\x01\x01"  # the slice's first byte flipped
    fabric, a, b = _pair(fault=Fault.HANG)
    h = a.post_layer_write("b", "layer.1", [0], [0])
    a.remove_peer("b")
    assert a.check(h) is TransferState.ERROR and fabric.in_flight() == 0


@pytest.mark.parametrize(("theirs", "why"), [
    ({"block_bytes": 32}, "blocks of one size"),
    ({"layers": 2}, "the same layers"),
    ({"layers": 0}, "the same layers"),
    ({"num_groups": 2}, None),
], ids=["block-size", "layer-count", "no-layers", "their-groups"])
def test_a_layer_write_is_refused_where_the_nixl_one_is(theirs: dict, why: str | None) -> None:
    fabric, a, b = _pair(theirs=theirs)
    if why is None:  # (their groups do not matter: ours do)
        a.post_layer_write("b", "layer.0", [0], [0])
        a.num_groups = 2
        why = "one KV cache group"
    with pytest.raises(ValueError, match=why):
        a.post_layer_write("b", "layer.0", [0], [0])


def test_a_layer_write_checks_its_arguments() -> None:
    fabric, a, b = _pair()
    with pytest.raises(ValueError, match="not in"):
        a.post_layer_write("b", "layer.9", [0], [0])
    with pytest.raises(ValueError, match="remote blocks"):
        a.post_layer_write("b", "layer.0", [0, 1], [0])
    with pytest.raises(ValueError, match="pool of 8"):
        a.post_layer_write("b", "layer.0", [8], [0])
    with pytest.raises(ConnectionError):
        b.post_layer_write("a", "layer.0", [0], [0])  # no handshake that way
    plain = InMemoryAgent(fabric, "plain", 8, 16)
    plain.add_peer(b.metadata())
    with pytest.raises(ValueError, match="the same layers"):
        plain.post_layer_write("b", "layer.0", [0], [0])
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.post_layer_write("b", "layer.0", [0], [0])


# -- the simulation ----------------------------------------------------------------------------


def _watch(sim: Simulation) -> dict[str, list[tuple[str | None, str, str | None]]]:
    """Each send machine's transitions (source, trigger, destination), as they happen."""
    seen: dict[str, list[tuple[str | None, str, str | None]]] = collections.defaultdict(list)

    def spy(engine_id: str, o: Outcome) -> None:
        if o.lifecycle == "send" and o.violation is None and not o.stale:
            seen[o.req].append((o.src, o.trigger, o.dst))

    sim.observers.append(spy)
    return seen


def test_streamed_requests_arrive_layer_by_layer_as_the_prefill_computes_them() -> None:
    """No faults: every decode request is done, its every prompt token as computed.
    The prefill writes while it computes (streaming), over several steps, whether
    its writes were over before its finish (streamed) or not; an ask that comes
    after the finish (the decode leg reached its engine last) is written at once."""
    n = 60
    sim = Simulation(SimConfig(seed=21, num_requests=n, stream=1.0))
    seen = _watch(sim)
    result = sim.run()
    assert result.violations == [] and result.illegal_events == []
    assert result.count("recv") == {"done": n}
    assert result.count("send") == {"released": n}
    paths: collections.Counter[tuple[str, ...] | str] = collections.Counter()
    for req, steps in seen.items():
        assert req.startswith("p-")
        if ("prefilling", "stream_asked", "streaming") in steps:
            paths["streaming", "streamed" if ("streaming", "write_done", "streamed") in steps else "writing"] += 1
        else:
            assert ("awaiting_pull", "stream_asked", "writing") in steps, steps
            paths["asked after the finish"] += 1
    assert paths["streaming", "streamed"] and paths["streaming", "writing"] and paths["asked after the finish"]
    assert paths["streaming", "streamed"] + paths["streaming", "writing"] > n // 2
    assert max(sim.prefill.passes.steps_of.values()) > 1  # chunked prompts


def test_a_layer_written_before_it_is_computed_is_caught() -> None:
    """The content check can fail: an engine that computes each layer only after it
    told the worker the layer was done (its writes carry what the blocks held
    before) delivers corrupt prompts, and the run says so; the honest engine
    delivers the same run intact."""
    cfg = SimConfig(seed=1, num_requests=30, stream=1.0)
    sim = Simulation(cfg)
    sim.prefill.passes.compute_after_save = True
    kinds = collections.Counter(v.kind for v in sim.run().violations)
    assert set(kinds) == {"corrupt_delivery"} and kinds["corrupt_delivery"] >= 5
    assert run_simulation(cfg).violations == []


def test_corrupted_layer_writes_are_detected() -> None:
    result = run_simulation(SimConfig(seed=5, num_requests=40, stream=1.0, faults=Faults(transfer_corrupt=0.3)))
    assert {v.kind for v in result.violations} == {"corrupt_delivery"}


def test_streamed_runs_with_faults_end_clean_repeat_and_replay(tmp_path: Path) -> None:
    cfg = SimConfig(seed=7, num_requests=80, stream=0.6, push=0.3, faults=Faults.mixed(0.06))
    a = run_simulation(SimConfig(**{**cfg.__dict__, "log_dir": tmp_path / "a"}))
    b = run_simulation(cfg)
    assert a.violations == [] and a.illegal_events == []
    assert a.final_states == b.final_states and a.end_ns == b.end_ns
    assert {"done", "failed"} <= set(a.count("recv"))
    report = analyse(a.log_paths)
    assert report.exit_code == 0, [str(f) for f in report.findings]
    assert {(m.engine_id, m.lifecycle, m.req): m.final_state for m in report.machines} == a.final_states


# -- what the simulation found in streamed push (kvsm/worker/push_stream.py, send.py) -----------


def test_layer_writes_landing_out_of_order_still_deliver_every_token() -> None:
    """Found by this simulation: a block a step filled partly was written, then written
    again whole by the next step while the first write could be in flight; NIXL does not
    order the two, and the first (stale past the step's tokens) could land last. Now a
    block is written once it is whole (the prompt's last block at the last step)."""
    result = run_simulation(SimConfig(seed=0, num_requests=40, stream=1.0, stream_reorder=2.0))
    assert result.violations == []


def test_a_last_write_posted_under_others_is_followed_by_the_notification_alone(tmp_path: Path) -> None:
    """On virtual time a step's layers are all saved at one instant, so the last write
    always goes out while earlier ones are in flight: NIXL would order a notification
    it carried after its own bytes only. It goes without; the notification follows
    alone once every write is over (the prefill worker notes ``notif_alone``), and
    every prompt token arrives as computed (sent before, the run fails: corrupt or
    early deliveries)."""
    result = run_simulation(SimConfig(seed=21, num_requests=30, stream=1.0, log_dir=tmp_path))
    assert result.violations == [] and result.count("recv") == {"done": 30}
    notes = [json.loads(line) for path in result.log_paths if "prefill" in path.name
             for line in path.read_text().splitlines() if '"worker.stream_written"' in line]
    assert len(notes) == 30 and all(n["notif_alone"] for n in notes)
    assert all(n["final_posting_ns"] <= n["done_ns"] for n in notes)


def test_a_notification_that_cannot_be_sent_fails_the_stream_visibly(tmp_path: Path) -> None:
    """Every write over, the notification alone refused (NIXL's genNotif to a peer it
    takes for gone): the prefill's stream ends ``write_done`` not ok, naming why, its
    blocks free at once; the decode request is told ``failed`` (or waits for its
    deadline) and fails, never done; nothing held anywhere."""
    sim = Simulation(SimConfig(seed=21, num_requests=30, stream=1.0, log_dir=tmp_path))
    real, calls = sim.prefill.agent.send_notif, [0]

    def every_third_refused(peer: str, msg: bytes) -> bool:
        calls[0] += 1
        return calls[0] % 3 != 0 and real(peer, msg)

    sim.prefill.agent.send_notif = every_third_refused  # type: ignore[method-assign]
    result = sim.run()
    assert result.violations == [] and result.illegal_events == []
    assert result.count("send") == {"released": 30}
    refused = {json.loads(line)["req"] for path in result.log_paths if "prefill" in path.name
               for line in path.read_text().splitlines()
               if '"write_done"' in line and "the notification saying so could not be sent" in line}
    failed = {req for (_, lc, req), state in result.final_states.items() if lc == "recv" and state == "failed"}
    assert len(refused) >= 5 and len(failed) == len(refused), (refused, failed)
    assert {r.replace("p-", "d-") for r in refused} == failed


def test_a_decode_leg_given_up_before_its_prefill_started_frees_the_prefill_at_its_finish() -> None:
    """Found by this simulation: an abandon by join key that came before the prefill worker
    knew the key made a machine of the key's name, and the prefill request itself then
    pinned its blocks for a whole lease. Now the key's arrival passes the abandon on."""
    result = run_simulation(SimConfig(seed=0, num_requests=60, stream=1.0, faults=Faults(decode_abort=0.5)))
    assert result.violations == []
    assert "expired" not in result.count("send")


def test_preempted_prefills_deliver_every_token_even_under_their_writes(tmp_path: Path) -> None:
    """vLLM preempts half the streamed prefills between two of their steps: their
    blocks go back to the pool (the next request may take them) and they are
    computed again later into new ones. A write still reading the freed blocks
    lands poisoned bytes (the send table's ``[writes_unsure]``): that decode rank is
    written again whole once such writes are over. Every decode request is done with
    every prompt token as computed; nothing leaks; the run repeats and replays clean."""
    n = 60
    cfg = SimConfig(seed=3, num_requests=n, stream=1.0, stream_preempt=0.5, stream_max_steps=4,
                    log_dir=tmp_path)
    sim = Simulation(cfg)
    seen = _watch(sim)
    result = sim.run()
    assert result.violations == [] and result.illegal_events == []
    assert result.count("recv") == {"done": n}
    assert result.count("send") == {"released": n}
    preempted = {req for req, steps in seen.items() if any(t == "stream_preempted" for _, t, _ in steps)}
    assert len(preempted) >= n // 4, len(preempted)
    # Both ways: every write seen over before the free (the stream goes on), or not (written again).
    rewritten = {json.loads(line)["req"] for path in result.log_paths if "prefill" in path.name
                 for line in path.read_text().splitlines() if '"worker.stream_rewrite"' in line}
    assert rewritten and rewritten < preempted, (len(rewritten), len(preempted))
    assert result.final_states == run_simulation(SimConfig(**{**cfg.__dict__, "log_dir": None})).final_states
    report = analyse(result.log_paths)
    assert report.exit_code == 0, [str(f) for f in report.findings]


def _rewrite_at_once(self: Streamer, req: str, o: Outcome) -> None:
    """A planted bug: written again at once, under the writes in question."""
    for reader in o.event.unsure:  # type: ignore[attr-defined]
        w = self.streams.get(req, {}).get(reader)
        if w is not None:
            w.written = [0] * len(w.written)


@pytest.mark.parametrize(("bug", "reorder"), [(lambda self, req, o: None, 0.0), (_rewrite_at_once, 10.0)],
                         ids=["not-written-again", "written-again-under-the-writes"])
def test_a_preempted_stream_not_written_again_after_its_writes_delivers_poisoned_bytes(
        monkeypatch: pytest.MonkeyPatch, bug: Any, reorder: float) -> None:
    """The check can fail: a worker that lets a stream whose write was still reading
    the freed blocks go on without writing it again, or writes it again before those
    writes are over (NIXL does not order two writes into one block: a poisoned one may
    land last), delivers the poison (``InMemoryAgent.freed``), and the run says so;
    the same runs with the real worker are clean."""
    cfg = SimConfig(seed=3, num_requests=60, stream=1.0, stream_preempt=0.5, stream_max_steps=4,
                    stream_reorder=reorder)
    assert run_simulation(cfg).violations == []
    monkeypatch.setattr(Streamer, "_rewrite_unsure_streams", bug)
    kinds = collections.Counter(v.kind for v in run_simulation(cfg).violations)
    assert kinds["corrupt_delivery"] >= 3, kinds
