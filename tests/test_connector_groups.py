"""Several KV cache groups through vLLM's real Scheduler (hybrid KV cache manager).

The tiny model's two layers made one sliding-window layer (window 32 tokens)
and one full-attention layer, as Gemma 2 alternates them: vLLM keeps its
hybrid KV cache manager on with kvsm (``SupportsHMA``), and every hook sees
one block list per group, indexed by position, the null block (0) where the
sliding window no longer keeps one.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.vllm.connector import KVSMConnector
from kvsm.vllm.metadata import KVSMConnectorMetadata
from kvsm_testing.scheduler import SchedulerHarness, make_scheduler, remote_decode_params, remote_prefill_params

BS = 16
WINDOW = 32


def harness(kv_role: str, **kw: Any) -> SchedulerHarness:
    extra = {"side_channel_host": "127.0.0.1", "side_channel_port": 23456}
    return make_scheduler(kv_role=kv_role, extra_config=extra, engine_id=f"{kv_role}-g", block_size=BS,
                          sliding_window=WINDOW, **kw)


def meta_of(step: Any) -> KVSMConnectorMetadata:
    meta = step.connector_metadata
    assert isinstance(meta, KVSMConnectorMetadata), type(meta)
    return meta


def test_vllm_keeps_its_hybrid_manager_on_and_kvsm_sees_both_groups() -> None:
    with harness("kv_consumer") as h:
        connector = h.connector
        assert isinstance(connector, KVSMConnector)
        groups = h.scheduler.kv_cache_config.kv_cache_groups
        assert len(groups) == 2
        assert [g.kind for g in connector.kv_groups] == [
            "full" if type(grp.kv_cache_spec).__name__ == "FullAttentionSpec" else f"sliding_window({WINDOW})"
            for grp in groups]
        assert connector.get_loaded_kv_cache_group_ids(None) == (0, 1)  # type: ignore[arg-type]


def test_prefill_returns_every_group_by_position_and_pins_no_null_block() -> None:
    with harness("kv_producer") as h:
        free0 = h.free_blocks()
        h.add_request(100, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id="p-1")
        out = h.step().finished["p-1"]
        blocks = out.kv_transfer_params["remote_block_ids"]
        groups = h.scheduler.kv_cache_config.kv_cache_groups
        sw = next(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
        full = 1 - sw
        assert len(blocks) == 2
        assert len(blocks[full]) == len(blocks[sw]) == -(-100 // BS)  # by position, the partial last block too
        assert 0 not in blocks[full]
        # 100 tokens, window 32: the first (100 - 32 + 1) // 16 = 4 positions hold nothing any more.
        assert blocks[sw][:4] == [0, 0, 0, 0] and 0 not in blocks[sw][4:]
        meta = meta_of(h.step())
        [finish] = meta.send_finish
        assert finish.ok and 0 not in finish.block_ids
        assert sorted(finish.block_ids) == sorted(b for ids in blocks for b in ids if b)
        h.step(finished_sending={"p-1"})
        assert h.free_blocks() == free0


def test_decode_pairs_each_group_by_position_and_reads_only_what_the_window_keeps() -> None:
    with harness("kv_consumer") as h:
        free0 = h.free_blocks()
        groups = h.scheduler.kv_cache_config.kv_cache_groups
        sw = next(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
        full = 1 - sw
        remote: list[list[int]] = [[], []]
        remote[full] = [101, 102, 103, 104, 105, 106, 107]
        remote[sw] = [0, 0, 0, 0, 205, 206, 207]  # as the prefill side of 100 tokens leaves them
        params = remote_prefill_params(remote_block_ids=remote, remote_request_id="p-2", remote_num_tokens=100)
        h.add_request(100, kv_transfer_params=params, max_tokens=2, request_id="d-2")
        start = meta_of(h.step()).recv_start[0]
        assert not start.problem, start.problem
        local = h.block_ids("d-2")
        pairs = start.group_block_ids()
        assert len(start.group_sizes) == 2
        # Every non-null local block is read from the prefill's block at its position.
        for g in (full, sw):
            want = [(b, remote[g][j]) for j, b in enumerate(local[g]) if b != 0 and j < len(remote[g])]
            assert list(zip(*pairs[g], strict=True)) == want, (g, pairs[g], local[g])
        assert [r for _, r in zip(*pairs[sw], strict=True)] == [205, 206, 207]
        assert 0 not in start.local_block_ids and 0 not in start.remote_block_ids
        h.step(finished_recving={"d-2"})
        h.run_until_idle()
        assert h.free_blocks() == free0


def test_a_block_the_prefill_side_no_longer_holds_is_a_problem_not_a_read() -> None:
    """The decode engine needs position 4 of the sliding-window group, the prefill
    side sent the null block there (another window, another engine version):
    the request must fail, not deliver a block of garbage."""
    with harness("kv_consumer") as h:
        groups = h.scheduler.kv_cache_config.kv_cache_groups
        sw = next(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
        remote: list[list[int]] = [[], []]
        remote[1 - sw] = [101, 102, 103, 104, 105, 106, 107]
        remote[sw] = [0, 0, 0, 0, 0, 206, 207]
        params = remote_prefill_params(remote_block_ids=remote, remote_request_id="p-3", remote_num_tokens=100)
        h.add_request(100, kv_transfer_params=params, max_tokens=2, request_id="d-3")
        start = meta_of(h.step()).recv_start[0]
        assert f"KV cache group {sw}: block 4 is to be loaded, but the prefill side has the null block" in (
            start.problem)


@pytest.mark.parametrize("remote", [[[1, 2, 3]], [[1, 2], [3, 4], [5, 6]]])
def test_params_of_another_number_of_groups_run_the_request_locally(remote: list[list[int]],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with harness("kv_consumer") as h, caplog.at_level("WARNING", logger="kvsm.scheduler"):
        params = remote_prefill_params(remote_block_ids=remote, remote_request_id="p-4", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=params, max_tokens=1, request_id="d-4")
        s = h.step()
        assert not meta_of(s).recv_start and "d-4" in s.scheduled  # computed here, nothing read
        assert (f"request d-4 will not use KV transfer: remote_block_ids has {len(remote)} KV cache group(s), "
                f"this engine's KV cache 2") in caplog.text


def test_a_mamba_state_group_is_described_and_one_with_speculative_slots_refused() -> None:
    """Qwen3-Next's groups (gated-delta-net state beside full attention): the state
    group moves (the prefill side then holds the last prompt token back); one with
    speculative state slots is refused when the connector starts, naming it."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from kvsm.vllm.connector import kv_groups_of

    def config(mamba: MambaSpec) -> KVCacheConfig:
        full = FullAttentionSpec(block_size=1152, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
        return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.linear_attn", "model.layers.2.linear_attn"], mamba),
            KVCacheGroupSpec(["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"], full)])

    shapes, dtypes = ((3, 1024), (4, 128, 128)), (torch.bfloat16, torch.float32)
    groups = kv_groups_of(config(MambaSpec(block_size=1152, shapes=shapes, dtypes=dtypes)))
    assert [g.kind.split("(")[0] for g in groups] == ["mamba", "full"]
    with pytest.raises(ValueError, match=r"KV cache group 0 is a MambaSpec \(layers \['model.layers.0.linear_attn'"
                                         r".*without speculative slots only"):
        kv_groups_of(config(MambaSpec(block_size=1152, shapes=shapes, dtypes=dtypes, num_speculative_blocks=1)))


