"""Section 10 of tools/bench.py: multi-turn conversations, decode-to-prefill reuse.

Three pairs of real vLLM API servers (the tiny Llama, prefill on core 0, decode
on core 1), one after the other, each behind ``kvsm.router``:

* ``kvsm reuse``: KVSMConnector, both engines ``kv_both`` with
  ``bidirectional_kv_xfer``, the router with ``--reuse-holds``;
* ``kvsm off``: KVSMConnector as deployed without it (producer, consumer);
* ``upstream``: vLLM's NixlConnector, both ``kv_both`` with its own
  ``bidirectional_kv_xfer`` (480 s ``decoder_kv_blocks_ttl``).

Several conversations at once, in lock step: every conversation sends turn k,
all answers come back, a think time, turn k+1. Turn k+1's prompt is turn k's
prompt, turn k's answer (its token ids) and a few new tokens, as token ids.
Two runs per pair:

* streamed: TTFT per turn. kvsm's router learns each streamed turn's hold
  after the stream ends (``--reuse-holds``); upstream's reuse needs the decode
  answer's ``kv_transfer_params``, which vLLM puts only in non-streamed
  answers, so a streamed conversation reads nothing back there;
* non-streamed, client-driven (upstream's contract): each turn carries the
  previous answer's ``kv_transfer_params``, which the router hands to the
  prefill leg; the turn's latency.

For every turn, the prefill engine's prompt tokens by source
(``vllm:prompt_tokens_by_source``: computed there, read from its prefix cache,
transferred), from its ``/metrics`` before and after the turn.

Then issue 32's TTFT target: ``vllm bench serve`` (section 6's client and
workload) at rate 8 against a kvsm pair behind the router with and without
``--first-token-seeding``, and against a single engine with no connector.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_serve import vllm_bench_serve

from benchlib import Row, Section, Sizes, Target

CONFIGS = ("kvsm reuse", "kvsm off", "upstream")
FIRST = 200  # tokens of a conversation's first prompt
ANSWER = 200  # tokens generated per turn (ignore_eos)
NEW = 24  # the client's new tokens per turn
THINK_S = 0.3  # between an answer and the next turn
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SEEDING_GOAL_MS = 5.0  # issue 32: P/D TTFT p50 over a single engine's, rate 8, first-token seeding


def _pair(config: str, model: str, workdir: Path) -> tuple[Any, Any, Any]:
    from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs

    connector = "NixlConnector" if config == "upstream" else "KVSMConnector"
    specs = pd_specs(connector=connector)
    for spec in specs:
        spec.log_stats = True  # prompt tokens by source in /metrics
        spec.max_model_len = 2048
        spec.kv_load_failure_policy = "recompute"
        if config != "kvsm off":
            spec.kv_role = "kv_both"
            spec.extra_config["bidirectional_kv_xfer"] = True
    prefill, decode = (VLLMServer(s, model, workdir / config.replace(" ", "_")) for s in specs)
    router = RouterProcess([prefill.url], [decode.url], workdir, timeout_s=300,
                           extra_args=["--reuse-holds"] if config == "kvsm reuse" else [])
    return prefill, decode, router


def _by_source(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(SOURCES, 0.0)
    for m in re.finditer(r'^vllm:prompt_tokens_by_source_total\{([^}]*)\} ([0-9.e+]+)$', text, flags=re.M):
        source = re.search(r'source="([^"]+)"', m.group(1))
        if source and source.group(1) in out:
            out[source.group(1)] += float(m.group(2))
    return out


def _turn(url: str, model: str, prompt: list[int], *, stream: bool,
          params: dict[str, Any] | None) -> tuple[float, list[int], dict[str, Any] | None]:
    """One turn through the router: (TTFT ms when streamed, else the turn's ms; the
    answer's token ids; the answer's kv_transfer_params, non-streamed only)."""
    host, port = url.removeprefix("http://").split(":")
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": ANSWER, "temperature": 0,
                            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    if params:
        body["kv_transfer_params"] = params
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {resp.read()[:300]!r}")
        if not stream:
            out = json.loads(resp.read())
            return (time.perf_counter() - t0) * 1e3, list(out["choices"][0]["token_ids"]), out.get(
                "kv_transfer_params")
        first: float | None = None
        ids: list[int] = []
        while line := resp.readline():
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", ()):
                if first is None:
                    first = (time.perf_counter() - t0) * 1e3
                ids += choice.get("token_ids") or []
        if first is None:
            raise RuntimeError(f"{url}: a stream without a token")
        return first, ids, None
    finally:
        conn.close()


def _conversations(router: str, prefill: str, model: str, rng: random.Random, *, n: int, turns: int,
                   stream: bool) -> list[dict[str, Any]]:
    """``n`` conversations of ``turns`` turns in lock step; per turn: the times and the
    prefill engine's prompt tokens by source."""
    prompts = [[rng.randrange(10, 1100) for _ in range(FIRST)] for _ in range(n)]
    params: list[dict[str, Any] | None] = [None] * n
    out = []
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for _ in range(turns):
            before = _by_source(prefill)
            results = list(pool.map(lambda i: _turn(router, model, prompts[i], stream=stream, params=params[i]),
                                    range(n)))
            after = _by_source(prefill)
            out.append({"ms": [r[0] for r in results],
                        "tokens": {s: after[s] - before[s] for s in SOURCES}})
            for i, (_, ids, answer_params) in enumerate(results):
                prompts[i] = prompts[i] + ids + [rng.randrange(10, 1100) for _ in range(NEW)]
                params[i] = answer_params if answer_params and answer_params.get("do_remote_decode") else None
            time.sleep(THINK_S)
    return out


