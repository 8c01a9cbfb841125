"""vLLM's per-layer KV cache tensors described as regions (``describe_kv_caches``).

The rule is in ``kvsm.transport.layout``'s doc. A tensor is only read for its
metadata (``data_ptr``, ``shape``, ``stride``, ``element_size``, ``device``),
through the ``KVTensor`` protocol: nothing here imports torch (only the vLLM
adapter does), and anything with those five answers can be described.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvsm.transport.regions import MAX_DESCS, KVLayout, MemType, Region, TokenPlanes


class KVDevice(Protocol):
    """What is read of a tensor's device (``torch.device``)."""

    @property
    def type(self) -> str: ...

    @property
    def index(self) -> int | None: ...


class KVTensor(Protocol):
    """What is read of a KV cache tensor (a ``torch.Tensor``)."""

    @property
    def shape(self) -> Sequence[int]: ...

    @property
    def device(self) -> KVDevice: ...

    def stride(self) -> Sequence[int]: ...

    def element_size(self) -> int: ...

    def data_ptr(self) -> int: ...


def _device(tensor: KVTensor, layer: str) -> tuple[MemType, int]:
    dev = tensor.device
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        return "VRAM", dev.index if dev.index is not None else 0
    raise ValueError(f"layer {layer!r}: KV cache on device {dev} (only cpu and cuda are supported)")


def _find_block_dim(layer: str, shape: tuple[int, ...], num_blocks: int | None,
                    block_dim: int | None) -> int:
    ndim = len(shape)
    if ndim < 1:
        raise ValueError(f"layer {layer!r}: a 0-dim tensor is not a KV cache")
    if block_dim is not None:
        bd = block_dim + ndim if block_dim < 0 else block_dim
        if not 0 <= bd < ndim:
            raise ValueError(f"layer {layer!r}: block_dim={block_dim} out of range for shape {shape}")
        if num_blocks is not None and shape[bd] != num_blocks:
            raise ValueError(f"layer {layer!r}: dim {bd} of shape {shape} has size {shape[bd]}, "
                             f"not num_blocks={num_blocks}")
        return bd
    if num_blocks is None:
        # No hint: vLLM-CPU (and most layouts) put blocks first. The one
        # common layout that does not, FlashAttention's K/V split
        # [2, num_blocks, ...], must not be misread as 2 blocks.
        if ndim == 5 and shape[0] == 2:
            raise ValueError(f"layer {layer!r}: shape {shape} may be FlashAttention's "
                             f"[2, num_blocks, block_size, kv_heads, head_size] or "
                             f"[num_blocks=2, ...]: pass num_blocks= or block_dim=")
        return 0
    # The innermost dim is never the block dim (a block would be one element).
    cands = [d for d in range(max(ndim - 1, 1)) if shape[d] == num_blocks]
    if not cands:
        raise ValueError(f"layer {layer!r}: no dim of shape {shape} has size num_blocks={num_blocks}")
    if len(cands) > 1:
        raise ValueError(f"layer {layer!r}: ambiguous block dim in shape {shape}: dims {cands} "
                         f"all have size num_blocks={num_blocks}; pass block_dim=")
    return cands[0]


