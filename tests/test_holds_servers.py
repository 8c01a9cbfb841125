"""Decode-to-prefill reuse as an operator runs it: two vLLM API servers with
``bidirectional_kv_xfer`` behind ``python -m kvsm.router --reuse-holds``.

Conversations of token-id prompts go through the router, streamed (the router
learns each turn's hold itself once the stream ends) and not streamed with the
client passing the previous answer's ``kv_transfer_params`` (upstream's
contract); a chat conversation too. Every answer must equal the decode
server's own (its prefix cache salted apart: a single engine); from turn 2 the
prefill server must take the conversation so far by transfer
(``vllm:prompt_tokens_by_source``); at the end the replay of both servers'
event logs finds no violation.
"""

from __future__ import annotations

import http.client
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.replay import analyse
from kvsm_testing.reliability import wait_until

pytestmark = pytest.mark.slow

ANSWER = 40
NEW = 12
BLOCK = 128  # the servers' (kvsm_testing.servers.pd_specs)
RNG = random.Random(20261206)


@dataclass
class Deployment:
    model: str
    prefill: Any
    decode: Any
    router: Any
    events: Path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from kvsm_testing import build_tiny_model
    from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs, running_pair

    tmp = tmp_path_factory.mktemp("holds-servers")
    model = str(build_tiny_model())
    events = tmp / "events"
    specs = pd_specs(event_log_dir=str(events), extra_config={"bidirectional_kv_xfer": True})
    for spec in specs:
        spec.kv_role = "kv_both"
        spec.kv_load_failure_policy = "recompute"
        spec.log_stats = True
        spec.max_model_len = 1024
        spec.extra_args = ("--shutdown-timeout", "10")  # vLLM's default (0) kills the engine: no clean stop
    prefill, decode = (VLLMServer(s, model, tmp) for s in specs)
    router = RouterProcess([prefill.url], [decode.url], tmp, timeout_s=60, extra_args=["--reuse-holds"])
    with running_pair(prefill, decode, router, ready_timeout=240, stop_timeout=20):
        yield Deployment(model, prefill, decode, router, events)


def _transferred(server: Any) -> float:
    """The prefill server's prompt tokens taken by transfer so far."""
    text = server.metrics()
    return sum(float(v) for v in re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} ([0-9.e+]+)$', text,
        flags=re.M))


def _streamed(url: str, body: dict[str, Any]) -> list[int]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:300]
        ids: list[int] = []
        while line := resp.readline():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", ()):
                    ids += choice.get("token_ids") or []
        return ids
    finally:
        conn.close()


def _reference(d: Deployment, prompt: list[int], salt: str) -> list[int]:
    out = d.decode.post("/v1/completions", {"model": d.model, "prompt": prompt, "max_tokens": ANSWER,
                                            "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                            "cache_salt": salt})
    return list(out["choices"][0]["token_ids"])


def _body(d: Deployment, prompt: list[int]) -> dict[str, Any]:
    return {"model": d.model, "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def _router_holds(d: Deployment) -> dict[str, float]:
    from urllib.request import urlopen

    with urlopen(d.router.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^kvsm_router_holds_total\{event="([a-z_]+)"\} ([0-9.e+]+)$', text, flags=re.M)}


def test_a_streamed_conversation_reads_its_past_turns_from_the_decode_server(deployment: Deployment) -> None:
    d = deployment
    prompt = [RNG.randrange(10, 1100) for _ in range(150)]
    last = 0  # the previous turn's prompt length
    for turn in range(3):
        before = _transferred(d.prefill)
        used_before = _router_holds(d).get("used", 0)
        answer = _streamed(d.router.url, _body(d, prompt))
        assert answer == _reference(d, prompt, f"s{turn}"), f"turn {turn + 1}"
        if turn:
            # The conversation so far came from the decode server's hold (learned as the last
            # prompt and its whole answer), but the full blocks the prefill server has itself.
            assert _transferred(d.prefill) - before == last + ANSWER - last // BLOCK * BLOCK, turn
            assert _router_holds(d).get("used", 0) == used_before + 1
        last = len(prompt)
        prompt = prompt + answer + [RNG.randrange(10, 1100) for _ in range(NEW)]
        # The router learns the streamed turn's hold once the stream has ended.
        wait_until(lambda n=turn: _router_holds(d).get("learned", 0) >= n + 1, 10, "the router to learn the hold")


def test_the_client_passes_the_previous_answers_params(deployment: Deployment) -> None:
    """Upstream's contract: a non-streamed answer's kv_transfer_params, sent back with
    the next turn, reach the prefill leg."""
    d = deployment
    prompt = [RNG.randrange(10, 1100) for _ in range(150)]
    params: dict[str, Any] | None = None
    for turn in range(3):
        before = _transferred(d.prefill)
        body = _body(d, prompt)
        if params:
            body["kv_transfer_params"] = params
        out = _post(d.router.url, body)
        answer = list(out["choices"][0]["token_ids"])
        assert answer == _reference(d, prompt, f"c{turn}"), f"turn {turn + 1}"
        if turn:
            assert _transferred(d.prefill) - before > 0, turn
        params = out["kv_transfer_params"]
        assert params["do_remote_decode"] and params["remote_num_tokens"] == len(prompt) + ANSWER - 1
        prompt = prompt + answer + [RNG.randrange(10, 1100) for _ in range(NEW)]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    from urllib.request import Request, urlopen

    req = Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_a_chat_conversation_is_right_whatever_its_template_makes_of_the_answer(deployment: Deployment) -> None:
    """A chat template renders the previous answer again as text: its tokens may
    differ from those generated, and the prefill server then reads only the held
    blocks the prompt really starts with (the digests decide): right either way."""
    from urllib.request import Request, urlopen

    d = deployment
    messages: list[dict[str, str]] = [{"role": "user", "content": "blocks engine decode prefill " * 20}]

    def chat(url: str, salt: str | None = None) -> str:
        body: dict[str, Any] = {"model": d.model, "messages": messages, "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True}
        if salt:
            body["cache_salt"] = salt
        req = Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
        with urlopen(req, timeout=120) as r:
            return str(json.loads(r.read())["choices"][0]["message"]["content"])

    for turn in range(3):
        answer = chat(d.router.url)
        assert answer == chat(d.decode.url, f"chat{turn}"), f"turn {turn + 1}"
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and then {turn}?"}]


def test_replay_of_both_servers_finds_no_violation(deployment: Deployment) -> None:
    from kvsm_testing.servers import stop_pair

    d = deployment
    stop_pair(d.prefill, d.decode, d.router, timeout=20)
    report = analyse(sorted(d.events.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    finals: dict[str, set[str]] = {}
    for m in report.machines:
        finals.setdefault(m.lifecycle, set()).add(m.final_state)
    # Holds were read by the next turns, and the stopping decode server released the
    # last ones at once (no next turn comes to a stopping engine), not at its drain's end.
    assert "hold_released" in finals["sched"] and finals["send"] == {"released"}, finals
    # (the scheduler may stop before a step reports the last ones' blocks free: closed then)
    stops = [line for f in d.events.glob("decode.scheduler.*.jsonl") for line in f.read_text().splitlines()
             if '"release_decided"' in line]
    assert stops and all("the engine is stopping" in line for line in stops), stops