def _serve_ttft(model: str, workdir: Path, repeat: int, num_prompts: int) -> dict[str, list[float]]:
    """TTFT p50 at rate 8 under ``vllm bench serve``: one kvsm pair behind a seeding and
    a plain router (alternated), then a single engine; one value per repetition."""
    from kvsm_testing.servers import RouterProcess, ServerSpec, VLLMServer, pd_specs, running_pair

    p_spec, d_spec = pd_specs()
    d_spec.kv_load_failure_policy = "recompute"
    prefill, decode = VLLMServer(p_spec, model, workdir), VLLMServer(d_spec, model, workdir)
    routers = {"seeded": RouterProcess([prefill.url], [decode.url], workdir, extra_args=["--first-token-seeding"]),
               "plain": RouterProcess([prefill.url], [decode.url], workdir)}
    out: dict[str, list[float]] = {"seeded": [], "plain": [], "single": []}
    with running_pair(prefill, decode, ready_timeout=600):
        for r in routers.values():
            r.start()
        try:
            for rep in range(repeat):
                for name in (("seeded", "plain") if rep % 2 == 0 else ("plain", "seeded")):
                    res = vllm_bench_serve(routers[name].url, model, workdir / name, rate="8",
                                           num_prompts=num_prompts, seed=rep)
                    out[name].append(float(res["median_ttft_ms"]))
        finally:
            for r in routers.values():
                r.stop()
    single = VLLMServer(ServerSpec("single", "kv_both", connector="", cpu=1), model, workdir)
    single.start()
    try:
        single.wait_ready(timeout=600)
        for rep in range(repeat):
            res = vllm_bench_serve(single.url, model, workdir / "single", rate="8", num_prompts=num_prompts, seed=rep)
            out["single"].append(float(res["median_ttft_ms"]))
    finally:
        single.stop(timeout=20)
    return out