def describe_kv_caches(kv_caches: Mapping[str, KVTensor], *, num_blocks: int | None = None,
                       block_dim: int | None = None, groups: Sequence[Sequence[str]] | None = None,
                       heads: Mapping[str, int] | None = None,
                       tokens: Mapping[str, tuple[int, TokenPlanes]] | None = None) -> KVLayout:
    """Describe per-layer KV cache tensors as regions of blocks (see the module doc).

    ``kv_caches`` maps layer name to tensor, in layer order (the order is part
    of the signature, so both peers must pass their layers in the same order).
    Without ``num_blocks`` or ``block_dim`` the block dim is 0 (vLLM-CPU).
    ``groups``: the layer names of each KV cache group (vLLM's
    ``kv_cache_config.kv_cache_groups``), each layer in exactly one; None: one
    group of every layer. ``tokens``: per layer, its tokens per block and their
    ``TokenPlanes`` (layers without one move whole blocks only). Raises
    ``ValueError`` naming the layer, its shape
    and strides when a tensor cannot be described.
    """
    if not kv_caches:
        raise ValueError("no KV cache tensors to describe")
    group_of: dict[str, int] = {}
    for g, names in enumerate(groups or ()):
        for name in names:
            if name in group_of:
                raise ValueError(f"layer {name!r} is in KV cache groups {group_of[name]} and {g}")
            group_of[name] = g
    if groups is not None:
        missing = [name for name in kv_caches if name not in group_of]
        unknown = [name for name in group_of if name not in kv_caches]
        if missing or unknown:
            raise ValueError(f"KV cache groups do not match the KV cache tensors: layers in no group "
                             f"{missing[:4]}, group layers without a tensor {unknown[:4]}")
    regions: list[Region] = []
    mem_type: MemType | None = None
    layout_blocks: int | None = None
    first_layer = ""
    for layer, t in kv_caches.items():
        shape = tuple(int(s) for s in t.shape)
        strides = tuple(int(s) for s in t.stride())
        mt, dev = _device(t, layer)
        if mem_type is None:
            mem_type, first_layer = mt, layer
        elif mt != mem_type:
            raise ValueError(f"layer {layer!r} is in {mt} but layer {first_layer!r} is in {mem_type}: "
                             f"one layout holds one memory type")
        bd = _find_block_dim(layer, shape, num_blocks, block_dim)
        nb = shape[bd]
        if layout_blocks is None:
            layout_blocks = nb
        elif nb != layout_blocks:
            raise ValueError(f"layer {layer!r} has {nb} blocks (shape {shape}, block dim {bd}) but "
                             f"layer {first_layer!r} has {layout_blocks}")
        es = t.element_size()
        # The dims after the block dim must be one dense run of memory.
        expected = 1
        for d in range(len(shape) - 1, bd, -1):
            if shape[d] != 1 and strides[d] != expected:
                raise ValueError(f"layer {layer!r}: the dims after block dim {bd} are not contiguous "
                                 f"(shape {shape}, strides {strides}, element size {es}): a block "
                                 f"must be one contiguous run of memory")
            expected *= shape[d]
        block_bytes = expected * es
        if block_bytes == 0:
            raise ValueError(f"layer {layer!r}: empty blocks (shape {shape})")
        block_stride = strides[bd] * es
        if nb > 1 and block_stride < block_bytes:
            raise ValueError(f"layer {layer!r}: blocks overlap (shape {shape}, strides {strides}: "
                             f"block stride {block_stride} B < block size {block_bytes} B)")
        if nb <= 1:
            block_stride = max(block_stride, block_bytes)
        base = t.data_ptr()
        n_heads = (heads or {}).get(layer, 0)
        if n_heads < 1 or len(shape) < bd + 3 or shape[bd + 1] != n_heads:
            n_heads = 0  # not heads-major (or not an attention layer): read whole only
        block_tokens, planes = (tokens or {}).get(layer, (0, None))
        lead = shape[:bd]
        for part, idx in enumerate(itertools.product(*(range(s) for s in lead))):
            offset = sum(i * strides[j] for j, i in enumerate(idx)) * es
            regions.append(Region(layer=layer, part=part, base_addr=base + offset, num_blocks=nb,
                                  block_bytes=block_bytes, block_stride=block_stride, device_id=dev,
                                  group=group_of.get(layer, 0), heads=n_heads, block_tokens=block_tokens,
                                  tokens=planes))
    assert mem_type is not None and layout_blocks is not None
    if len(regions) * layout_blocks > MAX_DESCS:
        raise ValueError(f"{len(regions)} regions x {layout_blocks} blocks do not fit NIXL's int32 "
                         f"descriptor indices")
    return KVLayout(regions=tuple(regions), mem_type=mem_type, num_blocks=layout_blocks,
                    num_groups=max(1, len(groups or ())))
