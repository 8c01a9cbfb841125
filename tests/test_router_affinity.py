"""Prefix affinity in ``kvsm.router`` (``kvsm.router_affinity``), without vLLM.

The balancer alone (its choice, ties, the load guard), then the router in front
of two fake prefill and two fake decode backends (aiohttp apps that answer as
vLLM does what the router relies on: a prefill answer with
``kv_transfer_params``, a decode answer as JSON or server-sent events,
``/tokenize``): a conversation's turns meet the backends of its first turn,
unrelated conversations spread round robin, the load guard, the counters of
``/metrics`` and the log line, and affinity off choosing as before.
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
from kvsm.router_affinity import Balancer
from kvsm.router_decider import PrefixIndex, block_hashes

MODEL = "m"
BS = 4  # the prefix index's block size here


# -- the balancer alone ----------------------------------------------------------------------


def _balancer(on: bool = True, max_inflight: int | None = None) -> Balancer:
    return Balancer(["p1", "p2"], ["d1", "d2", "d3"], PrefixIndex(BS), on=on, max_inflight=max_inflight)


def _hashes(tokens: list[int]) -> list[int]:
    return block_hashes(MODEL, tokens, BS)


def test_longest_prefix_wins_ties_and_misses_go_round_robin() -> None:
    b = _balancer()
    b.record(b.pick("decode", _hashes(list(range(8)))), _hashes(list(range(8))))  # a miss: d1, 2 blocks
    b.indexes["decode"].add("d2", _hashes(list(range(4))))  # d2 holds the first block only
    turn2 = _hashes([*range(8), 50, 51, 52, 53])
    choice = b.pick("decode", turn2)
    assert (choice.url, choice.reason, choice.blocks, choice.field()) == ("d1", "prefix", 2, "decode:prefix:2")
    # The round robin turned once (the miss): the next miss goes to d2, then d3.
    assert [b.pick("decode", _hashes([9] * 4)).url for _ in range(3)] == ["d2", "d3", "d1"]
    # Two backends holding the same longest prefix: round robin between them (d3 holds none).
    b.indexes["decode"].add("d2", _hashes(list(range(8))))
    assert [(c.url, c.reason) for c in (b.pick("decode", turn2) for _ in range(3))] == [
        ("d2", "tie"), ("d1", "tie"), ("d2", "tie")]
    assert b.pick("decode", None).reason == "no_tokens"
    # The prefill index is its own: nothing recorded there yet.
    assert b.pick("prefill", turn2).reason == "miss"
    assert b.counts[("decode", "prefix")] == 1 and b.counts[("decode", "tie")] == 3


def test_the_load_guard_sends_a_loaded_favourite_s_requests_to_the_least_loaded() -> None:
    b = _balancer()
    hashes = _hashes(list(range(8)))
    b.indexes["decode"].add("d2", hashes)
    held = [b.hold(b.pick("decode", hashes)) for _ in range(5)]  # d2 at 0..4 in flight: not over 2 * 0 + 4
    for h in held:
        h.__enter__()
    assert b.inflight["decode"] == {"d1": 0, "d2": 5, "d3": 0}
    over = b.pick("decode", hashes)
    assert (over.url, over.reason, over.blocks) == ("d1", "overloaded", 0)
    with b.hold(over), b.hold(b.pick("decode", hashes)):  # d3 next: the least loaded, round robin
        assert b.inflight["decode"] == {"d1": 1, "d2": 5, "d3": 1}
        # Now the least loaded has 1: d2's limit is 2 * 1 + 4 = 6, and 5 is not over it.
        assert b.pick("decode", hashes).url == "d2"
    for h in held:
        h.__exit__(None, None, None)
    assert b.inflight["decode"] == {"d1": 0, "d2": 0, "d3": 0}
    # A limit given: more than 1 in flight is too many.
    b1 = _balancer(max_inflight=1)
    b1.indexes["decode"].add("d2", hashes)
    with b1.hold(b1.pick("decode", hashes)), b1.hold(b1.pick("decode", hashes)):
        assert b1.pick("decode", hashes).reason == "overloaded"
    with pytest.raises(ValueError):
        _balancer(max_inflight=-1)


def test_off_is_round_robin_and_records_no_prefill_blocks() -> None:
    b = _balancer(on=False)
    hashes = _hashes(list(range(8)))
    b.indexes["decode"].add("d3", hashes)
    assert [(c.url, c.reason) for c in (b.pick("decode", hashes) for _ in range(4))] == [
        ("d1", "off"), ("d2", "off"), ("d3", "off"), ("d1", "off")]
    b.record(b.pick("prefill", hashes), hashes)
    assert b.indexes["prefill"].size("p2") == 0  # nothing to remember when nothing reads it
    text = b.prometheus()
    assert 'kvsm_router_affinity_total{role="decode",reason="off"} 4' in text
    assert 'kvsm_router_inflight_requests{role="decode",backend="d1"} 0' in text
    assert "kvsm_router_prefix_affinity 0" in text


# -- the router in front of fake backends ---------------------------------------------------


class Backends:
    """Two prefill and two decode backends that record, per backend, every request body."""

    def __init__(self) -> None:
        self.sent: dict[str, list[dict[str, Any]]] = {n: [] for n in ("p0", "p1", "d0", "d1")}
        self.tokenized: dict[str, list[dict[str, Any]]] = {"d0": [], "d1": []}
        self.names: dict[str, str] = {}  # URL -> name
        self.decode_gate = asyncio.Event()
        self.decode_gate.set()
        self.tokenize_fails = False

    def prefill_app(self, name: str) -> web.Application:
        async def gen(request: web.Request) -> web.Response:
            self.sent[name].append(await request.json())
            return web.json_response({"choices": [{"index": 0, "text": "x"}],
                                      "kv_transfer_params": {"remote_engine_id": name}})
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        return app

    def decode_app(self, name: str) -> web.Application:
        async def gen(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.sent[name].append(body)
            await self.decode_gate.wait()
            text = f"{name}:{'pd' if body.get('kv_transfer_params') else 'local'}"
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
            self.tokenized[name].append(body)
            if self.tokenize_fails:
                return web.json_response({"error": {"message": "no tokenizer", "type": "X"}}, status=500)
            text = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])
            tokens = [len(w) * 100 + sum(map(ord, w)) % 97 for w in text.split()]  # one token per word
            return web.json_response({"count": len(tokens), "max_model_len": 512, "tokens": tokens})
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        app.router.add_post("/tokenize", tokenize)
        return app


Scenario = Callable[[TestClient, Backends], Awaitable[None]]


def _run(scenario: Scenario, affinity: bool, **kw: Any) -> Backends:
    async def main() -> None:
        backends = Backends()
        servers = {n: TestServer(backends.prefill_app(n) if n[0] == "p" else backends.decode_app(n))
                   for n in backends.sent}
        for name, server in servers.items():
            await server.start_server()
            backends.names[str(server.make_url("")).rstrip("/")] = name
        urls = {n: str(s.make_url("")).rstrip("/") for n, s in servers.items()}
        app = create_app([urls["p0"], urls["p1"]], [urls["d0"], urls["d1"]], 10, prefix_block_size=BS,
                         prefix_affinity=affinity, **kw)
        try:
            async with TestClient(TestServer(app)) as client:
                await scenario(client, backends)
        finally:
            for server in servers.values():
                await server.close()
        out.append(backends)

    out: list[Backends] = []
    asyncio.run(main())
    return out[0]


async def _where(client: TestClient, backends: Backends, body: dict[str, Any],
                 path: str = "/v1/completions") -> tuple[str, str]:
    """(prefill, decode) backend names a request went to ("-" for no prefill), by the router's headers."""
    resp = await client.post(path, json={"model": MODEL, "max_tokens": 2, **body})
    assert resp.status == 200, await resp.text()
    await resp.read()
    prefill = resp.headers["X-KVSM-Prefill-Backend"]
    return backends.names.get(prefill, "-"), backends.names[resp.headers["X-KVSM-Decode-Backend"]]


