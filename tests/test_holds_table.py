"""Holds for next turns (``bidirectional_kv_xfer``) in the tables and under vLLM's
real Scheduler: what is held, what the budget releases and in which order, how
a hold ends on the sending side (never freed while a claim's read may come),
and how a prefill engine judges an offered hold. The real engines' run is
tests/test_holds.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import require
from kvsm.hold_digests import block_digests, matched_blocks, prefix_digest
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import IllegalEventPolicy, LifecycleTracker
from kvsm.lifecycle.table import SEND
from kvsm.replay import analyse
from kvsm.scheduler.holds import HOLD_DIGESTS_KEY, HOLD_TAIL_KEY, HoldIndex

S = 1_000_000_000
BLOCK = 16


def _send() -> LifecycleTracker:
    return LifecycleTracker(SEND, VirtualClock(), policy=IllegalEventPolicy.RAISE)


def _pin(t: LifecycleTracker, req: str, *, hold: bool = True) -> None:
    t.create(req)
    assert t.apply(ev.FinishedOk(req=req, block_ids=(3, 4), lease_ns=480 * S, hold=hold)).dst == "awaiting_pull"


def test_an_unclaimed_hold_is_released_at_once_and_counted() -> None:
    t = _send()
    _pin(t, "h")
    out = t.apply(ev.ReleaseAsked(req="h", reason="over budget", lease_ns=30 * S))
    assert (out.dst, out.effects) == ("released", ("cancel_lease", "count_hold_ended", "free_blocks"))
    # Asked again (told twice): declared stale, nothing freed twice.
    assert t.verdict("h", {"released": "gone"}) == "gone"


def test_a_claimed_hold_waits_for_its_read_and_is_no_longer_extended() -> None:
    t = _send()
    _pin(t, "h")
    assert t.apply(ev.Heartbeat(req="h", lease_ns=30 * S, reader="d0")).dst == "awaiting_pull"
    out = t.apply(ev.ReleaseAsked(req="h", reason="over budget", lease_ns=30 * S))
    assert (out.dst, out.effects) == ("releasing", ("arm_lease",))
    m = t.get("h")
    assert m is not None and m.lease_deadline_ns == 30 * S  # a claim's lease from now, not the 480 s
    # A claim or heartbeat now is not granted (answered unknown): no read may start on it.
    assert t.apply(ev.Heartbeat(req="h", lease_ns=30 * S, reader="d1")).stale
    assert m.lease_deadline_ns == 30 * S
    out = t.apply(ev.ReadNotif(req="h", reader="d0"))
    assert (out.dst, out.effects) == ("released", ("cancel_lease", "count_served", "free_blocks"))


def test_a_claimed_hold_whose_read_never_comes_ends_with_its_lease() -> None:
    t = _send()
    _pin(t, "h")
    t.apply(ev.Heartbeat(req="h", lease_ns=30 * S, reader="d0"))
    t.apply(ev.ReleaseAsked(req="h", reason="over budget", lease_ns=30 * S))
    out = t.apply(ev.LeaseExpired(req="h"))
    assert (out.dst, out.effects) == ("hold_expired", ("count_hold_ended", "free_blocks"))


def test_a_holds_time_to_live_ends_it_without_the_unread_lease_warning() -> None:
    t = _send()
    _pin(t, "h")
    _pin(t, "p", hold=False)
    assert t.apply(ev.LeaseExpired(req="h")).effects == ("count_hold_ended", "free_blocks")
    assert t.apply(ev.LeaseExpired(req="p")).effects == ("count_expired_lease", "free_blocks")
    # A read after a hold expired is the violation it is on a prefill's lease.
    lenient = LifecycleTracker(SEND, VirtualClock())
    _pin(lenient, "h2")
    lenient.apply(ev.LeaseExpired(req="h2"))
    assert lenient.apply(ev.ReadNotif(req="h2", reader="d0")).violation == "read_after_lease_expiry"


def test_digests_match_block_by_block() -> None:
    tokens = list(range(100, 180))
    held = block_digests(tokens, BLOCK, 4)
    assert len(held) == 4 and matched_blocks(held, tokens + [1, 2, 3], BLOCK) == 4
    edited = tokens[:40] + [7] + tokens[41:]  # a token of block 2 differs: blocks 0-1 match
    assert matched_blocks(held, edited, BLOCK) == 2
    assert matched_blocks(held, tokens[:20], BLOCK) == 1  # only one full block given
    assert block_digests(tokens, BLOCK, 4) == held  # the same in every process (no hash seed)


def test_the_index_releases_the_oldest_first_but_never_the_new_hold() -> None:
    idx = HoldIndex()
    for req, n in (("a", 5), ("b", 4), ("c", 6)):
        idx.add(req, n)
    assert idx.oldest_over(10, keep="c") == [("a", 15)]  # 10 fits
    assert idx.oldest_over(9, keep="c") == [("a", 15), ("b", 10)]
    assert idx.oldest_over(5, keep="c") == [("a", 15), ("b", 10)]  # never the new hold itself
    assert idx.oldest_over(20, keep="c") == []
    idx.remove("a")
    assert idx.total == 10 and len(idx) == 2


# --- under vLLM's real Scheduler ---------------------------------------------------------


def _harness(tmp: Path, **extra: Any) -> Any:
    require("vllm")
    from kvsm_testing.scheduler import make_scheduler

    return make_scheduler(kv_role="kv_both", block_size=BLOCK, num_blocks=200, kv_load_failure_policy="recompute",
                          engine_id="dec", extra_config={"bidirectional_kv_xfer": True, "event_log_dir": str(tmp),
                                                         **extra})


def _decode_turn(h: Any, req: str, prompt: list[int], max_tokens: int) -> dict[str, Any] | None:
    """A P/D decode request run to its end (its load reported at once): its answer's params."""
    from kvsm_testing.scheduler import remote_prefill_params

    n_blocks = -(-len(prompt) // BLOCK)
    params = remote_prefill_params(remote_block_ids=list(range(1, n_blocks + 1)), remote_request_id=f"p-{req}",
                                   remote_num_tokens=len(prompt))
    h.add_request(prompt, kv_transfer_params=params, max_tokens=max_tokens, request_id=req)
    for i in range(max_tokens + 4):
        step = h.step(finished_recving={req} if i == 0 else ())
        if req in step.finished:
            return step.finished[req].kv_transfer_params
    raise AssertionError(f"{req} did not finish")


def test_finished_decode_requests_are_held_and_the_budget_releases_the_oldest(tmp_path: Path) -> None:
    h = _harness(tmp_path, decoder_kv_hold_blocks=8)
    half = h.connector.scheduler_half
    prompt = h.make_prompt(40)
    offer = _decode_turn(h, "d1", prompt, 10)  # 49 tokens computed: 4 blocks, the last partial
    assert offer is not None and offer["do_remote_decode"] and not offer["do_remote_prefill"]
    assert offer["remote_engine_id"] == "dec" and offer["remote_request_id"] == "d1"
    assert offer["remote_num_tokens"] == 49 and len(offer["remote_block_ids"][0]) == 4
    tokens = prompt + [h.sampled_token_id] * 10
    assert offer[HOLD_DIGESTS_KEY] == block_digests(tokens, BLOCK, 3)
    assert offer[HOLD_TAIL_KEY] == prefix_digest(tokens, BLOCK, 49)
    assert half.pending_counts()["held_blocks"] == 4
    # A second hold of 4 blocks fits (8); a third pushes the oldest out, never itself.
    assert _decode_turn(h, "d2", h.make_prompt(40), 10) is not None
    assert _decode_turn(h, "d3", h.make_prompt(40), 10) is not None
    states = {m.req: m.state for m in half.requests.live()}
    assert states == {"d1": "hold_releasing", "d2": "held", "d3": "held"}
    assert half.pending_counts()["held_blocks"] == 8
    # A hold larger than the whole budget is not held, and says why.
    assert _decode_turn(h, "big", h.make_prompt(150), 2) is None
    # The workers report the released hold's blocks free: it ends.
    h.step(finished_sending={"d1"})
    assert {m.req: m.state for m in half.requests.live()} == {"d2": "held", "d3": "held"}
    h.close()  # a clean stop: the holds left end closed_at_shutdown
    report = analyse(sorted(tmp_path.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    lines = [line for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert any('"release_decided"' in line and "memory pressure" in line and '"d1"' in line for line in lines)
    assert any('"sched.not_held"' in line and "exceed decoder_kv_hold_blocks (8)" in line for line in lines)


def test_a_release_never_overtakes_its_holds_own_pin(tmp_path: Path) -> None:
    """Two holds finishing in one step with a budget for one: the first's release
    goes to the workers after its pin, in the same batch."""
    h = _harness(tmp_path, decoder_kv_hold_blocks=4)
    from kvsm_testing.scheduler import remote_prefill_params

    for req in ("x", "y"):
        params = remote_prefill_params(remote_block_ids=[1, 2, 3], remote_request_id=f"p-{req}",
                                       remote_num_tokens=40)
        h.add_request(h.make_prompt(40), kv_transfer_params=params, max_tokens=3, request_id=req)
    finishes = []
    for i in range(8):
        step = h.step(finished_recving={"x", "y"} if i == 0 else ())
        finishes += list(step.connector_metadata.send_finish)
        if {"x", "y"} <= set(step.finished):
            break
    finishes += list(h.step().connector_metadata.send_finish)
    order = [(f.req, "release" if f.release else "pin") for f in finishes]
    assert order == [("x", "pin"), ("y", "pin"), ("x", "release")], order


def test_a_prefill_reads_the_held_blocks_its_prompt_starts_with(tmp_path: Path) -> None:
    """On the prefill side: the matching held blocks are loaded (minus the last
    prompt token, which gives the first token), then the prompt is prefilled and
    pinned as before; a prompt that does not start with them computes all."""
    h = _harness(tmp_path)
    half = h.connector.scheduler_half
    held = list(range(500, 580))  # 5 blocks held
    offer = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[11, 12, 13, 14, 15]],
             "remote_engine_id": "other-dec", "remote_request_id": "d9", "remote_host": "127.0.0.1",
             "remote_port": 5999, "remote_num_tokens": 80, "remote_block_size": BLOCK,
             HOLD_DIGESTS_KEY: block_digests(held, BLOCK, 5)}
    h.add_request(held + [1, 2, 3], kv_transfer_params=offer, max_tokens=1, request_id="next")
    edited = held[:35] + [9] + held[36:]  # differs in block 2: blocks 0-1 match
    h.add_request(edited + [1], kv_transfer_params={**offer, "remote_request_id": "d10"}, max_tokens=1,
                  request_id="edited")
    # A partial last block held: read when the prompt has all of it.
    tailed = {**offer, "remote_request_id": "d11", "remote_num_tokens": 75,
              HOLD_DIGESTS_KEY: offer[HOLD_DIGESTS_KEY][:4], HOLD_TAIL_KEY: prefix_digest(held, BLOCK, 75)}
    h.add_request(held[:75] + [1, 2], kv_transfer_params=tailed, max_tokens=1, request_id="tail")
    h.add_request(held[:74] + [1, 2], kv_transfer_params={**tailed, "remote_request_id": "d12"}, max_tokens=1,
                  request_id="short")
    # One reader per hold (its blocks go after one read): a second one computes.
    h.add_request(held + [4], kv_transfer_params=offer, max_tokens=1, request_id="twice")
    stranger = {k: v for k, v in offer.items() if k != HOLD_DIGESTS_KEY}
    h.add_request(h.make_prompt(50), kv_transfer_params=stranger, max_tokens=1, request_id="stranger")
    step = h.step()
    starts = {s.req: s for s in step.connector_metadata.recv_start}
    assert starts["next"].num_tokens == 80 and starts["next"].remote_req == "d9"
    assert starts["edited"].num_tokens == 2 * BLOCK
    assert starts["tail"].num_tokens == 75 and len(starts["tail"].remote_block_ids) == 5
    assert starts["short"].num_tokens == 4 * BLOCK  # its 75th token differs: the full blocks only
    assert "stranger" not in starts and "twice" not in starts
    assert {s.req for s in step.connector_metadata.send_start} == {"next", "edited", "tail", "short", "stranger",
                                                                   "twice"}
    states = {m.req: m.state for m in half.requests.live()}
    assert states == {r: "reuse_loading" for r in ("next", "edited", "tail", "short")}  # the others prefilled at once
    finished: dict[str, Any] = dict(step.finished)
    for i in range(6):
        finished.update(h.step(finished_recving={"next", "edited", "tail", "short"} if i == 0 else ()).finished)
    assert set(finished) == {"next", "edited", "tail", "short", "stranger", "twice"}
    assert all(o.kv_transfer_params and o.kv_transfer_params["do_remote_prefill"] for o in finished.values())
    h.close()  # a clean stop: the holds left end closed_at_shutdown
    report = analyse(sorted(tmp_path.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    finals = {m.req: m.final_state for m in report.machines if m.lifecycle == "sched"}
    assert set(finals.values()) == {"pinned"} and len(finals) == 6, finals


@pytest.mark.parametrize(("role", "policy", "needle"), [
    ("kv_consumer", "recompute", "needs kv_role 'kv_both'"),
    ("kv_both", "fail", "needs kv_load_failure_policy 'recompute'"),
])
def test_bidirectional_needs_both_roles_and_the_recompute_policy(role: str, policy: str, needle: str) -> None:
    require("vllm")
    from kvsm_testing.scheduler import make_scheduler

    with pytest.raises(ValueError, match=needle):
        make_scheduler(kv_role=role, kv_load_failure_policy=policy, extra_config={"bidirectional_kv_xfer": True})
