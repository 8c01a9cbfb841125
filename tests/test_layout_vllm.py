"""describe_kv_caches over the KV caches vLLM itself allocates, one per model kind.

vLLM's own ``get_kv_cache_config_from_groups`` and ``allocate_kv_cache`` (what
the CPU model runner does before ``register_kv_caches``) build the tensors of
each kind of KV cache group: full attention beside sliding window (Gemma 2),
MLA's latent (DeepSeek-V2), gated-delta-net state beside full attention
(Qwen3-Next's padded Mamba pages). Each must come out as regions whose block
``b`` is exactly the tensor's block ``b``, tagged with its group, with memory
that groups share registered once. (Mamba groups are described here but not
transferred yet: the connector refuses them at start.)
"""

from __future__ import annotations

import math
from typing import Any

from conftest import require

torch = require("torch")
require("vllm")

from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvsm.transport.layout import describe_kv_caches

BLOCKS = 10


def allocate(groups: list[KVCacheGroupSpec], page_bytes: int) -> dict[str, Any]:
    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's
    layers = sum(len(g.layer_names) for g in groups) // len(groups)
    kv_config = get_kv_cache_config_from_groups(config, groups, page_bytes * layers * BLOCKS)
    tensors = allocate_kv_cache(kv_config, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout())
    return {name: tensors[name] for g in groups for name in g.layer_names}


def check(kv: dict[str, Any], groups: list[KVCacheGroupSpec]) -> Any:
    names = [list(g.layer_names) for g in groups]
    layout = describe_kv_caches(kv, groups=names if len(groups) > 1 else None)
    assert layout.num_blocks == BLOCKS and layout.num_groups == len(groups)
    descs = layout.all_block_descs()
    for i, region in enumerate(layout.regions):
        t = kv[region.layer]
        assert region.group == next(g for g, ns in enumerate(names) if region.layer in ns)
        for b in (0, 3, BLOCKS - 1):  # block b of the region is the tensor's block b, whole
            addr, length, _ = (int(x) for x in descs[i * BLOCKS + b])
            assert addr == t[b].data_ptr()
            assert length == region.block_bytes
    return layout


def test_sliding_window_and_full_attention_share_each_buffer_and_are_registered_once() -> None:
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128)
    groups = [KVCacheGroupSpec(["model.layers.0.attn", "model.layers.2.attn"], window),
              KVCacheGroupSpec(["model.layers.1.attn", "model.layers.3.attn"], full)]
    kv = allocate(groups, full.page_size_bytes)
    layout = check(kv, groups)
    # vLLM aliases the groups from byte 0 of each buffer: layers 0 and 1 are the same memory.
    assert kv["model.layers.0.attn"].data_ptr() == kv["model.layers.1.attn"].data_ptr()
    assert all(r.block_bytes == full.page_size_bytes for r in layout.regions)
    assert len(layout.registration_descs()) == 2  # two buffers, four layers
    # A read of 2 blocks of the window group and 1 of the full group: the window's
    # blocks only in layers 0 and 2.
    idx = layout.desc_index_array([4, 5, 6], group_sizes=(2, 1)).tolist()
    assert [layout.regions[i // BLOCKS].layer for i in idx] == [
        "model.layers.0.attn", "model.layers.0.attn", "model.layers.2.attn", "model.layers.2.attn",
        "model.layers.1.attn", "model.layers.3.attn"]


def test_mla_latent_is_one_region_per_layer() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], mla)]
    kv = allocate(groups, mla.page_size_bytes)
    layout = check(kv, groups)
    assert [(r.part, r.block_bytes) for r in layout.regions] == [(0, 16 * 576 * 4)] * 2


def test_mamba_state_pages_are_described_with_their_padding() -> None:
    """Qwen3-Next's shapes: a conv state and an SSM state per page, padded to the
    attention page; only the state's bytes are a block, the padding is skipped."""
    conv, ssm = (3, 1024), (4, 128, 128)
    conv_dtype = torch.bfloat16
    attn_token = FullAttentionSpec(block_size=1, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    bare = MambaSpec(shapes=(conv, ssm), dtypes=(conv_dtype, torch.float32), block_size=4096)
    block = 32 * math.ceil(bare.page_size_bytes / (32 * attn_token.page_size_bytes))
    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(shapes=(conv, ssm), dtypes=(conv_dtype, torch.float32), block_size=4096,
                      page_size_padded=full.page_size_bytes)
    groups = [KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn"], full)]
    kv = allocate(groups, full.page_size_bytes)
    layout = check(kv, groups)
    state, attn = layout.regions
    assert state.block_bytes == mamba.real_page_size_bytes < state.block_stride == full.page_size_bytes
    assert attn.block_bytes == attn.block_stride == full.page_size_bytes
    assert state.base_addr == attn.base_addr  # aliased from byte 0
    assert layout.registration_descs() == [(attn.base_addr, attn.span, 0)]  # once, the longer span