async def _metrics(client: TestClient) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return await resp.text()


def _conversation(seed: int) -> list[list[int]]:
    """Four turns' token-id prompts: each is the last one, its answer and a new message."""
    turns = [[seed * 1000 + i for i in range(20)]]
    for k in range(1, 4):
        answer = [seed * 1000 + 500 + 10 * k + i for i in range(6)]
        turns.append([*turns[-1], *answer, *(seed * 1000 + 800 + 10 * k + i for i in range(5))])
    return turns


async def _interleaved(client: TestClient, backends: Backends, stream: bool = False) -> list[tuple[str, str]]:
    """Conversation A's four turns, each followed by an unrelated conversation's first turn."""
    out = []
    for k, turn in enumerate(_conversation(1)):
        out.append(await _where(client, backends, {"prompt": turn, "stream": stream}))
        out.append(await _where(client, backends, {"prompt": _conversation(10 + k)[0]}))
    return out


def test_a_conversation_meets_its_first_turn_s_backends_and_others_spread(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        seen = await _interleaved(client, backends, stream=True)
        assert seen[0::2] == [("p0", "d0")] * 4  # conversation A: every turn where its first went
        # The unrelated conversations take the round robin's turns: A's first turn was p0/d0.
        assert seen[1::2] == [("p1", "d1"), ("p0", "d0"), ("p1", "d1"), ("p0", "d0")]
        metrics = await _metrics(client)
        for role in ("prefill", "decode"):
            assert f'kvsm_router_affinity_total{{role="{role}",reason="prefix"}} 3' in metrics
            assert f'kvsm_router_affinity_total{{role="{role}",reason="miss"}} 5' in metrics
        assert "kvsm_router_prefix_affinity 1" in metrics
        assert 'kvsm_router_inflight_requests{role="decode",backend=' in metrics

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        backends = _run(scenario, affinity=True)
    assert backends.tokenized == {"d0": [], "d1": []}  # token ids are taken as given
    lines = [r.getMessage() for r in caplog.records if "req=" in r.getMessage()]
    assert "affinity=decode:miss:0,prefill:miss:0" in lines[0]
    # Turn 2: 20 + 6 + 5 = 31 tokens, of which turn 1's 20 are 5 blocks of 4 held by both.
    assert "affinity=decode:prefix:5,prefill:prefix:5" in lines[2]


def test_affinity_off_keeps_the_round_robin_exactly() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        seen = await _interleaved(client, backends)
        assert seen == [("p0", "d0"), ("p1", "d1")] * 4
        seen = [await _where(client, backends, {"prompt": "a text prompt"}) for _ in range(3)]
        assert seen == [("p0", "d0"), ("p1", "d1"), ("p0", "d0")]
        metrics = await _metrics(client)
        assert 'kvsm_router_affinity_total{role="decode",reason="off"} 11' in metrics
        assert 'kvsm_router_affinity_total{role="prefill",reason="off"} 11' in metrics
        assert "kvsm_router_prefix_affinity 0" in metrics

    backends = _run(scenario, affinity=False)
    assert backends.tokenized == {"d0": [], "d1": []}  # nothing counted: no threshold, no affinity


def test_text_and_chat_are_tokenized_for_affinity_and_a_failure_goes_round_robin() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        first = " ".join(f"w{i}" for i in range(12))
        turns = [first, first + " answer one more words", first + " answer one more words answer two new"]
        seen = []
        for k, turn in enumerate(turns):
            seen.append(await _where(client, backends, {"prompt": turn}))
            seen.append(await _where(client, backends, {"prompt": f"other {k} " * 6}))
        assert seen[0::2] == [("p0", "d0")] * 3
        assert seen[1::2] == [("p1", "d1"), ("p0", "d0"), ("p1", "d1")]
        chat = {"messages": [{"role": "user", "content": first}]}
        assert await _where(client, backends, chat, "/v1/chat/completions") == ("p0", "d0")
        # Which decode backend counts the tokens turns on its own.
        assert [len(v) for v in backends.tokenized.values()] == [4, 3]
        backends.tokenize_fails = True
        # The round robin's turn: four misses so far (p0/d0, p1/d1, p0/d0, p1/d1).
        assert [await _where(client, backends, {"prompt": first}) for _ in range(2)] == [("p0", "d0"),
                                                                                         ("p1", "d1")]
        assert 'kvsm_router_affinity_total{role="decode",reason="no_tokens"} 2' in await _metrics(client)

    _run(scenario, affinity=True)


def test_with_the_threshold_a_next_turn_goes_alone_to_its_decode_backend() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        a, b = _conversation(1), _conversation(2)
        assert await _where(client, backends, {"prompt": a[0]}) == ("p0", "d0")  # 20 uncached: P/D
        assert await _where(client, backends, {"prompt": b[0]}) == ("p1", "d1")
        # 11 new tokens beyond turn 1's cached 20: under 16, so d0 alone computes them.
        assert await _where(client, backends, {"prompt": a[1]}) == ("-", "d0")
        assert await _where(client, backends, {"prompt": b[1]}) == ("-", "d1")
        metrics = await _metrics(client)
        assert 'kvsm_router_disagg_total{path="local",reason="below_threshold"} 2' in metrics
        # No prefill choice for a prompt that skips the prefill engine.
        assert 'kvsm_router_affinity_total{role="prefill",reason="miss"} 2' in metrics
        assert 'kvsm_router_affinity_total{role="prefill",reason="prefix"} 0' in metrics

    _run(scenario, affinity=True, disagg_threshold=16)


def test_the_load_guard_in_front_of_backends_and_a_list_of_prompts() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        a = _conversation(1)
        assert await _where(client, backends, {"prompt": a[0]}) == ("p0", "d0")
        backends.decode_gate.clear()  # decode answers wait: requests stay in flight
        tasks = [asyncio.ensure_future(_where(client, backends, {"prompt": a[1]})) for _ in range(4)]
        while sum(len(backends.sent[d]) for d in ("d0", "d1")) < 5:
            await asyncio.sleep(0.01)
        metrics = await _metrics(client)
        assert 'kvsm_router_inflight_requests{role="decode",backend="' in metrics
        backends.decode_gate.set()
        decodes = sorted(d for _, d in await asyncio.gather(*tasks))
        # Limit 1: d0 takes two (at 0 and 1 in flight), then d1, the least loaded, the rest.
        assert decodes == ["d0", "d0", "d1", "d1"]
        assert 'kvsm_router_affinity_total{role="decode",reason="overloaded"} 2' in await _metrics(client)
        # A list of prompts: each prompt chooses for itself.
        resp = await client.post("/v1/completions", json={"model": MODEL, "max_tokens": 2,
                                                          "prompt": [a[2], _conversation(5)[0]]})
        assert resp.status == 200
        texts = [c["text"] for c in (await resp.json())["choices"]]
        assert texts[0] in ("d0:pd", "d1:pd")  # a[1]'s blocks are on both now

    _run(scenario, affinity=True, affinity_max_inflight=1)


def test_comparing_backends_leaves_their_least_recently_used_order_be() -> None:
    index = PrefixIndex(block_size=2, capacity=4)
    index.add("d", block_hashes(MODEL, [1, 2, 3, 4], 2))
    index.add("d", block_hashes(MODEL, [5, 6, 7, 8], 2))
    assert index.matched_blocks("d", block_hashes(MODEL, [1, 2, 3, 4], 2), touch=False) == 2
    index.add("d", block_hashes(MODEL, [9, 10], 2))  # one over: [1, 2]'s hash, still the oldest, goes
    assert index.matched_blocks("d", block_hashes(MODEL, [1, 2, 3, 4], 2)) == 0
    assert index.cached_tokens("d", MODEL, [5, 6, 7, 8]) == 4
