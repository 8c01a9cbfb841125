"""Streamed push in ``kvsm.router`` (``--transfer-mode``, ``kvsm.router_stream``), without vLLM.

The router in front of a fake prefill backend that answers as kvsm's prefill
engine does what the router relies on (its coordinates in the answer's
``kv_transfer_params``, ``kvsm_protocol`` among them), whose streamed legs can
be held back until the test lets them go or made to fail, and the decode
backend of ``tests/test_router_decider.py`` (JSON or server-sent events), told
apart by when each decode request arrived. Checked on what the fakes received:
a prefill backend's first request goes sequentially with ``transfer_mode``
push and teaches its coordinates; the next goes with both legs at once (the
decode leg reaches its backend while the prefill leg is still held back), with
the contract's params and one join key; the client gets the decode's answer;
a failed prefill leg fails nothing and is counted; a failed decode leg cancels
the prefill leg; lists of prompts, the threshold and a decode hold; the option
conflicts; ``pull`` and ``push`` only set the prefill leg's ``transfer_mode``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from test_router_decider import MODEL, Fakes, _metrics, _text
from test_router_holds import _offer, _until

from kvsm import router
from kvsm.router import PREFILL_KV_PARAMS, create_app
from kvsm.router_stream import KEY_PREFIX

PROMPT = list(range(100, 120))
HOST, PORT = "10.0.0.7", 5601
GENERATE = ("/v1/completions", "/v1/chat/completions")


class StreamFakes(Fakes):
    """``Fakes``' decode backend, and a prefill backend that answers as a kvsm engine does."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()  # streamed prefill legs answer once it is set
        self.gate.set()
        self.fail_stream_prefill = False
        self.fail_decode = False
        self.decode_gate = asyncio.Event()  # decode requests are answered once it is set
        self.decode_gate.set()
        self.engine_id = "engine-p0"
        self.groups = 2
        self.block_size: int | None = 16
        self.answered = 0  # prefill answers sent
        self.answered_at_decode: list[int] = []  # self.answered when each decode request arrived
        self.waiting = 0  # streamed prefill legs held back now
        self.cancelled = 0  # prefill legs whose connection the router closed while they waited

    def prefill_app(self) -> web.Application:
        async def gen(request: web.Request) -> web.Response:
            body = await request.json()
            self.prefill.append(body)
            asked = body["kv_transfer_params"]
            if asked.get("transfer_mode") == "stream":
                self.waiting += 1
                try:
                    await self.gate.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
                finally:
                    self.waiting -= 1
                if self.fail_stream_prefill:
                    return web.json_response({"error": {"message": "injected", "type": "X"}}, status=500)
            self.answered += 1
            kv = {"do_remote_prefill": True, "do_remote_decode": False,
                  "remote_block_ids": [[1, 2, 3]] + [[4]] * (self.groups - 1), "remote_engine_id": self.engine_id,
                  "remote_request_id": request.headers["X-Request-Id"], "remote_host": HOST, "remote_port": PORT,
                  "tp_size": 1, "dcp_size": 1, "pp_size": 1, "kvsm_protocol": 1, "remote_num_tokens": 20,
                  "transfer_mode": asked.get("transfer_mode", "pull"),
                  **({} if self.block_size is None else {"remote_block_size": self.block_size})}
            return web.json_response({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                      "kv_transfer_params": kv})
        app = web.Application()
        for path in GENERATE:
            app.router.add_post(path, gen)
        return app

    def decode_app(self) -> web.Application:
        @web.middleware
        async def arrived(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                          ) -> web.StreamResponse:
            if request.path in GENERATE:
                self.answered_at_decode.append(self.answered)
                if self.fail_decode:  # once the prefill leg is in (and held back): its cancel is seen
                    await _until(lambda: self.waiting > 0)
                    return web.json_response({"error": {"message": "decode down", "type": "X"}}, status=500)
                await self.decode_gate.wait()
            return await handler(request)
        app = super().decode_app()
        app.middlewares.append(arrived)
        return app

    def coordinates(self) -> dict[str, Any]:
        """What a streamed decode leg must name the prefill engine by."""
        return {"remote_engine_id": self.engine_id, "remote_host": HOST, "remote_port": PORT, "tp_size": 1,
                "dcp_size": 1, "pp_size": 1, "kvsm_protocol": 1,
                **({} if self.block_size is None else {"remote_block_size": self.block_size})}


Scenario = Callable[[TestClient, StreamFakes], Awaitable[None]]


