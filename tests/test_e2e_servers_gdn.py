"""Qwen3-Next (gated-delta-net state beside full attention, bfloat16) on two
real vLLM API servers with KVSMConnector, through kvsm's router.

The prefill server holds each prompt's last token back (a Mamba/GDN state
holds every token computed) and the decode server computes it on the
transferred state: N - 1 tokens in one step, then one. The reference is a
single engine computing each prompt the same way (its batch limit one token
short of the prompt), one prompt per call: this model's bfloat16 arithmetic
gives another result for the whole prompt in one step, or for another batch,
so the requests go one at a time (the transfer itself is shown byte-exact in
``test_pd_models.py``). Checked:

* through the router: every output equals the reference, the decode worker's
  ``matched`` record has N - 1 prompt tokens by transfer for each;
* two requests' blocks swapped by a router that mixed them up: both outputs
  differ from the reference (the comparison can fail);
* the replay of both servers' logs is clean and every machine ended.
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

from kvsm.lifecycle.table import LIFECYCLES
from kvsm.replay import analyse
from kvsm_testing.engine import run_engine_subprocess, wait_engine_subprocess
from kvsm_testing.pd_pair import matched_tokens
from kvsm_testing.reliability import wait_until
from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs
from kvsm_testing.tiny_model import build_tiny_model, vllm_args

# Extended: the GDN state's transfer runs in CI on the offline pair (test_pd_models.py,
# qwen3_next); this is the same on API servers (-m extended).
pytestmark = [pytest.mark.slow, pytest.mark.extended]

KIND = "qwen3_next"
MAX_TOKENS = 10
RNG = random.Random(20261202)
# Long enough that the reference's one-short batch limit stays above vLLM's minimum; one
# length for all, so that one reference engine (its batch limit one token short of that
# length) computes every prompt as the pair does. (Every prompt fits the model's first
# 1152-token block whatever its length: lengths that differ would test nothing more.)
PROMPT_LEN = 280
ROUTED = [[RNG.randrange(10, 1100) for _ in range(PROMPT_LEN)] for _ in range(4)]
SWAPPED = [[RNG.randrange(10, 1100) for _ in range(PROMPT_LEN)] for _ in range(2)]


class GDNServers:
    def __init__(self, tmp: Path) -> None:
        self.model = str(build_tiny_model(kind=KIND))
        self.logs = tmp / "logs"
        prompts = ROUTED + SWAPPED
        ref = run_engine_subprocess(
            "reference", self.model, prompts, MAX_TOKENS, workdir=tmp / "ref",
            extra_args=["--llm-kwargs", json.dumps({**vllm_args(KIND), "max_num_batched_tokens": PROMPT_LEN - 1}),
                        "--one-by-one"])
        # (Before the servers: the cores are two.)
        self.reference = dict(zip(map(tuple, prompts), wait_engine_subprocess(ref)["outputs"], strict=True))
        self.prefill, self.decode = (VLLMServer(s, self.model, tmp)
                                     for s in pd_specs(event_log_dir=str(self.logs), model_kind=KIND))
        self.router: RouterProcess | None = None
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready(timeout=600)
        self.router = RouterProcess([self.prefill.url], [self.decode.url], tmp).start()

    def body(self, prompt: list[int], max_tokens: int, kv: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, **({"kv_transfer_params": kv} if kv else {})}

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for s in (self.prefill, self.decode):
            s.terminate()
        for s in (self.prefill, self.decode):
            s.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GDNServers]:
    s = GDNServers(tmp_path_factory.mktemp("e2e-gdn"))
    try:
        yield s
    finally:
        s.stop()


def _token_ids(out: dict[str, Any]) -> list[int]:
    ids = out["choices"][0].get("token_ids")
    assert ids is not None, f"no token_ids in the reply: {out}"
    return list(ids)


def test_outputs_through_the_router_equal_the_reference_and_the_state_came_by_transfer(
        servers: GDNServers) -> None:
    assert servers.router is not None
    import urllib.request

    for prompt in ROUTED:
        req = urllib.request.Request(servers.router.url + "/v1/completions",
                                     data=json.dumps(servers.body(prompt, MAX_TOKENS)).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert _token_ids(out) == servers.reference[tuple(prompt)], f"{len(prompt)}-token prompt"
    # Each decode request's matched record: the prompt less the held-back token, by transfer.
    matched = [json.loads(line)["input"] for f in servers.logs.glob("decode.worker.*.jsonl")
               for line in f.read_text().splitlines() if '"event":"matched"' in line.replace(" ", "")]
    by_transfer = sorted(matched_tokens(servers.logs, "decode", [m["remote_req"] for m in matched]).values())
    assert by_transfer == sorted(len(p) - 1 for p in ROUTED), by_transfer


def test_swapped_blocks_are_caught_by_the_comparison(servers: GDNServers) -> None:
    kv = []
    for prompt in SWAPPED:
        out = servers.prefill.post("/v1/completions", servers.body(prompt, 1, {"do_remote_decode": True}))
        params = dict(out["kv_transfer_params"])
        params.pop("remote_prefill_cached_tokens", None)
        kv.append(params)
    kv[0]["remote_block_ids"], kv[1]["remote_block_ids"] = kv[1]["remote_block_ids"], kv[0]["remote_block_ids"]
    outs = [_token_ids(servers.decode.post("/v1/completions", servers.body(p, MAX_TOKENS, k)))
            for p, k in zip(SWAPPED, kv, strict=True)]
    for prompt, got in zip(SWAPPED, outs, strict=True):
        assert got != servers.reference[tuple(prompt)], "a misdirected transfer went unnoticed"


def test_replay_of_both_servers_is_clean(servers: GDNServers) -> None:
    def settled() -> bool:
        report = analyse(sorted(servers.logs.glob("*.jsonl")))
        ours = [m for m in report.machines if m.lifecycle in ("send", "recv")]
        return bool(ours) and all(m.final_state in LIFECYCLES[m.lifecycle].terminal for m in ours)

    wait_until(settled, 15, "every send and recv machine terminal in the logs")
    servers.stop()
    report = analyse(sorted(servers.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    assert {m.final_state for m in report.machines if m.lifecycle == "recv"} == {"done"}
