"""The scheduler harness (kvsm_testing.scheduler) driving vLLM's real Scheduler
with upstream's NixlConnector (scheduler side only: no NIXL agent, no worker).

These tests pin down how vLLM 0.32 calls a connector's scheduler-side hooks
for decode (kv_consumer) and prefill (kv_producer) requests, including load
failures and aborts; kvsm's own scheduler-side tests rely on the same harness.
"""

from __future__ import annotations

import json
import threading

import pytest

from conftest import require

require("vllm")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvsm_testing.ports import free_port as _free_port
from kvsm_testing.scheduler import (
    make_scheduler,
    remote_decode_params,
    remote_prefill_params,
)

BS = 16
PROMPT = 40  # 3 blocks of 16
UPSTREAM_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "remote_num_tokens",
}


@pytest.fixture
def side_port(monkeypatch) -> int:
    port = _free_port()
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port))
    return port


@pytest.fixture
def make(side_port):
    """make(kv_role, **kw) -> a harness with upstream NixlConnector; closed at
    teardown."""
    made = []

    def factory(kv_role: str, **kw):
        kw.setdefault("kv_connector", "NixlConnector")
        kw.setdefault("kv_connector_module_path", None)
        kw.setdefault("block_size", BS)
        h = make_scheduler(kv_role=kv_role, **kw)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()
    assert not any(t.name == "nixl_handshake_listener" for t in threading.enumerate())


def _decode_params(rid: str = "p-1"):
    return remote_prefill_params(
        remote_block_ids=[[101, 102, 103]],
        remote_request_id=rid,
        remote_num_tokens=PROMPT,
    )


def _names(calls, rid=None):
    return [c.name for c in calls if rid is None or c.request_id == rid]


# -- decode role -------------------------------------------------------------


def test_decode_remote_prefill_happy_path(make):
    h = make("kv_consumer")
    calls = h.trace_hooks()
    start = h.free_blocks()
    req = h.add_request(PROMPT, kv_transfer_params=_decode_params(), max_tokens=3)
    rid = req.request_id

    s1 = h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s1.scheduled == {}  # nothing runs while the KV is in flight
    assert start - h.free_blocks() == 3
    (local_blocks,) = h.block_ids(rid)
    assert len(local_blocks) == 3
    meta = s1.connector_metadata.reqs_to_recv[rid]
    assert [list(g) for g in meta.local_block_ids] == [local_blocks]
    assert meta.remote.block_ids == [[101, 102, 103]]
    assert meta.awaiting_kvs

    # Reported received: promoted at the next schedule(), not in this step.
    s2 = h.step(finished_recving={rid})
    assert s2.scheduled == {} and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # A full-prompt hit recomputes the last prompt token to sample.
    s3 = h.step()
    assert s3.scheduled == {rid: 1}
    assert req.status == RequestStatus.RUNNING
    assert rid not in s3.connector_metadata.reqs_to_recv

    rest = h.run_until_idle()
    finished = {k: v for s in rest for k, v in s.finished.items()}
    assert finished[rid].finish_reason == FinishReason.LENGTH
    assert finished[rid].kv_transfer_params is None  # D side returns nothing
    assert list(req.output_token_ids) == [h.sampled_token_id] * 3
    assert h.free_blocks() == start
    assert not h.has_requests()

    # The hook sequence vLLM 0.32 drives for one decode request.
    seq = _names(calls, rid)
    assert seq == [
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "update_state_after_alloc",  # again when scheduled after the load
        "request_finished_all_groups",  # SupportsHMA: not request_finished
    ]
    first_alloc, second_alloc = (
        c for c in calls if c.name == "update_state_after_alloc"
    )
    assert first_alloc.detail["num_external_tokens"] == PROMPT
    assert second_alloc.detail["num_external_tokens"] == 0
    get_matched = next(c for c in calls if c.name == "get_num_new_matched_tokens")
    assert get_matched.detail == {"local": 0, "result": (PROMPT, True)}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_decode_load_failure(make, policy):
    h = make("kv_consumer", kv_load_failure_policy=policy)
    start = h.free_blocks()
    req = h.add_request(PROMPT, kv_transfer_params=_decode_params(), max_tokens=2)
    rid = req.request_id
    h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (blocks,) = h.block_ids(rid)

    # What the NIXL worker reports for a failed read: finished + failed +
    # the request's local blocks as invalid.
    s = h.step(
        finished_recving={rid},
        failed_recving={rid},
        invalid_block_ids=set(blocks),
    )
    if policy == "fail":
        assert s.finished[rid].finish_reason == FinishReason.ERROR
        assert req.status == RequestStatus.FINISHED_ERROR
        assert h.free_blocks() == start  # freed in the same step
        h.run_until_idle()
    else:
        assert not s.finished
        s = h.step()
        assert s.scheduled == {rid: PROMPT}  # recomputed locally from scratch
        rest = h.run_until_idle()
        finished = {k: v for r in rest for k, v in r.finished.items()}
        assert finished[rid].finish_reason == FinishReason.LENGTH
        assert list(req.output_token_ids) == [h.sampled_token_id] * 2
    assert h.free_blocks() == start
    assert not h.has_requests()


