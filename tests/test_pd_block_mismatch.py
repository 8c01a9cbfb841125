"""Block sizes that differ between prefill and decode: read in segments, never wrong.

vLLM-CPU lays a block's bytes out by its kernel (the vec kernel keeps K
transposed per head, the AMX one in 16-token tiles), so a 128-token block is
not two 64-token blocks as bytes (upstream here delivers 4 wrong outputs of 5
at 64 -> 128, with no error). kvsm describes where each token of a block
lives (``kvsm.token_layout``, checked against vLLM's own cache writer at
start) and reads each pair of blocks in segments of the smaller size.

Offline pairs 64 -> 128 and 128 -> 64 on real engines (the KV-sensitive tiny
Llama, float32: the ``vec`` kernel) and 64 -> 128 with the bfloat16 tiny
Qwen3 (the ``amx`` kernel on a CPU with AMX tiles): every output equals a single engine's,
every prompt token came by transfer, a local prefix hit on the decode side
reads only the rest, a corrupted transfer changes the output, nothing stays
held on either side, and the replay is clean, its ``matched`` records saying
how the blocks were paired.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.replay import analyse
from kvsm.testing.engine import run_engine_subprocess, wait_engine_subprocess
from kvsm.testing.pd_pair import PDEngine
from kvsm.testing.ports import free_port_run
from kvsm.testing.reliability import wait_until
from kvsm.testing.tiny_model import build_tiny_model, vllm_args

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
RNG = random.Random(77)


def _prompt(n: int) -> list[int]:
    return [RNG.randrange(10, 1100) for _ in range(n)]


# Partial last blocks of either size (300 = 2 x 128 + 44 = 4 x 64 + 44; 100 < 128; 31 < 64).
PROMPTS = [_prompt(300), _prompt(100), _prompt(31)]
# Shares PROMPTS[0]'s first 256 tokens: two 128-token or four 64-token blocks, cached on
# the decode side once PROMPTS[0] went through it.
PREFIX_HIT = PROMPTS[0][:256] + _prompt(60)
FRESH = _prompt(200)  # for the corruption test, never seen before
ALL = [*PROMPTS, PREFIX_HIT, FRESH]


class Pair:
    def __init__(self, tmp: Path, kind: str, p_block: int, d_block: int) -> None:
        model = build_tiny_model(kind=kind)
        kw = vllm_args(kind)
        # bfloat16 rounding depends on the batch: then every engine runs one prompt per call.
        self.one_by_one = kw.get("dtype") == "bfloat16"
        self.logs = tmp / "logs"
        self.blocks = (p_block, d_block)
        ref = run_engine_subprocess("reference", model, ALL, MAX_TOKENS, workdir=tmp / "ref",
                                    extra_args=["--llm-kwargs", json.dumps({**kw, "block_size": d_block}),
                                                *(["--one-by-one"] if self.one_by_one else [])])
        base = free_port_run(4)
        self.prefill = PDEngine("prefill", "kv_producer", model=model, port=base, engine_id="prefill-b",
                                log_dir=self.logs, workdir=tmp, cpu=0, llm_kwargs={**kw, "block_size": p_block})
        self.decode = PDEngine("decode", "kv_consumer", model=model, port=base + 2, engine_id="decode-b",
                               log_dir=self.logs, workdir=tmp, cpu=1, llm_kwargs={**kw, "block_size": d_block})
        self.reference = dict(zip(map(tuple, ALL), wait_engine_subprocess(ref)["outputs"]))

    def prefill_params(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        if not self.one_by_one:
            return self.prefill.prefill_params(prompts)
        return [self.prefill.prefill_params([p])[0] for p in prompts]

    def generate(self, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.one_by_one:
            return self.decode.generate(prompts, MAX_TOKENS, params)
        return [self.decode.generate([p], MAX_TOKENS, [kv])[0] for p, kv in zip(prompts, params)]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


# The float32 tiny Llama runs vLLM-CPU's vec kernel; the bfloat16 tiny Qwen3 its amx
# kernel on a CPU with AMX tiles (this machine's), the vec one elsewhere.
@pytest.fixture(scope="module", params=[("llama", 64, 128), ("llama", 128, 64), ("qwen3", 64, 128)],
                ids=["p64-to-d128", "p128-to-d64", "bf16-p64-to-d128"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    kind, p_block, d_block = request.param
    pair = Pair(tmp_path_factory.mktemp(f"pd-blocks-{kind}-{p_block}-{d_block}"), kind, p_block, d_block)
    try:
        yield pair
    finally:
        pair.close()


def _records(logs: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(logs.glob(pattern)) for line in f.read_text().splitlines()
            if line.strip()]


def _matched(logs: Path) -> list[dict[str, Any]]:
    return [r["input"] for r in _records(logs, "decode-b.worker.*.jsonl")
            if r.get("kind") == "transition" and r.get("event") == "matched"]


def test_outputs_equal_a_single_engine_and_every_prompt_token_came_by_transfer(pair: Pair) -> None:
    params = pair.prefill_params(PROMPTS)
    assert [p["remote_block_size"] for p in params] == [pair.blocks[0]] * len(PROMPTS)
    outs = pair.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out["finish_reason"] == "length", out
        assert out["token_ids"] == pair.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        assert out["num_cached_tokens"] == len(prompt), f"{len(prompt)}-token prompt"
    p_block, d_block = pair.blocks
    wait_until(lambda: len(_matched(pair.logs)) >= len(PROMPTS), 10, "the decode worker's matched records")
    said = [m["segments"] for m in _matched(pair.logs)]
    assert all(f"prefill blocks of {p_block} tokens into blocks of {d_block}" in s for s in said), said


def test_a_local_prefix_hit_reads_only_the_rest(pair: Pair) -> None:
    (params,) = pair.prefill_params([PROMPTS[0]])
    (first,) = pair.generate([PROMPTS[0]], [params])  # caches its full blocks here
    assert first["token_ids"] == pair.reference[tuple(PROMPTS[0])]
    (params,) = pair.prefill_params([PREFIX_HIT])
    (out,) = pair.generate([PREFIX_HIT], [params])
    assert out["token_ids"] == pair.reference[tuple(PREFIX_HIT)]
    assert out["num_cached_tokens"] == len(PREFIX_HIT)
    wait_until(lambda: any(m["num_tokens"] == len(PREFIX_HIT) - 256 for m in _matched(pair.logs)), 10,
               "a matched record for the 60 tokens past the local hit")
    (last,) = [m for m in _matched(pair.logs) if m["num_tokens"] == len(PREFIX_HIT) - 256]
    unit = min(pair.blocks)
    assert last["segments"].startswith(f"{-(-60 // unit)} segments of {unit} tokens"), last


def test_a_corrupted_transfer_changes_the_output(pair: Pair) -> None:
    (params,) = pair.prefill_params([FRESH])
    pair.prefill.request({"op": "corrupt", "block_ids": params["remote_block_ids"][0]})
    (out,) = pair.generate([FRESH], [params])
    assert out["num_cached_tokens"] == len(FRESH)  # it did come by transfer
    assert out["token_ids"] != pair.reference[tuple(FRESH)], "a corrupted transfer went unnoticed"


def test_nothing_stays_held_and_the_replay_is_clean(pair: Pair) -> None:
    def settled() -> bool:
        return (pair.prefill.request({"op": "state"})["worker"]["send"] == {}
                and pair.decode.request({"op": "state"})["worker"]["recv"] == {})

    wait_until(settled, 10, "no live machine on either side")
    pair.close()
    report = analyse(sorted(pair.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    recv = [m for m in report.machines if m.lifecycle == "recv"]
    assert len(recv) == len(PROMPTS) + 3 and {m.final_state for m in recv} == {"done"}