def _run(scenario: Scenario, timeout: float = 10, **kw: Any) -> StreamFakes:
    async def main() -> None:
        fakes = StreamFakes()
        # handler_cancellation: a prefill leg the router gives up on sees its connection close.
        p = TestServer(fakes.prefill_app(), handler_cancellation=True)
        d = TestServer(fakes.decode_app())
        await p.start_server()
        await d.start_server()
        app = create_app([str(p.make_url("")).rstrip("/")], [str(d.make_url("")).rstrip("/")], timeout,
                         prefix_block_size=4, **kw)
        try:
            async with TestClient(TestServer(app, handler_cancellation=True)) as client:  # as the CLI runs it
                try:
                    await scenario(client, fakes)
                finally:  # the router's shutdown waits for the prefill legs it still runs
                    fakes.gate.set()
                    fakes.decode_gate.set()
        finally:
            await p.close()
            await d.close()
        out.append(fakes)

    out: list[StreamFakes] = []
    asyncio.run(main())
    return out[0]


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The requests' log lines."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.getMessage().startswith("req=")]


def _stream_params(key: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "stream", "kvsm_stream": key}


def _decode_params(fakes: StreamFakes, key: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "stream", "kvsm_stream": key,
            "remote_request_id": key, "remote_block_ids": [[] for _ in range(fakes.groups)], **fakes.coordinates()}


async def _learn(client: TestClient, fakes: StreamFakes) -> None:
    """A first request: sequential, push, and the prefill backend's coordinates learned."""
    assert await _text(client, {"prompt": [1, *PROMPT]}) == "pd"
    assert fakes.prefill[-1]["kv_transfer_params"] == {**PREFILL_KV_PARAMS, "transfer_mode": "push"}
    assert fakes.decode[-1]["kv_transfer_params"]["remote_engine_id"] == fakes.engine_id  # the answer's, as before
    metrics = await _metrics(client)
    assert 'kvsm_router_stream_fallback_sequential_total{reason="unknown_backend"} 1' in metrics
    assert "kvsm_router_stream_backends_known 1" in metrics and "kvsm_router_stream_pairs_total 0" in metrics


async def _held_back(client: TestClient, fakes: StreamFakes, path: str,
                     body: dict[str, Any]) -> aiohttp.ClientResponse:
    """Send a request with the streamed prefill legs held back, check that its decode leg arrived
    before any prefill answer, and return the client's response."""
    fakes.gate.clear()
    before = len(fakes.answered_at_decode)
    task = asyncio.ensure_future(client.post(path, json={"model": MODEL, "max_tokens": 2, **body}))
    await _until(lambda: len(fakes.answered_at_decode) > before)
    assert fakes.answered_at_decode[-1] == fakes.answered  # no prefill answer since: the decode leg did not wait
    return await task


@pytest.mark.parametrize("block_size", [16, None])
def test_the_first_request_teaches_and_the_next_sends_both_legs_at_once(caplog: pytest.LogCaptureFixture,
                                                                        block_size: int | None) -> None:
    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        fakes.block_size = block_size
        await _learn(client, fakes)
        resp = await _held_back(client, fakes, "/v1/completions", {"prompt": PROMPT})
        # The client has the decode's answer while the prefill leg is still held back.
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "pd"
        await _until(lambda: len(fakes.prefill) == 2)
        assert fakes.answered == 1
        key = fakes.prefill[-1]["kv_transfer_params"]["kvsm_stream"]
        assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 32
        assert fakes.prefill[-1] == {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": False,
                                     "kv_transfer_params": _stream_params(key)}
        assert fakes.decode[-1] == {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                    "kv_transfer_params": _decode_params(fakes, key)}
        assert len(_lines(caplog)) == 1  # the request's log line waits for its prefill leg
        fakes.gate.set()
        await _until(lambda: len(_lines(caplog)) == 2)
        assert fakes.answered == 2
        metrics = await _metrics(client)
        assert "kvsm_router_stream_pairs_total 1" in metrics and "kvsm_router_stream_prefill_errors_total 0" in metrics
        assert 'kvsm_router_transfer_mode{mode="stream"} 1' in metrics

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario, transfer_mode="stream")
    first, second = _lines(caplog)
    assert first.endswith(" transfer=sequential")
    assert second.endswith(" transfer=stream prefill_stream=ok") and " prefill_ms=-" not in second