def test_the_compatibility_info_names_a_differing_group_layout() -> None:
    from kvsm.handshake import CompatInfo
    from kvsm.handshake.messages import compat_hash, compat_mismatch

    base = {"model": "m", "dtype": "float32", "num_layers": 4, "num_kv_heads": 2, "head_size": 32,
            "block_size": 128, "kv_layout": "block-major 2x128x64"}
    mine = CompatInfo(**base, kv_groups="sliding_window(128)/128x2 full/128x2")
    theirs = CompatInfo(**base, kv_groups="full/128x4")
    assert compat_hash(mine) != compat_hash(theirs)
    assert compat_mismatch(mine, theirs) == [
        "kv_groups: 'sliding_window(128)/128x2 full/128x2' here, 'full/128x4' on the peer"]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_of_several_groups_fails_the_request_whole(policy: str) -> None:
    """With several groups vLLM refuses block-level load errors (it raises): the
    worker reports the request in failed_recving (and finished_recving) only, and
    the engine's policy decides; the connector withholds the blocks it would have
    reported (``get_block_ids_with_load_errors`` is empty for several groups)."""
    with harness("kv_consumer", kv_load_failure_policy=policy) as h:
        free0 = h.free_blocks()
        remote = [[101, 102, 103], [201, 202, 203]]
        params = remote_prefill_params(remote_block_ids=remote, remote_request_id="p-f", remote_num_tokens=40)
        h.add_request(40, kv_transfer_params=params, max_tokens=2, request_id="d-f")
        h.step()
        results = [h.step(finished_recving={"d-f"}, failed_recving={"d-f"})]
        results += h.run_until_idle()
        finished = {rid: out for r in results for rid, out in r.finished.items()}
        assert finished["d-f"].finish_reason.name == ("LENGTH" if policy == "recompute" else "ERROR")
        assert h.free_blocks() == free0
        with pytest.raises(RuntimeError, match="multiple KV cache groups"):  # what block ids would do
            h.add_request(40, kv_transfer_params=dict(params, remote_request_id="p-g"), max_tokens=2,
                          request_id="d-g")
            h.step()
            h.step(finished_recving={"d-g"}, failed_recving={"d-g"}, invalid_block_ids=set(h.block_ids("d-g")[0]))
