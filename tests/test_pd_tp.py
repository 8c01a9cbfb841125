"""Offline prefill -> decode pairs whose tensor parallel sizes differ (1 -> 2, 2 -> 1).

Two vLLM engines with KVSMConnector, one of them at tensor parallel 2 (vLLM's
multiprocess executor, a worker process per rank, ``VLLM_CPU_OMP_THREADS_BIND``
giving each its own core), serving the tiny Llama (2 KV heads: one per rank
at TP 2). Each decode rank reads its head from the prefill engine's blocks
(1 -> 2: both decode ranks read the one prefill rank, which frees its blocks
after both; 2 -> 1: the decode rank reads half of each block from each
prefill rank). For each direction:

* the outputs equal a single engine's at the decode engine's TP size, every
  prompt token came by transfer (``num_cached_tokens`` and each decode rank's
  ``matched`` record), and each rank's plan is in its event log;
* a corrupted transfer (noise written into the prefill blocks on every rank)
  changes the outputs;
* the replay of every process's log is clean, every machine ended, and each
  worker's clean stop shows nothing live (no block held on any rank).

The prefill engine never steps after its ``generate``.
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
from kvsm.testing.pd_pair import PDEngine, matched_tokens
from kvsm.testing.ports import free_port_run
from kvsm.testing.reliability import wait_until
from kvsm.testing.tiny_model import build_tiny_model, vllm_args

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # a core per worker of a TP 2 engine
RNG = random.Random(20261202)
PROMPTS = [[RNG.randrange(10, 1100) for _ in range(n)] for n in (40, 150, 300)]
SENSITIVE = [RNG.randrange(10, 1100) for _ in range(200)]


def _engine_args(tp: int, cpu: int, kw: dict[str, Any]) -> dict[str, Any]:
    return {"llm_kwargs": {**kw, "tensor_parallel_size": tp}, "env": BIND if tp > 1 else None,
            "cpu": None if tp > 1 else cpu}


class TPPairOffline:
    def __init__(self, p_tp: int, d_tp: int, tmp: Path, blocks: tuple[int, int] = (128, 128),
                 kind: str = "llama") -> None:
        self.p_tp, self.d_tp = p_tp, d_tp
        self.blocks = blocks
        self.kind = kind
        kw = vllm_args(kind)
        p_kw = {**kw, "block_size": blocks[0]} if kw.get("block_size", 128) else kw  # (MLA: vLLM's choice)
        d_kw = {**kw, "block_size": blocks[1]} if kw.get("block_size", 128) else kw
        self.model = build_tiny_model(kind=kind)
        self.logs = tmp / "logs"
        self.decode_id = f"decode-tp{d_tp}"
        prompts = [*PROMPTS, SENSITIVE]
        ref = run_engine_subprocess(
            "reference", self.model, prompts, MAX_TOKENS, workdir=tmp / "ref",
            extra_args=["--llm-kwargs", json.dumps({**d_kw, "tensor_parallel_size": d_tp})],
            env=BIND if d_tp > 1 else None)
        # (The reference first: three TP 2 worker processes at once would share 2 cores.)
        self.reference = {tuple(p): out for p, out in zip(prompts, wait_engine_subprocess(ref)["outputs"],
                                                          strict=True)}
        base = free_port_run(4)
        self.prefill = PDEngine("prefill", "kv_producer", model=self.model, port=base, engine_id=f"prefill-tp{p_tp}",
                                log_dir=self.logs, workdir=tmp, **_engine_args(p_tp, 0, p_kw))
        self.decode = PDEngine("decode", "kv_consumer", model=self.model, port=base + 2, engine_id=self.decode_id,
                               log_dir=self.logs, workdir=tmp, **_engine_args(d_tp, 1, d_kw))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


# The third pair's block sizes differ too (64 -> 128): each decode rank reads its head in
# segments. The last two are DeepSeek-V2 (MLA): its latent is replicated on every rank, so a
# decode rank reads it whole from one prefill rank (and tells the others they may free theirs).
# Then Gemma 2 both ways: two KV cache groups (sliding window and full attention) split by head.
@pytest.fixture(scope="module", params=[(1, 2, 128, 128, "llama"), (2, 1, 128, 128, "llama"),
                                        (1, 2, 64, 128, "llama"), (1, 2, 16, 16, "deepseek_v2"),
                                        (2, 1, 16, 16, "deepseek_v2"), (1, 2, 128, 128, "gemma2"),
                                        (2, 1, 128, 128, "gemma2")],
                ids=["tp1-to-tp2", "tp2-to-tp1", "tp1-b64-to-tp2-b128", "mla-tp1-to-tp2", "mla-tp2-to-tp1",
                     "hybrid-tp1-to-tp2", "hybrid-tp2-to-tp1"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPPairOffline]:
    p_tp, d_tp, p_block, d_block, kind = request.param
    p = TPPairOffline(p_tp, d_tp, tmp_path_factory.mktemp(f"pd-tp{p_tp}{d_tp}-b{p_block}-{kind}"),
                      (p_block, d_block), kind)
    try:
        yield p
    finally:
        p.close()


def _records(logs: Path, pattern: str) -> list[dict[str, Any]]:
    out = []
    for f in sorted(logs.glob(pattern)):
        out += [json.loads(line) for line in f.read_text(errors="replace").splitlines() if line.strip()]
    return out


def test_outputs_equal_a_single_engine_and_every_rank_read_its_heads(pair: TPPairOffline) -> None:
    params = pair.prefill.prefill_params(PROMPTS)
    assert all(p["tp_size"] == pair.p_tp for p in params)
    outs = pair.decode.generate(PROMPTS, MAX_TOKENS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["token_ids"] == pair.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
    assert [o["num_cached_tokens"] for o in outs] == [len(p) for p in PROMPTS]
    remote = [p["remote_request_id"] for p in params]
    matched = matched_tokens(pair.logs, pair.decode_id, remote)
    assert [matched[q] for q in remote] == [len(p) for p in PROMPTS]
    for rank in range(pair.d_tp):  # each decode rank's plan, in its own log (flushed in batches)
        def matched_of(rank: int = rank) -> list[dict[str, Any]]:
            return [r["input"] for r in _records(pair.logs, f"{pair.decode_id}.worker.rank{rank}.*.jsonl")
                    if r.get("kind") == "transition" and r.get("event") == "matched"]

        records = wait_until(matched_of, 10, f"decode rank {rank}'s matched records")
        plans = {m["plan"] for m in records}
        segments = {m["segments"] for m in records}
        p_block, d_block = pair.blocks
        if p_block != d_block:  # each rank read its head in segments
            assert segments and all(f"prefill blocks of {p_block} tokens into blocks of {d_block}" in s
                                    for s in segments), segments
        else:
            assert segments <= {""}, segments
        assert len(plans) == 1, plans
        plan = plans.pop()
        assert plan.startswith(f"d{rank}/{pair.d_tp} from p*/{pair.p_tp}"), plan
        if pair.kind == "deepseek_v2":
            assert "[all]->[all]" in plan, plan  # the replicated latent, whole
        elif pair.p_tp < pair.d_tp:
            assert f"p0[{rank}..{rank}/2]->[all]" in plan, plan  # its head of the one prefill rank's two
        else:
            assert "p0[all]->[0..0/2]" in plan and "p1[all]->[1..1/2]" in plan, plan


def test_a_corrupted_transfer_changes_the_output(pair: TPPairOffline) -> None:
    (params,) = pair.prefill.prefill_params([SENSITIVE])
    blocks = sorted({b for ids in params["remote_block_ids"] for b in ids if b})
    pair.prefill.request({"op": "corrupt", "block_ids": blocks})
    (out,) = pair.decode.generate([SENSITIVE], MAX_TOKENS, [params])
    assert out["token_ids"] != pair.reference[tuple(SENSITIVE)], "a corrupted transfer went unnoticed"


def test_replay_of_every_rank_is_clean_and_nothing_is_left_on_any_rank(pair: TPPairOffline) -> None:
    pair.close()
    logs = sorted(pair.logs.glob("*.jsonl"))
    workers = [f for f in logs if ".worker." in f.name]
    assert len(workers) == pair.p_tp + pair.d_tp, [f.name for f in logs]
    report = analyse(logs)
    assert not report.findings, [str(f) for f in report.findings]
    assert {m.final_state for m in report.machines if m.lifecycle == "recv"} == {"done"}
    assert {m.final_state for m in report.machines if m.lifecycle == "send"} == {"released"}
    # Each worker's clean stop shows nothing live. (vLLM's executor may kill a TP worker
    # process before its log's last record is written: then the replay above, which found
    # every machine of every process terminal, is what says nothing was left.)
    stopped = 0
    for f in workers:
        stops = [r for r in _records(f.parent, f.name) if r.get("event") == "worker.shutdown"]
        if stops:
            stopped += 1
            assert stops[-1]["clean"] and stops[-1]["live"] == {"recv": {}, "send": {}}, (f.name, stops)
    assert stopped >= 1, "no worker wrote its clean stop"


def test_kill_9_of_one_prefill_rank_fails_the_request_fast_and_the_decode_engine_serves_on(
        tmp_path: Path) -> None:
    """2 -> 1: one prefill rank's worker process is killed (``kill -9``) after the
    prefill answered and before the decode request: the decode request fails
    (vLLM's ``fail`` policy: an error, no text from a half-read cache) well inside
    the handshake timeout's order of magnitude, the decode worker holds nothing
    afterwards, and the decode engine serves a local request on."""
    import os
    import signal
    import time

    pair = TPPairOffline(2, 1, tmp_path)
    try:
        (params,) = pair.prefill.prefill_params([PROMPTS[1]])
        rank1 = sorted(pair.logs.glob("prefill-tp2.worker.rank1.*.jsonl"))
        assert len(rank1) == 1, rank1
        os.kill(int(rank1[0].name.split(".")[-2]), signal.SIGKILL)
        t0 = time.monotonic()
        (out,) = pair.decode.generate([PROMPTS[1]], MAX_TOKENS, [params])
        took = time.monotonic() - t0
        assert out["finish_reason"] == "error" and out["num_cached_tokens"] == 0, out
        assert took < 15, f"the failure took {took:.1f} s"
        state = pair.decode.request({"op": "state"})
        assert state["worker"]["recv"] == {}, state
        (local,) = pair.decode.generate([PROMPTS[0]], MAX_TOKENS)  # no transfer: computed here
        assert local["token_ids"] == pair.reference[tuple(PROMPTS[0])]
        def causes() -> list[dict[str, Any]]:  # (the log's writer thread flushes in batches)
            return [r["input"] for r in _records(pair.logs, f"{pair.decode_id}.worker.rank0.*.jsonl")
                    if r.get("kind") == "transition" and r.get("event") in ("error", "peer_dead", "timeout")]

        wait_until(causes, 10, "the decode worker's record of the cause")
    finally:
        pair.close()
