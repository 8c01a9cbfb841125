"""Streamed push (transfer_mode "stream") for models of several KV cache groups.

Gemma 2 (sliding window of 128 beside full attention: two groups), Gemma 3
(three sliding-window layers to one global one: four groups of one layer each,
whose tensors overlay one buffer) and Llama 4 (three chunked local attention
layers, chunks of 128, to one global one), tiny random-weight models, on two
vLLM engines with KVSMConnector in two processes. The prefill engine computes
in chunks of CHUNK tokens, so vLLM frees a windowed group's early blocks
mid-prompt (``remove_skipped_blocks``): those positions are never written
(``StreamStep``'s ``UNWRITTEN``), the decode side reads only the window.

For each kind: the decode outputs equal a single engine's (the decode engine's
own, apart from its prefix cache), every prompt token came by the writes, the
prefill worker wrote while computing, a corrupted write changes the output,
nothing is held afterwards and the replay of both engines is clean.
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
from kvsm_testing.pd_pair import PDEngine, engine_records, matched_tokens, replay_stopped_pair, started, stream_pairs
from kvsm_testing.ports import free_port_run
from kvsm_testing.reliability import wait_until
from kvsm_testing.tiny_model import build_tiny_model, vllm_args

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
BLOCK = 128
CHUNK = 64
GROUPS = {"gemma2": 2, "gemma3": 4, "llama4": 4}
RNG = random.Random(20261207)


def _prompt(n: int) -> list[int]:
    return [RNG.randrange(10, 1100) for _ in range(n)]


# Longer than the window (its first blocks freed mid-prompt), about it, under it.
LONG, MID, SHORT = _prompt(450), _prompt(300), _prompt(100)
# SEEN is pulled first, so that the prefill engine caches its first two blocks; HIT
# shares them (a prefill prefix hit, written at the first step) and is streamed with
# those cached blocks corrupted.
SEEN = _prompt(256) + _prompt(30)
HIT = SEEN[:256] + _prompt(200)
PROMPTS = [LONG, MID, SHORT, HIT]


class StreamPair:
    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.model = build_tiny_model(kind=kind)
        self.logs = tmp / "logs"
        kw = vllm_args(kind)
        base = free_port_run(4)
        self.prefill, self.decode = started(
            PDEngine("prefill", "kv_producer", model=self.model, port=base, engine_id=f"prefill-{kind}",
                     log_dir=self.logs, workdir=tmp, cpu=0, wait=False,
                     llm_kwargs={**kw, "max_num_batched_tokens": CHUNK, "enable_chunked_prefill": True}),
            PDEngine("decode", "kv_consumer", model=self.model, port=base + 2, engine_id=f"decode-{kind}",
                     log_dir=self.logs, workdir=tmp, cpu=1, llm_kwargs=kw, wait=False))
        refs = self.decode.generate(PROMPTS, MAX_TOKENS, cache_salt="reference")
        self.reference = {tuple(p): o["token_ids"] for p, o in zip(PROMPTS, refs, strict=True)}
        self.coordinates = {"remote_engine_id": f"prefill-{kind}", "remote_host": "127.0.0.1",
                            "remote_port": base, "tp_size": 1, "pp_size": 1, PRODUCER_KEY: PROTOCOL_VERSION,
                            "remote_block_size": BLOCK}

    def stream(self, prompts: list[list[int]], *, decode_first_s: float = 0.0,
               cache_salt: str | None = None) -> tuple[list[str], list[dict[str, Any]]]:
        return stream_pairs(self.prefill, self.decode, prompts, MAX_TOKENS, self.coordinates,
                            groups=GROUPS[self.kind], decode_first_s=decode_first_s, cache_salt=cache_salt)

    def records(self, engine: str) -> list[dict[str, Any]]:
        return engine_records(self.logs, f"{engine}-{self.kind}")

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module", params=sorted(GROUPS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamPair]:
    p = StreamPair(request.param, tmp_path_factory.mktemp(f"stream-{request.param}"))
    try:
        yield p
    finally:
        p.close()


def test_outputs_equal_a_single_engine_and_every_prompt_token_is_written(pair: StreamPair) -> None:
    keys, (out,) = pair.stream([LONG], decode_first_s=0.3)
    more, outs = pair.stream([MID, SHORT])
    for prompt, o in zip([LONG, MID, SHORT], [out, *outs], strict=True):
        assert o["token_ids"] == pair.reference[tuple(prompt)], f"{pair.kind}: {len(prompt)}-token prompt"
        assert o["num_cached_tokens"] == len(prompt), f"{pair.kind}: {len(prompt)}-token prompt"
    matched = matched_tokens(pair.logs, f"decode-{pair.kind}", keys + more)
    assert [matched[k] for k in keys + more] == [len(LONG), len(MID), len(SHORT)]

    def written() -> dict[str, Any] | None:
        return next((r for r in pair.records("prefill") if r.get("event") == "worker.stream_written"
                     and r.get("key") == keys[0]), None)

    note = wait_until(written, 5, "the long prompt's stream written in the prefill log")
    # Asked before the prefill computed it, written over its chunks, layer by layer.
    steps = [r["event"] for r in pair.records("prefill") if r.get("lifecycle") == "send" and r["req"] == note["req"]]
    assert "stream_asked" in steps, steps
    assert note["steps"] == -(-len(LONG) // CHUNK) and note["writes"] >= 4, note
    said = [r for r in pair.records("prefill") + pair.records("decode")
            if r.get("event") in ("sched.stream_refused", "sched.params_ignored")]
    assert not said, said


def test_a_corrupted_streamed_write_changes_the_output(pair: StreamPair) -> None:
    """HIT's first two blocks come from the prefill engine's prefix cache (SEEN's,
    corrupted there): the streamed writes carry them and the output differs."""
    (params,) = pair.prefill.prefill_params([SEEN])
    pair.decode.generate([SEEN], MAX_TOKENS, [params], cache_salt="seen")
    blocks = sorted({b for ids in params["remote_block_ids"] for b in ids[:2] if b})
    pair.prefill.request({"op": "corrupt", "block_ids": blocks})
    keys, (out,) = pair.stream([HIT], decode_first_s=0.2, cache_salt="hit")
    assert matched_tokens(pair.logs, f"decode-{pair.kind}", keys)[keys[0]] == len(HIT)
    assert out["token_ids"] != pair.reference[tuple(HIT)], f"{pair.kind}: a corrupted streamed write went unnoticed"


def test_nothing_is_held_and_the_replay_is_clean(pair: StreamPair) -> None:
    report = replay_stopped_pair(pair.prefill, pair.decode, pair.logs)
    assert {m.final_state for m in report.machines if m.lifecycle == "recv"} == {"done"}