def test_decode_abort_while_waiting_keeps_blocks_until_recv_reported(make):
    h = make("kv_consumer")
    calls = h.trace_hooks()
    start = h.free_blocks()
    req = h.add_request(PROMPT, kv_transfer_params=_decode_params())
    rid = req.request_id
    h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = h.free_blocks()
    assert start - held == 3

    h.abort([rid])
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert h.free_blocks() == held  # a posted read may still write them
    fin = [c for c in calls if c.name == "request_finished_all_groups"]
    assert len(fin) == 1 and fin[0].detail["status"] == "FINISHED_ABORTED"
    assert fin[0].detail["delay_free"] is False  # the scheduler delays by itself

    s = h.step()
    assert not s.finished  # an abort emits no output
    assert h.free_blocks() == held and h.has_requests()

    h.step(finished_recving={rid})
    assert h.free_blocks() == start
    assert h.request(rid) is None
    h.run_until_idle(max_steps=5)
    assert not h.has_requests()


def test_decode_abort_before_scheduled_tells_worker_to_release_remote(make):
    h = make("kv_consumer", max_num_seqs=1)
    start = h.free_blocks()
    first = h.add_request(PROMPT)  # occupies the only run slot
    waiting = h.add_request(PROMPT, kv_transfer_params=_decode_params("p-9"))
    h.step()
    assert waiting.status == RequestStatus.WAITING  # never matched/allocated
    h.abort([waiting.request_id])
    s = h.step()
    # Upstream queues an empty-block "recv" so its worker notifies the
    # prefill engine to free the remote blocks.
    meta = s.connector_metadata.reqs_to_recv[waiting.request_id]
    assert meta.local_block_ids == [] and not meta.awaiting_kvs
    assert meta.remote.request_id == "p-9"
    h.run_until_idle()
    assert first.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert h.free_blocks() == start


# -- prefill role ------------------------------------------------------------


def test_prefill_holds_blocks_until_finished_sending(make, side_port):
    h = make("kv_producer", engine_id="prefill-A")
    calls = h.trace_hooks()
    start = h.free_blocks()
    req = h.add_request(PROMPT, kv_transfer_params=remote_decode_params(), max_tokens=1)
    rid = req.request_id

    s = h.step()
    assert s.scheduled == {rid: PROMPT}
    out = s.finished[rid]
    assert out.finish_reason == FinishReason.LENGTH
    params = out.kv_transfer_params
    assert UPSTREAM_KEYS <= params.keys()
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "prefill-A"
    assert params["remote_request_id"] == rid
    assert params["remote_port"] == side_port
    assert params["tp_size"] == 1
    assert params["remote_num_tokens"] == PROMPT
    # One list per KV cache group, as a tuple (a list after JSON).
    assert isinstance(params["remote_block_ids"], tuple)
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == 3

    assert start - h.free_blocks() == 3  # pinned for the decode side's read
    s = h.step()
    # The next step's metadata tells the worker to arm the lease, and
    # finished_req_ids tells it the request is done.
    assert rid in s.connector_metadata.reqs_to_send
    assert rid in s.scheduler_output.finished_req_ids
    assert start - h.free_blocks() == 3 and h.has_requests()
    h.step(finished_sending={rid})
    assert h.free_blocks() == start
    assert h.request(rid) is None
    h.run_until_idle(max_steps=5)

    seq = _names(calls, rid)
    assert seq == [
        "on_new_request",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "request_finished_all_groups",
    ]
    fin = next(c for c in calls if c.name == "request_finished_all_groups")
    assert fin.detail["delay_free"] is True
    assert fin.detail["status"] == "FINISHED_LENGTH_CAPPED"


def test_prefill_abort_mid_step_frees_at_once(make):
    h = make("kv_producer")
    calls = h.trace_hooks()
    start = h.free_blocks()
    req = h.add_request(PROMPT, kv_transfer_params=remote_decode_params())
    s = h.step(abort_after_schedule=[req.request_id])
    assert not s.finished  # the model's output for it is dropped
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert h.free_blocks() == start  # nothing pinned for an aborted prefill
    fin = next(c for c in calls if c.name == "request_finished_all_groups")
    assert fin.detail["delay_free"] is False and fin.detail["params"] is None
    h.run_until_idle(max_steps=5)


