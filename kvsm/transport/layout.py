"""KV cache tensors described as NIXL descriptors: regions of equally spaced blocks.

A *region* is a run of ``num_blocks`` equally spaced, equally sized blocks in
one memory space: block ``b`` of a region lives at ``base_addr + b *
block_stride`` and is ``block_bytes`` long. ``describe_kv_caches`` turns
vLLM's per-layer KV cache tensors into regions by one generic rule:

* the *block dim* is the dim whose size is ``num_blocks`` (an explicit
  ``block_dim`` wins; two candidate dims are an error naming the layer);
* each index combination of the dims *before* the block dim is one region
  (its ``part`` is the flat index of that combination);
* the dims *after* the block dim form one block and must be contiguous.

So vLLM-CPU's ``[num_blocks, kv_heads, block_size, 2*head_size]`` is one
region per layer; FlashAttention's ``[2, num_blocks, block_size, kv_heads,
head_size]`` is two (K and V); ``[num_blocks, 2, block_size, kv_heads,
head_size]`` is one.

Descriptor order, the contract between ``block_descs`` and ``desc_indices``
(and with the peer, which preps the same order from the layout it receives):
region-major, then block. ``NixlTransport`` preps the descriptors of *all*
blocks of *all* regions once (``all_block_descs``), so descriptor ``r *
num_blocks + b`` is block ``b`` of region ``r``, and a transfer is two index
lists.

KV cache groups (vLLM's hybrid KV cache manager: full attention beside
sliding window, Mamba state or another block size). Every group's blocks come
from one block pool, so a block id means the same block in every layer, but a
request has its own block ids *per group*, and they hold data only in that
group's layers. ``describe_kv_caches(..., groups=[layer names, ...])`` tags
each region with its group; a transfer then gives its block ids group after
group with ``group_sizes`` (how many belong to each), and each segment is
indexed in its own group's regions only. Layers of different groups may share
memory (vLLM's ``KVCacheTensor.shared_by``): their regions alias, and
``registration_descs`` registers each byte once.

Pure Python plus numpy; a tensor is only read for its metadata (data_ptr,
shape, stride, element_size, device). Nothing here imports NIXL or torch.

This module is the public path of both halves: ``kvsm.transport.regions`` (the
regions, ``KVLayout`` and its descriptor math) and ``kvsm.transport.describe``
(tensors into regions).
"""

from kvsm.transport.describe import KVDevice, KVTensor, describe_kv_caches
from kvsm.transport.regions import KVLayout, MemType, Region, Segments, TokenPlanes

__all__ = ["KVDevice", "KVLayout", "KVTensor", "MemType", "Region", "Segments", "TokenPlanes", "describe_kv_caches"]