def test_a_streamed_client_gets_the_decode_s_events_and_answers_refresh_the_coordinates(
        caplog: pytest.LogCaptureFixture) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}

    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        await _learn(client, fakes)
        fakes.engine_id = "engine-p0-restarted"  # the streamed leg's answer says so
        resp = await _held_back(client, fakes, "/v1/chat/completions", chat)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        assert await resp.read() == b'data: {"choices": [{"index": 0, "text": "pd"}]}\n\ndata: [DONE]\n\n'
        await _until(lambda: len(fakes.prefill) == 2)
        key = fakes.prefill[-1]["kv_transfer_params"]["kvsm_stream"]
        assert fakes.decode[-1]["kv_transfer_params"] == {**_decode_params(fakes, key),
                                                          "remote_engine_id": "engine-p0"}
        assert fakes.decode[-1]["stream"] is True and fakes.decode[-1]["messages"] == chat["messages"]
        assert fakes.prefill[-1]["stream"] is False and fakes.prefill[-1]["max_tokens"] == 1
        fakes.gate.set()
        await _until(lambda: len(_lines(caplog)) == 2)  # the prefill leg's answer is in
        assert await _text(client, {"prompt": PROMPT, "stream": True}) == "pd"
        await _until(lambda: len(fakes.prefill) == 3)
        key = fakes.prefill[-1]["kv_transfer_params"]["kvsm_stream"]
        assert fakes.decode[-1]["kv_transfer_params"] == _decode_params(fakes, key)  # the new engine id

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario, transfer_mode="stream")


def test_a_failed_prefill_leg_does_not_fail_the_client_s_request(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        await _learn(client, fakes)
        fakes.fail_stream_prefill = True
        for stream in (False, True):
            assert await _text(client, {"prompt": PROMPT, "stream": stream}) == "pd"
        await _until(lambda: len(_lines(caplog)) == 3)
        metrics = await _metrics(client)
        assert "kvsm_router_stream_prefill_errors_total 2" in metrics and "kvsm_router_stream_pairs_total 2" in metrics
        # The coordinates stay: the next request goes streamed again.
        fakes.fail_stream_prefill = False
        assert await _text(client, {"prompt": PROMPT}) == "pd"
        assert fakes.decode[-1]["kv_transfer_params"]["transfer_mode"] == "stream"
        await _until(lambda: len(_lines(caplog)) == 4)

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario, transfer_mode="stream")
    lines = _lines(caplog)
    assert lines[3].endswith(" transfer=stream prefill_stream=ok")
    for line in lines[1:3]:
        assert " status=200 " in line and " transfer=stream prefill_stream=error prefill_stream_error=" in line
        assert "returned 500: injected" in line and " error=" not in line
    assert any("streamed prefill leg failed" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)


def test_a_silent_prefill_leg_is_given_up_after_the_router_s_timeout(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        await _learn(client, fakes)
        resp = await _held_back(client, fakes, "/v1/completions", {"prompt": PROMPT})  # never let go
        assert resp.status == 200
        await _until(lambda: len(_lines(caplog)) == 2)  # after about a second
        assert "kvsm_router_stream_prefill_errors_total 1" in await _metrics(client)
        await _until(lambda: fakes.cancelled == 1)  # its connection was closed

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario, timeout=0.5, transfer_mode="stream")
    assert "prefill_stream=error" in _lines(caplog)[1] and "did not answer within 0.5 s" in _lines(caplog)[1]


def test_a_failed_decode_leg_cancels_the_prefill_leg(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        await _learn(client, fakes)
        fakes.fail_decode = True
        resp = await _held_back(client, fakes, "/v1/completions", {"prompt": PROMPT})
        assert resp.status == 500 and "decode down" in (await resp.json())["error"]["message"]
        await _until(lambda: fakes.cancelled == 1)
        await _until(lambda: len(_lines(caplog)) == 2)
        metrics = await _metrics(client)
        assert "kvsm_router_stream_prefill_cancelled_total 1" in metrics
        assert "kvsm_router_stream_prefill_errors_total 0" in metrics

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        fakes = _run(scenario, transfer_mode="stream")
    assert fakes.answered == 1
    assert " status=500 " in _lines(caplog)[1] and "transfer=stream prefill_stream=cancelled" in _lines(caplog)[1]


def test_a_client_that_goes_away_cancels_the_prefill_leg(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        await _learn(client, fakes)
        fakes.gate.clear()
        fakes.decode_gate.clear()
        task = asyncio.ensure_future(client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT}))
        await _until(lambda: fakes.waiting == 1 and len(fakes.answered_at_decode) == 2)
        task.cancel()  # the client closes its connection while both legs run
        await _until(lambda: fakes.cancelled == 1)
        await _until(lambda: len(_lines(caplog)) == 2)
        assert "kvsm_router_stream_prefill_cancelled_total 1" in await _metrics(client)

    with caplog.at_level(logging.INFO, logger="kvsm.router"):
        _run(scenario, transfer_mode="stream")
    assert " status=499 " in _lines(caplog)[1] and "transfer=stream prefill_stream=cancelled" in _lines(caplog)[1]


