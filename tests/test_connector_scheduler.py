"""KVSMConnector's scheduler half, driven by vLLM's real Scheduler (no model).

Each test checks what the scheduler half relays to the workers
(``KVSMConnectorMetadata``), what it writes into ``kv_transfer_params``, and
that vLLM's own block accounting comes back to where it started: the
connector must never make vLLM leak or double-free a block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.handoff.facts import PRODUCER_KEY, PROMPT_FINGERPRINT_KEY, prompt_fingerprint
from kvsm.handshake import PROTOCOL_VERSION
from kvsm.vllm.config import kvsm_config
from kvsm.vllm.metadata import KVSMConnectorMetadata
from kvsm_testing.pins import PinWorker
from kvsm_testing.scheduler import (
    SchedulerHarness,
    make_scheduler,
    remote_decode_params,
    remote_prefill_params,
)

UPSTREAM_PREFILL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                         "remote_request_id", "remote_host", "remote_port", "tp_size", "remote_num_tokens"}


def harness(kv_role: str, tmp_path: Path | None = None, **kw: Any) -> SchedulerHarness:
    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": 23456, **kw.pop("extra_config", {})}
    if tmp_path is not None:
        extra["event_log_dir"] = str(tmp_path / "logs")
    return make_scheduler(kv_role=kv_role, extra_config=extra, engine_id=kw.pop("engine_id", f"{kv_role}-e"), **kw)


def log_records(h: SchedulerHarness, tmp_path: Path) -> list[dict[str, Any]]:
    """Every record the harness's scheduler half logged (under ``tmp_path``), flushed
    first; its ``sched`` machines replay clean (each decision as the table declares it)."""
    report = h.replay()
    assert not report.findings, [str(f) for f in report.findings]
    return [json.loads(line) for f in (tmp_path / "logs").glob("*.jsonl") for line in f.read_text().splitlines()]


def meta_of(step: Any) -> KVSMConnectorMetadata:
    meta = step.connector_metadata
    assert isinstance(meta, KVSMConnectorMetadata), type(meta)
    return meta


def pending(h: SchedulerHarness) -> dict[str, int]:
    return h.connector.scheduler_half.pending_counts()


def drained(h: SchedulerHarness) -> None:
    assert all(v == 0 for v in pending(h).values()), pending(h)


# ---------------------------------------------------------------- decode side


def test_decode_request_waits_for_remote_blocks_then_runs(tmp_path: Path) -> None:
    with harness("kv_consumer", tmp_path) as h:
        free0 = h.free_blocks()
        params = remote_prefill_params(remote_block_ids=[7, 8, 9], remote_request_id="p-1", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=params, max_tokens=3, request_id="d-1")
        s1 = h.step()
        meta = meta_of(s1)
        assert [r.req for r in meta.recv_start] == ["d-1"]
        start = meta.recv_start[0]
        local = h.block_ids("d-1")[0]
        assert start.local_block_ids == tuple(local) and len(local) == 3
        assert start.remote_block_ids == (7, 8, 9)
        assert (start.remote_req, start.remote_engine, start.remote_port) == ("p-1", "prefill-engine", 5600)
        assert start.num_tokens == 40 and start.awaited
        assert h.request("d-1").status.name == "WAITING_FOR_REMOTE_KVS"
        assert s1.scheduled == {}
        # Waiting: nothing is relayed twice.
        assert not meta_of(h.step()).recv_start
        h.step(finished_recving={"d-1"})
        results = h.run_until_idle()
        finished = {rid for r in results for rid in r.finished}
        assert "d-1" in finished
        assert h.free_blocks() == free0
        drained(h)


def test_prefill_blocks_of_another_size_are_paired_by_their_tokens(tmp_path: Path) -> None:
    """The prefill's params say its blocks hold 32 tokens; this engine's hold 16: the
    40-token prompt's three local blocks are filled from segments of the two prefill
    blocks holding their tokens (a local prefix hit would be left out, and so is the
    rest of the last block)."""
    with harness("kv_consumer", tmp_path) as h:
        params = {**remote_prefill_params(remote_block_ids=[7, 8], remote_request_id="p-s", remote_num_tokens=40),
                  "remote_block_size": 32}
        h.add_request(40, kv_transfer_params=params, max_tokens=2, request_id="d-s")
        start = meta_of(h.step()).recv_start[0]
        local = h.block_ids("d-s")[0]
        assert start.num_tokens == 40 and start.problem == ""
        assert start.local_block_ids == tuple(local) and len(local) == 3
        assert start.remote_block_ids == (7, 7, 8)
        assert (start.segment_tokens, start.local_segments, start.remote_segments, start.block_sizes) == (
            16, (0, 0, 0), (0, 1, 0), (16, 32))
        h.step(finished_recving={"d-s"})
        h.run_until_idle()
        drained(h)
        # Sizes where neither divides the other: the request runs here, saying why.
        params = {**remote_prefill_params(remote_block_ids=[7, 8], remote_request_id="p-t", remote_num_tokens=40),
                  "remote_block_size": 24}
        h.add_request(40, kv_transfer_params=params, max_tokens=2, request_id="d-t")
        s = h.step()
        assert not meta_of(s).recv_start and "d-t" in s.scheduled
        h.run_until_idle()
        drained(h)
    reasons = [r["reason"] for r in log_records(h, tmp_path) if r["event"] == "sched.params_ignored"]
    assert reasons == ["the prefill engine's blocks hold 24 tokens, this engine's 16: blocks of different sizes are "
                       "read in segments, so one size must divide the other"], reasons


def test_params_without_kvsms_producer_key_are_warned_of_once_per_prefill_engine(tmp_path: Path) -> None:
    """Upstream NixlConnector's params look like kvsm's, but its side channel speaks
    another protocol: params without ``kvsm_protocol`` say so in the log, once per
    prefill engine, and the request goes on (a router may have rebuilt them)."""
    with harness("kv_consumer", tmp_path) as h:
        for n, (engine, marked) in enumerate([("up", False), ("up", False), ("kv", True), ("up2", False)]):
            params = remote_prefill_params(remote_block_ids=[7, 8, 9], remote_request_id=f"p-f{n}",
                                           remote_engine_id=engine, remote_num_tokens=40)
            if marked:
                params[PRODUCER_KEY] = PROTOCOL_VERSION
            h.add_request(40, kv_transfer_params=params, max_tokens=1, request_id=f"d-f{n}")
            assert meta_of(h.step()).recv_start  # read as ever
            h.step(finished_recving={f"d-f{n}"})
            h.run_until_idle()
        drained(h)
    warned = [(r["req"], r["remote_engine"]) for r in log_records(h, tmp_path)
              if r["event"] == "sched.foreign_producer"]
    assert warned == [("d-f0", "up"), ("d-f3", "up2")], warned


def test_decode_partial_local_prefix_hit_reads_only_the_missing_blocks() -> None:
    with harness("kv_consumer") as h:
        prompt = h.make_prompt(40)
        h.add_request(prompt, max_tokens=1, request_id="local")  # caches 2 full blocks of the prompt
        h.run_until_idle()
        params = remote_prefill_params(remote_block_ids=[7, 8, 9], remote_request_id="p-2", remote_num_tokens=40)
        h.add_request(prompt, kv_transfer_params=params, max_tokens=1, request_id="d-2")
        start = meta_of(h.step()).recv_start[0]
        assert start.num_tokens == 8  # 40 - 32 cached locally
        assert start.remote_block_ids == (9,) and len(start.local_block_ids) == 1
        h.step(finished_recving={"d-2"})
        h.run_until_idle()
        drained(h)


def test_decode_full_local_hit_only_notifies_and_is_not_awaited() -> None:
    with harness("kv_consumer") as h:
        prompt = h.make_prompt(40)
        h.add_request(prompt, max_tokens=1, request_id="local")
        h.run_until_idle()
        # The prefill side computed only 32 tokens, all of them cached here already.
        params = remote_prefill_params(remote_block_ids=[7, 8], remote_request_id="p-3", remote_num_tokens=32)
        h.add_request(prompt, kv_transfer_params=params, max_tokens=2, request_id="d-3")
        s = h.step()
        start = meta_of(s).recv_start[0]
        assert start.local_block_ids == () and start.remote_block_ids == () and not start.awaited
        assert "d-3" in s.scheduled  # runs at once: vLLM does not wait for it
        h.run_until_idle()
        drained(h)


def test_several_decode_requests_in_one_step() -> None:
    with harness("kv_consumer") as h:
        free0 = h.free_blocks()
        for i in range(5):
            params = remote_prefill_params(remote_block_ids=[10 + i, 20 + i], remote_request_id=f"p-{i}",
                                           remote_num_tokens=20)
            h.add_request(20, kv_transfer_params=params, request_id=f"d-{i}")
        meta = meta_of(h.step())
        assert sorted(r.req for r in meta.recv_start) == [f"d-{i}" for i in range(5)]
        assert {r.remote_req for r in meta.recv_start} == {f"p-{i}" for i in range(5)}
        h.step(finished_recving={f"d-{i}" for i in range(5)})
        h.run_until_idle()
        assert h.free_blocks() == free0
        drained(h)


def test_abort_while_loading_is_relayed_and_blocks_wait_for_the_worker() -> None:
    with harness("kv_consumer") as h:
        free0 = h.free_blocks()
        params = remote_prefill_params(remote_block_ids=[1, 2, 3], remote_request_id="p-a", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=params, request_id="d-a")
        h.step()
        h.abort("d-a")
        meta = meta_of(h.step())
        assert [(a.req, a.awaited) for a in meta.recv_abort] == [("d-a", True)]
        assert h.free_blocks() == free0 - 3  # vLLM holds them until the worker says no read can write
        h.step(finished_recving={"d-a"})
        assert h.free_blocks() == free0
        drained(h)


def test_abort_before_allocation_tells_the_prefill_side() -> None:
    with harness("kv_consumer", max_num_seqs=1) as h:
        h.add_request(20, max_tokens=50, request_id="busy")
        params = remote_prefill_params(remote_block_ids=[4], remote_request_id="p-b", remote_num_tokens=20)
        h.add_request(20, kv_transfer_params=params, request_id="d-b")
        h.step()
        assert h.request("d-b").status.name == "WAITING"
        h.abort("d-b")
        meta = meta_of(h.step())
        assert [(a.req, a.remote_req) for a in meta.recv_abandon] == [("d-b", "p-b")]
        assert not meta.recv_start and not meta.recv_abort
        h.abort("busy")
        h.run_until_idle()
        drained(h)


def test_a_request_the_api_server_rejected_frees_the_prefill_sides_blocks(tmp_path: Path) -> None:
    """vLLM's API server, rejecting a decode request before the engine sees it (a
    bad argument), submits a stand-in: prompt [0], the request's params, aborted at
    once (``notify_kv_transfer_request_rejected``). Its params describe another
    prompt, but they are not the request to run: the prefill request is abandoned
    in the next step (not left pinned until its lease ends), and no warning says
    the request "will not use KV transfer". A stand-in for params that a live
    request of this engine reads abandons nothing."""
    with harness("kv_consumer", tmp_path) as h:
        params = remote_prefill_params(remote_block_ids=[5, 6], remote_request_id="p-r", remote_num_tokens=40)
        h.add_request([0], kv_transfer_params=params, request_id="rejected", abort_immediately=True)
        meta = meta_of(h.step())
        assert [(a.req, a.remote_req) for a in meta.recv_abandon] == [("rejected", "p-r")]
        assert not meta.recv_start and not meta.recv_abort
        h.run_until_idle()
        drained(h)
        live = remote_prefill_params(remote_block_ids=[7, 8], remote_request_id="p-l", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=live, max_tokens=2, request_id="d-live")
        h.add_request([0], kv_transfer_params=live, request_id="rejected-2", abort_immediately=True)
        meta = meta_of(h.step())
        assert [r.req for r in meta.recv_start] == ["d-live"] and not meta.recv_abandon
        h.step(finished_recving={"d-live"})
        h.run_until_idle()
        drained(h)
    records = log_records(h, tmp_path)
    assert not [r for r in records if r["event"] == "sched.params_ignored"]
    rejected = {r["req"]: r.get("kept_for") for r in records if r["event"] == "sched.rejected_upstream"}
    assert rejected == {"rejected": None, "rejected-2": "d-live"}, rejected


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_follows_the_engine_policy(policy: str) -> None:
    with harness("kv_consumer", kv_load_failure_policy=policy) as h:
        free0 = h.free_blocks()
        params = remote_prefill_params(remote_block_ids=[1, 2, 3], remote_request_id="p-f", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=params, max_tokens=2, request_id="d-f")
        h.step()
        local = set(h.block_ids("d-f")[0])
        results = [h.step(finished_recving={"d-f"}, failed_recving={"d-f"}, invalid_block_ids=local)]
        results += h.run_until_idle()
        finished = {rid: out for r in results for rid, out in r.finished.items()}
        reason = finished["d-f"].finish_reason.name
        assert reason == ("LENGTH" if policy == "recompute" else "ERROR")
        assert h.free_blocks() == free0
        drained(h)


def test_heartbeats_keep_queued_requests_leases_alive() -> None:
    with harness("kv_consumer", max_num_seqs=1,
                 extra_config={"heartbeat_interval": 0.001, "kv_lease_duration": 1}) as h:
        h.add_request(20, max_tokens=30, request_id="busy")
        params = remote_prefill_params(remote_block_ids=[4], remote_request_id="p-h", remote_num_tokens=20,
                                       remote_port=6000)
        h.add_request(20, kv_transfer_params=params, request_id="d-h")
        beats = []
        # The sleeps below are the tested thing: a heartbeat is due once its interval
        # (1 ms) has passed in real time, at the next step.
        import time

        for _ in range(5):
            time.sleep(0.002)
            beats += meta_of(h.step()).heartbeats
        assert beats, "no heartbeat for a queued remote request"
        assert all(b.claims == ("p-h",) and b.remote_port == 6000 for b in beats)
        h.abort("busy")
        # The freed seat goes to the queued request at the next step: its read starts.
        assert [r.req for r in meta_of(h.step()).recv_start] == ["d-h"]
        # Once vLLM allocated its blocks the worker claims it: no more heartbeats,
        # though an interval has passed again.
        time.sleep(0.002)
        assert not meta_of(h.step()).heartbeats
        h.step(finished_recving={"d-h"})
        h.run_until_idle()
        drained(h)


def test_bad_params_run_the_request_locally_and_say_why(tmp_path: Path) -> None:
    with harness("kv_consumer", tmp_path) as h:
        params = remote_prefill_params(remote_block_ids=[1], remote_request_id="p-x")
        del params["remote_host"]
        h.add_request(20, kv_transfer_params=params, max_tokens=2, request_id="d-x")
        s = h.step()
        assert not meta_of(s).recv_start and "d-x" in s.scheduled
        assert pending(h)["ignored"] == 1
        h.run_until_idle()
        drained(h)
    records = log_records(h, tmp_path)
    ignored = [r for r in records if r["event"] == "sched.params_ignored"]
    assert ignored and "remote_host" in ignored[0]["reason"]


def test_a_pipeline_parallel_prefill_is_read_stage_by_stage(tmp_path: Path) -> None:
    """Params from a prefill engine of pipeline parallel 2 are read: the worker is told
    the stages (it reads each stage's layers from that stage's workers). A
    ``pp_size`` that is not a positive integer (or more stages than kvsm reads
    from) runs the request here, saying why."""
    with harness("kv_consumer", tmp_path) as h:
        params = {**remote_prefill_params(remote_block_ids=[1], remote_request_id="p-pp"), "pp_size": 2}
        h.add_request(20, kv_transfer_params=params, max_tokens=2, request_id="d-pp")
        s = h.step()
        starts = meta_of(s).recv_start
        assert [(r.req, r.remote_pp_size, r.remote_tp_size) for r in starts] == [("d-pp", 2, 1)]
        for n, bad in enumerate((0, "2", 2.0, 65)):
            params = {**remote_prefill_params(remote_block_ids=[1], remote_request_id=f"p-bad{n}"), "pp_size": bad}
            h.add_request(20, kv_transfer_params=params, max_tokens=2, request_id=f"d-bad{n}")
            s = h.step()
            assert not meta_of(s).recv_start and f"d-bad{n}" in s.scheduled
        h.step(finished_recving={"d-pp"})
        h.run_until_idle()
        drained(h)
    records = log_records(h, tmp_path)
    ignored = [r["reason"] for r in records if r["event"] == "sched.params_ignored"]
    assert len(ignored) == 4 and all("pp_size must be an integer from 1 to 64" in r for r in ignored), ignored


def test_params_of_another_prompt_are_not_read_and_the_request_runs_locally(tmp_path: Path) -> None:
    """vLLM's completions API gives every prompt of a list the one set of params
    its prefill response carried (the first prompt's): a decode request must not
    read another prompt's blocks. A prefill of more tokens than this prompt, or
    a fingerprint of other tokens, runs the request locally, saying why; the
    request the params belong to still reads them."""
    with harness("kv_producer", engine_id="prefill-f") as p:
        prompt = p.make_prompt(40)
        p.add_request(prompt, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id="p-f")
        params = p.step().finished["p-f"].kv_transfer_params
        assert params[PROMPT_FINGERPRINT_KEY] == prompt_fingerprint(prompt, 40)
        p.step(finished_sending={"p-f"})
        p.run_until_idle()
    other = [t + 1 for t in prompt]  # as long, other tokens
    with harness("kv_consumer", tmp_path) as h:
        free0 = h.free_blocks()
        h.add_request(prompt, kv_transfer_params=params, max_tokens=2, request_id="d-own")
        h.add_request(other, kv_transfer_params=params, max_tokens=2, request_id="d-other")
        h.add_request(prompt[:30], kv_transfer_params=params, max_tokens=2, request_id="d-shorter")
        s = h.step()
        assert [r.req for r in meta_of(s).recv_start] == ["d-own"]
        assert {"d-other", "d-shorter"} <= set(s.scheduled) and "d-own" not in s.scheduled
        h.step(finished_recving={"d-own"})
        h.run_until_idle()
        drained(h)
        assert h.free_blocks() == free0
    records = log_records(h, tmp_path)
    # Without a fingerprint (upstream's prefill), an offer of fewer tokens than the prompt is read.
    with harness("kv_consumer") as h:
        bare = {k: v for k, v in params.items() if k != PROMPT_FINGERPRINT_KEY}
        h.add_request(other + [5], kv_transfer_params=bare, max_tokens=2, request_id="d-bare")
        assert [r.req for r in meta_of(h.step()).recv_start] == ["d-bare"]
    reasons = {r["req"]: r["reason"] for r in records if r["event"] == "sched.params_ignored"}
    assert set(reasons) == {"d-other", "d-shorter"}, reasons
    assert "first 40 prompt tokens differ" in reasons["d-other"]
    assert "prefill of 40 tokens, this prompt has 30" in reasons["d-shorter"]


def test_a_prefill_leg_of_several_tokens_offers_its_prompt_and_a_decode_request_reads_it() -> None:
    """A prefill leg sent with max_tokens 3 computed two tokens past its prompt: the
    params count (and fingerprint) the prompt only, so the decode request with that
    prompt reads it (before, they counted 42 tokens and the decode engine refused
    them as another request's)."""
    with harness("kv_producer", engine_id="prefill-m") as p:
        prompt = p.make_prompt(40)
        p.add_request(prompt, kv_transfer_params=remote_decode_params(), max_tokens=3, request_id="p-m")
        finished: dict[str, Any] = {}
        for _ in range(5):
            finished.update(p.step().finished)
            if "p-m" in finished:
                break
        params = finished["p-m"].kv_transfer_params
        assert params["remote_num_tokens"] == 40
        assert params[PROMPT_FINGERPRINT_KEY] == prompt_fingerprint(prompt, 40)
        p.step(finished_sending={"p-m"})
        p.run_until_idle()
    with harness("kv_consumer") as h:
        h.add_request(prompt, kv_transfer_params=params, max_tokens=2, request_id="d-m")
        (start,) = meta_of(h.step()).recv_start
        assert start.req == "d-m" and start.num_tokens == 40
        h.step(finished_recving={"d-m"})
        h.run_until_idle()
        drained(h)


def test_one_request_of_an_engine_reads_a_prefill_request_the_others_run_locally(tmp_path: Path) -> None:
    """The samples of an n > 1 request (or a retry sent while the first runs) carry
    the same params: the prefill side frees its blocks after one read's
    notification, so a second reader could be reading reused blocks. The first
    reads; the others run locally, saying why; once the reader has finished, the
    params are free again (and a later reader learns from its claim whether the
    blocks are still there)."""
    with harness("kv_consumer", tmp_path) as h:
        free0 = h.free_blocks()
        prompt = h.make_prompt(40)
        params = remote_prefill_params(remote_block_ids=[1, 2], remote_request_id="p-n", remote_num_tokens=40)
        for req in ("d-a", "d-b"):
            h.add_request(prompt, kv_transfer_params=params, max_tokens=2, request_id=req)
        s = h.step()
        assert [r.req for r in meta_of(s).recv_start] == ["d-a"] and "d-b" in s.scheduled
        h.step(finished_recving={"d-a"})
        h.run_until_idle()
        assert pending(h)["readers"] == 0
        # (a prompt the decode engine has not cached: else a local hit reads nothing)
        h.add_request(h.make_prompt(40), kv_transfer_params=params, max_tokens=2, request_id="d-c")
        assert [r.req for r in meta_of(h.step()).recv_start] == ["d-c"]
        h.step(finished_recving={"d-c"})
        h.run_until_idle()
        drained(h)
        assert h.free_blocks() == free0
    records = log_records(h, tmp_path)
    reasons = {r["req"]: r["reason"] for r in records if r["event"] == "sched.params_ignored"}
    assert list(reasons) == ["d-b"] and "request d-a of this engine already reads" in reasons["d-b"], reasons


# ---------------------------------------------------------------- prefill side


def test_prefill_finish_pins_blocks_and_returns_upstream_params() -> None:
    with harness("kv_producer", engine_id="prefill-7") as h:
        free0 = h.free_blocks()
        h.add_request(40, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id="p-1")
        s = h.step()
        assert [x.req for x in meta_of(s).send_start] == ["p-1"]
        out = s.finished["p-1"]
        params = out.kv_transfer_params
        assert UPSTREAM_PREFILL_KEYS <= set(params)
        assert params[PRODUCER_KEY] == PROTOCOL_VERSION and params["remote_block_size"] == 16
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "prefill-7" and params["remote_request_id"] == "p-1"
        assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", 23456, 1)
        assert params["remote_num_tokens"] == 40
        blocks = params["remote_block_ids"]
        assert len(blocks) == 1 and len(blocks[0]) == 3  # one KV cache group, partial last block included
        # The next step tells the worker to pin exactly those blocks.
        meta = meta_of(h.step())
        assert [(f.req, f.ok, list(f.block_ids)) for f in meta.send_finish] == [("p-1", True, blocks[0])]
        assert h.free_blocks() == free0 - 3
        h.step(finished_sending={"p-1"})
        assert h.free_blocks() == free0
        drained(h)


def _log_events(tmp_path: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for f in (tmp_path / "logs").glob("*.scheduler.*.jsonl"):
        out += [r for r in map(json.loads, f.read_text().splitlines()) if r["event"] == event]
    return out


def test_prefill_finish_reaches_the_worker_without_another_step(tmp_path: Path) -> None:
    """The pin goes to the worker from request_finished itself: an engine that
    never steps again (offline, after generate returns) still serves it."""
    worker = PinWorker("sched-test-pins")
    try:
        with harness("kv_producer", tmp_path, engine_id="prefill-8") as h:
            h.connector.set_xfer_handshake_metadata({0: worker.channel(0)})
            h.add_request(40, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id="p-1")
            s = h.step()
            blocks = s.finished["p-1"].kv_transfer_params["remote_block_ids"][0]
            assert worker.arrived.wait(2.0), "the worker heard nothing without another step"
            (finish, via, _), = worker.got
            assert (finish.req, finish.ok, list(finish.block_ids), via) == ("p-1", True, blocks, "in_process")
            assert finish.pinned_ns > 0
            assert meta_of(h.step()).send_finish == []  # not a second time with the step
            h.step(finished_sending={"p-1"})
            drained(h)
        (pinned,) = _log_events(tmp_path, "sched.pinned")
        assert (pinned["req"], pinned["block_ids"], pinned["via"], pinned["workers"]) == ("p-1", blocks,
                                                                                            "in_process", 1)
        assert pinned["lease_deadline_ns"] - pinned["pinned_ns"] == 30 * 10**9
    finally:
        worker.close()


def test_prefill_finish_falls_back_to_the_step_when_the_worker_cannot_take_it(tmp_path: Path) -> None:
    worker = PinWorker("sched-test-pins")
    with harness("kv_producer", tmp_path) as h:
        h.connector.set_xfer_handshake_metadata({0: worker.channel(0)})
        worker.close()  # its loop no longer takes posts
        h.add_request(40, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id="p-1")
        h.step()
        meta = meta_of(h.step())
        assert [(f.req, f.ok) for f in meta.send_finish] == [("p-1", True)]
        h.step(finished_sending={"p-1"})
        drained(h)
    assert [r["worker_rank"] for r in _log_events(tmp_path, "sched.pin_handoff_failed")] == [0]
    # The decision names the path it was meant for; the failed hand-off says what happened.
    assert [r["via"] for r in _log_events(tmp_path, "sched.pinned")] == ["in_process"]


def test_handshake_metadata_of_another_connector_is_refused() -> None:
    with harness("kv_producer") as h, pytest.raises(TypeError, match="KVSMWorkerChannel"):
        h.connector.set_xfer_handshake_metadata({0: object()})


def test_prefill_abort_frees_at_once_and_tells_the_worker() -> None:
    with harness("kv_producer", max_num_batched_tokens=32, max_num_seqs=4, max_model_len=512) as h:
        free0 = h.free_blocks()
        h.add_request(200, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id="p-2")
        h.step()  # chunked prefill: still running
        h.abort("p-2")
        meta = meta_of(h.step())
        assert [(f.req, f.ok, f.reason) for f in meta.send_finish] == [("p-2", False, "FINISHED_ABORTED")]
        assert h.free_blocks() == free0
        drained(h)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", "kv_both"])
def test_each_role_does_only_its_part(kv_role: str) -> None:
    with harness(kv_role) as h:
        params = remote_prefill_params(remote_block_ids=[1, 2], remote_request_id="p-r", remote_num_tokens=20)
        h.add_request(20, kv_transfer_params=params, request_id="recv")
        h.add_request(20, kv_transfer_params=remote_decode_params(), request_id="send")
        s = h.step()
        consumes = kv_role != "kv_producer"
        produces = kv_role != "kv_consumer"
        assert bool(meta_of(s).recv_start) == consumes
        results = [s, *h.run_until_idle(auto_transfers=True)]
        finished = {rid: out for r in results for rid, out in r.finished.items()}
        assert (finished["send"].kv_transfer_params is not None) == produces
        assert "recv" in finished
        drained(h)


# ---------------------------------------------------------------- loading


def test_plugin_entry_point_registers_the_connector_without_module_path() -> None:
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector='KVSMConnector', "
        "kv_role='kv_both'))\n"
        "print(cls.__module__, cls.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}  # load every installed plugin
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "kvsm.vllm.connector KVSMConnector"


def test_harness_loads_it_by_name_through_the_plugin() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with make_scheduler(kv_role="kv_both", kv_connector="KVSMConnector", kv_connector_module_path=None,
                        extra_config={"side_channel_port": 23457}) as h:
        assert type(h.connector).__name__ == "KVSMConnector"


@pytest.mark.parametrize(("extra", "needle"), [
    ({"kv_lease_duration": -1}, "kv_lease_duration"),
    ({"side_channel_port": "http"}, "side_channel_port"),
    ({"heartbeat_interval": 60, "kv_lease_duration": 30}, "heartbeat_interval"),
    ({"backends": "UCX"}, "backends"),
    ({"num_threads": "4"}, "num_threads"),
    ({"num_threads": -1}, "num_threads"),
    ({"stall_timeout": 0}, "stall_timeout"),
    ({"kv_recompute_threshold": -1}, "kv_recompute_threshold"),
    ({"kv_recompute_threshold": 1.5}, "kv_recompute_threshold"),
    ({"kv_recompute_threshold": "64"}, "kv_recompute_threshold"),
    ({"side_channel_keys": "/nonexistent/kvsm-keys"}, "side_channel_keys: cannot read the directory"),
    ({"side_channel_keys": 7}, "side_channel_keys"),
    ({"side_channel_keys_reload": 0}, "side_channel_keys_reload"),
])
def test_bad_config_is_refused_naming_the_key(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_scheduler(kv_role="kv_both", extra_config=extra)


def test_side_channel_and_event_log_fall_back_to_the_environment() -> None:

    with make_scheduler(kv_role="kv_both", extra_config={}) as h:
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "7100",
               "KVSM_EVENT_LOG_DIR": "/tmp/kvsm-logs"}
        cfg = kvsm_config(h.vllm_config, env=env)
        assert (cfg.side_channel_host, cfg.side_channel_port, cfg.event_log_dir) == ("10.1.2.3", 7100,
                                                                                      "/tmp/kvsm-logs")
        bare = kvsm_config(h.vllm_config, env={})
        assert (bare.side_channel_host, bare.side_channel_port, bare.event_log_dir) == ("localhost", 5600, None)
        assert bare.lease_s == 30 and bare.heartbeat_interval_s == 5
        with pytest.raises(ValueError, match="VLLM_NIXL_SIDE_CHANNEL_PORT"):
            kvsm_config(h.vllm_config, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "99999"})
    with make_scheduler(kv_role="kv_both", extra_config={"side_channel_host": "h", "side_channel_port": 6000,
                                                        "event_log_dir": "/x"}) as h:
        cfg = kvsm_config(h.vllm_config, env=env)
        assert (cfg.side_channel_host, cfg.side_channel_port, cfg.event_log_dir) == ("h", 6000, "/x")
        assert cfg.event_log_path("worker", 1).startswith(f"/x/{cfg.engine_id}.worker.rank1.")


# ---------------------------------------------------------------- stopping


def test_a_stop_request_has_the_workers_close_their_pins_once_the_drain_time_is_up() -> None:
    """vLLM's engine core drains on SIGTERM while pins are live and is killed when
    its wait is over: from the drain time on, every step tells the workers to close
    their pins (they then report them finished_sending and vLLM runs out of work)."""
    with harness("kv_producer") as h:
        half = h.connector.scheduler_half
        assert not meta_of(h.step()).stopping
        half.request_stop(3600.0)
        assert not meta_of(h.step()).stopping
        half.request_stop(0.0)  # the first request's time holds
        assert not meta_of(h.step()).stopping
    with harness("kv_producer") as h:
        h.connector.scheduler_half.request_stop(0.0)
        metas = [meta_of(h.step()) for _ in range(2)]
        assert all(m.stopping for m in metas) and all(metas)
        assert "stopping" in repr(metas[0])
