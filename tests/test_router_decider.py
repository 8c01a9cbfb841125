"""Selective disaggregation in ``kvsm.router`` (``kvsm.router_decider``), without vLLM.

The prefix index and the decision alone, then the router in front of two fake
backends (aiohttp apps that record what they are sent): which prompts skip the
prefill backend, what the decode backend is sent then, ``/tokenize`` and its
failures, lists of prompts, the counters of ``/metrics`` and the log line.
The same against real servers: ``tests/test_router.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvsm.router import create_app
from kvsm.router_decider import Decider, PrefixIndex, block_hashes, tokenize_body

MODEL = "m"


# -- the index and the decision -----------------------------------------------------------


def test_block_hashes_chain_whole_blocks_and_the_model() -> None:
    a = block_hashes(MODEL, list(range(40)), 16)
    assert len(a) == 2  # the last 8 tokens are no whole block
    assert block_hashes(MODEL, list(range(32)), 16) == a
    # A block's hash covers every block before it: a different first block changes all.
    b = block_hashes(MODEL, [99, *range(1, 40)], 16)
    assert b[0] != a[0] and b[1] != a[1]
    assert block_hashes("other", list(range(40)), 16) != a


def test_prefix_index_counts_leading_whole_blocks_per_backend() -> None:
    index = PrefixIndex(block_size=4)
    index.record("d1", MODEL, list(range(10)))  # blocks 0-3, 4-7
    assert index.cached_tokens("d1", MODEL, list(range(10))) == 8
    assert index.cached_tokens("d1", MODEL, [*range(6), 50, 51, 52, 53]) == 4  # diverges in the second block
    assert index.cached_tokens("d1", MODEL, [7, *range(1, 10)]) == 0
    assert index.cached_tokens("d2", MODEL, list(range(10))) == 0
    assert index.cached_tokens("d1", "other", list(range(10))) == 0


def test_prefix_index_drops_the_least_recently_used_first() -> None:
    index = PrefixIndex(block_size=2, capacity=4)
    index.record("d", MODEL, [1, 2, 3, 4])  # 2 hashes
    index.record("d", MODEL, [5, 6, 7, 8])  # 2 more: full
    assert index.cached_tokens("d", MODEL, [1, 2, 3, 4]) == 4  # used again: now the newest
    index.record("d", MODEL, [9, 10])  # one over: [5, 6]'s first hash goes
    assert index.size("d") == 4
    assert index.cached_tokens("d", MODEL, [5, 6, 7, 8]) == 0
    assert index.cached_tokens("d", MODEL, [1, 2, 3, 4]) == 4
    assert index.cached_tokens("d", MODEL, [9, 10]) == 2


def test_decider_threshold_and_counts() -> None:
    off = Decider(0)
    assert (off.decide("d", MODEL, [1] * 5).path, off.decide("d", MODEL, [1] * 5).reason) == ("pd", "off")
    d = Decider(threshold=10, block_size=4)
    short = d.decide("d", MODEL, list(range(9)))
    assert (short.path, short.reason, short.uncached) == ("local", "below_threshold", 9)
    long = d.decide("d", MODEL, list(range(10)))
    assert (long.path, long.uncached) == ("pd", 10)
    d.index.record("d", MODEL, list(range(100)))
    cached = d.decide("d", MODEL, [*range(100), *range(500, 509)])  # 100 cached, 9 new
    assert (cached.path, cached.cached_tokens, cached.uncached) == ("local", 100, 9)
    assert "disagg=local disagg_reason=below_threshold uncached=9 threshold=10" in cached.fields()
    text = d.prometheus()
    assert 'kvsm_router_disagg_total{path="local",reason="below_threshold"} 2' in text
    assert 'kvsm_router_disagg_total{path="pd",reason="above_threshold"} 1' in text
    assert "kvsm_router_disagg_threshold_tokens 10" in text
    with pytest.raises(ValueError):
        Decider(-1)


def test_tokenize_body() -> None:
    assert tokenize_body("/v1/completions", {}, [5, 6]) == [5, 6]
    assert tokenize_body("/v1/completions", {"model": MODEL, "add_special_tokens": False}, "hi") == {
        "model": MODEL, "prompt": "hi", "add_special_tokens": False}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 3}
    assert tokenize_body("/v1/chat/completions", chat, None) == {"model": MODEL, "messages": chat["messages"],
                                                                  "tools": []}
    assert tokenize_body("/v1/completions", {}, [True, 2]) is None
    assert tokenize_body("/v1/completions", {}, {"x": 1}) is None


# -- the router in front of fake backends ---------------------------------------------------


class Fakes:
    """A prefill and a decode backend that record every request body."""

    def __init__(self) -> None:
        self.prefill: list[dict[str, Any]] = []
        self.decode: list[dict[str, Any]] = []
        self.tokenize: list[dict[str, Any]] = []
        self.tokenize_fails = False

    def prefill_app(self) -> web.Application:
        async def gen(request: web.Request) -> web.Response:
            self.prefill.append(await request.json())
            return web.json_response({"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {"at": "p"}})
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        return app

    def decode_app(self) -> web.Application:
        async def gen(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.decode.append(body)
            text = "pd" if body.get("kv_transfer_params") else "local"
            if not body.get("stream"):
                return web.json_response({"choices": [{"index": 0, "text": text}],
                                          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\ndata: [DONE]\n\n"
                            .encode())
            await out.write_eof()
            return out

        async def tokenize(request: web.Request) -> web.Response:
            body = await request.json()
            self.tokenize.append(body)
            if self.tokenize_fails:
                return web.json_response({"error": {"message": "no tokenizer", "type": "X"}}, status=500)
            text = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])
            tokens = [len(w) for w in text.split()]  # one token per word
            return web.json_response({"count": len(tokens), "max_model_len": 512, "tokens": tokens})
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        app.router.add_post("/tokenize", tokenize)
        return app


Scenario = Callable[[TestClient, Fakes], Awaitable[None]]


def _run(scenario: Scenario, threshold: int, block_size: int = 4) -> Fakes:
    async def main() -> None:
        fakes = Fakes()
        p, d = TestServer(fakes.prefill_app()), TestServer(fakes.decode_app())
        await p.start_server()
        await d.start_server()
        app = create_app([str(p.make_url("")).rstrip("/")], [str(d.make_url("")).rstrip("/")], 10,
                         disagg_threshold=threshold, prefix_block_size=block_size)
        try:
            async with TestClient(TestServer(app)) as client:
                await scenario(client, fakes)
        finally:
            await p.close()
            await d.close()
        out.append(fakes)

    out: list[Fakes] = []
    asyncio.run(main())
    return out[0]


async def _text(client: TestClient, body: dict[str, Any], path: str = "/v1/completions") -> str:
    resp = await client.post(path, json={"model": MODEL, "max_tokens": 2, **body})
    assert resp.status == 200, await resp.text()
    if body.get("stream"):
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in (await resp.text()).splitlines()
                       if line.startswith("data: {"))
    out = await resp.json()
    return "".join(c.get("text") or c.get("message", {}).get("content", "") for c in out["choices"])


async def _metrics(client: TestClient) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    return await resp.text()


def test_short_prompts_go_alone_long_ones_by_pd_and_a_cached_prefix_counts(caplog: pytest.LogCaptureFixture) -> None:
    long = list(range(100, 120))

    async def scenario(client: TestClient, fakes: Fakes) -> None:
        assert await _text(client, {"prompt": [1, 2, 3]}) == "local"
        assert fakes.prefill == [] and "kv_transfer_params" not in fakes.decode[-1]
        assert await _text(client, {"prompt": long}) == "pd"
        assert len(fakes.prefill) == 1 and fakes.decode[-1]["kv_transfer_params"] == {"at": "p"}
        # The same 20 tokens and 3 more: 20 cached (whole blocks of 4), 3 uncached.
        assert await _text(client, {"prompt": [*long, 7, 8, 9], "stream": True}) == "local"
        assert len(fakes.prefill) == 1
        metrics = await _metrics(client)
        assert 'kvsm_router_disagg_total{path="local",reason="below_threshold"} 2' in metrics
        assert 'kvsm_router_disagg_total{path="pd",reason="above_threshold"} 1' in metrics

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        fakes = _run(scenario, threshold=10)
    assert fakes.tokenize == []  # token ids are counted as given
    lines = [r.getMessage() for r in caplog.records if "req=" in r.getMessage()]
    assert "prefill=- " in lines[0] and "disagg=local disagg_reason=below_threshold uncached=3 threshold=10" in lines[0]
    assert "disagg=pd disagg_reason=above_threshold uncached=20 threshold=10" in lines[1]
    assert "uncached=3 " in lines[2]


def test_text_and_chat_are_counted_by_tokenize() -> None:
    async def scenario(client: TestClient, fakes: Fakes) -> None:
        assert await _text(client, {"prompt": "two words"}) == "local"
        assert await _text(client, {"prompt": " ".join(["w"] * 12)}) == "pd"
        chat = {"messages": [{"role": "user", "content": "hello there"}], "add_generation_prompt": True}
        assert await _text(client, chat, "/v1/chat/completions") == "local"
        assert fakes.tokenize[-1] == {"model": MODEL, "messages": chat["messages"], "add_generation_prompt": True}
        assert len(fakes.prefill) == 1

    fakes = _run(scenario, threshold=10)
    assert [b.get("prompt") for b in fakes.tokenize[:2]] == ["two words", " ".join(["w"] * 12)]


def test_a_failed_tokenize_means_pd_not_a_failed_request() -> None:
    async def scenario(client: TestClient, fakes: Fakes) -> None:
        fakes.tokenize_fails = True
        assert await _text(client, {"prompt": "two words"}) == "pd"
        assert 'reason="tokenize_failed"} 1' in await _metrics(client)

    assert len(_run(scenario, threshold=10).prefill) == 1


def test_threshold_zero_never_tokenizes_and_always_pd() -> None:
    async def scenario(client: TestClient, fakes: Fakes) -> None:
        assert await _text(client, {"prompt": "two words"}) == "pd"
        assert await _text(client, {"prompt": [1]}) == "pd"
        assert 'kvsm_router_disagg_total{path="pd",reason="off"} 2' in await _metrics(client)

    fakes = _run(scenario, threshold=0)
    assert fakes.tokenize == [] and len(fakes.prefill) == 2


def test_a_list_of_prompts_is_decided_per_prompt_and_a_streamed_one_goes_by_pd() -> None:
    async def scenario(client: TestClient, fakes: Fakes) -> None:
        assert await _text(client, {"prompt": [[1, 2], list(range(50, 80)), [3]]}) == "localpdlocal"
        assert len(fakes.prefill) == 1 and fakes.prefill[0]["prompt"] == list(range(50, 80))
        assert await _text(client, {"prompt": [[1, 2], [3]], "stream": True}) == "pd"
        assert 'reason="streamed_list"} 1' in await _metrics(client)

    _run(scenario, threshold=10)


def test_cli_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsm import router, router_cli

    seen: dict[str, Any] = {}
    monkeypatch.setattr(router, "create_app", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(router.web, "run_app", lambda *a, **kw: None)
    monkeypatch.setattr(router.logging, "basicConfig", lambda **kw: None)
    urls = ["--prefill", "http://p", "--decode", "http://d"]
    router.main([*urls, "--disagg-threshold", "7", "--prefix-block-size", "128", "--prefix-affinity",
                 "--affinity-max-inflight", "3", "--first-token-seeding", "--reuse-holds"])
    assert seen == {"disagg_threshold": 7, "prefix_block_size": 128, "prefix_affinity": True,
                    "affinity_max_inflight": 3, "first_token_seeding": True, "reuse_holds": True}
    router.main(urls)
    assert seen == {"disagg_threshold": router_cli.DEFAULT_DISAGG_THRESHOLD, "prefix_block_size": 16,
                    "prefix_affinity": False, "affinity_max_inflight": None, "first_token_seeding": False,
                    "reuse_holds": False}
    with pytest.raises(SystemExit):
        router.main([*urls, "--disagg-threshold", "-1"])
    with pytest.raises(SystemExit):
        router.main([*urls, "--affinity-max-inflight", "-1"])
