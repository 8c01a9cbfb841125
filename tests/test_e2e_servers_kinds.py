"""Gemma 2 (sliding window + full attention: two KV cache groups) and DeepSeek-V2
(MLA latents) on two real vLLM API servers with KVSMConnector: the server pair
must be able to tell a misdirected transfer from a correct one.

The demo runs these kinds green through the router (``test_e2e_servers.py``);
this shows that its comparison can fail on servers too. Each kind's pair:

* an honest transfer of a prompt the decode server has never seen gives the
  prefill server's own output;
* two requests' blocks swapped (every group's block ids, as a router that mixed
  up two responses would hand them over): the reads succeed, into the wrong
  places, and both outputs differ from the prefill server's own;
* the replay of both servers' logs is clean.
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
from kvsm.testing.servers import VLLMServer, pd_specs
from kvsm.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Several blocks each (Gemma 2: 128 tokens a block, DeepSeek-V2: 16), never seen by either server before.
PROMPT_LEN = 300


class KindPair:
    def __init__(self, kind: str, tmp: Path) -> None:
        self.model = str(build_tiny_model(kind=kind))
        self.logs = tmp / "logs"
        self.prefill, self.decode = (VLLMServer(s, self.model, tmp)
                                     for s in pd_specs(event_log_dir=str(self.logs), model_kind=kind))
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready(timeout=600)

    def complete(self, server: VLLMServer, prompt: list[int], max_tokens: int,
                 kv: dict[str, Any] | None = None) -> list[int]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True,
                                **({"kv_transfer_params": kv} if kv is not None else {})}
        out = server.post("/v1/completions", body)
        ids = out["choices"][0].get("token_ids")
        assert ids is not None, f"no token_ids in the reply: {out}"
        return list(ids)

    def params(self, prompt: list[int]) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}
        kv = dict(self.prefill.post("/v1/completions", body)["kv_transfer_params"])
        kv.pop("remote_prefill_cached_tokens", None)
        return kv

    def stop(self) -> None:
        for s in (self.prefill, self.decode):
            s.terminate()
        for s in (self.prefill, self.decode):
            s.stop()


@pytest.fixture(scope="module", params=["gemma2", "deepseek_v2"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindPair]:
    p = KindPair(request.param, tmp_path_factory.mktemp(f"e2e-{request.param}"))
    try:
        yield p
    finally:
        p.stop()


def test_an_honest_transfer_equals_and_swapped_blocks_are_caught(pair: KindPair) -> None:
    rng = random.Random(20261203)
    a, c, d = ([rng.randrange(10, 1100) for _ in range(PROMPT_LEN)] for _ in range(3))
    reference = {tuple(p): pair.complete(pair.prefill, p, MAX_TOKENS) for p in (a, c, d)}
    assert pair.complete(pair.decode, a, MAX_TOKENS, pair.params(a)) == reference[tuple(a)]
    kv = [pair.params(p) for p in (c, d)]
    kv[0]["remote_block_ids"], kv[1]["remote_block_ids"] = kv[1]["remote_block_ids"], kv[0]["remote_block_ids"]
    swapped = [pair.complete(pair.decode, p, MAX_TOKENS, k) for p, k in zip((c, d), kv, strict=True)]
    assert swapped[0] != reference[tuple(c)] and swapped[1] != reference[tuple(d)], \
        "a misdirected transfer went unnoticed"


def test_replay_of_both_servers_is_clean(pair: KindPair) -> None:
    pair.stop()
    report = analyse(sorted(pair.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    recv = [m for m in report.machines if m.lifecycle == "recv"]
    assert len(recv) >= 3 and {m.final_state for m in recv} == {"done"}, [(m.key, m.final_state) for m in recv]
