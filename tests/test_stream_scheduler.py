"""Streamed push (transfer_mode "stream") in KVSMConnector's scheduler half,
driven by vLLM's real Scheduler (no model).

The prefill side tells its workers, step by step, what each step computes of a
streamed request (``StreamStep``: the blocks by position, the tokens, the last
step), starting with its join key (``SendStart.stream``); the decode side
matches the whole prompt before the prefill computes it and relays its blocks
by position (``RecvStart.stream``); what cannot be streamed is refused with a
reason, and the request runs locally.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from conftest import require

require("vllm")

from test_connector_scheduler import drained, harness, log_records, meta_of, pending

from kvsm.handoff.facts import PRODUCER_KEY, STREAM_KEY, UNWRITTEN
from kvsm.handshake import PROTOCOL_VERSION
from kvsm.scheduler.stream_steps import GroupReach, StreamSteps

KEY = "kvsm-stream-0123abcd"


def prefill_leg(key: str = KEY) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "stream", STREAM_KEY: key}


def decode_leg(key: str = KEY, **overrides: Any) -> dict[str, Any]:
    """What kvsm's router sends the decode engine of a streamed pair."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "stream", STREAM_KEY: key,
              "remote_request_id": key, "remote_block_ids": [[]], "remote_engine_id": "prefill-engine",
              "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "pp_size": 1,
              PRODUCER_KEY: PROTOCOL_VERSION, "remote_block_size": 16}
    params.update(overrides)
    return {k: v for k, v in params.items() if v is not None}


