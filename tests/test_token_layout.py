"""Blocks of different sizes read in segments: the token layout of vLLM-CPU's
kernels, checked against vLLM's own cache writer, and real NIXL reads of
segments between two agents.

``kvsm.vllm.token_layout`` says where each token of a block lives for the ``vec``
and ``amx`` kernels; here vLLM's writer (``cpu_attn_reshape_and_cache``)
fills blocks of one size, NIXL reads them segment by segment into blocks of
another, and the result must equal what the writer puts in blocks of that
size directly. Wrong planes must fail the same check (it can tell).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from conftest import require

require("vllm")
require("nixl._api")
torch = require("torch")

from kvsm.handshake import CompatInfo, compat_hash, compat_mismatch
from kvsm.scheduler.block_pairing import pair_segments as _pair_segments
from kvsm.transport.base import TransferState
from kvsm.transport.layout import KVLayout, Segments, TokenPlanes, describe_kv_caches
from kvsm.transport.nixl import NixlTransport
from kvsm.vllm.token_layout import _write, planes_hold, planes_of, token_planes

HEADS, HEAD = 2, 32
KERNELS = [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.float32)]
if torch.cpu._is_amx_tile_supported():
    torch.cpu._init_amx()
    KERNELS.append(("amx", torch.bfloat16))


@pytest.mark.parametrize(("isa", "dtype"), KERNELS, ids=[f"{i}-{str(d)[6:]}" for i, d in KERNELS])
@pytest.mark.parametrize(("small", "big"), [(32, 64), (64, 128), (32, 128)])
def test_the_planes_rebuild_the_writers_blocks_of_another_size(isa: str, dtype: Any, small: int, big: int) -> None:
    planes = planes_of(isa, HEAD, torch.empty(0, dtype=dtype).element_size())
    assert planes is not None
    assert planes_hold(planes, isa, dtype, HEADS, HEAD, small, big)


@pytest.mark.parametrize(("isa", "dtype"), KERNELS, ids=[f"{i}-{str(d)[6:]}" for i, d in KERNELS])
def test_wrong_planes_fail_the_check(isa: str, dtype: Any) -> None:
    elt = torch.empty(0, dtype=dtype).element_size()
    token_major = TokenPlanes(planes=((1, 2 * HEAD * elt),))  # what the tensor's shape would suggest
    other = planes_of("vec" if isa == "amx" else "amx", HEAD, elt)
    assert other is not None
    for wrong in (token_major, other):
        assert not planes_hold(wrong, isa, dtype, HEADS, HEAD, 64, 128), wrong


def test_token_planes_names_the_layout_or_declines() -> None:
    caches = {"l0": torch.zeros(4, HEADS, 64, 2 * HEAD), "l1": torch.zeros(4, HEADS, 64, 2 * HEAD)}
    tokens, name = token_planes(caches, "vec", HEAD, 64)
    assert name == f"cpu:{HEAD}x4,1x{HEAD * 4}/1" and set(tokens) == {"l0", "l1"}
    assert token_planes(caches, "vec16", HEAD, 64)[1] == name  # the same layout, whichever vLLM picks
    assert tokens["l0"][0] == 64
    assert token_planes(caches, None, HEAD, 64) == ({}, "")  # not vLLM-CPU's attention
    assert token_planes(caches, "neon", HEAD, 64) == ({}, "")  # a kernel kvsm has not measured
    assert token_planes(caches, "vec", HEAD, 128) == ({}, "")  # the tensor is not of that block size


# -- real NIXL reads of segments --------------------------------------------------------------


def _layout(caches: dict[str, Any], block: int, planes: TokenPlanes, heads: int | None = None) -> KVLayout:
    return describe_kv_caches(caches, tokens={k: (block, planes) for k in caches},
                              heads={k: heads for k in caches} if heads else None)


def _read(src: NixlTransport, dst: NixlTransport, local: list[int], remote: list[int], segments: Segments,
          **heads: Any) -> None:
    peer = dst.add_peer(src.metadata())
    h = dst.post_read(peer, local, remote, b"done", segments=segments, **heads)
    end = time.monotonic() + 10
    while dst.check(h) is TransferState.PENDING and time.monotonic() < end:
        src.get_notifs()  # (one process plays both sides: the sender must progress too)
        time.sleep(0.005)
    assert dst.check(h) is TransferState.DONE, getattr(h, "error", "")
    assert dst.release(h)


@pytest.mark.parametrize(("p_block", "d_block"), [(64, 128), (128, 64)])
def test_a_nixl_read_in_segments_fills_blocks_as_the_writer_would(p_block: int, d_block: int) -> None:
    planes = planes_of("vec", HEAD, 4)
    assert planes is not None
    tokens = 256
    prefill = {f"l{i}": _write("vec", torch.float32, HEADS, HEAD, p_block, tokens) * (i + 1) for i in range(2)}
    want = {f"l{i}": _write("vec", torch.float32, HEADS, HEAD, d_block, tokens) * (i + 1) for i in range(2)}
    n_d = tokens // d_block
    decode = {k: torch.zeros(n_d + 1, HEADS, d_block, 2 * HEAD) for k in prefill}  # block 0 stays untouched
    unit = min(p_block, d_block)
    pairs = [(1 + t // d_block, (t % d_block) // unit, t // p_block, (t % p_block) // unit)
             for t in range(0, tokens, unit)]
    with NixlTransport("seg-p", _layout(prefill, p_block, planes)) as p, \
            NixlTransport("seg-d", _layout(decode, d_block, planes)) as d:
        _read(p, d, [x[0] for x in pairs], [x[2] for x in pairs],
              Segments(unit, tuple(x[1] for x in pairs), tuple(x[3] for x in pairs), d_block, p_block))
    for k in decode:
        assert torch.equal(decode[k][1:], want[k]), k
        assert not decode[k][0].any()


def test_a_segment_read_takes_one_rank_s_heads() -> None:
    """Tensor parallel sizes differ too: a decode rank of 1 head reads head 1 of 2."""
    planes = planes_of("vec", HEAD, 4)
    assert planes is not None
    prefill = {"l0": _write("vec", torch.float32, HEADS, HEAD, 64, 128)}
    want = _write("vec", torch.float32, HEADS, HEAD, 128, 128)
    decode = {"l0": torch.zeros(1, 1, 128, 2 * HEAD)}
    with NixlTransport("head-p", _layout(prefill, 64, planes, HEADS)) as p, \
            NixlTransport("head-d", _layout(decode, 128, planes, 1)) as d:
        _read(p, d, [0, 0], [0, 1], Segments(64, (0, 1), (0, 0), 128, 64), remote_heads=(1, 1, 2))
    assert torch.equal(decode["l0"][0, 0], want[0, 1])


def test_reads_across_block_sizes_that_cannot_be_done_are_refused_by_name() -> None:
    planes = planes_of("vec", HEAD, 4)
    assert planes is not None
    prefill = {"l0": torch.zeros(4, HEADS, 64, 2 * HEAD)}
    decode = {"l0": torch.zeros(2, HEADS, 128, 2 * HEAD)}
    with NixlTransport("bad-p", _layout(prefill, 64, planes)) as p, \
            NixlTransport("bad-d", _layout(decode, 128, planes)) as d:
        peer = d.add_peer(p.metadata())
        with pytest.raises(ValueError, match="must go in segments"):
            d.post_read(peer, [0], [0], b"")  # whole blocks across sizes: never
        with pytest.raises(ValueError, match="hold 64 tokens, not 128"):
            d.post_read(peer, [0], [0], b"", segments=Segments(128, (0,), (0,), 128, 128))
        with pytest.raises(ValueError, match="segment index out of range"):
            d.post_read(peer, [0], [0], b"", segments=Segments(64, (2,), (0,), 128, 64))
    whole = describe_kv_caches(decode)  # no token layout: whole blocks only
    with pytest.raises(ValueError, match="move whole only"):
        whole.check_segments(128, 64)


def test_layouts_of_other_block_sizes_agree_only_on_one_token_layout() -> None:
    vec, amx = planes_of("vec", HEAD, 4), planes_of("amx", HEAD, 4)
    assert vec is not None and amx is not None
    a = _layout({"l0": torch.zeros(4, HEADS, 64, 2 * HEAD)}, 64, vec)
    b = _layout({"l0": torch.zeros(2, HEADS, 128, 2 * HEAD)}, 128, vec)
    c = _layout({"l0": torch.zeros(2, HEADS, 128, 2 * HEAD)}, 128, amx)
    assert a.mismatch(b) is None
    assert "block_bytes" in (a.mismatch(c) or "")
    assert "block_bytes" in (a.mismatch(describe_kv_caches({"l0": torch.zeros(2, HEADS, 128, 2 * HEAD)})) or "")


def test_the_compatibility_check_ignores_block_size_only_between_named_token_layouts() -> None:
    base = CompatInfo(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_size=32, block_size=64,
                      kv_layout="block-major HxTx64", token_layout="cpu:32x4,1x128/1")
    other = msgspec.structs.replace(base, block_size=128)
    assert compat_hash(base) == compat_hash(other) and compat_mismatch(base, other) == []
    amx = msgspec.structs.replace(other, token_layout="cpu:1x128,2x64/16")
    assert compat_hash(base) != compat_hash(amx)
    assert compat_mismatch(base, amx) == [f"token_layout: {base.token_layout!r} here, {amx.token_layout!r} "
                                          f"on the peer"]
    plain = msgspec.structs.replace(base, token_layout="", kv_layout="block-major Hx64x64")
    lines = compat_mismatch(plain, msgspec.structs.replace(plain, block_size=128))
    assert lines == ["block_size: 64 here, 128 on the peer"], lines


# -- the scheduler's pairing --------------------------------------------------------------------


def _blocks(ids: list[int], hits: int = 0) -> list[Any]:
    return [SimpleNamespace(block_id=b, block_hash=("h", b) if i < hits else None, is_null=False)
            for i, b in enumerate(ids)]


def test_pairing_fills_every_new_local_block_from_the_prefill_blocks_holding_its_tokens() -> None:
    # 300 tokens: prefill blocks of 64 (5 of them), decode blocks of 128 (3).
    local, remote, fields, problem = _pair_segments(_blocks([7, 8, 9]), (10, 11, 12, 13, 14), 128, 64, 300)
    assert problem == ""
    assert local == (7, 7, 8, 8, 9) and remote == (10, 11, 12, 13, 14)
    assert fields == {"segment_tokens": 64, "local_segments": (0, 1, 0, 1, 0),
                      "remote_segments": (0, 0, 0, 0, 0), "block_sizes": (128, 64)}
    # The other way, with a local prefix hit of three 64-token blocks: tokens 192..299 are read.
    local, remote, fields, problem = _pair_segments(_blocks([1, 2, 3, 4, 5], hits=3), (20, 21, 22), 64, 128,
                                                    108)
    assert problem == "" and local == (4, 5) and remote == (21, 22)
    assert fields["local_segments"] == (0, 0) and fields["remote_segments"] == (1, 0)


def test_pairing_names_tokens_the_prefill_side_does_not_hold() -> None:
    _, _, _, problem = _pair_segments(_blocks([7, 8]), (10, 11), 128, 64, 200)
    assert "tokens 128..191 are to be loaded, but the prefill side has no block there" in problem
    _, _, _, problem = _pair_segments(_blocks([7]), (10,), 96, 64, 64)
    assert "one must divide the other" in problem
