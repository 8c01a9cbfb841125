"""Decode-to-prefill reuse in ``kvsm.router`` (``kvsm.router_holds``), without vLLM.

The hold store alone (longest match, expiry, capacity), then the router in
front of one fake prefill and two fake decode backends that answer as a
``bidirectional_kv_xfer`` decode engine does what the router relies on: a
non-streamed answer to a P/D leg (or to a ``kvsm_hold`` call) carries the
hold's ``kv_transfer_params`` with the chained digests of the held blocks (the
prompt's and generated tokens, full blocks of the computed ones), a streamed
one carries token ids only when asked (``return_token_ids``). Checked on what
the fakes received: the client's offer reaches the prefill leg and not the
decode leg; under ``--reuse-holds`` a turn's hold is learned (non-streamed, and
streamed by the ``kvsm_hold`` call after the stream) and the next turn's
prefill leg gets it, a prompt that does not start with the held tokens does
not, and the decode leg goes to the backend that holds; the log line and the
counters of ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvsm.hold_digests import block_digests
from kvsm.router import PREFILL_KV_PARAMS, create_app
from kvsm.router_holds import HoldStore, StreamTap, client_hold

MODEL = "m"
BS = 4  # the fake engines' block size
HOLD_ASK = {"kvsm_hold": True}


def _offer(engine: str, held: list[int], block_size: int = BS, expiry: float | None = None) -> dict[str, Any]:
    """A decode engine's hold offer of ``held`` (prompt and generated ids), as kvsm's scheduler builds it."""
    n = (len(held) - 1) // block_size  # full blocks of the computed tokens (the last one is not)
    return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [list(range(n))],
            "remote_engine_id": engine, "remote_request_id": f"r{len(held)}", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": n * block_size,
            "remote_block_size": block_size, "kvsm_hold_digests": block_digests(held, block_size, n),
            "kvsm_protocol": 1, "remote_blocks_expiry_time": time.time() + 60 if expiry is None else expiry,
            "transfer_mode": "pull"}


# -- the store alone ---------------------------------------------------------------------------


def test_the_store_gives_the_longest_hold_a_prompt_starts_with_once() -> None:
    store = HoldStore(on=True)
    short, long = list(range(9)), list(range(17))  # 2 and 4 held blocks
    assert store.learn("http://d0", _offer("e0", short)) and store.learn("http://d1", _offer("e1", long))
    assert not store.learn("http://d0", {"do_remote_decode": True})  # no blocks: no offer
    got = store.take([*range(20), 7])
    assert got is not None and got.url == "http://d1" and got.tokens == 16
    assert store.take([*range(20), 7]) is not None and len(store) == 0  # then the shorter; each once
    assert store.take([*range(20), 7]) is None
    # A prompt that diverges inside the held tokens does not get the hold.
    store.learn("http://d0", _offer("e0", long))
    assert store.take([*range(15), 99, 100]) is None and len(store) == 1
    assert store.backend_of({"remote_engine_id": "e1"}, ["http://d0", "http://d1"]) == "http://d1"
    assert store.backend_of({"remote_engine_id": "e1"}, ["http://d0"]) is None
    assert store.counts == {"learned": 3, "used": 2, "missed": 2, "client": 0, "expired": 0, "learn_failed": 0}


def test_the_store_drops_expired_holds_and_keeps_a_bounded_number() -> None:
    store = HoldStore(on=True, capacity=2)
    store.learn("d", _offer("e", list(range(9)), expiry=time.time() - 1))
    assert store.take(list(range(12))) is None and store.counts["expired"] == 1
    for first in (100, 200, 300):
        store.learn("d", _offer("e", [first, *range(8)]))
    assert len(store) == 2 and store.take([100, *range(8)]) is None and store.take([300, *range(8)]) is not None
    # Another block size matches at its own size.
    store.learn("d", _offer("e", list(range(17)), block_size=8))
    got = store.take(list(range(20)))
    assert got is not None and got.block_size == 8 and got.tokens == 16


def test_client_hold_takes_an_offer_out_of_the_body_and_leaves_other_params() -> None:
    offer = _offer("e", list(range(9)))
    assert client_hold({"prompt": [1], "kv_transfer_params": offer}) == ({"prompt": [1]}, offer)
    other = {"prompt": [1], "kv_transfer_params": {"do_remote_decode": True}}
    assert client_hold(other) == (other, None)


# -- the router in front of fake backends ---------------------------------------------------------


def _words(text: str) -> list[int]:
    return [len(w) for w in text.split()]  # one token per word: its length


def _gen(n: int) -> list[int]:
    return [2 + i % 5 for i in range(n)]  # token id k's text is "x" * k


class Backends:
    """A prefill (p0) and two decode backends (d0, d1) that record, per backend, every request body."""

    def __init__(self) -> None:
        self.sent: dict[str, list[dict[str, Any]]] = {n: [] for n in ("p0", "d0", "d1")}
        self.names: dict[str, str] = {}  # URL -> name
        self.offers: list[dict[str, Any]] = []  # every hold offered, in order
        self.hold_fails = False

    def prefill_app(self) -> web.Application:
        async def gen(request: web.Request) -> web.Response:
            body = await request.json()
            self.sent["p0"].append(body)
            choice: dict[str, Any] = {"index": 0, "text": "x" * _gen(1)[0] + " ", "finish_reason": "length"}
            if body.get("return_token_ids"):  # a seeded request's prefill leg (completions here)
                choice.update(token_ids=_gen(1), prompt_token_ids=body["prompt"])
            return web.json_response({"choices": [choice],
                                      "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p0"}})
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        return app

    def decode_app(self, name: str) -> web.Application:
        async def gen(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.sent[name].append(body)
            chat = request.path.endswith("/chat/completions")
            prompt = body.get("prompt")
            ids = (_words(" ".join(m["content"] for m in body["messages"])) if chat else
                   _words(prompt) if isinstance(prompt, str) else list(prompt))
            out_ids = _gen(body.get("max_tokens") or 4)
            asked = bool(body.get("return_token_ids"))
            if body.get("kv_transfer_params") == HOLD_ASK and self.hold_fails:
                return web.json_response({"error": {"message": "injected", "type": "X"}}, status=500)
            if not body.get("stream"):
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
                choice.update({"message": {"role": "assistant", "content": ""}} if chat else {"text": ""})
                answer: dict[str, Any] = {"choices": [choice]}
                if body.get("kv_transfer_params"):  # a P/D leg or a kvsm_hold call: held at its finish
                    answer["kv_transfer_params"] = _offer(f"engine-{name}", ids + out_ids)
                    self.offers.append(answer["kv_transfer_params"])
                return web.json_response(answer)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i, t in enumerate(out_ids):
                first, last = i == 0, i == len(out_ids) - 1
                c: dict[str, Any] = {"index": 0, "token_ids": [t] if asked else None,
                                     "finish_reason": "length" if last else None}
                chunk: dict[str, Any] = {"id": "c", "choices": [c]}
                if chat:
                    c["delta"] = {"content": "x" * t + " "}
                    if first and asked:
                        chunk["prompt_token_ids"] = ids
                else:
                    c.update(text="x" * t + " ", prompt_token_ids=ids if first and asked else None)
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out

        async def tokenize(request: web.Request) -> web.Response:
            body = await request.json()
            text = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])
            return web.json_response({"count": len(_words(text)), "max_model_len": 512, "tokens": _words(text)})
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, gen)
        app.router.add_post("/tokenize", tokenize)
        return app

    def holds_asked(self, name: str) -> list[dict[str, Any]]:
        return [b for b in self.sent[name] if b.get("kv_transfer_params") == HOLD_ASK]


Scenario = Callable[[TestClient, Backends], Awaitable[None]]


def _run(scenario: Scenario, **kw: Any) -> Backends:
    async def main() -> None:
        backends = Backends()
        servers = {n: TestServer(backends.prefill_app() if n == "p0" else backends.decode_app(n))
                   for n in backends.sent}
        for name, server in servers.items():
            await server.start_server()
            backends.names[str(server.make_url("")).rstrip("/")] = name
        urls = {n: str(s.make_url("")).rstrip("/") for n, s in servers.items()}
        app = create_app([urls["p0"]], [urls["d0"], urls["d1"]], 10, prefix_block_size=BS, **kw)
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


async def _post(client: TestClient, backends: Backends, body: dict[str, Any],
                path: str = "/v1/completions") -> tuple[str, bytes]:
    """The decode backend's name a request went to, and the response's body."""
    resp = await client.post(path, json={"model": MODEL, "max_tokens": 4, **body})
    assert resp.status == 200, await resp.text()
    return backends.names[resp.headers["X-KVSM-Decode-Backend"]], await resp.read()


async def _metrics(client: TestClient) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return await resp.text()


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def _until_metric(client: TestClient, line: str) -> None:
    for _ in range(200):
        if line in await _metrics(client):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {line!r} in /metrics")


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_a_client_offer_goes_to_the_prefill_leg_and_not_to_the_decode_leg(caplog: pytest.LogCaptureFixture) -> None:
    offer = _offer("engine-d1", list(range(13)))

    async def scenario(client: TestClient, backends: Backends) -> None:
        await _post(client, backends, {"prompt": list(range(20)), "kv_transfer_params": offer})
        assert backends.sent["p0"][-1]["kv_transfer_params"] == offer
        decode_leg = (backends.sent["d0"] + backends.sent["d1"])[-1]
        assert decode_leg["kv_transfer_params"] == {"do_remote_prefill": True, "remote_engine_id": "p0"}
        # Without an offer: the default prefill params, as before.
        await _post(client, backends, {"prompt": list(range(20))})
        assert backends.sent["p0"][-1]["kv_transfer_params"] == PREFILL_KV_PARAMS
        assert 'kvsm_router_holds_total{event="client"} 1' in await _metrics(client)

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario)
    lines = [r.getMessage() for r in caplog.records if "req=" in r.getMessage()]
    assert " hold=client:12" in lines[0] and " hold=" not in lines[1]


def test_reuse_holds_learns_a_turn_and_gives_the_next_turn_its_hold(caplog: pytest.LogCaptureFixture) -> None:
    turn1 = list(range(10, 20))

    async def scenario(client: TestClient, backends: Backends) -> None:
        where1, _ = await _post(client, backends, {"prompt": turn1, "max_tokens": 6})
        offer = backends.offers[-1]  # held: 10 prompt + 6 generated, 15 computed: 3 blocks
        assert offer["remote_num_tokens"] == 12 and offer["remote_engine_id"] == f"engine-{where1}"
        # Turn 2: turn 1's prompt, its answer and a new message. Round robin would pick the
        # other decode backend; the hold sends it where the blocks are.
        turn2 = [*turn1, *_gen(6), 7, 8, 9]
        where2, _ = await _post(client, backends, {"prompt": turn2})
        assert backends.sent["p0"][-1]["kv_transfer_params"] == offer
        assert where2 == where1
        assert backends.sent[where2][-1]["kv_transfer_params"] == {"do_remote_prefill": True,
                                                                     "remote_engine_id": "p0"}
        # A prompt that does not start with the held tokens (turn 1's first token changed): none.
        await _post(client, backends, {"prompt": [99, *turn2[1:]]})
        assert backends.sent["p0"][-1]["kv_transfer_params"] == PREFILL_KV_PARAMS
        # Turn 3 reads what turn 2 left held (turn 1's hold was read once, and is gone).
        await _post(client, backends, {"prompt": [*turn2, *_gen(4), 1]})
        assert backends.sent["p0"][-1]["kv_transfer_params"] == backends.offers[1]
        assert backends.offers[1]["kvsm_hold_digests"][:3] == offer["kvsm_hold_digests"]
        metrics = await _metrics(client)
        for event, n in (("learned", 4), ("used", 2), ("missed", 2)):
            assert f'kvsm_router_holds_total{{event="{event}"}} {n}' in metrics, metrics
        assert 'kvsm_router_affinity_total{role="decode",reason="hold"} 2' in metrics
        assert "kvsm_router_reuse_holds 1" in metrics

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario, reuse_holds=True)
    lines = [r.getMessage() for r in caplog.records if "req=" in r.getMessage()]
    assert [line.split(" hold=")[1].split()[0] for line in lines] == ["miss", "store:12", "miss", "store:20"]
    assert "affinity=decode:hold:0," in lines[1] and "affinity=decode:hold:0," in lines[3]


def test_without_reuse_holds_nothing_is_learned() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        await _post(client, backends, {"prompt": list(range(10)), "max_tokens": 6})
        await _post(client, backends, {"prompt": [*range(10), *_gen(6), 1]})
        assert all(b["kv_transfer_params"] == PREFILL_KV_PARAMS for b in backends.sent["p0"])
        assert 'kvsm_router_holds_total{event="learned"} 0' in await _metrics(client)

    _run(scenario)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_turn_is_held_after_its_stream_and_the_client_sees_no_ids_it_did_not_ask(path: str) -> None:
    chat = path.endswith("/chat/completions")
    text = "aa bbb c dddd eeeee ff g"

    def prompt(words: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words}

    async def scenario(client: TestClient, backends: Backends) -> None:
        where, raw = await _post(client, backends, {**prompt(text), "stream": True, "max_tokens": 6}, path)
        leg = backends.sent[where][0]
        assert leg["return_token_ids"] is True and leg["stream"] is True
        events = _events(raw)
        assert len(events) == 6 and all("prompt_token_ids" not in e for e in events)
        for e in events:
            c = e["choices"][0]
            assert c.get("token_ids") is None and c.get("prompt_token_ids") is None, e
        await _until(lambda: bool(backends.holds_asked(where)))
        ask = backends.holds_asked(where)[0]
        assert ask["prompt"] == [*_words(text), *_gen(6)]
        assert (ask["max_tokens"], ask["stream"], ask["model"]) == (1, False, MODEL)
        await _until_metric(client, "kvsm_router_holds_stored 1")
        # The next turn (its text: turn 1's, the answer's and new words) reads that hold.
        answer = " ".join("x" * t for t in _gen(6))
        where2, _ = await _post(client, backends, prompt(f"{text} {answer} hh ii"), path)
        assert backends.sent["p0"][-1]["kv_transfer_params"] == backends.offers[0] and where2 == where

    _run(scenario, reuse_holds=True)


def test_a_client_asking_for_token_ids_keeps_them_and_a_failed_hold_call_stays_off_its_stream() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        backends.hold_fails = True
        body = {"prompt": list(range(9)), "stream": True, "max_tokens": 3, "return_token_ids": True}
        where, raw = await _post(client, backends, body)
        events = _events(raw)
        assert events[0]["choices"][0]["prompt_token_ids"] == list(range(9))
        assert [e["choices"][0]["token_ids"] for e in events] == [[t] for t in _gen(3)]
        await _until(lambda: bool(backends.holds_asked(where)))
        await _until_metric(client, 'kvsm_router_holds_total{event="learn_failed"} 1')
        assert "kvsm_router_holds_stored 0" in await _metrics(client)
        # n > 1: several conversations, none learned, no ids asked.
        where, _ = await _post(client, backends, {"prompt": list(range(9)), "stream": True, "n": 2})
        assert "return_token_ids" not in backends.sent[where][-1]

    _run(scenario, reuse_holds=True)


def test_stream_tap_passes_events_it_cannot_read_and_learns_only_a_finished_stream() -> None:
    tap = StreamTap("/v1/completions", {"prompt": [1], "stream": True})
    assert tap.leg_fields() == {"return_token_ids": True}
    first = {"choices": [{"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": [1, 2]}]}
    out = tap.feed(f"data: {json.dumps(first)}\n\ndata: {{broken".encode())
    assert json.loads(out[6:]) == {"choices": [{"index": 0, "text": "a", "token_ids": None, "prompt_token_ids": None}]}
    assert tap.token_ids() is None  # not finished
    assert tap.close() == b"data: {broken\n\n"
    tap.feed(b'data: {"choices": [{"index": 0, "text": "b", "token_ids": [6], "finish_reason": "stop"}]}\n\n')
    assert tap.token_ids() == [1, 2, 5, 6]
    assert StreamTap.of(True, "/v1/completions", {"prompt": [1], "stream": True, "echo": True}) is None
    assert StreamTap.of(False, "/v1/completions", {"prompt": [1], "stream": True}) is None


def test_a_seeded_stream_is_learned_too() -> None:
    async def scenario(client: TestClient, backends: Backends) -> None:
        where, raw = await _post(client, backends, {"prompt": list(range(9)), "stream": True})
        events = _events(raw)
        assert "".join(e["choices"][0]["text"] for e in events) == "".join("x" * t + " " for t in _gen(4))
        assert all(e["choices"][0].get("token_ids") is None for e in events), events
        await _until(lambda: bool(backends.holds_asked(where)))
        assert backends.holds_asked(where)[0]["prompt"] == [*range(9), *_gen(4)]
        await _until_metric(client, "kvsm_router_holds_stored 1")

    _run(scenario, reuse_holds=True, first_token_seeding=True)