def test_a_streamed_prefill_tells_its_workers_each_steps_tokens_and_blocks() -> None:
    """A 100-token prompt in chunks of 32: four steps, each saying which tokens it
    computes and the request's blocks so far, the last one marked; the key with the
    first step; a plain prefill beside it says nothing of steps."""
    with harness("kv_producer", max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256) as h:
        free0 = h.free_blocks()
        h.add_request(100, kv_transfer_params=prefill_leg(), max_tokens=1, request_id="p-s")
        h.add_request(20, kv_transfer_params={"do_remote_decode": True}, max_tokens=1, request_id="p-plain")
        steps = []
        while "p-s" not in {rid for r in steps for rid in r.finished}:
            steps.append(h.step())
            assert len(steps) < 20
        metas = [meta_of(s) for s in steps]
        assert [(s.req, s.stream) for s in metas[0].send_start][:1] == [("p-s", KEY)]
        facts = [(f.start, f.end, f.last, len(f.block_ids[0])) for m in metas for f in m.stream_steps]
        # (the plain prefill shares the first steps' budget: what is left of 32 tokens each)
        assert facts[-1][1:3] == (100, True) and all(not last for _, _, last, _ in facts[:-1]), facts
        assert [a for a, *_ in facts] == sorted(a for a, *_ in facts) and facts[0][0] == 0, facts
        assert all(prev[1] == nxt[0] for prev, nxt in zip(facts, facts[1:], strict=False)), facts
        assert all(n == -(-end // 16) for _, end, _, n in facts), facts  # its blocks, by position
        assert all(f.req == "p-s" for m in metas for f in m.stream_steps)
        assert all(len(f.block_ids) == 1 for m in metas for f in m.stream_steps)  # one KV cache group
        blocks = [f.block_ids[0] for m in metas for f in m.stream_steps]
        assert all(b[:len(a)] == a for a, b in zip(blocks, blocks[1:], strict=False)), blocks  # only grown
        h.run_until_idle(finished_sending={"p-s", "p-plain"})
        assert h.free_blocks() == free0
        drained(h)


def test_a_streamed_decode_request_is_matched_before_the_prefill_computes(tmp_path: Path) -> None:
    with harness("kv_consumer", tmp_path) as h:
        h.add_request(40, kv_transfer_params=decode_leg(), max_tokens=2, request_id="d-s")
        (start,) = meta_of(h.step()).recv_start
        assert (start.stream, start.push, start.remote_req, start.remote_block_ids) == (True, True, KEY, ())
        assert start.local_block_ids == tuple(h.block_ids("d-s")[0]) and len(start.local_block_ids) == 3
        assert (start.num_tokens, start.first_position, start.awaited) == (40, 0, True)
        assert h.request("d-s").status.name == "WAITING_FOR_REMOTE_KVS"
        h.step(finished_recving={"d-s"})
        h.run_until_idle()
        drained(h)


def test_a_local_prefix_hit_is_not_asked_for() -> None:
    """The prompt's first two blocks are cached here: only the third is asked for,
    by its position."""
    with harness("kv_consumer") as h:
        prompt = h.make_prompt(40)
        h.add_request(prompt, max_tokens=1, request_id="local")
        h.run_until_idle()
        h.add_request(prompt, kv_transfer_params=decode_leg(), max_tokens=1, request_id="d-hit")
        (start,) = meta_of(h.step()).recv_start
        assert (start.num_tokens, start.first_position, len(start.local_block_ids)) == (8, 2, 1)
        assert start.local_block_ids == tuple(h.block_ids("d-hit")[0][2:])
        h.step(finished_recving={"d-hit"})
        h.run_until_idle()
        drained(h)


@pytest.mark.parametrize(("overrides", "needle", "told"), [
    ({"remote_block_size": 32}, "blocks hold 32 tokens, this engine's 16", True),
    ({"tp_size": 2}, "tensor parallel sizes differ", True),
    ({"pp_size": 2}, "pipeline parallel", True),
    ({STREAM_KEY: "another-key"}, "must be the join key", False),
    ({"remote_block_ids": [[3, 4]]}, "remote_block_ids must be empty", False),
    ({PRODUCER_KEY: None}, "only a kvsm prefill engine streams", False),
    ({"transfer_mode": "streamed"}, "transfer_mode 'streamed'", False),
])
def test_what_cannot_be_streamed_runs_locally_and_says_why(tmp_path: Path, overrides: dict[str, Any],
                                                           needle: str, told: bool) -> None:
    """Refused with the reason logged; the request runs locally. A kvsm prefill
    engine's stream this engine cannot take (``told``) is abandoned at once by the
    join key, so that the prefill side frees its blocks at its finish, not at its
    lease's end; params that are not a kvsm streamed pair's tell nobody."""
    with harness("kv_consumer", tmp_path) as h:
        h.add_request(40, kv_transfer_params=decode_leg(**overrides), max_tokens=2, request_id="d-x")
        s = h.step()
        assert not meta_of(s).recv_start and "d-x" in s.scheduled
        abandons = [(a.req, a.remote_req, a.remote_engine, a.remote_port) for a in meta_of(s).recv_abandon]
        assert abandons == ([("d-x", KEY, "prefill-engine", 5600)] if told else []), abandons
        assert pending(h)["ignored"] == 1
        h.run_until_idle()
        drained(h)
    records = [json.loads(line) for f in (tmp_path / "logs").glob("*.jsonl") for line in f.read_text().splitlines()]
    reasons = [r["reason"] for r in records if r["event"] == "sched.params_ignored"]
    assert reasons and needle in reasons[0], reasons


def test_a_model_of_several_kv_cache_groups_streams_each_groups_blocks(tmp_path: Path) -> None:
    """Gemma 2's shape (sliding window of 32 beside full attention, blocks of 16),
    a 100-token prompt in chunks of 32. The prefill side names both groups' blocks
    at each step, the sliding window's as null before the window of the prompt's
    last token (position (100 - 32) // 16 = 4 on: the ones vLLM never frees
    mid-prompt); the decode side asks for both groups' blocks by position, group
    after group, null where its vLLM gave the null block."""
    with harness("kv_both", tmp_path, sliding_window=32, max_num_batched_tokens=32, max_num_seqs=8,
                 max_model_len=256) as h:
        h.add_request(100, kv_transfer_params=prefill_leg(), max_tokens=1, request_id="p-g")
        steps = []
        while "p-g" not in {rid for r in steps for rid in r.finished}:
            steps.append(h.step())
            assert len(steps) < 20
        facts = [f for s in steps for f in meta_of(s).stream_steps]
        assert [(f.start, f.end) for f in facts] == [(0, 32), (32, 64), (64, 96), (96, 100)]
        at = [g.window for g in h.connector.kv_groups].index(32)  # the sliding window's group
        for f in facts:
            sliding, full = f.block_ids[at], f.block_ids[1 - at]
            assert len(full) == len(sliding) == -(-f.end // 16), f
            assert UNWRITTEN not in full, f
            assert sliding[:4] == (UNWRITTEN,) * min(4, len(sliding)) and UNWRITTEN not in sliding[4:], f
        h.run_until_idle(finished_sending={"p-g"})
        h.add_request(100, kv_transfer_params=decode_leg(remote_block_ids=[[], []]), max_tokens=1,
                      request_id="d-g")
        (start,) = meta_of(h.step()).recv_start
        # vLLM's null block (0) before the sliding window here: not asked for; nothing cached.
        rows = [[(j, b) for j, b in enumerate(ids) if b != 0] for ids in h.block_ids("d-g")]
        assert start.stream and start.first_position == 0, start
        assert start.group_firsts == tuple(row[0][0] for row in rows), start
        assert start.group_firsts[at] > 0 and start.group_firsts[1 - at] == 0, start
        assert start.group_sizes == tuple(map(len, rows)), start
        assert start.local_block_ids == tuple(b for row in rows for _, b in row), start
        h.step(finished_recving={"d-g"})
        h.run_until_idle()
        drained(h)
    records = log_records(h, tmp_path)
    assert not [r for r in records if r["event"] in ("sched.params_ignored", "sched.stream_refused")]


def test_positions_a_group_never_reads_are_not_written() -> None:
    """A 100-token prompt in blocks of 16: full attention reads every position; a
    sliding window of 32 reads from token 68 (block 4); chunks of 48, from token 96
    (block 6). What lies before is UNWRITTEN at every step, whatever the step computes."""
    streams = StreamSteps((GroupReach(), GroupReach(window=32), GroupReach(chunk=48)), block_size=16)
    request = SimpleNamespace(request_id="p-r", num_computed_tokens=0, num_prompt_tokens=100)
    streams.add(request, prefill_leg())
    ids = ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17], [21, 22, 23, 24, 25, 26, 27])
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    out = SimpleNamespace(num_scheduled_tokens={"p-r": 100}, preempted_req_ids=set(), scheduled_cached_reqs=cached,
                          scheduled_new_reqs=[SimpleNamespace(req_id="p-r", block_ids=ids)])
    (step,) = streams.steps(out)
    u = UNWRITTEN
    assert step.block_ids == ((1, 2, 3, 4, 5, 6, 7), (u, u, u, u, 15, 16, 17), (u, u, u, u, u, u, 27))
    assert GroupReach(window=200).first_read(100) == 0 and GroupReach(chunk=128).first_read(128) == 0


def test_groups_of_different_block_sizes_are_refused_naming_them() -> None:
    """Streamed push writes every group's blocks by position: groups whose blocks hold
    different numbers of tokens are refused (the one place this is checked), and a
    reach that names another number of groups than the block sizes is a plain error."""
    from worker_peer import config_fields

    from kvsm.config import KVSMConfig
    from kvsm.scheduler.half import SchedulerHalf

    cfg = KVSMConfig(**config_fields("p-e", "kv_producer", 5600))
    half = SchedulerHalf(cfg, group_block_sizes=(16, 32), stream_reach=(GroupReach(), GroupReach(window=64)))
    assert half._stream_unsupported == ("its KV cache groups' blocks hold [16, 32] tokens; streamed push writes "
                                        "groups of one block size")
    assert SchedulerHalf(cfg, group_block_sizes=(16, 16))._stream_unsupported == ""
    with pytest.raises(ValueError, match="stream_reach names 1 KV cache groups"):
        SchedulerHalf(cfg, group_block_sizes=(16, 16), stream_reach=(GroupReach(),))


def test_a_preempted_streamed_prefill_is_told_to_the_workers() -> None:
    """A step whose scheduling preempted a streamed prefill (vLLM's
    ``preempted_req_ids``: it freed the blocks) says so to the workers, timed no
    earlier than the free; a plain request preempted beside it is none of theirs.
    Resumed, the request's blocks are its new list, from its first token again."""
    streams = StreamSteps()
    request = SimpleNamespace(request_id="p-s", num_computed_tokens=0, num_prompt_tokens=100)
    streams.add(request, prefill_leg())
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    first = SimpleNamespace(num_scheduled_tokens={"p-s": 32},
                            scheduled_new_reqs=[SimpleNamespace(req_id="p-s", block_ids=([4, 5],))],
                            scheduled_cached_reqs=cached, preempted_req_ids=set())
    assert [(s.start, s.end, s.block_ids) for s in streams.steps(first)] == [(0, 32, ((4, 5),))]
    assert streams.preempted(first, 1) == []
    request.num_computed_tokens = 0  # (vLLM resets it at the preemption)
    freed_at = time.monotonic_ns()
    out = SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                          preempted_req_ids={"p-s", "p-plain"})
    assert streams.steps(out) == []
    (gone,) = streams.preempted(out, time.monotonic_ns())
    assert gone.req == "p-s" and gone.at_ns >= freed_at
    resumed = SimpleNamespace(req_ids=["p-s"], new_block_ids=[([9, 7, 8],)], resumed_req_ids={"p-s"})
    again = SimpleNamespace(num_scheduled_tokens={"p-s": 48}, scheduled_new_reqs=[], scheduled_cached_reqs=resumed,
                            preempted_req_ids=set())
    assert [(s.start, s.end, s.block_ids) for s in streams.steps(again)] == [(0, 48, ((9, 7, 8),))]
