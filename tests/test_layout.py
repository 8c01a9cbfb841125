"""describe_kv_caches: KV cache tensors as NIXL regions, addresses checked exactly."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from conftest import require

torch = require("torch")

from kvsm.transport.layout import KVLayout, Region, describe_kv_caches

NB, H, BS, D = 10, 2, 16, 32  # blocks, kv heads, block size, head size


def cpu_caches(layers: int = 2, dtype=torch.float32, nb: int = NB, d: int = D):
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(nb, H, BS, 2 * d, dtype=dtype)
            for i in range(layers)}


def test_vllm_cpu_layout_one_region_per_layer():
    caches = cpu_caches(dtype=torch.bfloat16)
    lay = describe_kv_caches(caches, num_blocks=NB)
    assert lay.mem_type == "DRAM" and lay.num_blocks == NB
    assert [(r.layer, r.part) for r in lay.regions] == [(name, 0) for name in caches]
    for r, t in zip(lay.regions, caches.values()):
        assert r.base_addr == t.data_ptr()
        assert r.block_bytes == H * BS * 2 * D * 2 == t[0].nbytes
        assert r.block_stride == t.stride(0) * 2 == r.block_bytes
        assert r.num_blocks == NB and r.device_id == 0
    # block dim 0 is also the default when nothing is said
    assert describe_kv_caches(caches) == lay
    assert describe_kv_caches(caches, block_dim=0) == lay


def test_flash_attention_layout_splits_k_and_v():
    t = torch.zeros(2, NB, BS, H, D, dtype=torch.float16)
    lay = describe_kv_caches({"l0": t}, num_blocks=NB)
    k, v = lay.regions
    blk = BS * H * D * 2
    assert (k.layer, k.part, v.layer, v.part) == ("l0", 0, "l0", 1)
    assert k.base_addr == t.data_ptr() == t[0].data_ptr()
    assert v.base_addr == t.data_ptr() + NB * blk == t[1].data_ptr()
    assert k.block_bytes == v.block_bytes == blk and k.block_stride == v.block_stride == blk
    assert lay.block_descs([3]) == [(t[0, 3].data_ptr(), blk, 0), (t[1, 3].data_ptr(), blk, 0)]
    assert lay.registration_descs() == [(t[0].data_ptr(), NB * blk, 0), (t[1].data_ptr(), NB * blk, 0)]
    with pytest.raises(ValueError, match=r"l0.*FlashAttention.*pass num_blocks"):
        describe_kv_caches({"l0": t})  # no hint: [2, ...] could be 2 blocks
    assert describe_kv_caches({"l0": t}, block_dim=1) == lay


def test_blocks_first_kv_layout_is_one_region():
    t = torch.zeros(NB, 2, BS, H, D, dtype=torch.float16)
    lay = describe_kv_caches({"l0": t}, num_blocks=NB)
    (r,) = lay.regions
    assert r.base_addr == t.data_ptr() and r.block_bytes == 2 * BS * H * D * 2 == r.block_stride
    assert lay.block_descs([0, 9]) == [(t[0].data_ptr(), r.block_bytes, 0),
                                       (t[9].data_ptr(), r.block_bytes, 0)]


def test_view_of_a_larger_buffer_keeps_its_stride():
    # Two layers interleaved per block in one buffer: blocks are not adjacent.
    buf = torch.zeros(NB, 2, H, BS, 2 * D)
    lay = describe_kv_caches({"a": buf[:, 0], "b": buf[:, 1]}, num_blocks=NB)
    a, b = lay.regions
    blk = H * BS * 2 * D * 4
    assert a.block_bytes == b.block_bytes == blk and a.block_stride == b.block_stride == 2 * blk
    assert b.base_addr == a.base_addr + blk == buf[0, 1].data_ptr()
    assert lay.block_descs([4]) == [(buf[4, 0].data_ptr(), blk, 0), (buf[4, 1].data_ptr(), blk, 0)]
    # the registered span ends with the last block, not a stride later
    assert lay.registration_descs()[1] == (b.base_addr, (NB - 1) * 2 * blk + blk, 0)
    assert b.base_addr + (NB - 1) * 2 * blk + blk == buf.data_ptr() + buf.nbytes


def test_non_contiguous_blocks_are_rejected_with_shape_and_strides():
    t = torch.zeros(NB, BS, H, 2 * D).transpose(1, 2)  # [NB, H, BS, 2D] with swapped strides
    with pytest.raises(ValueError) as e:
        describe_kv_caches({"model.layers.3.attn": t}, num_blocks=NB)
    msg = str(e.value)
    assert "'model.layers.3.attn'" in msg and "not contiguous" in msg
    assert str(tuple(t.shape)) in msg and str(tuple(t.stride())) in msg


def test_ambiguous_block_dim_names_the_layer():
    t = torch.zeros(16, H, 16, 2 * D)  # num_blocks == block_size == 16
    with pytest.raises(ValueError, match=r"'l7': ambiguous block dim in shape \(16, 2, 16, 64\): dims \[0, 2\]"):
        describe_kv_caches({"l7": t}, num_blocks=16)
    assert describe_kv_caches({"l7": t}, num_blocks=16, block_dim=0).regions[0].block_bytes == t[0].nbytes
    # The innermost dim is never a block dim: 2*head_size == num_blocks is fine.
    t = torch.zeros(64, H, BS, 64)
    assert describe_kv_caches({"l": t}, num_blocks=64).regions[0].block_bytes == t[0].nbytes


def test_other_errors():
    with pytest.raises(ValueError, match="no dim .* num_blocks=7"):
        describe_kv_caches(cpu_caches(), num_blocks=7)
    with pytest.raises(ValueError, match="'x' has 5 blocks"):
        describe_kv_caches({"w": torch.zeros(4, H, BS, D), "x": torch.zeros(5, H, BS, D)})
    with pytest.raises(ValueError, match="dim 0 .* size 4, not num_blocks=5"):
        describe_kv_caches({"w": torch.zeros(4, H, BS, D)}, num_blocks=5, block_dim=0)
    with pytest.raises(ValueError, match="no KV cache"):
        describe_kv_caches({})


def test_desc_indices_agree_with_block_descs():
    lay = describe_kv_caches({"k": torch.zeros(2, NB, BS, H, D), "m": torch.zeros(2, NB, BS, H, D)},
                             num_blocks=NB)
    assert len(lay.regions) == 4
    every = lay.all_block_descs()
    assert every.shape == (4 * NB, 3)
    blocks = [7, 0, 3, 3, 9]
    idx = lay.desc_indices(blocks)
    assert idx == [r * NB + b for r in range(4) for b in blocks]
    assert idx[len(blocks) * 2 + 1] == lay.block_index(2, 0)
    assert [tuple(int(x) for x in row) for row in every[idx]] == lay.block_descs(blocks)
    assert lay.desc_index_array(blocks).dtype == np.int32
    with pytest.raises(ValueError, match="block id 10 out of range"):
        lay.desc_indices([1, NB])
    with pytest.raises(ValueError, match="block id -1"):
        lay.block_descs([-1])
    with pytest.raises(IndexError):
        lay.block_index(4, 0)
    assert lay.block_descs([]) == [] and lay.desc_indices([]) == []


def test_many_blocks_are_fast():
    import time

    lay = KVLayout(regions=tuple(Region(f"l{i}", 0, 1 << 40 | i << 32, 100_000, 8192, 8192, 0)
                                 for i in range(64)), mem_type="DRAM", num_blocks=100_000)
    blocks = np.random.default_rng(0).permutation(100_000)[:4096]
    t0 = time.perf_counter()
    idx = lay.desc_index_array(blocks)
    descs = lay.block_desc_array(blocks)
    assert time.perf_counter() - t0 < 0.5
    assert idx.shape == (64 * 4096,) and descs.shape == (64 * 4096, 3)
    assert int(descs[4096 + 5, 0]) == (1 << 40 | 1 << 32) + int(blocks[5]) * 8192


def test_signature_ignores_addresses_and_block_counts():
    # Both sets of tensors stay alive: otherwise the allocator may hand the second
    # the first one's freed memory, and the two base addresses would be equal.
    caches_a, caches_b = cpu_caches(), cpu_caches(nb=NB + 5)
    a = describe_kv_caches(caches_a, num_blocks=NB)
    b = describe_kv_caches(caches_b, num_blocks=NB + 5)
    assert a.regions[0].base_addr != b.regions[0].base_addr
    assert a.signature() == b.signature() and a.mismatch(b) is None
    c = describe_kv_caches(cpu_caches(d=2 * D))
    assert a.signature() != c.signature()
    assert a.mismatch(c) == (f"block_bytes of region 0 (layer 'model.layers.0.self_attn.attn' part 0): "
                             f"local {a.regions[0].block_bytes}, remote {c.regions[0].block_bytes}")
    assert "number of regions: local 2, remote 1" == a.mismatch(describe_kv_caches(cpu_caches(1)))
    renamed = describe_kv_caches({"x" + k: v for k, v in cpu_caches().items()})
    assert "region 0: local is layer 'model.layers.0.self_attn.attn'" in a.mismatch(renamed)


def test_layout_round_trips_through_msgpack():
    lay = describe_kv_caches({"l0": torch.zeros(2, NB, BS, H, D)}, num_blocks=NB)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(lay), type=KVLayout)
    assert back == lay and back.signature() == lay.signature()
    assert back.block_descs([1, 2]) == lay.block_descs([1, 2])


def hybrid_caches(nb: int = NB) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Four layers in two KV cache groups (sliding window: 0 and 2; full: 1 and 3);
    layers i and i+1 share one tensor, as vLLM's KVCacheTensor.shared_by makes them."""
    buffers = [torch.zeros(nb, H, BS, 2 * D) for _ in range(2)]
    caches = {f"model.layers.{i}.self_attn.attn": buffers[i // 2].view(nb, H, BS, 2 * D) for i in range(4)}
    names = list(caches)
    return caches, [[names[0], names[2]], [names[1], names[3]]]


def test_kv_cache_groups_tag_regions_and_each_segment_reads_its_own_layers():
    caches, groups = hybrid_caches()
    lay = describe_kv_caches(caches, groups=groups)
    assert lay.num_groups == 2
    assert [r.group for r in lay.regions] == [0, 1, 0, 1]
    assert lay.group_regions(0) == [0, 2] and lay.group_regions(1) == [1, 3]
    # Two blocks of group 0, then one of group 1: group 0's only in regions 0 and 2.
    idx = lay.desc_index_array([4, 7, 2], group_sizes=(2, 1)).tolist()
    assert idx == [0 * NB + 4, 0 * NB + 7, 2 * NB + 4, 2 * NB + 7, 1 * NB + 2, 3 * NB + 2]
    assert lay.num_descs(3, (2, 1)) == len(idx)
    assert lay.num_bytes(3, (2, 1)) == len(idx) * lay.regions[0].block_bytes
    assert lay.num_bytes(3) == 3 * 4 * lay.regions[0].block_bytes
    # Block 4 of group 0 in layer 0 is the same memory as block 4 of layer 1 (shared tensor).
    descs = lay.all_block_descs()
    assert int(descs[idx[0], 0]) == caches[groups[0][0]][4].data_ptr() == caches[groups[1][0]][4].data_ptr()
    with pytest.raises(ValueError, match="add up to 2, not 3"):
        lay.desc_index_array([4, 7, 2], group_sizes=(1, 1))
    with pytest.raises(ValueError, match="1 KV cache groups of blocks for a layout of 2"):
        lay.desc_index_array([4], group_sizes=(1,))


def test_shared_tensors_are_registered_once():
    caches, groups = hybrid_caches()
    lay = describe_kv_caches(caches, groups=groups)
    regs = lay.registration_descs()
    assert len(regs) == 2  # two tensors, four layers
    assert sorted(addr for addr, _, _ in regs) == sorted(t.data_ptr() for t in list(caches.values())[::2])
    assert all(n == NB * H * BS * 2 * D * 4 for _, n, _ in regs)


def test_group_layout_mismatches_are_named():
    caches, groups = hybrid_caches()
    two = describe_kv_caches(caches, groups=groups)
    one = describe_kv_caches(caches)
    assert one.mismatch(two) == "number of KV cache groups: local 1, remote 2"
    swapped = describe_kv_caches(caches, groups=[groups[1], groups[0]])
    assert two.mismatch(swapped) == ("KV cache group of region 0 (layer 'model.layers.0.self_attn.attn' part 0): "
                                     "local 0, remote 1")
    with pytest.raises(ValueError, match="layers in no group"):
        describe_kv_caches(caches, groups=[groups[0]])
    with pytest.raises(ValueError, match="in KV cache groups 0 and 1"):
        describe_kv_caches(caches, groups=[groups[0], [*groups[1], groups[0][0]]])


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_a_small_read_indexes_in_python_as_numpy_does(groups: int) -> None:
    """Reads of a few descriptors take the plain-Python path of desc_index_array
    (a list or tuple of block ids), larger ones and arrays numpy's: the same
    indices, dtype and errors, with and without KV cache groups."""
    rng = np.random.default_rng(groups)
    lay = KVLayout(regions=tuple(Region(f"l{i}", 0, 1 << 40 | i << 32, 50, 4096, 4096, 0, group=i % groups)
                                 for i in range(6)), mem_type="DRAM", num_blocks=50, num_groups=groups)
    for n in (0, 1, 3, 10, 11, 40):
        blocks = [int(b) for b in rng.integers(0, 50, n)]
        cut = sorted(int(c) for c in rng.integers(0, n + 1, groups - 1))
        sizes = tuple(b - a for a, b in zip([0, *cut], [*cut, n])) if groups > 1 else ()
        small = lay.desc_index_array(blocks, sizes)
        big = lay.desc_index_array(np.asarray(blocks, dtype=np.int64), sizes)  # (an array: numpy's path)
        assert small.dtype == big.dtype == np.int32 and small.tolist() == big.tolist(), (n, sizes)
        assert lay.desc_index_array(tuple(blocks), sizes).tolist() == big.tolist()
        assert len(small) == lay.num_descs(n, sizes)
    for bad in ([3, 50], [-1]):
        for arg in (bad, np.asarray(bad)):
            with pytest.raises(ValueError, match=f"block id {bad[-1]} out of range: the layout has 50 blocks"):
                lay.desc_index_array(arg, (len(bad),) + (0,) * (groups - 1) if groups > 1 else ())
    if groups > 1:
        for arg in ([1, 2], np.asarray([1, 2])):
            with pytest.raises(ValueError, match="add up to 1, not 2 blocks"):
                lay.desc_index_array(arg, (1,) + (0,) * (groups - 1))


class _NumpyDevice:
    type = "cpu"
    index = None


class _NumpyKV:
    """A KV cache tensor that is not torch's: describe_kv_caches reads only what
    its KVTensor protocol names (the transport never imports torch)."""

    device = _NumpyDevice()

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.shape = a.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def element_size(self) -> int:
        return self.a.itemsize

    def data_ptr(self) -> int:
        return int(self.a.ctypes.data)


def test_any_tensor_with_the_five_answers_is_described_as_torchs() -> None:
    caches = cpu_caches()
    as_numpy = {name: _NumpyKV(t.numpy()) for name, t in caches.items()}
    assert describe_kv_caches(as_numpy, num_blocks=NB) == describe_kv_caches(caches, num_blocks=NB)
