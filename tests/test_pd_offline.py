"""An offline prefill -> decode pair with KVSMConnector, checked against one engine.

Two vLLM engines (tiny local model, CPU, single-process each) in two
processes: the prefill engine computes each prompt and returns upstream-shaped
``kv_transfer_params``; the decode engine reads the KV over NIXL and
continues. The decode outputs must equal a plain single engine's greedy
outputs, the decode engine must have taken the prompt's KV from the transfer
(``num_cached_tokens``, and the transferred token counts in its event log),
a corrupted or misdirected transfer must break the comparison (so it can tell
a right transfer from a wrong one), and the replay of both engines' event
logs must show every request done, with no violation.

Each test sets up what it needs on the module's pair (``Pair.ensure_decoded``:
the prompt whose blocks a prefix test expects in the decode engine's cache),
and each records what it transferred (``Pair.record``), which the replay test
checks the logs and counters against: every test runs alone as well as in a
full run.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.handoff.facts import PRODUCER_KEY, PROMPT_FINGERPRINT_KEY, prompt_fingerprint
from kvsm.handshake.messages import PROTOCOL_VERSION
from kvsm.replay import analyse
from kvsm_testing import build_tiny_model
from kvsm_testing.pd_pair import PDEngine, matched_tokens, started, stream_pairs
from kvsm_testing.ports import free_port_run
from kvsm_testing.reliability import wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12
BLOCK = 128


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1100) for _ in range(n)]


RNG = random.Random(20261130)
SHORT = _prompt(RNG, 1)  # one token: fewer than the decode engine's kv_recompute_threshold
RECOMPUTE_THRESHOLD = 2
UNDER_BLOCK = _prompt(RNG, 40)  # under one block
ONE_BLOCK = _prompt(RNG, BLOCK)  # exactly one full block
LONG = _prompt(RNG, 300)  # two full blocks and a partial one
LONG_PREFIX = LONG[:256] + _prompt(RNG, 44)  # shares LONG's two full blocks
FRESH_A = _prompt(RNG, 200)  # for the sensitivity tests, never seen before
FRESH_B = _prompt(RNG, 200)
FRESH_C = _prompt(RNG, 150)
FRESH_D = _prompt(RNG, 180)
PUSH_A = _prompt(RNG, 300)  # push mode (transfer_mode "push"): the prefill engine writes the blocks
PUSH_B = _prompt(RNG, 40)
PUSH_C = _prompt(RNG, 200)
# Streamed push (transfer_mode "stream"): the prefill engine computes these in chunks of
# CHUNK tokens, and writes each layer of each chunk as its forward pass ends.
STREAM_A = _prompt(RNG, 450)  # fifteen chunks
STREAM_B = _prompt(RNG, 60)  # one
STREAM_C = _prompt(RNG, 300)  # three
STREAM_PREFIX = LONG[:256] + _prompt(RNG, 150)  # shares LONG's two full blocks
PREFILL_HIT = _prompt(RNG, 256) + _prompt(RNG, 20)  # its first two blocks: a pulled prompt's, cached there
PREFILL_HIT_SEEN = PREFILL_HIT[:256] + _prompt(RNG, 30)
CORRUPT_HIT = _prompt(RNG, 256) + _prompt(RNG, 25)  # the same shape, its prefill-side cache corrupted
CORRUPT_HIT_SEEN = CORRUPT_HIT[:256] + _prompt(RNG, 35)
CHUNK = 32
ALL_PROMPTS = [SHORT, UNDER_BLOCK, ONE_BLOCK, LONG, LONG_PREFIX, FRESH_A, FRESH_B, FRESH_C, FRESH_D, PUSH_A, PUSH_B,
               PUSH_C, STREAM_A, STREAM_B, STREAM_C, STREAM_PREFIX, PREFILL_HIT, PREFILL_HIT_SEEN, CORRUPT_HIT,
               CORRUPT_HIT_SEEN]


class Pair:
    def __init__(self, tmp: Path) -> None:
        self.model = build_tiny_model()
        self.logs = tmp / "logs"
        base = free_port_run(4)
        self.prefill, self.decode = started(
            # Chunked prefill, as a long prompt's on a real deployment: several steps per prompt.
            PDEngine("prefill", "kv_producer", model=self.model, port=base, engine_id="prefill-pd",
                     log_dir=self.logs, workdir=tmp, cpu=0, wait=False,
                     llm_kwargs={"max_num_batched_tokens": CHUNK, "enable_chunked_prefill": True}),
            PDEngine("decode", "kv_consumer", model=self.model, port=base + 2, engine_id="decode-pd",
                     log_dir=self.logs, workdir=tmp, cpu=1, wait=False,
                     extra={"kv_recompute_threshold": RECOMPUTE_THRESHOLD}))
        # The single engine's outputs: the decode engine's own, computed apart from its prefix
        # cache (a cache_salt) before anything is read into it.
        refs = self.decode.generate(ALL_PROMPTS, MAX_TOKENS, cache_salt="reference")
        self.reference = {tuple(p): o["token_ids"] for p, o in zip(ALL_PROMPTS, refs, strict=True)}
        self.closed = False
        # What the tests made the pair do: requests, reads (one per request with blocks
        # to read), blocks read; and the prompts decoded by transfer (cached there now).
        self.ledger: Counter[str] = Counter()
        self.decoded: set[tuple[int, ...]] = set()
        # What kvsm's router learns from a prefill engine's answers: where its side channel is.
        self.prefill_coordinates = {"remote_engine_id": "prefill-pd", "remote_host": "127.0.0.1",
                                    "remote_port": base, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
                                    PRODUCER_KEY: PROTOCOL_VERSION, "remote_block_size": BLOCK}

    def record(self, prompts: list[list[int]], *, reads: int, blocks: int, right: bool = True) -> None:
        """These prompts went to the decode engine; ``right``: with their own KV."""
        self.ledger.update(requests=len(prompts), reads=reads, blocks=blocks)
        if right:
            self.decoded.update(map(tuple, prompts))

    def ensure_decoded(self, prompt: list[int]) -> None:
        """``prompt`` went through the pair by transfer (so its full blocks are in the
        decode engine's prefix cache): what an earlier test did, or done here."""
        if tuple(prompt) in self.decoded:
            return
        (params,) = self.prefill_params([prompt])
        (out,) = self.decode.generate([prompt], MAX_TOKENS, [params])
        assert out["token_ids"] == self.reference[tuple(prompt)]
        self.record([prompt], reads=1, blocks=len(params["remote_block_ids"][0]))

    def prefill_params(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        # As a user does it: after generate returns, nothing steps the prefill engine again.
        return self.prefill.prefill_params(prompts)

    def stream(self, prompts: list[list[int]], *, decode_first_s: float = 0.0,
               cache_salt: str | None = None) -> tuple[list[str], list[dict[str, Any]]]:
        """Both legs of each prompt at once, as kvsm's router sends a streamed pair."""
        return stream_pairs(self.prefill, self.decode, prompts, MAX_TOKENS, self.prefill_coordinates,
                            decode_first_s=decode_first_s, cache_salt=cache_salt)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.prefill.close()
            self.decode.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("pd"))
    try:
        yield p
    finally:
        p.close()


def _matched_tokens(logs: Path, remote_reqs: list[str], timeout: float = 10.0) -> dict[str, int]:
    return matched_tokens(logs, "decode-pd", remote_reqs, timeout)


def test_outputs_equal_a_single_engine_and_prompts_come_from_the_transfer(pair: Pair) -> None:
    prompts = [UNDER_BLOCK, ONE_BLOCK, LONG]  # several requests in one step on both sides
    params = pair.prefill_params(prompts)
    assert all(len(p["remote_block_ids"]) == 1 for p in params)
    assert [len(p["remote_block_ids"][0]) for p in params] == [1, 1, 3]
    outs = pair.decode.generate(prompts, MAX_TOKENS, params)
    pair.record(prompts, reads=3, blocks=5)
    for prompt, out in zip(prompts, outs):
        assert out["finish_reason"] == "length"
        assert out["token_ids"] == pair.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        # Every prompt token's KV came over the transfer (no local prefix hit yet).
        assert out["num_cached_tokens"] == len(prompt), f"{len(prompt)}-token prompt"
    remote = [p["remote_request_id"] for p in params]
    matched = _matched_tokens(pair.logs, remote)
    assert [matched[q] for q in remote] == [len(p) for p in prompts]


def test_fewer_remote_tokens_than_the_recompute_threshold_are_computed_here(pair: Pair) -> None:
    """kv_recompute_threshold 2 on the decode engine (upstream's key): the one-token
    prompt's token is computed there, not read, the output is the single engine's,
    and the prefill side is told to unpin at once (not at its lease's end); the
    scheduler's log says why."""
    (params,) = pair.prefill_params([SHORT])
    (out,) = pair.decode.generate([SHORT], MAX_TOKENS, [params])
    pair.record([SHORT], reads=0, blocks=0, right=False)
    assert out["token_ids"] == pair.reference[tuple(SHORT)]
    remote = params["remote_request_id"]
    wait_until(lambda: remote not in pair.prefill.request({"op": "state"})["worker"]["send"], 5,
               f"the prefill side to unpin {remote}")

    def recomputed() -> list[dict[str, Any]] | None:
        records = [json.loads(line) for f in pair.logs.glob("decode-pd.scheduler.*.jsonl")
                   for line in f.read_text().splitlines() if line.strip()]
        steps = [r for r in records if r.get("lifecycle") == "sched" and r.get("input", {}).get("remote_req") == remote]
        if not steps:
            return None
        mine = [r for r in records if r.get("lifecycle") == "sched" and r.get("req") == steps[0]["req"]]
        return mine if mine[-1].get("dst") == "ran_locally" else None
    steps = wait_until(recomputed, 10, "the decode scheduler's log to end the request ran_locally")
    assert [(r["event"], r["dst"]) for r in steps[1:]] == [
        ("params_read", "claiming"), ("remote_tokens_counted", "recomputing"),
        ("blocks_allocated", "computing_locally"), ("request_finished", "ran_locally")], steps
    assert steps[2]["input"] == {"tokens": 1, "threshold": RECOMPUTE_THRESHOLD}


def test_local_prefix_hit_reads_only_the_rest(pair: Pair) -> None:
    """LONG_PREFIX shares LONG's two full blocks, cached on the decode engine."""
    pair.ensure_decoded(LONG)
    (params,) = pair.prefill_params([LONG_PREFIX])
    (out,) = pair.decode.generate([LONG_PREFIX], MAX_TOKENS, [params])
    pair.record([LONG_PREFIX], reads=1, blocks=1)
    assert out["token_ids"] == pair.reference[tuple(LONG_PREFIX)]
    assert out["num_cached_tokens"] == len(LONG_PREFIX)  # 256 local + 44 transferred
    remote = params["remote_request_id"]
    assert _matched_tokens(pair.logs, [remote])[remote] == 44


def test_full_local_hit_only_notifies_the_prefill_side(pair: Pair) -> None:
    """The prefill side offers 256 tokens the decode engine already caches: nothing
    to read, yet the prefill engine must be told, so it unpins without waiting out
    its lease."""
    pair.ensure_decoded(LONG)
    (params,) = pair.prefill_params([LONG])
    params["remote_num_tokens"] = 256
    params[PROMPT_FINGERPRINT_KEY] = prompt_fingerprint(LONG, 256)
    (out,) = pair.decode.generate([LONG], MAX_TOKENS, [params])
    pair.record([LONG], reads=0, blocks=0)
    assert out["token_ids"] == pair.reference[tuple(LONG)]
    remote = params["remote_request_id"]
    wait_until(lambda: remote not in pair.prefill.request({"op": "state"})["worker"]["send"], 5,
               f"the prefill side to unpin {remote}")


def test_a_prefill_leg_of_several_tokens_still_hands_over_its_prompt(pair: Pair) -> None:
    """A prefill leg sent with a client's default max_tokens, not 1: its KV goes on
    past the prompt. The decode request reads the prompt's part (before, the params
    counted every computed token, more than the prompt, and the decode engine
    refused them as another request's: computed locally, the blocks pinned for a lease)."""
    outs = pair.prefill.generate([FRESH_D], 5, [{"do_remote_decode": True}])
    assert len(outs[0]["token_ids"]) == 5
    params = dict(outs[0]["kv_transfer_params"])
    params.pop("remote_prefill_cached_tokens", None)
    assert params["remote_num_tokens"] == len(FRESH_D)
    (out,) = pair.decode.generate([FRESH_D], MAX_TOKENS, [params])
    pair.record([FRESH_D], reads=1, blocks=2)
    assert out["token_ids"] == pair.reference[tuple(FRESH_D)]
    remote = params["remote_request_id"]
    assert _matched_tokens(pair.logs, [remote])[remote] == len(FRESH_D)
    wait_until(lambda: remote not in pair.prefill.request({"op": "state"})["worker"]["send"], 5,
               f"the prefill side to unpin {remote}")


def _push_params(pair: Pair, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """A router's prefill leg asking for push mode (upstream's key); the answer's params echo it."""
    outs = pair.prefill.generate(prompts, 1, [{"do_remote_decode": True, "transfer_mode": "push"}] * len(prompts))
    params = [dict(o["kv_transfer_params"]) for o in outs]
    for p in params:
        p.pop("remote_prefill_cached_tokens", None)
        assert p["transfer_mode"] == "push"
    return params


def _machine_steps(logs: Path, pattern: str, lifecycle: str, req: str) -> list[tuple[str, str]]:
    records = [json.loads(line) for f in logs.glob(pattern) for line in f.read_text().splitlines() if line.strip()]
    return [(r["event"], r["dst"]) for r in records if r.get("lifecycle") == lifecycle and r.get("req") == req]


def test_push_mode_the_prefill_engine_writes_every_prompt_token(pair: Pair) -> None:
    """transfer_mode "push" on the prefill leg: the decode engine claims, then asks
    the prefill worker to write into its blocks; outputs equal the single engine's,
    every prompt token came by the write, and both engines' logs tell that path."""
    prompts = [PUSH_A, PUSH_B]
    params = _push_params(pair, prompts)
    outs = pair.decode.generate(prompts, MAX_TOKENS, params)
    pair.record(prompts, reads=2, blocks=4)
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == pair.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        assert out["num_cached_tokens"] == len(prompt)
    remote = [p["remote_request_id"] for p in params]
    matched = _matched_tokens(pair.logs, remote)
    assert [matched[q] for q in remote] == [len(p) for p in prompts]
    for q in remote:
        wait_until(lambda q=q: q not in pair.prefill.request({"op": "state"})["worker"]["send"], 5,
                   f"the prefill side to free {q} once written")
        # (its log's writer flushes every 50 ms: the release's line may be on its way)
        steps = wait_until(lambda q=q: (lambda st: st if st and st[-1][1] == "released" else None)(
            _machine_steps(pair.logs, "prefill-pd.worker.*.jsonl", "send", q)), 5, f"{q} released in the log")
        assert [e for e, _ in steps if e in ("write_asked", "write_done", "read_notif")] == [
            "write_asked", "write_done"], steps
        assert steps[-1] == ("write_done", "released"), steps
    records = [json.loads(line) for f in pair.logs.glob("decode-pd.worker.*.jsonl")
               for line in f.read_text().splitlines() if line.strip()]
    mine = [r for r in records if r.get("lifecycle") == "recv" and r.get("input", {}).get("remote_req") in remote]
    assert len(mine) == 2
    for r in mine:  # (the log's writer flushes every 50 ms: the last line may be on its way)
        def ended(req: str = r["req"]) -> list[tuple[str, str]] | None:
            steps = _machine_steps(pair.logs, "decode-pd.worker.*.jsonl", "recv", req)
            return steps if steps[-1][1] == "done" else None

        steps = wait_until(ended, 5, f"{r['req']} done in the decode log")
        assert [s for s in steps if s[0] in ("writes_asked", "writes_landed", "reads_posted")] == [
            ("writes_asked", "being_written"), ("writes_landed", "done")], steps


def test_push_mode_a_corrupted_write_breaks_the_comparison(pair: Pair) -> None:
    (params,) = _push_params(pair, [PUSH_C])
    pair.prefill.request({"op": "corrupt", "block_ids": params["remote_block_ids"][0]})
    (out,) = pair.decode.generate([PUSH_C], MAX_TOKENS, [params])
    pair.record([PUSH_C], reads=1, blocks=2, right=False)
    assert out["token_ids"] != pair.reference[tuple(PUSH_C)], "a corrupted write went unnoticed"


def _stream_story(pair: Pair, key: str) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """The prefill send machine's steps for the streamed request of join key ``key``
    (once released), and its worker's ``worker.stream_written`` record."""
    def written() -> tuple[list[tuple[str, str]], dict[str, Any]] | None:
        records = [json.loads(line) for f in pair.logs.glob("prefill-pd.worker.*.jsonl")
                   for line in f.read_text().splitlines() if line.strip()]
        note = next((r for r in records if r.get("event") == "worker.stream_written" and r.get("key") == key), None)
        if note is None:
            return None
        steps = [(r["event"], r["dst"]) for r in records
                 if r.get("lifecycle") == "send" and r.get("req") == note["req"]]
        return (steps, note) if steps and steps[-1][1] == "released" else None

    return wait_until(written, 5, f"the streamed request {key} released in the prefill log")


def test_stream_mode_writes_each_layer_while_the_prefill_computes(pair: Pair) -> None:
    """transfer_mode "stream": both legs at once (the decode leg a little ahead, as when
    the prefill engine is busy). The decode engine allocates and claims by the join key,
    the prefill worker writes each layer of each chunk as it is computed, and the
    last write lands right after the last layer: outputs equal the single engine's,
    every prompt token came by the writes, and both logs tell that path."""
    keys, outs = pair.stream([STREAM_A], decode_first_s=0.3)
    pair.record([STREAM_A], reads=1, blocks=4)
    (out,) = outs
    assert out["token_ids"] == pair.reference[tuple(STREAM_A)]
    assert out["num_cached_tokens"] == len(STREAM_A)
    assert _matched_tokens(pair.logs, keys)[keys[0]] == len(STREAM_A)
    steps, note = _stream_story(pair, keys[0])
    # Asked while the prefill was computing, written over its chunks: each of the 2 layers
    # at least twice (what was computed at the ask, then the rest as computed; one write per
    # whole block when the ask comes within the first block's 4 steps, as it mostly does),
    # done before or after the finish pinned the blocks.
    assert ("stream_asked", "streaming") in steps, steps
    assert steps[-1] in (("finished_ok", "released"), ("write_done", "released")), steps
    assert note["steps"] == 15 and note["writes"] >= 2 * 2, note
    assert note["last_layer_ns"] > 0 and note["done_ns"] >= note["last_layer_ns"], note
    wait_until(lambda: not pair.prefill.request({"op": "state"})["worker"]["send"], 5, "nothing pinned")
    records = [json.loads(line) for f in pair.logs.glob("decode-pd.worker.*.jsonl")
               for line in f.read_text().splitlines() if line.strip()]
    (mine,) = [r["req"] for r in records if r.get("event") == "matched" and r["input"]["remote_req"] == keys[0]]
    wait_until(lambda: _machine_steps(pair.logs, "decode-pd.worker.*.jsonl", "recv", mine)[-1][1] == "done", 5,
               "the decode request done in its log")
    dsteps = _machine_steps(pair.logs, "decode-pd.worker.*.jsonl", "recv", mine)
    assert [s for s in dsteps if s[0] in ("writes_asked", "writes_landed", "reads_posted")] == [
        ("writes_asked", "being_written"), ("writes_landed", "done")], dsteps


def test_stream_mode_legs_sent_together(pair: Pair) -> None:
    """Both legs at the same moment (whichever engine is first): right either way."""
    prompts = [STREAM_B, STREAM_C]
    keys, outs = pair.stream(prompts)
    pair.record(prompts, reads=2, blocks=4)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out["token_ids"] == pair.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
        assert out["num_cached_tokens"] == len(prompt)
    matched = _matched_tokens(pair.logs, keys)
    assert [matched[k] for k in keys] == [len(p) for p in prompts]


def test_stream_mode_a_local_prefix_hit_is_not_written(pair: Pair) -> None:
    """STREAM_PREFIX shares LONG's two full blocks, cached on the decode engine: only the
    blocks after them are asked for (written by position from the third on)."""
    pair.ensure_decoded(LONG)
    keys, (out,) = pair.stream([STREAM_PREFIX], decode_first_s=0.2)
    pair.record([STREAM_PREFIX], reads=1, blocks=2)
    assert out["token_ids"] == pair.reference[tuple(STREAM_PREFIX)]
    assert out["num_cached_tokens"] == len(STREAM_PREFIX)
    assert _matched_tokens(pair.logs, keys)[keys[0]] == len(STREAM_PREFIX) - 256


def _pull_and_read(pair: Pair, prompt: list[int]) -> list[int]:
    """``prompt`` through the pair by pull (its blocks then cached on both engines); its prefill blocks."""
    (params,) = pair.prefill_params([prompt])
    (out,) = pair.decode.generate([prompt], MAX_TOKENS, [params])
    pair.record([prompt], reads=1, blocks=len(params["remote_block_ids"][0]))
    assert out["token_ids"] == pair.reference[tuple(prompt)]
    return list(params["remote_block_ids"][0])


def test_stream_mode_a_prefill_prefix_hit_is_written_at_the_first_step(pair: Pair) -> None:
    """The prefill engine holds the prompt's first two blocks in its prefix cache (an
    earlier request's): computed before any step, they go with the first one. The
    decode leg carries a cache salt, so that it has no hit of its own."""
    _pull_and_read(pair, PREFILL_HIT_SEEN)
    keys, (out,) = pair.stream([PREFILL_HIT], decode_first_s=0.2, cache_salt="stream-prefill-hit")
    pair.record([PREFILL_HIT], reads=1, blocks=3, right=False)  # (salted: not in the decode's own cache)
    assert out["token_ids"] == pair.reference[tuple(PREFILL_HIT)]
    assert out["num_cached_tokens"] == len(PREFILL_HIT)
    assert _matched_tokens(pair.logs, keys)[keys[0]] == len(PREFILL_HIT)


def test_stream_mode_a_corrupted_write_breaks_the_comparison(pair: Pair) -> None:
    """As above, with the prefill side's cached blocks corrupted first: the streamed
    writes carry them, and the output differs (the comparison can tell)."""
    blocks = _pull_and_read(pair, CORRUPT_HIT_SEEN)
    pair.prefill.request({"op": "corrupt", "block_ids": blocks[:2]})
    keys, (out,) = pair.stream([CORRUPT_HIT], decode_first_s=0.2, cache_salt="stream-corrupt")
    pair.record([CORRUPT_HIT], reads=1, blocks=3, right=False)
    assert _matched_tokens(pair.logs, keys)[keys[0]] == len(CORRUPT_HIT)
    assert out["token_ids"] != pair.reference[tuple(CORRUPT_HIT)], "a corrupted streamed write went unnoticed"


def test_corrupted_prefill_blocks_break_the_comparison(pair: Pair) -> None:
    (params,) = pair.prefill_params([FRESH_A])
    pair.prefill.request({"op": "corrupt", "block_ids": params["remote_block_ids"][0]})
    (out,) = pair.decode.generate([FRESH_A], MAX_TOKENS, [params])
    pair.record([FRESH_A], reads=1, blocks=2, right=False)
    assert out["token_ids"] != pair.reference[tuple(FRESH_A)], "a corrupted transfer went unnoticed"


def test_reading_the_wrong_blocks_breaks_the_comparison(pair: Pair) -> None:
    pa, pb = pair.prefill_params([FRESH_B, FRESH_C])
    pa["remote_block_ids"], pb["remote_block_ids"] = pb["remote_block_ids"], pa["remote_block_ids"]
    # Same number of blocks (2 each), so the reads succeed, into the wrong places.
    outs = pair.decode.generate([FRESH_B, FRESH_C], MAX_TOKENS, [pa, pb])
    pair.record([FRESH_B, FRESH_C], reads=2, blocks=4, right=False)
    assert outs[0]["token_ids"] != pair.reference[tuple(FRESH_B)]
    assert outs[1]["token_ids"] != pair.reference[tuple(FRESH_C)]


def test_replay_of_both_engines_shows_every_request_done(pair: Pair) -> None:
    pair.ensure_decoded(LONG)  # something to replay, run alone
    # Once the read notifications reached the prefill side's loop, nothing is live.
    def settled() -> tuple[dict[str, Any], dict[str, Any]] | None:
        pstate = pair.prefill.request({"op": "state"})
        dstate = pair.decode.request({"op": "state"})
        return (pstate, dstate) if pstate["worker"]["send"] == {} and dstate["worker"]["recv"] == {} else None

    pstate, dstate = wait_until(settled, 5, "no live send machine on the prefill side, no recv on the decode side")
    pair.close()  # flushes and closes the event logs
    report = analyse(sorted(pair.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    assert report.exit_code == 0
    finals: dict[str, dict[str, int]] = {}
    for m in report.machines:
        finals.setdefault(m.lifecycle, {}).setdefault(m.final_state, 0)
        finals[m.lifecycle][m.final_state] += 1
    # Requests' machines; the decode worker's peer machine (the third lifecycle) is
    # replay's to judge (no findings, above).
    finals.pop("peer", None)
    # Each scheduler's own machines (kvsm/lifecycle/sched.py): every decode request
    # read and ran (or, under kv_recompute_threshold, ran locally), every prefill
    # pinned its blocks.
    sched = finals.pop("sched")
    assert set(sched) <= {"done", "pinned", "ran_locally"}, sched
    assert set(finals) == {"recv", "send"}, finals
    assert set(finals["recv"]) == {"done"} and set(finals["send"]) == {"released"}
    # One request's whole story across both engines, from the CLI.
    decode_req = next(m.req for m in report.machines if m.lifecycle == "recv")
    cli = subprocess.run([sys.executable, str(REPO / "tools" / "replay.py"), str(pair.logs), "--request",
                          decode_req], capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    # (the first request to the prefill engine: its claim fetched the agent, then its reads went out)
    for needle in ("prefill-pd/worker", "decode-pd/worker",
                   "--finished_ok-->", "--handshake_ok-->", "--all_reads_done--> done", "--read_notif--> released"):
        assert needle in cli.stdout, f"{needle!r} missing from the timeline:\n{cli.stdout}"
    # In a full run: 3 + 1 (computed here) + 1 + 1 (notify only) + 1 + 2 requests, each
    # once on each side; 7 reads of 12 blocks (1+1+3, 1, 2, 2+2); and 3 pushed (2 + 1 corrupted).
    ledger = pair.ledger
    assert finals["recv"]["done"] == finals["send"]["released"] == ledger["requests"], (finals, ledger)
    # The connectors' own counters agree (what vLLM's stats and Prometheus get).
    assert dstate["stats"]["num_xfers"] == ledger["reads"] and dstate["stats"]["num_handshakes"] == 1
    # Each block 2 layers x [2 heads, 128 tokens, 64] float32.
    assert dstate["stats"]["xfer_bytes_total"] == ledger["blocks"] * 2 * (2 * 128 * 64 * 4)
    # A notify-only request is released by its side-channel message, not a read.
    assert pstate["stats"]["reads_served"] == ledger["reads"] and not pstate["stats"]["failures"]
    assert not dstate["stats"]["failures"]
