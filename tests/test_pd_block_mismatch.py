"""Block sizes that differ between prefill and decode: read in segments, never wrong.

vLLM-CPU lays a block's bytes out by its kernel (the vec kernel keeps K
transposed per head, the AMX one in 16-token tiles), so a 128-token block is
not two 64-token blocks as bytes (upstream here delivers 4 wrong outputs of 5
at 64 -> 128, with no error). kvsm describes where each token of a block
lives (``kvsm.vllm.token_layout``, checked against vLLM's own cache writer at
start) and reads each pair of blocks in segments of the smaller size.

Offline pairs of ``kv_both`` engines on real engines: the KV-sensitive tiny
Llama (float32: the ``vec`` kernel) with blocks of 64 tokens on one engine and
128 on the other, used both ways (64 -> 128, then 128 -> 64, each way with
prompts of its own), and 64 -> 128 with the bfloat16 tiny Qwen3 (the ``amx``
kernel on a CPU with AMX tiles). Each way: every output equals a single
engine's (the decode engine's own, computed apart from its prefix cache with a
``cache_salt``), every prompt token came by transfer, a local prefix hit on the
decode side reads only the rest, a corrupted transfer changes the output,
nothing stays held on either side, and the replay is clean, its ``matched``
records saying how the blocks were paired.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.replay import analyse
from kvsm_testing.both_ways import BothWays
from kvsm_testing.pd_pair import PDEngine, started
from kvsm_testing.ports import free_port_run
from kvsm_testing.reliability import wait_until
from kvsm_testing.tiny_model import build_tiny_model, vllm_args

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
RNG = random.Random(77)


def _prompt(n: int) -> list[int]:
    return [RNG.randrange(10, 1100) for _ in range(n)]


class Prompts:
    """One way's prompts: no engine finds another way's in its prefix cache."""

    def __init__(self) -> None:
        # Partial last blocks of either size (300 = 2 x 128 + 44 = 4 x 64 + 44; 100 < 128; 31 < 64).
        self.transfer = [_prompt(300), _prompt(100), _prompt(31)]
        # Shares transfer[0]'s first 256 tokens: two 128-token or four 64-token blocks, cached on
        # the decode side once transfer[0] went through it.
        self.prefix_hit = self.transfer[0][:256] + _prompt(60)
        self.fresh = _prompt(200)  # for the corruption test, never seen before
        self.all = [*self.transfer, self.prefix_hit, self.fresh]


WAYS = {"forward": Prompts(), "backward": Prompts()}


class Pair(BothWays):
    """Two ``kv_both`` engines, A with blocks of ``blocks[0]`` tokens and B with
    ``blocks[1]``: "forward" prefills on A and decodes on B, "backward" the other
    way round (only the ``ways`` given are tested)."""

    def __init__(self, tmp: Path, kind: str, blocks: tuple[int, int], ways: tuple[str, ...]) -> None:
        model = build_tiny_model(kind=kind)
        kw = vllm_args(kind)
        # bfloat16 rounding depends on the batch: then every engine runs one prompt per call.
        self.one_by_one = kw.get("dtype") == "bfloat16"
        self.ways = ways
        base = free_port_run(4)
        ids = (f"a-b{blocks[0]}", f"b-b{blocks[1]}")
        super().__init__(started(*(
            PDEngine(name, "kv_both", model=model, port=base + 2 * i, engine_id=ids[i], log_dir=tmp / "logs",
                     workdir=tmp, cpu=i, llm_kwargs={**kw, "block_size": block}, wait=False)
            for i, (name, block) in enumerate(zip(("a", "b"), blocks)))), blocks, ids, tmp / "logs")
        # Each way's references, computed by its decode engine before anything is read into it.
        self.reference: dict[tuple[int, ...], list[int]] = {}
        for way in ways:
            prompts = WAYS[way].all
            outs = self._run(self.decode(way), prompts, [None] * len(prompts), f"reference-{way}")
            self.reference.update(zip(map(tuple, prompts), (o["token_ids"] for o in outs)))

    def _run(self, engine: PDEngine, prompts: list[list[int]], params: list[dict[str, Any] | None],
             cache_salt: str | None = None) -> list[dict[str, Any]]:
        if not self.one_by_one:
            return engine.generate(prompts, MAX_TOKENS, params, cache_salt=cache_salt)
        return [engine.generate([p], MAX_TOKENS, [kv], cache_salt=cache_salt)[0] for p, kv in zip(prompts, params)]

    def prefill_params(self, way: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
        if not self.one_by_one:
            return self.prefill(way).prefill_params(prompts)
        return [self.prefill(way).prefill_params([p])[0] for p in prompts]

    def generate(self, way: str, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._run(self.decode(way), prompts, list(params))



# The float32 tiny Llama runs vLLM-CPU's vec kernel; the bfloat16 tiny Qwen3 its amx
# kernel on a CPU with AMX tiles (this machine's), the vec one elsewhere.
@pytest.fixture(scope="module", params=[("llama", (64, 128), ("forward", "backward")),
                                        ("qwen3", (64, 128), ("forward",))],
                ids=["b64-b128-both-ways", "bf16-p64-to-d128"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    kind, blocks, ways = request.param
    pair = Pair(tmp_path_factory.mktemp(f"pd-blocks-{kind}-{blocks[0]}-{blocks[1]}"), kind, blocks, ways)
    try:
        yield pair
    finally:
        pair.close()


def _matched(pair: Pair, way: str) -> list[dict[str, Any]]:
    return [r["input"] for r in pair.records(f"{pair.decode_id(way)}.worker.*.jsonl")
            if r.get("kind") == "transition" and r.get("event") == "matched"]


def test_outputs_equal_a_single_engine_and_every_prompt_token_came_by_transfer(pair: Pair) -> None:
    for way in pair.ways:
        prompts = WAYS[way].transfer
        p_block, d_block = pair.block_sizes(way)
        params = pair.prefill_params(way, prompts)
        assert [p["remote_block_size"] for p in params] == [p_block] * len(prompts)
        outs = pair.generate(way, prompts, params)
        for prompt, out in zip(prompts, outs):
            assert out["finish_reason"] == "length", out
            assert out["token_ids"] == pair.reference[tuple(prompt)], f"{way}: {len(prompt)}-token prompt"
            assert out["num_cached_tokens"] == len(prompt), f"{way}: {len(prompt)}-token prompt"
        n = len(prompts)
        wait_until(lambda way=way, n=n: len(_matched(pair, way)) >= n, 10,
                   "the decode worker's matched records")
        said = [m["segments"] for m in _matched(pair, way)]
        assert all(f"prefill blocks of {p_block} tokens into blocks of {d_block}" in s for s in said), (way, said)


def test_a_local_prefix_hit_reads_only_the_rest(pair: Pair) -> None:
    for way in pair.ways:
        ps = WAYS[way]
        (params,) = pair.prefill_params(way, [ps.transfer[0]])
        (first,) = pair.generate(way, [ps.transfer[0]], [params])  # caches its full blocks here
        assert first["token_ids"] == pair.reference[tuple(ps.transfer[0])]
        (params,) = pair.prefill_params(way, [ps.prefix_hit])
        (out,) = pair.generate(way, [ps.prefix_hit], [params])
        assert out["token_ids"] == pair.reference[tuple(ps.prefix_hit)]
        assert out["num_cached_tokens"] == len(ps.prefix_hit)
        rest = len(ps.prefix_hit) - 256
        wait_until(lambda way=way, rest=rest: any(m["num_tokens"] == rest for m in _matched(pair, way)), 10,
                   "a matched record for the 60 tokens past the local hit")
        (last,) = [m for m in _matched(pair, way) if m["num_tokens"] == rest]
        unit = min(pair.blocks)
        assert last["segments"].startswith(f"{-(-60 // unit)} segments of {unit} tokens"), (way, last)


def test_a_corrupted_transfer_changes_the_output(pair: Pair) -> None:
    for way in pair.ways:
        fresh = WAYS[way].fresh
        (params,) = pair.prefill_params(way, [fresh])
        pair.prefill(way).request({"op": "corrupt", "block_ids": params["remote_block_ids"][0]})
        (out,) = pair.generate(way, [fresh], [params])
        assert out["num_cached_tokens"] == len(fresh)  # it did come by transfer
        assert out["token_ids"] != pair.reference[tuple(fresh)], f"{way}: a corrupted transfer went unnoticed"


def test_nothing_stays_held_and_the_replay_is_clean(pair: Pair) -> None:
    def settled() -> bool:
        return all(e.request({"op": "state"})["worker"][side] == {} for e in pair.engines for side in ("send", "recv"))

    wait_until(settled, 10, "no live machine on either side")
    pair.close()
    report = analyse(sorted(pair.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    recv = [m for m in report.machines if m.lifecycle == "recv"]
    assert len(recv) == (len(WAYS["forward"].transfer) + 3) * len(pair.ways), len(recv)
    assert {m.final_state for m in recv} == {"done"}
