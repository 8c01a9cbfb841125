"""How vLLM-CPU's attention kernels keep tokens in a block, so engines with
different block sizes can read each other's blocks (``TokenPlanes``).

vLLM-CPU's cache is ``[num_blocks, kv_heads, block_size, 2 * head_size]``,
but the bytes of a block are laid out by its kernel (its *isa*), not as that
shape says; measured here with vLLM's own cache writer
(``cpu_attn_reshape_and_cache``):

* ``vec`` (float32, or bfloat16 without AMX; block sizes a multiple of 32) and
  ``vec16`` (block or head sizes a multiple of 16 only): per head, K
  transposed (``[head_size][block_size]``: a row per dimension), then V
  token-major (``[block_size][head_size]``);
* ``amx`` (bfloat16 on a CPU with AMX tiles): per head, K in 16-token tiles
  (``[block_size / 16][head_size / 2][16][2]``: tiles in token order), then V
  in columns of 16 dimensions (``[head_size / 16][block_size / 2][16][2]``).

So a head is planes of rows of every token of the block in token order, which
``TokenPlanes`` describes, and a 64-token run of a 128-token block holds the
same bytes as a 64-token block. Because that rests on a measurement, not on
a documented contract, ``token_planes`` checks it at registration for this
engine's kernel: it writes random keys and values with vLLM's writer into
blocks of this size and of half and twice this size, rebuilds one from the
other with the planes, and compares bytes. Any difference (another kernel, a
vLLM that changed its layout) leaves the layout without planes, and a peer of
another block size is then refused by the compatibility check, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsm.transport.layout import TokenPlanes

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvsm.vllm.token_layout")


def planes_of(isa: str, head_size: int, element_size: int) -> TokenPlanes | None:
    """The planes of one head for a vLLM-CPU attention kernel, or None (not known)."""
    if isa in ("vec", "vec16"):  # (vec16: head sizes or block sizes of 16, not 32; the same layout)
        return TokenPlanes(planes=((head_size, element_size), (1, head_size * element_size)))
    if isa == "amx" and head_size % 16 == 0:
        return TokenPlanes(planes=((1, head_size * element_size), (head_size // 16, 16 * element_size)), align=16)
    return None


def _write(isa: str, dtype: torch.dtype, heads: int, head_size: int, block_size: int, tokens: int) -> Any:
    """Blocks of ``block_size`` holding ``tokens`` random keys and values (seeded),
    written by vLLM's own CPU cache writer."""
    import torch
    from vllm import _custom_ops as ops

    blocks = -(-tokens // block_size)
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, block_size * 2, head_size).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(1234)
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(tokens), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return cache


def planes_hold(planes: TokenPlanes, isa: str, dtype: torch.dtype, heads: int, head_size: int,
                small: int, big: int) -> bool:
    """Whether blocks of ``big`` tokens, rebuilt from blocks of ``small`` by the
    planes, equal the ones vLLM's writer fills directly (the same tokens)."""
    import torch

    tokens = 2 * big
    src = _write(isa, dtype, heads, head_size, small, tokens)
    want = _write(isa, dtype, heads, head_size, big, tokens)
    src_bytes = src.view(torch.uint8).reshape(src.shape[0], -1).numpy()
    want_bytes = want.view(torch.uint8).reshape(want.shape[0], -1).numpy()
    rebuilt = np.zeros_like(want_bytes)
    per = big // small

    head_small, head_big = planes.head_bytes(small), planes.head_bytes(big)
    if head_small * heads != src_bytes.shape[1] or head_big * heads != want_bytes.shape[1]:
        return False
    whole = planes.runs(small, small, 0, head_small, range(heads)).tolist()
    # Segment k's runs are the same in every block: one table per segment.
    parts = [planes.runs(big, small, k, head_big, range(heads)).tolist() for k in range(per)]
    for j in range(want_bytes.shape[0]):
        for k, part in enumerate(parts):
            for (to, n), (fro, _) in zip(part, whole):
                rebuilt[j, to:to + n] = src_bytes[j * per + k, fro:fro + n]
    return bool((rebuilt == want_bytes).all())


def token_planes(kv_caches: dict[str, torch.Tensor], isa: str | None, head_size: int,
                 block_size: int) -> tuple[dict[str, tuple[int, TokenPlanes]], str]:
    """Per attention layer its tokens per block and planes, and the layout's name
    for the compatibility check ("" and no layers: blocks move whole only, so
    the peer's block size must equal this one's)."""
    first = next(iter(kv_caches.values()))
    if isa is None or first.device.type != "cpu" or first.dim() != 4 or first.shape[2] != block_size:
        return {}, ""
    heads, elt = int(first.shape[1]), first.element_size()
    planes = planes_of(isa, head_size, elt)
    if planes is None:
        return {}, ""
    try:
        half_ok = block_size % (32 if isa == "vec16" else 64) == 0  # the half must be a size this kernel takes
        checks = [(block_size // 2, block_size)] if half_ok else []
        checks.append((block_size, 2 * block_size))
        ok = all(planes_hold(planes, isa, first.dtype, heads, head_size, s, b) for s, b in checks)
    except Exception as e:  # noqa: BLE001 - a vLLM without the writer, or one that refuses these sizes
        log.info("kvsm: cannot check the %s kernel's block layout (%s: %s); blocks move whole only",
                 isa, type(e).__name__, e)
        return {}, ""
    if not ok:
        log.warning("kvsm: vLLM's %s attention kernel does not lay blocks out as kvsm expects; engines of "
                    "other block sizes will be refused", isa)
        return {}, ""
    # Named by the layout, not the kernel: vec and vec16 (which vLLM picks by block and head size) agree.
    name = "cpu:" + ",".join(f"{rows}x{tb}" for rows, tb in planes.planes) + f"/{planes.align}"
    return {layer: (block_size, planes) for layer in kv_caches}, name


def cpu_attention_isa(layer: Any, dtype: torch.dtype, block_size: int, head_size: int,
                      cache_dtype: str) -> str | None:
    """The kernel vLLM-CPU's attention uses for this layer (None: not vLLM-CPU's
    attention, or a quantised cache)."""
    if cache_dtype not in ("auto", ""):
        return None
    isa = getattr(getattr(layer, "impl", None), "isa", None) or getattr(layer, "isa", None)
    if isinstance(isa, str):
        return isa
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))
    except Exception:  # noqa: BLE001 - not a layout kvsm can describe
        return None
