"""The demo's request mix (``tools/pd_demo.py``'s ``run_mix``) on real vLLM API
servers with KVSMConnector and the kvsm router, for the pairs the demo's own
run (``test_e2e_servers.py``, the tiny Llama) does not cover: one pair per
model kind (a module-scoped fixture), shared by its tests. (Block sizes that
differ are read both ways by the offline ``kv_both`` pair of
``test_pd_block_mismatch.py``: the same segment reads on real engines, with a
corrupted transfer and a local prefix hit besides.) The kinds: Gemma 2
(sliding window + full attention: two KV cache groups), DeepSeek-V2 (MLA
latents), Qwen3 (bfloat16: on a CPU with AMX the decode server's first forward
pass is a loaded request's, which killed vLLM's AMX attention until kvsm asked
for the permission) and Gemma 3 (three sliding-window layers to one global:
four groups).

For each pair:

* the demo's mix through the router: every output equal to a single engine's
  (the prefill server asked alone), every prompt token by transfer but the
  prefix-cache repeat's locally cached blocks;
* the comparison can fail: an honest transfer of a prompt the
  decode server has never seen gives the prefill server's own output; two
  requests' blocks swapped (every group's block ids, as a router that mixed up
  two responses would hand them over): the reads succeed, into the wrong
  places, and both outputs differ from the prefill server's own;
* the replay of both servers' logs, once they are stopped, is clean.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm_testing.reliability import metric, read_records, replay_when_settled, wait_until
from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs
from kvsm_testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _load_demo() -> ModuleType:
    """``tools/pd_demo.py`` as a module (``tools`` is no package)."""
    spec = importlib.util.spec_from_file_location("kvsm_pd_demo", REPO / "tools" / "pd_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


pd_demo = _load_demo()

MAX_TOKENS = 12
# Several blocks each (Gemma 2: 128 tokens a block, DeepSeek-V2: 16), never seen by either server before.
PROMPT_LEN = 300
# The mix as the demo's test sends it (tools/pd_demo.py --requests 4): 11 named requests, 4 of load.
MIX_REQUESTS = 4


def check_mix(mix: Any) -> None:
    """What the demo exits 0 on, and more: every output equal to a single engine's,
    every prompt token by transfer but the locally cached blocks of the repeat."""
    assert mix.failures == [], mix.failures
    assert len(mix.cases) == 11 and len(mix.load) == MIX_REQUESTS
    rows = [(c.name, len(c.prompt), c.transferred, c.error or (c.text == c.reference)) for c in mix.cases]
    assert all(c.match for c in mix.cases + mix.load), rows
    for c in mix.cases:
        assert c.transferred is not None, rows
        assert c.transferred == len(c.prompt) or c.name == "prefix-cache repeat", rows


def _stop(servers: list[VLLMServer], routers: list[RouterProcess]) -> None:
    """The routers, then every server at once (each stop is idempotent)."""
    for r in routers:
        r.stop()
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


def _replay_is_clean(logs: Path, min_reads: int) -> None:
    report = replay_when_settled(lambda: sorted(logs.glob("*.jsonl")))
    assert report.exit_code == 0 and not report.findings, [str(f) for f in report.findings]
    recv = [m for m in report.machines if m.lifecycle == "recv"]
    assert len(recv) >= min_reads and {m.final_state for m in recv} == {"done"}, \
        [(m.key, m.final_state) for m in recv]


# ---------------------------------------------------------------- block sizes that differ
# (First in the file: pytest runs the tests of this unparametrized fixture before
# the model kinds' groups, and its last test stops its servers: one pair at a time.)


class KindPair:
    def __init__(self, kind: str, tmp: Path) -> None:
        self.kind = kind
        self.model = str(build_tiny_model(kind=kind))
        self.logs = tmp / "logs"
        self.prefill, self.decode = (VLLMServer(s, self.model, tmp)
                                     for s in pd_specs(event_log_dir=str(self.logs), model_kind=kind))
        self.router = RouterProcess([self.prefill.url], [self.decode.url], tmp)

    def start(self) -> None:
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready(timeout=600)
        self.router.start()

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
        _stop([self.prefill, self.decode], [self.router])


# Gemma 2's two groups (sliding window + full) on servers: Gemma 3's four groups
# cover the same path here (Gemma 2 runs offline in test_pd_models.py and
# test_pd_tp.py, on servers in test_reliability_servers.py). DeepSeek-V2's MLA
# latent runs in CI offline (test_pd_models.py in bfloat16, test_pd_tp.py across
# TP sizes). -m extended runs both.
@pytest.fixture(scope="module", params=[pytest.param("gemma2", marks=pytest.mark.extended),
                                        pytest.param("deepseek_v2", marks=pytest.mark.extended), "qwen3", "gemma3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindPair]:
    p = KindPair(request.param, tmp_path_factory.mktemp(f"e2e-{request.param}"))
    try:
        p.start()
        yield p
    finally:
        p.stop()


@pytest.mark.timeout(900)  # the pair's start-up is this test's
def test_the_demos_mix_through_the_router(pair: KindPair) -> None:
    check_mix(pd_demo.run_mix(pair.router.url, pair.prefill.url, pair.model, pair.logs, requests=MIX_REQUESTS))


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


def test_streamed_through_kvsms_router(pair: KindPair, tmp_path: Path) -> None:
    """kvsm's router with ``--transfer-mode stream``: its first request learns the
    prefill server's side channel (sequential), the next two go streamed, both legs
    at once, each layer written into the decode server's blocks as the prefill
    server computes it, every KV cache group's (Gemma 3: four). The answers equal
    the prefill server's own, and the logs show both written by their join keys."""
    rng = random.Random(20261207)
    prompts = [[rng.randrange(10, 1100) for _ in range(n)] for n in (90, PROMPT_LEN, 200)]
    references = [pair.complete(pair.prefill, p, MAX_TOKENS) for p in prompts]
    with RouterProcess([pair.prefill.url], [pair.decode.url], tmp_path, timeout_s=60,
                       extra_args=("--transfer-mode", "stream")) as router:
        router.start()
        for prompt, reference in zip(prompts, references, strict=True):
            body = {"model": pair.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            out = json.loads(urllib.request.urlopen(urllib.request.Request(
                router.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}),
                timeout=120).read())
            assert out["choices"][0]["token_ids"] == reference, (pair.kind, len(prompt))
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
            assert metric(r.read().decode(), "kvsm_router_stream_pairs_total") == 2

    def written() -> list[dict[str, Any]] | None:
        records = read_records(sorted(pair.logs.glob("*.jsonl")))
        keys = {r["input"]["remote_req"] for r in records if r.get("event") == "matched"
                and str(r["input"].get("remote_req", "")).startswith("kvsm-stream-")}
        notes = [r for r in records if r.get("event") == "worker.stream_written" and r.get("key") in keys]
        return notes if len(keys) == len(notes) == 2 else None

    notes = wait_until(written, 20, "two streamed requests written in the prefill server's log")
    assert all(n["writes"] >= 2 for n in notes), notes


def test_replay_of_both_servers_is_clean(pair: KindPair) -> None:
    pair.stop()
    _replay_is_clean(pair.logs, min_reads=11 + MIX_REQUESTS + 3)