def test_a_list_of_prompts_goes_pair_by_pair_each_streamed_once_known() -> None:
    prompts = [[1, *PROMPT], [2, *PROMPT]]

    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        assert await _text(client, {"prompt": prompts}) == "pdpd"  # neither known yet: both sequential
        assert [b["kv_transfer_params"] for b in fakes.prefill] == [{**PREFILL_KV_PARAMS, "transfer_mode": "push"}] * 2
        assert await _text(client, {"prompt": prompts}) == "pdpd"
        await _until(lambda: len(fakes.prefill) == 4)
        streamed = {b["kv_transfer_params"]["kvsm_stream"]: b["prompt"] for b in fakes.prefill[2:]}
        assert len(streamed) == 2
        for leg in fakes.decode[2:]:
            key = leg["kv_transfer_params"]["kvsm_stream"]
            assert streamed[key] == leg["prompt"] and leg["kv_transfer_params"] == _decode_params(fakes, key)
        metrics = await _metrics(client)
        assert "kvsm_router_stream_pairs_total 2" in metrics
        assert 'kvsm_router_stream_fallback_sequential_total{reason="unknown_backend"} 2' in metrics

    _run(scenario, transfer_mode="stream")


def test_the_threshold_and_a_decode_hold_still_work_in_stream_mode() -> None:
    offer = _offer("engine-d0", list(range(13)))

    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        await _learn(client, fakes)
        assert await _text(client, {"prompt": [1, 2, 3]}) == "local"  # the decode backend alone
        assert len(fakes.prefill) == 1 and "kv_transfer_params" not in fakes.decode[-1]
        # A decode hold to read: sequential, the hold's params (its own transfer_mode) to the prefill leg.
        assert await _text(client, {"prompt": PROMPT, "kv_transfer_params": offer}) == "pd"
        assert fakes.prefill[-1]["kv_transfer_params"] == offer
        assert "kvsm_stream" not in fakes.decode[-1]["kv_transfer_params"]
        assert 'kvsm_router_stream_fallback_sequential_total{reason="hold"} 1' in await _metrics(client)

    _run(scenario, transfer_mode="stream", disagg_threshold=10)


@pytest.mark.parametrize("mode", [None, "pull", "push"])
def test_pull_and_push_only_set_the_prefill_leg_s_transfer_mode(mode: str | None) -> None:
    async def scenario(client: TestClient, fakes: StreamFakes) -> None:
        for _ in range(2):
            assert await _text(client, {"prompt": PROMPT}) == "pd"
        expected = PREFILL_KV_PARAMS if mode is None else {**PREFILL_KV_PARAMS, "transfer_mode": mode}
        assert [b["kv_transfer_params"] for b in fakes.prefill] == [expected] * 2
        assert all("kvsm_stream" not in b["kv_transfer_params"] for b in fakes.decode)
        assert fakes.answered_at_decode == [1, 2]  # each decode leg after its prefill's answer
        assert "kvsm_router_stream_backends_known 0" in await _metrics(client)

    _run(scenario, **({} if mode is None else {"transfer_mode": mode}))


def test_stream_mode_refuses_seeding_and_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    urls = ["http://p"], ["http://d"]
    for flags in ({"first_token_seeding": True}, {"reuse_holds": True}):
        with pytest.raises(ValueError, match="--transfer-mode stream conflicts with --"):
            create_app(*urls, transfer_mode="stream", **flags)
        create_app(*urls, transfer_mode="push", **flags)
    with pytest.raises(ValueError, match="--transfer-mode must be one of"):
        create_app(*urls, transfer_mode="sideways")

    seen: dict[str, Any] = {}
    monkeypatch.setattr(router, "create_app", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(router.web, "run_app", lambda *a, **kw: None)
    monkeypatch.setattr(router.logging, "basicConfig", lambda **kw: None)
    args = ["--prefill", "http://p", "--decode", "http://d"]
    router.main([*args, "--transfer-mode", "stream", "--disagg-threshold", "8"])
    assert seen["transfer_mode"] == "stream" and seen["disagg_threshold"] == 8
    for flag in ("--first-token-seeding", "--reuse-holds"):
        with pytest.raises(SystemExit):
            router.main([*args, "--transfer-mode", "stream", flag])
    with pytest.raises(SystemExit):
        router.main([*args, "--transfer-mode", "sideways"])
