"""What a peer can make a worker hold is bounded: early abandons and read
notifications (for prefills this worker has not heard finish) wait as send
machines, at most MAX_EARLY_INPUTS of them and each for at most a lease; the
refusal beyond it is the table's (``early_inputs_full``, the send machine's
``refused_early``). Runs the real worker on a driven loop and virtual time (no
NIXL, no sockets)."""

from __future__ import annotations

from kvsm.config import KVSMConfig
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.table import CLAIM_ANSWERS, MAX_EARLY_INPUTS
from kvsm.worker import WorkerHalf


def _prefill_worker(clock: VirtualClock) -> WorkerHalf:
    cfg = KVSMConfig(engine_id="prefill-bounds", kv_role="kv_producer", kv_buffer_device="cpu",
                     side_channel_host="127.0.0.1", side_channel_port=5600, lease_s=2.0, heartbeat_interval_s=1.0,
                     handshake_timeout_s=1.0, transfer_timeout_s=1.0, peer_backoff_s=1.0, peer_backoff_max_s=4.0,
                     notif_poll_interval_s=0.001, event_log_dir=None, backends=("memory",), tp_size=1, dp_rank=0,
                     pp_size=1, dcp_size=1, block_size=16, kv_load_failure_policy="fail")
    half = WorkerHalf(cfg, 0, clock=clock, loop_options={"mode": "driven"})
    half.loop.start()
    return half


def test_early_abandons_are_bounded_in_number_and_time() -> None:
    clock = VirtualClock()
    half = _prefill_worker(clock)
    try:
        flood = [f"never-{i}" for i in range(MAX_EARLY_INPUTS + 500)]
        answers = half.sender._on_claims("abandon", "decode/tp0", flood)
        assert set(answers.values()) == {"ok"}
        counts = half.send.count_by_state()
        assert counts["abandoned_early"] == MAX_EARLY_INPUTS
        assert len(half.send) == MAX_EARLY_INPUTS
        # Those beyond the bound were refused by the table, each counted once.
        assert half.state_counts["send"]["refused_early"] == 500 and half.send.final_state(flood[-1]) == "refused_early"
        assert half.stats.totals()["failures"].get("early_abandon_dropped") == 500
        # A read notification beyond it too; a second input for a refused request is stale.
        half.sender._on_read_notif(ev.ReadNotif(req="late-read", reader="decode/tp0"))
        assert half.send.final_state("late-read") == "refused_early"
        assert half.sender._on_claims("abandon", "decode/tp0", [flood[-1]]) == {flood[-1]: "ok"}
        assert half.send.final_state(flood[-1]) == "refused_early" and half.send.violations == 0
        assert half.send.verdict(flood[-1], CLAIM_ANSWERS) == "unknown"
        # A lease later every one is forgotten, and nothing is held.
        clock.advance(half.cfg.lease_ns + 1)
        half.loop.run_until_idle()
        assert len(half.send) == 0 and half.send.final_state(flood[0]) == "forgotten"
        assert half.resources()["send_io"] == 0 and half.resources()["loop_timers"] == 0
        # A finish after the abandon was forgotten is a new request and pins as usual.
        from kvsm.handoff.facts import SendFinish
        finish = SendFinish(req=flood[0], ok=True, block_ids=(1, 2), pinned_ns=clock.monotonic_ns())
        half.sender._on_send_finish((finish, "test"))
        assert half.send.get(flood[0]) is not None and half.send.get(flood[0]).state == "awaiting_pull"
    finally:
        half.loop.stop()


def test_an_early_abandon_frees_the_blocks_the_moment_the_finish_comes() -> None:
    from kvsm.handoff.facts import SendFinish

    clock = VirtualClock()
    half = _prefill_worker(clock)
    try:
        half.sender._on_claims("abandon", "decode/tp0", ["early"])
        half.sender._on_send_finish((SendFinish(req="early", ok=True, block_ids=(7,), pinned_ns=0), "test"))
        assert half.send.final_state("early") == "released"
        sent, _, _ = half.take_results()
        assert sent == {"early"}
    finally:
        half.loop.stop()