def bench_multiturn(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    from kvsm_testing import build_tiny_model
    from kvsm_testing.servers import running_pair

    sec = Section(10, "multiturn", "multi-turn conversations: decode-to-prefill reuse, kvsm vs off vs upstream")
    n = max(2, min(8, sizes.e2e_requests // 12))  # conversations at once
    turns = 6 if sizes.e2e_requests >= 50 else 4
    model = str(build_tiny_model())
    workdir = tmp / "multiturn"
    runs: dict[str, dict[str, list[list[dict[str, Any]]]]] = {c: {"streamed": [], "client": []} for c in CONFIGS}
    for config in CONFIGS:
        prefill, decode, router = _pair(config, model, workdir)
        with running_pair(prefill, decode, router, ready_timeout=600):
            rng = random.Random(20261206)
            _conversations(router.url, prefill.url, model, rng, n=2, turns=2, stream=True)  # warm-up
            for _ in range(repeat):
                runs[config]["streamed"].append(
                    _conversations(router.url, prefill.url, model, rng, n=n, turns=turns, stream=True))
                runs[config]["client"].append(
                    _conversations(router.url, prefill.url, model, rng, n=n, turns=turns, stream=False))

    def per_turn(config: str, mode: str, turn: int, what: str) -> list[float]:
        if what == "ms":
            return [ms for run in runs[config][mode] for ms in run[turn]["ms"]]
        return [run[turn]["tokens"][what] for run in runs[config][mode]]

    def share(config: str, mode: str, turn: int, source: str) -> list[float]:
        out = []
        for run in runs[config][mode]:
            tokens = run[turn]["tokens"]
            out.append(100.0 * tokens[source] / (sum(tokens.values()) or 1.0))
        return out

    for turn in range(turns):
        label = f"turn {turn + 1}"
        for mode, what in (("streamed", "TTFT"), ("client", "turn latency, params from the client")):
            sec.rows.append(Row(f"{label}: {what}, reuse (kvsm vs upstream)", "ms",
                                per_turn("kvsm reuse", mode, turn, "ms"), per_turn("upstream", mode, turn, "ms")))
            sec.rows.append(Row(f"{label}: {what}, kvsm without reuse", "ms", per_turn("kvsm off", mode, turn, "ms")))
            for source, said in (("external_kv_transfer", "transferred"), ("local_compute", "computed")):
                sec.rows.append(Row(f"{label}: prefill engine's prompt tokens {said}, {mode} (kvsm vs upstream)",
                                    "%", share("kvsm reuse", mode, turn, source),
                                    share("upstream", mode, turn, source)))
            sec.rows.append(Row(f"{label}: prefill engine's prompt tokens computed, {mode}, kvsm without reuse", "%",
                                share("kvsm off", mode, turn, "local_compute")))
    serve = _serve_ttft(model, workdir / "serve", repeat, max(20, sizes.serve_prompts // 2))
    sec.rows.append(Row("TTFT p50 at rate 8 (vllm bench serve), P/D with first-token seeding", "ms", serve["seeded"]))
    sec.rows.append(Row("TTFT p50 at rate 8, P/D without seeding", "ms", serve["plain"]))
    sec.rows.append(Row("TTFT p50 at rate 8, a single engine", "ms", serve["single"]))
    over = [a - b for a, b in zip(serve["seeded"], serve["single"], strict=True)]
    sec.rows.append(Row("TTFT p50 over the single engine, with seeding", "ms", over,
                        target=Target("max", SEEDING_GOAL_MS, f"<= {SEEDING_GOAL_MS:g} ms (issue 32)")))
    sec.notes.append(f"{n} conversations at once, {turns} turns, {FIRST} tokens first, {ANSWER} generated and "
                     f"{NEW} new per turn, {THINK_S} s think time; TTFT rows pool every request of the turn")
    sec.notes.append("streamed: upstream's reuse needs the decode answer's kv_transfer_params, which vLLM returns "
                     "only in non-streamed answers (kvsm's router learns a streamed turn's hold itself)")
    sec.extra = {"runs": runs, "conversations": n, "turns": turns, "serve_ttft_p50_ms": serve}
    return sec
