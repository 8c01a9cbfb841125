"""Streamed push (transfer_mode "stream") when vLLM preempts the prefill mid-stream.

Real engines, the tiny Llama: the prefill engine's KV cache holds BLOCKS blocks
of 128 tokens and computes at most 64 tokens of each prompt per step (chunked
prefill, ``long_prefill_token_threshold``), so three 450-token prompts (four
blocks each) run side by side until the cache is full, and vLLM's scheduler
preempts the latest: it frees that request's blocks at once (another may
compute into them the next step) and computes it again later into new ones.

What may happen to the preempted request, and what each must look like:

* every write of it was seen over before the free (``stream_preempted`` with
  no ``unsure`` rank): it streams on from its new blocks, and the decode
  request gets every prompt token by the writes;
* a write was still reading the freed blocks (``[writes_unsure]``): that decode
  rank is written again whole from the new blocks once those writes are over
  (``worker.stream_rewrite``), and the decode request gets every prompt token
  by the writes too. (Were one to fail, the decode engine computes the prompt
  itself: ``kv_load_failure_policy`` ``recompute``; the outputs would still
  match, the token count not.)

Either way the outputs equal a single engine's, nothing is held afterwards,
and the replay of both engines is clean. Which of the two happens depends on
timing; the test asserts a preemption happened and that the outcome matches it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.handoff.facts import PRODUCER_KEY
from kvsm.handshake.messages import PROTOCOL_VERSION
from kvsm_testing import build_tiny_model
from kvsm_testing.pd_pair import PDEngine, engine_records, matched_tokens, replay_stopped_pair, started, stream_pairs
from kvsm_testing.ports import free_port_run
from kvsm_testing.reliability import wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
BLOCK = 128
BLOCKS = 8  # the prefill engine's whole KV cache: two 450-token prompts and a half
RNG = random.Random(20261208)
WARM = [RNG.randrange(10, 1100) for _ in range(100)]
PROMPTS = [[RNG.randrange(10, 1100) for _ in range(450)] for _ in range(3)]


class Pair:
    def __init__(self, tmp: Path) -> None:
        model = build_tiny_model()
        self.logs = tmp / "logs"
        base = free_port_run(4)
        self.prefill, self.decode = started(
            PDEngine("prefill", "kv_producer", model=model, port=base, engine_id="prefill-pp", log_dir=self.logs,
                     workdir=tmp, cpu=0, wait=False,
                     llm_kwargs={"max_num_batched_tokens": 192, "long_prefill_token_threshold": 64,
                                 "enable_chunked_prefill": True, "num_gpu_blocks_override": BLOCKS}),
            PDEngine("decode", "kv_consumer", model=model, port=base + 2, engine_id="decode-pp", log_dir=self.logs,
                     workdir=tmp, cpu=1, wait=False, extra={"kv_load_failure_policy": "recompute"}))
        refs = self.decode.generate(PROMPTS, MAX_TOKENS, cache_salt="reference")
        self.reference = {tuple(p): o["token_ids"] for p, o in zip(PROMPTS, refs, strict=True)}
        self.coordinates = {"remote_engine_id": "prefill-pp", "remote_host": "127.0.0.1", "remote_port": base,
                            "tp_size": 1, "pp_size": 1, PRODUCER_KEY: PROTOCOL_VERSION, "remote_block_size": BLOCK}

    def stream(self, prompts: list[list[int]]) -> tuple[list[str], list[dict[str, Any]]]:
        """The decode legs a little ahead (a busy prefill engine)."""
        return stream_pairs(self.prefill, self.decode, prompts, MAX_TOKENS, self.coordinates, decode_first_s=0.3)

    def records(self, engine: str) -> list[dict[str, Any]]:
        return engine_records(self.logs, engine)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("stream-preempt"))
    try:
        yield p
    finally:
        p.close()


def test_a_prefill_preempted_mid_stream_ends_right_either_way(pair: Pair) -> None:
    pair.stream([WARM])  # (the decode worker knows the prefill agent: the asks come early)
    keys, outs = pair.stream(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["token_ids"] == pair.reference[tuple(prompt)]

    def prefill_settled() -> list[dict[str, Any]] | None:  # the prefill log, once every request's send machine ended
        records = pair.records("prefill-pp")
        ended = {r["req"] for r in records if r.get("lifecycle") == "send" and r.get("dst") == "released"}
        mine = {r["req"] for r in records if r.get("event") == "worker.stream_key" and r["key"] in keys}
        return records if len(mine) == len(keys) and mine <= ended else None

    prefill = wait_until(prefill_settled, 5, "every streamed prefill released in its log")
    said = [r for r in prefill if r.get("event") == "sched.stream_preempted"]
    assert said, "vLLM preempted no streamed prefill: the test's engine no longer fills its KV cache"
    # The send table heard each preemption, with the ranks whose writes were unsure.
    heard: dict[str, bool] = {}  # request -> a preemption of it found a write unsure (it may come more than once)
    for r in prefill:
        if r.get("event") == "stream_preempted":
            heard[r["req"]] = heard.get(r["req"], False) or bool(r["input"]["unsure"])
    assert heard, [r.get("event") for r in prefill]
    key_of = {r["req"]: r["key"] for r in prefill if r.get("event") == "worker.stream_key"}

    def decode_ends() -> dict[str, str] | None:  # join key -> its decode request's recv machine's end
        records = [r for r in pair.records("decode-pp") if r.get("lifecycle") == "recv"]
        req_of = {r["input"]["remote_req"]: r["req"] for r in records if r.get("event") == "matched"}
        last = {r["req"]: r["dst"] for r in records if r.get("kind") == "transition"}
        ends = {k: last.get(req_of.get(k, ""), "") for k in keys}
        return ends if all(e in ("done", "failed") for e in ends.values()) else None

    ends = wait_until(decode_ends, 5, "every decode request ended in its log")
    matched = matched_tokens(pair.logs, "decode-pp", keys)
    rewritten = {r["req"] for r in prefill if r.get("event") == "worker.stream_rewrite"}
    for req, unsure in heard.items():
        key = key_of[req]
        # Streamed on from its new blocks, or written again whole: every prompt token by the writes.
        assert ends[key] == "done" and matched[key] == 450, (req, unsure, ends, matched)
        assert (req in rewritten) == unsure, (req, unsure, rewritten)
    for key in set(keys) - {key_of[r] for r in heard}:  # the others were not disturbed
        assert ends[key] == "done" and matched[key] == 450, (key, ends, matched)


def test_nothing_is_held_and_the_replay_is_clean(pair: Pair) -> None:
    replay_stopped_pair(pair.prefill, pair.decode, pair.logs)