def test_prefill_to_decode_through_json(make):
    p = make("kv_producer", engine_id="P")
    d = make("kv_consumer", engine_id="D")
    preq = p.add_request(PROMPT, kv_transfer_params=remote_decode_params())
    out = p.step().finished[preq.request_id]
    forwarded = json.loads(json.dumps(out.kv_transfer_params))
    assert isinstance(forwarded["remote_block_ids"], list)
    assert forwarded["remote_block_ids"] == [
        list(out.kv_transfer_params["remote_block_ids"][0])
    ]
    helper = remote_prefill_params(
        remote_block_ids=forwarded["remote_block_ids"],
        remote_engine_id="P",
        remote_request_id=preq.request_id,
        remote_host=forwarded["remote_host"],
        remote_port=forwarded["remote_port"],
        remote_num_tokens=PROMPT,
    )
    for key, value in helper.items():
        assert forwarded[key] == value, key

    dreq = d.add_request(list(preq.prompt_token_ids), kv_transfer_params=forwarded)
    s = d.step()
    meta = s.connector_metadata.reqs_to_recv[dreq.request_id]
    assert meta.remote.block_ids == forwarded["remote_block_ids"]
    assert meta.remote.engine_id == "P"
    d.run_until_idle(auto_transfers=True)
    p.run_until_idle(finished_sending={preq.request_id})
    assert dreq.status == RequestStatus.FINISHED_LENGTH_CAPPED


# -- several requests, both roles, no connector ------------------------------


def test_several_requests_in_one_step(make):
    h = make("kv_consumer")
    start = h.free_blocks()
    remote = [
        h.add_request(PROMPT, kv_transfer_params=_decode_params(f"p-{i}"), max_tokens=2)
        for i in range(3)
    ]
    local = h.add_request(PROMPT, max_tokens=4)
    s = h.step()
    assert s.scheduled == {local.request_id: PROMPT}
    assert set(s.connector_metadata.reqs_to_recv) == {r.request_id for r in remote}
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in remote)
    assert start - h.free_blocks() == 4 * 3

    s = h.step(finished_recving={remote[0].request_id, remote[1].request_id})
    assert s.scheduled == {local.request_id: 1}  # its first decode step
    s = h.step()
    assert set(s.scheduled) == {
        local.request_id,
        remote[0].request_id,
        remote[1].request_id,
    }
    assert remote[2].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.step(finished_recving={remote[2].request_id})
    h.run_until_idle()
    assert all(
        r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in [*remote, local]
    )
    assert h.free_blocks() == start


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer", "kv_both"])
def test_auto_transfers_drain_many(make, role):
    h = make(role, max_num_seqs=8)
    start = h.free_blocks()
    reqs = []
    for i in range(24):
        if role == "kv_consumer" or (role == "kv_both" and i % 2):
            params = _decode_params(f"p-{i}")
        else:
            params = remote_decode_params()
        reqs.append(h.add_request(PROMPT, kv_transfer_params=params, max_tokens=2))
    h.abort([reqs[5].request_id])
    steps = h.run_until_idle(max_steps=200, auto_transfers=True)
    finished = {k for s in steps for k in s.finished}
    assert finished == {r.request_id for r in reqs} - {reqs[5].request_id}
    assert h.free_blocks() == start


def test_auto_transfers_abort_while_waiting(make):
    h = make("kv_consumer")
    start = h.free_blocks()
    req = h.add_request(PROMPT, kv_transfer_params=_decode_params())
    h.step()
    h.abort(req.request_id)
    assert h.pending_transfers() == ({req.request_id}, set())
    h.run_until_idle(max_steps=5, auto_transfers=True)
    assert h.free_blocks() == start


def test_no_connector_plain_request_and_prefix_hits(side_port):
    h = make_scheduler(kv_role="kv_both", kv_connector=None, block_size=BS)
    try:
        assert h.connector is None
        start = h.free_blocks()
        a = h.add_request(PROMPT, max_tokens=4)
        steps = h.run_until_idle()
        assert steps[0].scheduled == {a.request_id: PROMPT}
        assert steps[0].connector_metadata is None
        assert steps[0].model_runner_output.kv_connector_output is None
        finished = {k: v for s in steps for k, v in s.finished.items()}
        assert finished[a.request_id].finish_reason == FinishReason.LENGTH
        assert list(a.output_token_ids) == [h.sampled_token_id] * 4
        assert h.free_blocks() == start

        # Generated prompts never share a block; explicit ids can.
        b = h.add_request(PROMPT)
        assert h.step().scheduled == {b.request_id: PROMPT}
        c = h.add_request(list(a.prompt_token_ids))
        assert h.step().scheduled == {c.request_id: PROMPT - 2 * BS}
        h.run_until_idle()
        with pytest.raises(ValueError):
            h.step(finished_recving={"x"})
    finally:
        h.close()


def test_generated_prompts_are_distinct(make):
    h = make("kv_consumer")
    heads = {tuple(h.make_prompt(BS)) for _ in range(3000)}
    assert len(heads) == 3000
    assert len(h.make_prompt(2)) == 2 and len(h.make_prompt(100)) == 100


def test_run_until_idle_gives_up(make):
    h = make("kv_consumer")
    h.add_request(PROMPT, kv_transfer_params=_decode_params())
    with pytest.raises(RuntimeError, match="WAITING_FOR_REMOTE_KVS"):
        h.run_until_idle(max_steps=5)
