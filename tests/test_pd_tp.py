"""Offline prefill -> decode pairs whose tensor parallel sizes differ (1 -> 2, 2 -> 1).

Two vLLM engines with KVSMConnector, both ``kv_both``, one at tensor parallel 1
and one at 2 (vLLM's multiprocess executor, a worker process per rank,
``VLLM_CPU_OMP_THREADS_BIND`` giving each its own core), serving a tiny model
(the Llama's 2 KV heads: one per rank at TP 2). Each pair is used both ways:
the TP 1 engine prefills for the TP 2 one (both decode ranks read the one
prefill rank, which frees its blocks after both), then the TP 2 engine
prefills for the TP 1 one (the decode rank reads half of each block from each
prefill rank). Each direction has prompts of its own, so that no engine finds
in its own prefix cache what it must read. For each direction:

* the outputs equal a single engine's at the decode engine's TP size (the
  decode engine itself, computing the prompts apart from its prefix cache with
  a ``cache_salt``), every prompt token came by transfer (``num_cached_tokens``
  and each decode rank's ``matched`` record), and each rank's plan is in its
  event log;
* a corrupted transfer (noise written into the prefill blocks on every rank)
  changes the outputs;
* the replay of every process's log is clean, every machine ended, and each
  worker's clean stop shows nothing live (no block held on any rank).

A prefill engine never steps after its ``generate``.
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
from kvsm.handshake import PROTOCOL_VERSION
from kvsm.replay import analyse
from kvsm_testing.both_ways import DIRECTIONS, BothWays
from kvsm_testing.pd_pair import PDEngine, matched_tokens, started, stream_pairs
from kvsm_testing.ports import free_port_run
from kvsm_testing.reliability import wait_until
from kvsm_testing.tiny_model import build_tiny_model, vllm_args

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # a core per worker of a TP 2 engine
RNG = random.Random(20261202)
# DIRECTIONS: TP 1 prefills for TP 2, then TP 2 for TP 1.
PROMPTS = {d: [[RNG.randrange(10, 1100) for _ in range(n)] for n in (40, 150, 300)] for d in DIRECTIONS}
SENSITIVE = {d: [RNG.randrange(10, 1100) for _ in range(200)] for d in DIRECTIONS}


def _engine_args(tp: int, cpu: int, kw: dict[str, Any]) -> dict[str, Any]:
    return {"llm_kwargs": {**kw, "tensor_parallel_size": tp}, "env": BIND if tp > 1 else None,
            "cpu": None if tp > 1 else cpu}


class TPPairOffline(BothWays):
    """Two ``kv_both`` engines, A at TP ``a_tp`` with blocks of ``blocks[0]`` tokens
    and B at TP ``b_tp`` with ``blocks[1]``: "forward" prefills on A and decodes
    on B, "backward" the other way round."""

    def __init__(self, a_tp: int, b_tp: int, tmp: Path, blocks: tuple[int, int] = (128, 128),
                 kind: str = "llama") -> None:
        self.tps = (a_tp, b_tp)
        self.kind = kind
        kw = vllm_args(kind)
        a_kw = {**kw, "block_size": blocks[0]} if kw.get("block_size", 128) else kw  # (MLA: vLLM's choice)
        b_kw = {**kw, "block_size": blocks[1]} if kw.get("block_size", 128) else kw
        self.model = build_tiny_model(kind=kind)
        logs = tmp / "logs"
        ids = (f"a-tp{a_tp}", f"b-tp{b_tp}")
        base = free_port_run(4)
        super().__init__(started(*(
            PDEngine(name, "kv_both", model=self.model, port=base + 2 * i, engine_id=ids[i], log_dir=logs,
                     workdir=tmp, wait=False, **_engine_args(tp, i, e_kw))
            for i, (name, tp, e_kw) in enumerate((("a", a_tp, a_kw), ("b", b_tp, b_kw))))), blocks, ids, logs)
        self.reference: dict[tuple[int, ...], list[int]] = {}
        self.ports = (base, base + 2)  # each engine's side channel

    def coordinates(self, direction: str) -> dict[str, Any]:
        """The prefill engine's, as its answers give them to kvsm's router."""
        p, _ = self.way(direction)
        return {"remote_engine_id": self.ids[p], "remote_host": "127.0.0.1", "remote_port": self.ports[p],
                "tp_size": self.tps[p], "pp_size": 1, "dcp_size": 1, PRODUCER_KEY: PROTOCOL_VERSION,
                "remote_block_size": self.blocks[p]}

    def tp(self, direction: str) -> tuple[int, int]:
        p, d = self.way(direction)
        return self.tps[p], self.tps[d]

    def references(self, direction: str) -> None:
        """The decode engine's own outputs for the direction's prompts, computed
        apart from its prefix cache (before any of them is read or corrupted)."""
        prompts = [*PROMPTS[direction], SENSITIVE[direction]]
        if all(tuple(p) in self.reference for p in prompts):
            return
        outs = self.decode(direction).generate(prompts, MAX_TOKENS, cache_salt=f"reference-{direction}")
        self.reference.update({tuple(p): o["token_ids"] for p, o in zip(prompts, outs, strict=True)})



# Each pair both ways. The second pair's block sizes differ too (64 at TP 1, 128 at TP 2): each
# decode rank reads its head in segments. The third is DeepSeek-V2 (MLA): its latent is
# replicated on every rank, so a decode rank reads it whole from one prefill rank (and tells the
# others they may free theirs). Then Gemma 2: two KV cache groups (sliding window and full
# attention) split by head.
# (Block sizes that differ across TP sizes, -m extended: test_pd_block_mismatch.py reads
# segments on real engines in CI.)
@pytest.fixture(scope="module", params=[(1, 2, 128, 128, "llama"),
                                        pytest.param((1, 2, 64, 128, "llama"), marks=pytest.mark.extended),
                                        (1, 2, 16, 16, "deepseek_v2"), (1, 2, 128, 128, "gemma2")],
                ids=["tp1-tp2", "tp1-b64-tp2-b128", "mla-tp1-tp2", "hybrid-tp1-tp2"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TPPairOffline]:
    a_tp, b_tp, a_block, b_block, kind = request.param
    p = TPPairOffline(a_tp, b_tp, tmp_path_factory.mktemp(f"pd-tp{a_tp}{b_tp}-b{a_block}-{kind}"),
                      (a_block, b_block), kind)
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_outputs_equal_a_single_engine_and_every_rank_read_its_heads(pair: TPPairOffline, direction: str) -> None:
    pair.references(direction)
    prompts = PROMPTS[direction]
    p_tp, d_tp = pair.tp(direction)
    params = pair.prefill(direction).prefill_params(prompts)
    assert all(p["tp_size"] == p_tp for p in params)
    outs = pair.decode(direction).generate(prompts, MAX_TOKENS, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["token_ids"] == pair.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
    assert [o["num_cached_tokens"] for o in outs] == [len(p) for p in prompts]
    remote = [p["remote_request_id"] for p in params]
    decode_id = pair.decode_id(direction)
    matched = matched_tokens(pair.logs, decode_id, remote)
    assert [matched[q] for q in remote] == [len(p) for p in prompts]
    for rank in range(d_tp):  # each decode rank's plan, in its own log (flushed in batches)
        def matched_of(rank: int = rank) -> list[dict[str, Any]]:
            return [r["input"] for r in pair.records(f"{decode_id}.worker.rank{rank}.*.jsonl")
                    if r.get("kind") == "transition" and r.get("event") == "matched"
                    and r["input"].get("remote_req") in remote]

        records = wait_until(lambda rank=rank: len(got := matched_of(rank)) == len(remote) and got, 10,
                             f"decode rank {rank}'s matched records")
        plans = {m["plan"] for m in records}
        segments = {m["segments"] for m in records}
        p_block, d_block = pair.block_sizes(direction)
        if p_block != d_block:  # each rank read its head in segments
            assert segments and all(f"prefill blocks of {p_block} tokens into blocks of {d_block}" in s
                                    for s in segments), segments
        else:
            assert segments <= {""}, segments
        assert len(plans) == 1, plans
        plan = plans.pop()
        assert plan.startswith(f"d{rank}/{d_tp} from p*/{p_tp}"), plan
        if pair.kind == "deepseek_v2":
            assert "[all]->[all]" in plan, plan  # the replicated latent, whole
        elif p_tp < d_tp:
            assert f"p0[{rank}..{rank}/2]->[all]" in plan, plan  # its head of the one prefill rank's two
        else:
            assert "p0[all]->[0..0/2]" in plan and "p1[all]->[1..1/2]" in plan, plan


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_corrupted_transfer_changes_the_output(pair: TPPairOffline, direction: str) -> None:
    pair.references(direction)
    sensitive = SENSITIVE[direction]
    (params,) = pair.prefill(direction).prefill_params([sensitive])
    blocks = sorted({b for ids in params["remote_block_ids"] for b in ids if b})
    pair.prefill(direction).request({"op": "corrupt", "block_ids": blocks})
    (out,) = pair.decode(direction).generate([sensitive], MAX_TOKENS, [params])
    assert out["token_ids"] != pair.reference[tuple(sensitive)], "a corrupted transfer went unnoticed"


STREAMED = {d: [RNG.randrange(10, 1100) for _ in range(150)] for d in DIRECTIONS}
KEYS: list[str] = []  # the streamed pairs' join keys


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_stream_between_tensor_parallel_sizes_runs_on_the_decode_engine_and_frees_the_prefill_at_once(
        pair: TPPairOffline, direction: str) -> None:
    """Both legs at once, as kvsm's router sends a streamed pair: streamed push writes
    blocks rank to rank, so the decode engine refuses it, naming why, and computes
    the prompt itself (the output is its own, nothing came by transfer). It tells
    the prefill side at once, by the join key: every prefill rank frees the
    request's blocks at its finish (``remote_abandoned``), not at its lease's end."""
    prompt = STREAMED[direction]
    (reference,) = pair.decode(direction).generate([prompt], MAX_TOKENS, cache_salt=f"stream-ref-{direction}")
    groups = 2 if pair.kind == "gemma2" else 1
    (key,), (out,) = stream_pairs(pair.prefill(direction), pair.decode(direction), [prompt], MAX_TOKENS,
                                  pair.coordinates(direction), groups=groups)
    KEYS.append(key)
    assert out["token_ids"] == reference["token_ids"] and out["num_cached_tokens"] == 0
    decode_id, p_tp = pair.decode_id(direction), pair.tp(direction)[0]
    wait_until(lambda: [r for r in pair.records(f"{decode_id}.scheduler.*.jsonl")  # (its log flushes every 50 ms)
                        if r.get("event") == "sched.params_ignored"
                        and "tensor parallel sizes differ" in r.get("reason", "")], 5,
               "the decode scheduler's record of why it refused the stream")
    prefill_id = pair.ids[pair.way(direction)[0]]

    def ended_on_every_rank() -> list[list[tuple[str, str]]] | None:
        ends = []
        for rank in range(p_tp):
            records = pair.records(f"{prefill_id}.worker.rank{rank}.*.jsonl")
            reqs = {r["req"] for r in records if r.get("event") == "worker.stream_key" and r.get("key") == key}
            moves = [(r["event"], r["dst"]) for r in records if r.get("kind") == "transition"
                     and r.get("lifecycle") == "send" and r.get("req") in reqs]
            if not moves or moves[-1][1] != "released":
                return None
            ends.append(moves)
        return ends

    ends = wait_until(ended_on_every_rank, 10, f"the streamed request freed on each of the {p_tp} prefill rank(s)")
    for moves in ends:
        assert ("remote_abandoned", "abandoned_early") in moves or moves[-1][0] == "remote_abandoned", moves
        assert "lease_expired" not in {e for e, _ in moves}, moves


def test_replay_of_every_rank_is_clean_and_nothing_is_left_on_any_rank(pair: TPPairOffline) -> None:
    pair.close()
    logs = sorted(pair.logs.glob("*.jsonl"))
    workers = [f for f in logs if ".worker." in f.name]
    assert len(workers) == sum(pair.tps), [f.name for f in logs]
    report = analyse(logs)
    assert not report.findings, [str(f) for f in report.findings]
    # Aborted: the streamed legs a decode engine refused, told to the prefill side by an
    # abandon (by the join key; one that came before the prefill worker knew the key waited
    # in a machine of the key's name, which hands it on and ends ``forgotten``).
    recv_ends = {m.final_state for m in report.machines if m.lifecycle == "recv"}
    assert recv_ends <= {"done", "aborted"}, recv_ends
    sends = {m.req: m.final_state for m in report.machines if m.lifecycle == "send"}
    keys = {req for req in sends if req in KEYS}
    assert {sends[k] for k in keys} <= {"forgotten"}, sends
    assert {state for req, state in sends.items() if req not in keys} == {"released"}, sends
    # Each worker's clean stop shows nothing live. (vLLM's executor may kill a TP worker
    # process before its log's last record is written: then the replay above, which found
    # every machine of every process terminal, is what says nothing was left.)
    stopped = 0
    for f in workers:
        stops = [r for r in pair.records(f.name) if r.get("event") == "worker.shutdown"]
        if stops:
            stopped += 1
            assert stops[-1]["clean"] and stops[-1]["live"] == {"recv": {}, "send": {}}, (f.name, stops)
    assert stopped >= 1, "no worker wrote its clean stop"


HANDSHAKE_TIMEOUT_S = 5.0  # kvsm's default (kvsm.config): what a refusal must beat


def test_kill_9_of_one_prefill_rank_is_refused_at_once_and_the_decode_engine_serves_on(tmp_path: Path) -> None:
    """2 -> 1 on a fresh pair: one prefill rank's worker process is killed
    (``kill -9``) after the prefill answered and before the decode request. The
    decode rank's first contact with the dead rank's side channel is refused (its
    port is closed): the request fails at once, well before the handshake
    timeout, with ``peer_dead`` (reason ``refused``) in the decode worker's log
    (vLLM's ``fail`` policy: an error, no text from a half-read cache); the
    decode worker holds nothing afterwards, and the engine serves a local
    request on, right."""
    import os
    import signal
    import time

    pair = TPPairOffline(2, 1, tmp_path)  # "forward": the TP 2 engine prefills for the TP 1 one
    prefill, decode = pair.prefill("forward"), pair.decode("forward")
    local_prompt, prompt = PROMPTS["forward"][:2]
    try:
        (reference,) = decode.generate([local_prompt], MAX_TOKENS, cache_salt="reference")
        (params,) = prefill.prefill_params([prompt])
        rank1 = sorted(pair.logs.glob(f"{pair.ids[0]}.worker.rank1.*.jsonl"))
        assert len(rank1) == 1, rank1
        os.kill(int(rank1[0].name.split(".")[-2]), signal.SIGKILL)
        t0 = time.monotonic()
        (out,) = decode.generate([prompt], MAX_TOKENS, [params])
        took = time.monotonic() - t0
        assert out["finish_reason"] == "error" and out["num_cached_tokens"] == 0, out
        assert took < HANDSHAKE_TIMEOUT_S, f"the failure took {took:.1f} s: not refused at once"
        state = decode.request({"op": "state"})
        assert state["worker"]["recv"] == {}, state
        (local,) = decode.generate([local_prompt], MAX_TOKENS)  # no transfer: computed here
        assert local["token_ids"] == reference["token_ids"]

        def causes() -> list[dict[str, Any]]:  # (the log's writer thread flushes in batches)
            return [r for r in pair.records(f"{pair.decode_id('forward')}.worker.rank0.*.jsonl")
                    if r.get("kind") == "transition" and r.get("event") in ("error", "peer_dead", "timeout")]

        found = wait_until(causes, 10, "the decode worker's record of the cause")
        assert [(r["event"], r["input"].get("reason")) for r in found] == [("peer_dead", "refused")], found
    finally:
        pair.close()
