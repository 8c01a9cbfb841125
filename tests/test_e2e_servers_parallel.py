"""Tensor and data parallel deployments on real vLLM API servers, through kvsm's router.

One pair of ``kv_both`` servers of the tiny Llama (2 KV heads), each side
parallel, so that every rank of every engine has business, used both ways:

* a data parallel server ``x`` (two engines, TP 1 each, on side-channel ports
  base + 0 and base + 1, engine ids ``x_dp0`` and ``x_dp1``) and a TP 2 server
  ``y`` (one port for both ranks);
* "dp2-to-tp2": ``x`` prefills and ``y`` decodes: each decode rank reads one KV
  head of the one prefill rank (1 -> 2);
* "tp2-to-dp2": ``y`` prefills and ``x`` decodes: each decode engine reads one
  head from each prefill rank (2 -> 1).

Each way has a router of its own and prompts of its own (no server finds in its
prefix cache what it must read). For each: every output through the router
equals the decode server computing the prompt by itself (a ``cache_salt`` keeps
it off the transferred blocks), every prompt token comes by transfer to every
decode rank, both data parallel engines serve, each rank's read plan is in its
``matched`` record, and a transfer with its blocks out of order is caught by the
comparison; at the end the replay of every rank's log is clean with no request
left on any rank.

These pairs run on a 2-core machine only because the servers and the router share
the test's session (``ServerSpec.own_session``): see ``kvsm_testing.servers`` for
the kernel behaviour that starves a server in a session of its own.
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")
require("nixl")

from kvsm.lifecycle.table import LIFECYCLES
from kvsm_testing import build_tiny_model
from kvsm_testing.reliability import read_records, replay_when_settled, wait_until
from kvsm_testing.servers import RouterProcess, ServerSpec, VLLMServer, free_ports, stop_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
PROMPT_LEN = 300  # two full blocks of 128 and a partial one
PROMPTS = 4


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    dp: int = 1

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    def server_fields(self) -> dict[str, Any]:
        args = [*(["--tensor-parallel-size", str(self.tp)] if self.tp > 1 else []),
                *(["--data-parallel-size", str(self.dp)] if self.dp > 1 else []),
                "--shutdown-timeout", "10"]  # (its engines stop in order: each worker writes its clean stop)
        # Two worker processes: a core each (vLLM-CPU refuses to start TP 2 without it).
        return {"cpu": None, "extra_args": args, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "own_session": False}


X, Y = Parallel(dp=2), Parallel(tp=2)
WAYS = {"dp2-to-tp2": ("x", "y"), "tp2-to-dp2": ("y", "x")}  # (prefill, decode)
SEEDS = {"dp2-to-tp2": 20261204, "tp2-to-dp2": 20261205}


class ParallelPair:
    def __init__(self, tmp: Path) -> None:
        self.model = str(build_tiny_model())
        self.logs = tmp / "logs"
        http_x, http_y, side_x, side_y = free_ports(4)
        common = {"event_log_dir": str(self.logs)}
        self.par = {"x": X, "y": Y}
        self.servers = {
            "x": VLLMServer(ServerSpec("x", "kv_both", http_x, side_x, "x", **common, **X.server_fields()),
                            self.model, tmp),
            "y": VLLMServer(ServerSpec("y", "kv_both", http_y, side_y, "y", **common, **Y.server_fields()),
                            self.model, tmp)}
        self.routers = {way: RouterProcess([self.servers[p].url], [self.servers[d].url], tmp, own_session=False)
                        for way, (p, d) in WAYS.items()}

    def prefill(self, way: str) -> VLLMServer:
        return self.servers[WAYS[way][0]]

    def decode(self, way: str) -> VLLMServer:
        return self.servers[WAYS[way][1]]

    def p_par(self, way: str) -> Parallel:
        return self.par[WAYS[way][0]]

    def d_par(self, way: str) -> Parallel:
        return self.par[WAYS[way][1]]

    def engine_ids(self, name: str) -> set[str]:
        """The engine ids a server's engines log under (a data parallel one's: ``<name>_dp<i>``)."""
        dp = self.par[name].dp
        return {f"{name}_dp{i}" for i in range(dp)} if dp > 1 else {name}

    def complete(self, url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, **extra}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict[str, Any] = json.load(r)
        return out

    def tokens(self, out: dict[str, Any]) -> list[int]:
        ids = out["choices"][0].get("token_ids")
        assert ids is not None, f"no token_ids in the reply: {out}"
        return list(ids)

    def start(self) -> None:
        x, y = self.servers["x"], self.servers["y"]
        for server in (x, y):
            server.start()
        for server in (x, y):
            server.wait_ready(timeout=600)
        for router in self.routers.values():
            router.start()

    def close(self) -> None:
        """The routers, then both servers (each stop is idempotent)."""
        for router in self.routers.values():
            router.stop()
        stop_pair(self.servers["x"], self.servers["y"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ParallelPair]:
    p = ParallelPair(tmp_path_factory.mktemp("e2e-parallel"))
    try:
        p.start()
        yield p
    finally:
        p.close()


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1100) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _transitions(records: list[dict[str, Any]], lifecycle: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("lifecycle") == lifecycle and r.get("kind") in ("create", "transition")]


@pytest.mark.parametrize("way", WAYS)
def test_outputs_equal_the_decode_engine_alone_and_every_rank_reads_its_plan(pair: ParallelPair, way: str) -> None:
    prompts = _prompts(SEEDS[way], PROMPTS)
    decode, p_par, d_par = pair.decode(way), pair.p_par(way), pair.d_par(way)
    prefill_ids, decode_ids = (pair.engine_ids(name) for name in WAYS[way])
    # The decode server computing each prompt by itself, at its own parallel sizes,
    # one at a time (greedy output can depend on the batch).
    reference = [pair.tokens(pair.complete(decode.url, p, cache_salt=f"alone-{way}-{i}"))
                 for i, p in enumerate(prompts)]
    through_router = [pair.tokens(pair.complete(pair.routers[way].url, p)) for p in prompts]
    assert through_router == reference

    d_ranks = d_par.tp  # decode ranks per decode engine
    recv_terminal = LIFECYCLES["recv"].terminal

    def ours(records: list[dict[str, Any]], lifecycle: str, engines: set[str]) -> list[dict[str, Any]]:
        return [r for r in _transitions(records, lifecycle) if r["engine_id"] in engines]

    def settled() -> list[dict[str, Any]] | None:
        records = read_records(sorted(pair.logs.glob("*.jsonl")))
        recv = ours(records, "recv", decode_ids)
        matched = [r for r in recv if r["event"] == "matched"]
        last = {(r["engine_id"], r["rank"], r["req"]): r["dst"] for r in recv}
        sends = [r for r in ours(records, "send", prefill_ids) if r["dst"] in LIFECYCLES["send"].terminal]
        done = (len(matched) == PROMPTS * d_ranks and len(sends) == PROMPTS * p_par.tp
                and all(last[(r["engine_id"], r["rank"], r["req"])] in recv_terminal for r in matched))
        return records if done else None

    records = wait_until(settled, 15.0, "every rank's machines terminal in the event logs")
    recv = ours(records, "recv", decode_ids)
    matched = [r for r in recv if r["event"] == "matched"]
    # Every prompt token by transfer, on every rank.
    assert {r["input"]["num_tokens"] for r in matched} == {PROMPT_LEN}, [r["input"] for r in matched]
    # (read_unclaimed: reads posted right behind their claims, done before the grants)
    assert {r["dst"] for r in recv if r["event"] == "all_reads_done"} <= {"done", "read_unclaimed"}
    assert len([r for r in recv if r["dst"] == "done"]) == PROMPTS * d_ranks
    # Each decode rank's plan: which prefill ranks it reads, which heads.
    plans = {r["input"]["plan"] for r in matched}
    if d_par.tp == 2:  # 1 -> 2: each decode rank reads its head of the one prefill rank
        assert plans == {"d0/2 from p*/1: p0[0..0/2]->[all]", "d1/2 from p*/1: p0[1..1/2]->[all]"}, plans
    else:  # 2 -> 1: each decode engine reads one head from each prefill rank
        assert plans == {"d0/1 from p*/2: p0[all]->[0..0/2], p1[all]->[1..1/2]"}, plans
    # Both data parallel engines of the parallel side served (each its own engine id).
    if p_par.dp == 2:
        assert {r["input"]["remote_engine"] for r in matched} == prefill_ids
        assert len({r["input"]["remote_port"] for r in matched}) == 2  # base + 0 and base + 1
    if d_par.dp == 2:
        assert {r["engine_id"] for r in matched} == decode_ids
    # Every prefill rank released every request: each decode rank's read notified it.
    sends = [r for r in ours(records, "send", prefill_ids) if r["dst"] in LIFECYCLES["send"].terminal]
    assert {r["dst"] for r in sends} == {"released"}
    assert {r["rank"] for r in sends} == set(range(p_par.tp))


@pytest.mark.parametrize("way", WAYS)
def test_a_transfer_with_its_blocks_out_of_order_is_caught(pair: ParallelPair, way: str) -> None:
    """The comparison can fail: the prefill leg's block ids reversed (a router that
    garbled them) are read without error, into the wrong places, and the output
    differs from the decode engine's own."""
    (prompt,) = _prompts(SEEDS[way] + 7, 1)
    reference = pair.tokens(pair.complete(pair.decode(way).url, prompt, cache_salt="alone-reversed"))
    kv = pair.complete(pair.prefill(way).url, prompt, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    kv.pop("remote_prefill_cached_tokens", None)
    blocks = kv["remote_block_ids"]
    kv["remote_block_ids"] = [list(reversed(g)) for g in blocks] if blocks and isinstance(blocks[0], list) \
        else list(reversed(blocks))
    garbled = pair.tokens(pair.complete(pair.decode(way).url, prompt, kv_transfer_params=kv))
    assert garbled != reference, "a garbled transfer went unnoticed"


def test_replay_of_every_rank_is_clean_and_nothing_is_left_on_any_rank(pair: ParallelPair) -> None:
    pair.close()
    logs = sorted(pair.logs.glob("*.jsonl"))
    workers = [f for f in logs if ".worker." in f.name]
    assert len(workers) == X.ranks + Y.ranks, [f.name for f in logs]
    report = replay_when_settled(lambda: logs)
    assert not report.findings, [str(f) for f in report.findings]
    assert {m.final_state for m in report.machines if m.lifecycle == "recv"} == {"done"}
    assert {m.final_state for m in report.machines if m.lifecycle == "send"} == {"released"}
    # Every worker's clean stop shows nothing live (the servers run with a shutdown
    # timeout: without one, vLLM's API server stops its engines in "abort" mode and
    # force-kills their workers before they can write it).
    stopped = []
    for f in workers:
        stops = [r for r in read_records([f]) if r.get("event") == "worker.shutdown"]
        if stops:
            stopped.append(f.name)
            assert stops[-1]["clean"] and stops[-1]["live"] == {"recv": {}, "send": {}}, (f.name, stops)
    assert len(stopped) == len(workers), f"clean stops from {stopped} of {[f.name for f in workers]}"
