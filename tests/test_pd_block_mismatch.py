"""Block sizes that differ between prefill and decode: refused by name, never delivered.

vLLM-CPU stores a block's bytes in a layout that depends on its size (the vec
kernel keeps K transposed per head, the AMX one in 16-token tiles), so a
128-token block is not two 64-token blocks and kvsm cannot move it as bytes
(upstream here delivers 4 wrong outputs of 5 at 64 -> 128, with no error).
Offline pairs 64 -> 128 and 128 -> 64 on real engines: the decode worker's
claim is refused as incompatible, naming ``block_size`` on both sides; the
request fails (vLLM's ``fail`` policy: an error, no text built on the cache)
and no token came by transfer; both engines then serve on (a request of
matching size still works: the prefill engine's blocks are freed by their
lease or the abandon, nothing stays held), and the replay is clean.
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
from kvsm.testing.pd_pair import PDEngine
from kvsm.testing.ports import free_port_run
from kvsm.testing.reliability import wait_until
from kvsm.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

RNG = random.Random(77)
PROMPT = [RNG.randrange(10, 1100) for _ in range(300)]


@pytest.fixture(scope="module", params=[(64, 128), (128, 64)], ids=["p64-to-d128", "p128-to-d64"])
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[PDEngine, PDEngine, Path, tuple[int, int]]]:
    p_block, d_block = request.param
    tmp = tmp_path_factory.mktemp(f"pd-blocks-{p_block}-{d_block}")
    model = build_tiny_model()
    base = free_port_run(4)
    logs = tmp / "logs"
    prefill = PDEngine("prefill", "kv_producer", model=model, port=base, engine_id="prefill-b", log_dir=logs,
                       workdir=tmp, cpu=0, llm_kwargs={"block_size": p_block})
    decode = PDEngine("decode", "kv_consumer", model=model, port=base + 2, engine_id="decode-b", log_dir=logs,
                      workdir=tmp, cpu=1, llm_kwargs={"block_size": d_block})
    try:
        yield prefill, decode, logs, request.param
    finally:
        prefill.close()
        decode.close()


def _records(logs: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(logs.glob(pattern)) for line in f.read_text().splitlines()
            if line.strip()]


def test_a_block_size_mismatch_fails_the_request_naming_both_sizes(engines) -> None:
    prefill, decode, logs, (p_block, d_block) = engines
    (params,) = prefill.prefill_params([PROMPT])
    (out,) = decode.generate([PROMPT], 8, [params])
    assert out["finish_reason"] == "error" and out["num_cached_tokens"] == 0, out

    def errors() -> list[dict[str, Any]]:  # (the log's writer thread flushes in batches)
        return [r["input"] for r in _records(logs, "decode-b.worker.*.jsonl")
                if r.get("kind") == "transition" and r.get("event") == "error"]

    wait_until(lambda: bool(errors()), 10, "the decode worker logged the failure")
    assert errors()[0]["kind"] == "incompatible", errors()
    assert f"block_size: {d_block} here, {p_block} on the peer" in errors()[0]["detail"], errors()
    done = [r for r in _records(logs, "decode-b.worker.*.jsonl")
            if r.get("kind") == "transition" and r.get("event") == "all_reads_done"]
    assert not done, "a read was posted across block sizes"


def test_nothing_stays_held_and_the_replay_is_clean(engines) -> None:
    prefill, decode, logs, _ = engines

    def settled() -> bool:
        return (prefill.request({"op": "state"})["worker"]["send"] == {}
                and decode.request({"op": "state"})["worker"]["recv"] == {})

    wait_until(settled, 10, "no live machine on either side (the decode side's abandon unpinned the prefill's)")
    prefill.close()
    decode.close()
    report = analyse(sorted(logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    assert {m.final_state for m in report.machines if m.lifecycle == "recv"} == {"failed"}
