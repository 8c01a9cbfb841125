"""The regions of blocks a KV layout is made of, and the descriptor math over them.

See ``kvsm.transport.layout`` for the model (regions, descriptor order, KV
cache groups, segments). Pure Python plus numpy: nothing here imports NIXL or
torch, so a layout travels in the handshake and the in-memory transport uses it
as NIXL's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

MemType = Literal["DRAM", "VRAM"]

# NIXL takes int32 descriptor indices.
MAX_DESCS = 2**31 - 1
# Reads of up to this many descriptors get their indices in plain Python
# (``KVLayout.desc_index_array``): cheaper than numpy's per-call cost below it
# (measured: 1.6 against 5.6 µs for 4; even at 64).
_SMALL_READ = 64


class TokenPlanes(msgspec.Struct, frozen=True):
    """How one head of a block keeps its tokens, so that a block of one size can
    be read out of blocks of another (prefill and decode engines with different
    block sizes).

    A head's bytes are ``planes`` in memory order (vLLM-CPU: K, then V); a plane
    is ``rows`` rows, each row every token of the block in token order,
    ``token_bytes`` per token. So tokens ``[a, a + n)`` of a plane are one byte run
    per row, and those runs hold the same bytes, in the same order, whatever the
    block size (checked against vLLM's own cache writer at registration: see
    ``kvsm.connector``). ``align``: tokens that must move together (a kernel's
    tile); segments are multiples of it."""

    planes: tuple[tuple[int, int], ...]  # (rows, token_bytes)
    align: int = 1

    def head_bytes(self, block_tokens: int) -> int:
        return sum(rows * block_tokens * tb for rows, tb in self.planes)

    def runs(self, block_tokens: int, seg_tokens: int, seg: int, head_bytes: int,
             heads: range) -> np.ndarray:
        """``N x 2`` (offset in the block, length) of segment ``seg`` (tokens
        ``[seg * seg_tokens, (seg + 1) * seg_tokens)``) of ``heads``, in an order
        both block sizes share."""
        out: list[tuple[int, int]] = []
        for h in heads:
            base = h * head_bytes
            for rows, tb in self.planes:
                first = base + seg * seg_tokens * tb
                out.extend((first + r * block_tokens * tb, seg_tokens * tb) for r in range(rows))
                base += rows * block_tokens * tb
        return np.asarray(out, dtype=np.uint64).reshape(-1, 2)


# A read of blocks of different sizes, in segments of ``tokens`` tokens (the
# smaller block size): the read's i-th local block id is filled at its segment
# ``local[i]`` from segment ``remote[i]`` of the i-th remote block id.
# ``local_block`` / ``remote_block``: the tokens per block each side assumed,
# checked against the layouts before anything moves.
class Segments(msgspec.Struct, frozen=True):
    tokens: int
    local: tuple[int, ...]
    remote: tuple[int, ...]
    local_block: int
    remote_block: int


class Region(msgspec.Struct, frozen=True):
    """``num_blocks`` blocks of ``block_bytes`` at ``base_addr + b * block_stride``."""

    layer: str
    part: int
    base_addr: int
    num_blocks: int
    block_bytes: int
    block_stride: int
    device_id: int
    group: int = 0  # the KV cache group of its layer
    # KV heads in a block, outermost (vLLM-CPU's [heads, tokens, 2 * head_size]):
    # a run of heads is then one contiguous byte range, and tensor parallel
    # engines of different sizes can read each other's (``sliced``). 0: the
    # block cannot be cut by heads (MLA's latent, Mamba state, a tokens-major layout).
    heads: int = 0
    # Tokens per block, and how a head's block holds them (None: the block moves
    # whole only, so both engines must use one block size).
    block_tokens: int = 0
    tokens: TokenPlanes | None = None

    @property
    def unit_bytes(self) -> int:
        """Bytes of one head of a block (of the whole block when it has no heads)."""
        return self.block_bytes // self.heads if self.heads else self.block_bytes

    @property
    def span(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.block_bytes


class KVLayout(msgspec.Struct, frozen=True):
    """Where every KV block of one engine (one worker) lives.

    msgspec-serialisable, so it travels in the handshake: the peer preps its
    remote descriptor list from the addresses in here.
    """

    regions: tuple[Region, ...]
    mem_type: MemType
    num_blocks: int
    num_groups: int = 1

    # -- compatibility ---------------------------------------------------------

    def signature(self) -> tuple[tuple[str, int, int, int], ...]:
        """What must match between peers: the regions in order, each as
        ``(layer, part, block_bytes, group)``. Not addresses, strides, the number
        of blocks or the memory type: those may differ between engines."""
        return tuple((r.layer, r.part, r.block_bytes, r.group) for r in self.regions)

    def mismatch(self, other: KVLayout) -> str | None:
        """The first difference between the two signatures, in words; None if compatible."""
        if self.num_groups != other.num_groups:
            return f"number of KV cache groups: local {self.num_groups}, remote {other.num_groups}"
        if len(self.regions) != len(other.regions):
            return f"number of regions: local {len(self.regions)}, remote {len(other.regions)}"
        for i, (a, b) in enumerate(zip(self.regions, other.regions)):
            if a.layer != b.layer or a.part != b.part:
                return (f"region {i}: local is layer {a.layer!r} part {a.part}, "
                        f"remote is layer {b.layer!r} part {b.part}")
            if a.group != b.group:
                return (f"KV cache group of region {i} (layer {a.layer!r} part {a.part}): "
                        f"local {a.group}, remote {b.group}")
            if a.tokens is not None and a.tokens == b.tokens and a.block_tokens and b.block_tokens:
                if a.unit_bytes // a.block_tokens != b.unit_bytes // b.block_tokens:
                    return (f"bytes per token of region {i} (layer {a.layer!r} part {a.part}): local "
                            f"{a.unit_bytes // a.block_tokens}, remote {b.unit_bytes // b.block_tokens}")
                continue
            if bool(a.heads) != bool(b.heads) or a.unit_bytes != b.unit_bytes:
                # Head counts may differ (tensor parallel sizes differ): a head may not.
                if not (a.heads or b.heads):
                    return (f"block_bytes of region {i} (layer {a.layer!r} part {a.part}): "
                            f"local {a.block_bytes}, remote {b.block_bytes}")
                return (f"block_bytes of region {i} (layer {a.layer!r} part {a.part}): "
                        f"local {a.block_bytes} ({a.heads or 'no'} heads), "
                        f"remote {b.block_bytes} ({b.heads or 'no'} heads)")
        return None

    def sliced(self, start: int, count: int, of: int) -> KVLayout:
        """The same blocks cut down to heads ``[start, start + count)`` of ``of``
        in every region that holds ``of`` heads (what one tensor parallel rank
        reads of another's blocks). A region without heads (MLA's latent, Mamba
        state) is only ever read whole; asking to cut it, or a region of another
        head count, is a ``ValueError`` naming it."""
        if start == 0 and count == of:
            return self
        if not (0 <= start and 0 < count and start + count <= of):
            raise ValueError(f"heads {start}..{start + count - 1} are not within a block of {of} heads")
        out = []
        for r in self.regions:
            if r.heads != of:
                raise ValueError(f"layer {r.layer!r} part {r.part}: its blocks hold "
                                 f"{r.heads or 'no'} heads, so heads {start}..{start + count - 1} of {of} "
                                 f"cannot be cut out of them")
            unit = r.unit_bytes
            out.append(msgspec.structs.replace(r, base_addr=r.base_addr + start * unit,
                                               block_bytes=count * unit, heads=count))
        return msgspec.structs.replace(self, regions=tuple(out))

    def layer_names(self) -> tuple[str, ...]:
        """The layers it holds, in order (a pipeline parallel stage holds a run of the model's)."""
        return tuple(dict.fromkeys(r.layer for r in self.regions))

    def only(self, layers: Sequence[str]) -> KVLayout:
        """The same blocks of ``layers`` only (the layers two pipeline parallel stages
        share), in this layout's order; its descriptors are numbered afresh.
        ``ValueError`` naming a layer it does not hold."""
        wanted = set(layers)
        missing = wanted - {r.layer for r in self.regions}
        if missing:
            raise ValueError(f"layers {sorted(missing)[:4]} are not in this KV layout")
        if len(wanted) == len(self.layer_names()):
            return self
        return msgspec.structs.replace(self, regions=tuple(r for r in self.regions if r.layer in wanted))

    def group_regions(self, group: int) -> list[int]:
        """Indices of the regions of KV cache group ``group``."""
        return [i for i, r in enumerate(self.regions) if r.group == group]

    def num_descs(self, num_blocks: int, group_sizes: Sequence[int] = ()) -> int:
        """How many descriptors a transfer of ``num_blocks`` blocks takes."""
        if not group_sizes:
            return num_blocks * len(self.regions)
        return sum(n * len(self.group_regions(g)) for g, n in enumerate(group_sizes))

    def num_bytes(self, num_blocks: int, group_sizes: Sequence[int] = ()) -> int:
        """How many bytes a transfer of ``num_blocks`` blocks moves."""
        if not group_sizes:
            return num_blocks * sum(r.block_bytes for r in self.regions)
        return sum(n * sum(self.regions[i].block_bytes for i in self.group_regions(g))
                   for g, n in enumerate(group_sizes))

    # -- descriptors -------------------------------------------------------------

    def registration_descs(self) -> list[tuple[int, int, int]]:
        """``(addr, len, device_id)`` per region: the memory to register.

        ``len`` is the region's span, ``(num_blocks - 1) * block_stride +
        block_bytes``; equal to ``num_blocks * block_stride`` for dense
        blocks, and never past the last block when blocks are interleaved with
        other data (a view of a larger buffer). Layers of different KV cache
        groups that share one buffer (vLLM aliases every group from byte 0 of
        each ``KVCacheTensor``) start at the same address: registered once,
        with the longest of their spans."""
        spans: dict[tuple[int, int], int] = {}
        for r in self.regions:
            key = (r.base_addr, r.device_id)
            spans[key] = max(spans.get(key, 0), r.span)
        return [(addr, span, dev) for (addr, dev), span in spans.items()]

    def block_index(self, region_idx: int, block_id: int) -> int:
        """Index of block ``block_id`` of region ``region_idx`` in ``all_block_descs``."""
        if not 0 <= region_idx < len(self.regions):
            raise IndexError(f"region {region_idx} out of range ({len(self.regions)} regions)")
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} out of range ({self.num_blocks} blocks)")
        return region_idx * self.num_blocks + block_id

    def _blocks(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        b = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if b.size:
            lo, hi = int(b.min()), int(b.max())
            if lo < 0 or hi >= self.num_blocks:
                bad = lo if lo < 0 else hi
                raise ValueError(f"block id {bad} out of range: the layout has {self.num_blocks} blocks")
        return b

    def desc_index_array(self, block_ids: Sequence[int] | np.ndarray,
                         group_sizes: Sequence[int] = ()) -> np.ndarray:
        """``desc_indices`` as an int32 numpy array (what NIXL takes fastest).

        ``group_sizes``: ``block_ids`` hold that many blocks of each KV cache
        group in turn, each indexed in its own group's regions (empty: every
        block in every region)."""
        if isinstance(block_ids, (list, tuple)) and len(block_ids) * len(self.regions) <= _SMALL_READ:
            return np.array(self._small_desc_indices(block_ids, group_sizes), dtype=np.int32)
        b = self._blocks(block_ids)
        n = len(self.regions) * self.num_blocks
        if n > MAX_DESCS:
            raise ValueError(f"{n} descriptors do not fit NIXL's int32 indices")
        if not group_sizes:
            starts = np.arange(len(self.regions), dtype=np.int64) * self.num_blocks
            return (starts[:, None] + b[None, :]).reshape(-1).astype(np.int32)
        if len(group_sizes) != self.num_groups:
            raise ValueError(f"{len(group_sizes)} KV cache groups of blocks for a layout of {self.num_groups}")
        if sum(group_sizes) != b.size:
            raise ValueError(f"group sizes {list(group_sizes)} add up to {sum(group_sizes)}, not {b.size} blocks")
        parts = []
        at = 0
        for g, size in enumerate(group_sizes):
            starts = np.asarray(self.group_regions(g), dtype=np.int64) * self.num_blocks
            parts.append((starts[:, None] + b[None, at:at + size]).reshape(-1))
            at += size
        return np.concatenate(parts).astype(np.int32) if parts else np.empty(0, dtype=np.int32)

    def _small_desc_indices(self, block_ids: Sequence[int], group_sizes: Sequence[int]) -> list[int]:
        """``desc_index_array``'s indices for a few blocks, in plain Python: numpy's
        per-call cost (a dozen small arrays) was most of a one-block read's
        descriptor work on the decode loop. Same checks, same messages."""
        nb = self.num_blocks
        if block_ids:
            lo, hi = min(block_ids), max(block_ids)
            if lo < 0 or hi >= nb:
                raise ValueError(f"block id {lo if lo < 0 else hi} out of range: the layout has {nb} blocks")
        n = len(self.regions) * nb
        if n > MAX_DESCS:
            raise ValueError(f"{n} descriptors do not fit NIXL's int32 indices")
        if not group_sizes:
            return [r * nb + b for r in range(len(self.regions)) for b in block_ids]
        if len(group_sizes) != self.num_groups:
            raise ValueError(f"{len(group_sizes)} KV cache groups of blocks for a layout of {self.num_groups}")
        if sum(group_sizes) != len(block_ids):
            raise ValueError(f"group sizes {list(group_sizes)} add up to {sum(group_sizes)}, "
                             f"not {len(block_ids)} blocks")
        out: list[int] = []
        at = 0
        for g, size in enumerate(group_sizes):
            part = block_ids[at:at + size]
            out += [r * nb + b for r in self.group_regions(g) for b in part]
            at += size
        return out

    def layer_desc_index_array(self, layer: str, block_ids: Sequence[int]) -> np.ndarray:
        """``desc_index_array`` of ``layer``'s regions only (one KV cache group):
        what a streamed write of one layer moves. ``ValueError`` naming a layer
        this layout does not hold."""
        regions = [i for i, r in enumerate(self.regions) if r.layer == layer]
        if not regions:
            raise ValueError(f"layer {layer!r} is not in this KV layout")
        b = self._blocks(block_ids)
        starts = np.asarray(regions, dtype=np.int64) * self.num_blocks
        return (starts[:, None] + b[None, :]).reshape(-1).astype(np.int32)

    def desc_indices(self, block_ids: Sequence[int]) -> list[int]:
        """Indices into ``all_block_descs`` of ``block_ids`` in every region,
        region-major: the same order as ``block_descs(block_ids)``."""
        return self.desc_index_array(block_ids).tolist()

    def block_desc_array(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``block_descs`` as an ``N x 3`` uint64 numpy array (NIXL takes it as is)."""
        b = self._blocks(block_ids)
        regions = self.regions
        base = np.fromiter((r.base_addr for r in regions), dtype=np.uint64, count=len(regions))
        stride = np.fromiter((r.block_stride for r in regions), dtype=np.uint64, count=len(regions))
        length = np.fromiter((r.block_bytes for r in regions), dtype=np.uint64, count=len(regions))
        dev = np.fromiter((r.device_id for r in regions), dtype=np.uint64, count=len(regions))
        out = np.empty((len(regions), b.size, 3), dtype=np.uint64)
        out[:, :, 0] = base[:, None] + b.astype(np.uint64)[None, :] * stride[:, None]
        out[:, :, 1] = length[:, None]
        out[:, :, 2] = dev[:, None]
        return out.reshape(-1, 3)

    def block_descs(self, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(addr, block_bytes, device_id)`` for each region, for each block of
        ``block_ids`` (region-major)."""
        return [(int(a), int(n), int(d)) for a, n, d in self.block_desc_array(block_ids)]

    def num_segment_descs(self, pairs: int, heads: int | None = None) -> int:
        """How many descriptors ``pairs`` segment pairs take (``segment_desc_array``'s
        rows), ``heads`` of each block's heads (None: all)."""
        total = 0
        for r in self.regions:
            t = r.tokens
            if t is None or not r.block_tokens:
                continue
            rows = sum(rows for rows, _ in t.planes)
            total += rows * (heads if heads is not None else r.block_bytes // t.head_bytes(r.block_tokens))
        return pairs * total

    def check_segments(self, block_tokens: int, seg_tokens: int) -> None:
        """``ValueError`` unless every region's blocks hold ``block_tokens`` tokens
        and can be read in segments of ``seg_tokens``."""
        for r in self.regions:
            self._segmentable(r, block_tokens, seg_tokens)

    @staticmethod
    def _segmentable(r: Region, block_tokens: int, seg_tokens: int) -> TokenPlanes:
        t = r.tokens
        if t is None or not r.block_tokens:
            raise ValueError(f"layer {r.layer!r} part {r.part}: its blocks move whole only (no token "
                             f"layout), so blocks of another size cannot be read into or out of them")
        if r.block_tokens != block_tokens:
            raise ValueError(f"layer {r.layer!r} part {r.part}: its blocks hold {r.block_tokens} tokens, "
                             f"not {block_tokens}")
        if seg_tokens <= 0 or r.block_tokens % seg_tokens or seg_tokens % t.align:
            raise ValueError(f"layer {r.layer!r} part {r.part}: segments of {seg_tokens} tokens do not cut "
                             f"its blocks of {r.block_tokens} (kernel tiles of {t.align} tokens)")
        return t

    def segment_desc_array(self, block_ids: Sequence[int], segs: Sequence[int], seg_tokens: int,
                           heads: tuple[int, int, int] | None = None) -> np.ndarray:
        """``N x 3`` descriptors of segment ``segs[i]`` of block ``block_ids[i]``
        in every region, region-major, then block, then run (the order
        ``TokenPlanes.runs`` gives, the same on both engines). ``heads``: only
        that run ``(start, count, of)`` of each block's heads. ``ValueError`` when
        a region cannot be cut into segments of ``seg_tokens``."""
        b = self._blocks(block_ids)
        if len(segs) != b.size:
            raise ValueError(f"{len(segs)} segments for {b.size} blocks")
        parts = []
        for r in self.regions:
            t = self._segmentable(r, r.block_tokens, seg_tokens)
            if any(not 0 <= k < r.block_tokens // seg_tokens for k in segs):
                raise ValueError(f"segment index out of range for blocks of {r.block_tokens // seg_tokens} "
                                 f"segments: {sorted(set(segs))[-1]}")
            head_bytes = t.head_bytes(r.block_tokens)
            n_heads = r.block_bytes // head_bytes if head_bytes else 0
            if not n_heads or n_heads * head_bytes != r.block_bytes:
                raise ValueError(f"layer {r.layer!r} part {r.part}: token layout {t} does not tile its "
                                 f"{r.block_bytes}-byte blocks of {r.block_tokens} tokens")
            start, count = (0, n_heads) if heads is None else (heads[0], heads[1])
            if heads is not None and heads[2] != n_heads:
                raise ValueError(f"layer {r.layer!r} part {r.part}: heads {heads} of a block of {n_heads}")
            # Runs of segment k of any block, relative to the block's start: one table per segment.
            per_seg = {k: t.runs(r.block_tokens, seg_tokens, k, head_bytes, range(start, start + count))
                       for k in set(segs)}
            for block, k in zip(b.tolist(), segs):
                runs = per_seg[k]
                d = np.empty((runs.shape[0], 3), dtype=np.uint64)
                d[:, 0] = r.base_addr + block * r.block_stride + runs[:, 0]
                d[:, 1] = runs[:, 1]
                d[:, 2] = r.device_id
                parts.append(d)
        return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)

    def all_block_descs(self) -> np.ndarray:
        """Every block of every region, ``N x 3`` uint64: the list to prep once."""
        return self.block_desc_array(np.arange(self.num_blocks))
