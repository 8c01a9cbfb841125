"""``kvsm.router --first-token-seeding`` in front of the session's real prefill + decode pair.

The reference for every request is one engine: the prefill server asked
directly with the client's exact body (streamed as the client asked). Through
a seeded router, the concatenated text, the token ids, the logprobs' tokens,
the finish reason and the usage must equal it, greedy and seeded
(``temperature`` 1, ``seed``); the stream must read as one (one ``id``, one
``created``). Fake backends stand in where the decode leg must be slow (the
first chunk must not wait for it) or fail (the client must see an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from conftest import LlamaServers, require

require("vllm")

from kvsm.router import create_app
from kvsm_testing.http_app import serve_app
from kvsm_testing.servers import RouterProcess

pytestmark = pytest.mark.slow

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def servers(llama_servers: LlamaServers) -> LlamaServers:
    return llama_servers


@pytest.fixture(scope="module")
def router(servers: LlamaServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """A second router on the shared servers, with --first-token-seeding."""
    tmp = tmp_path_factory.mktemp("seeding-router")
    with RouterProcess([servers.prefill.url], [servers.decode.url], tmp, extra_args=["--first-token-seeding"]) as r:
        r.start()
        yield r


# -- HTTP helpers -------------------------------------------------------------------------


def _stream(base: str, path: str, body: dict[str, Any], rid: str | None = None) -> tuple[list[Any], float, float]:
    """The parsed ``data:`` payloads of a streamed answer ("[DONE]" as the string), the
    seconds to the first and to the last."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.monotonic()
    conn.request("POST", path, json.dumps(body),
                 {"Content-Type": "application/json", "X-Request-Id": rid or uuid.uuid4().hex})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events: list[Any] = []
    first = None
    try:
        while line := resp.readline():
            if line.startswith(b"data: "):
                first = first if first is not None else time.monotonic() - t0
                data = line[6:].decode().strip()
                events.append(data if data == "[DONE]" else json.loads(data))
    finally:
        conn.close()
    assert first is not None, "no event"
    return events, first, time.monotonic() - t0


def _summary(path: str, events: list[Any]) -> dict[str, Any]:
    """What must equal one engine's: text, token ids, logprobs tokens, finish, usage, errors."""
    out: dict[str, Any] = {"text": "", "token_ids": [], "lp_tokens": [], "finish": None, "stop_reason": None,
                           "usage": None, "errors": [], "roles": [], "prompt_token_ids": None,
                           "done": events[-1:] == ["[DONE]"]}
    for e in events:
        if e == "[DONE]":
            continue
        if "error" in e:
            out["errors"].append(e["error"])
            continue
        out["usage"] = e.get("usage") or out["usage"]
        out["prompt_token_ids"] = out["prompt_token_ids"] or e.get("prompt_token_ids")
        for c in e.get("choices") or []:
            if path == CHAT:
                delta = c.get("delta") or {}
                out["text"] += delta.get("content") or ""
                if delta.get("role"):
                    out["roles"].append(delta["role"])
                out["lp_tokens"] += [x["token"] for x in (c.get("logprobs") or {}).get("content") or []]
            else:
                out["text"] += c.get("text") or ""
                out["lp_tokens"] += (c.get("logprobs") or {}).get("tokens") or []
                out["prompt_token_ids"] = out["prompt_token_ids"] or c.get("prompt_token_ids")
            out["token_ids"] += c.get("token_ids") or []
            if c.get("finish_reason") is not None:
                out["finish"], out["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return out


def _body(path: str, n: int = 12, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "", "max_tokens": n, "temperature": 0, "stream": True, **extra}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        base["prompt"] = PROMPT
    return base


def _compare(servers: LlamaServers, base: str, path: str, body: dict[str, Any],
             rid: str | None = None) -> dict[str, Any]:
    """Stream ``body`` through the router at ``base`` and from one engine; assert they agree."""
    body = {**body, "model": servers.model}
    ref_events, _, _ = _stream(servers.prefill.url, path, body)
    got_events, _, _ = _stream(base, path, body, rid)
    ref, got = _summary(path, ref_events), _summary(path, got_events)
    assert not ref["errors"] and not got["errors"], (ref["errors"], got["errors"])
    assert got == ref, f"\nrouter: {got}\nengine: {ref}"
    chunks = [e for e in got_events if e != "[DONE]"]
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1, chunks
    assert len({e["object"] for e in chunks}) == 1, chunks
    return got


def _router_line(r: RouterProcess, rid: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = next((ln for ln in r.log_path.read_text().splitlines() if f"req={rid} " in ln), None)
        if line is not None:
            return line
        assert time.monotonic() < deadline, f"no router log line for {rid}"
        time.sleep(0.05)


def _first_tokens(servers: LlamaServers, path: str, n: int = 2, **extra: Any) -> tuple[list[int], list[str]]:
    """One engine's first ``n`` greedy token ids and their texts."""
    body = {**_body(path, n, **extra), "model": servers.model, "stream": False, "logprobs": True if path == CHAT
            else 0, "return_token_ids": True}
    if path == CHAT:
        body["top_logprobs"] = 0
    choice = servers.prefill.post(path, body)["choices"][0]
    lp = choice["logprobs"]
    texts = [x["token"] for x in lp["content"]] if path == CHAT else lp["tokens"]
    return choice["token_ids"], texts


# -- equality with one engine ---------------------------------------------------------------

CASES = {
    "greedy": {},
    "seeded": {"temperature": 1.0, "seed": 1234},
    "seeded_other": {"temperature": 1.0, "top_p": 0.9, "seed": 77},
    "usage": {"stream_options": {"include_usage": True}},
    "token_ids": {"return_token_ids": True},
    "seeded_usage_ids": {"temperature": 1.0, "seed": 5, "return_token_ids": True,
                         "stream_options": {"include_usage": True}},
    "min_tokens": {"min_tokens": 4, "temperature": 1.0, "seed": 9},
    "max_tokens_1": {"max_tokens": 1, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("case", list(CASES))
def test_streams_equal_one_engine(servers: LlamaServers, router: RouterProcess, path: str, case: str) -> None:
    rid = uuid.uuid4().hex
    got = _compare(servers, router.url, path, _body(path, **CASES[case]), rid)
    assert got["done"] and (got["text"] or case == "max_tokens_1")
    assert " seed=1 " in _router_line(router, rid)
    if path == CHAT:
        assert got["roles"] == ["assistant"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_logprobs(servers: LlamaServers, router: RouterProcess, path: str) -> None:
    extra = {"logprobs": True, "top_logprobs": 2} if path == CHAT else {"logprobs": 2}
    for more in ({}, {"temperature": 1.0, "seed": 3}):
        got = _compare(servers, router.url, path, _body(path, **extra, **more))
        assert len(got["lp_tokens"]) == 12


def test_echo(servers: LlamaServers, router: RouterProcess) -> None:
    got = _compare(servers, router.url, COMPLETIONS, _body(COMPLETIONS, echo=True))
    assert got["text"].startswith(PROMPT)
    got = _compare(servers, router.url, COMPLETIONS, _body(COMPLETIONS, echo=True, logprobs=1))
    assert len(got["lp_tokens"]) > 12


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_first_token_hits_a_stop(servers: LlamaServers, router: RouterProcess, path: str) -> None:
    """A stop token or a stop string hit by token 1: the stream ends from the prefill's answer,
    and the decode leg still runs (so the prefill frees the blocks: the decode reads them)."""
    ids, texts = _first_tokens(servers, path)
    usage = {"stream_options": {"include_usage": True}}
    got = _compare(servers, router.url, path, _body(path, stop_token_ids=[ids[0]], **usage))
    assert got["finish"] == "stop" and got["stop_reason"] == ids[0], got
    assert got["usage"]["completion_tokens"] == 1
    if texts[0].strip():
        stop = texts[0].strip()
        got = _compare(servers, router.url, path, _body(path, stop=[stop], **usage))
        assert got["finish"] == "stop" and got["stop_reason"] == stop, got
    rid = uuid.uuid4().hex
    _compare(servers, router.url, path, _body(path, stop_token_ids=[ids[0]]), rid)
    line = _router_line(router, rid)
    assert " seed=1 " in line and " status=200 " in line, line
    assert _recv_done(servers, rid)  # the decode leg ran and read the KV


def _recv_done(servers: LlamaServers, rid: str, timeout: float = 15) -> bool:
    """Did the decode worker's recv machine of ``rid`` end ``done`` (the KV read by transfer)?"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in servers.events.glob("decode.worker.*.jsonl"):
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("lifecycle") == "recv" and rid in (rec.get("req") or "") and rec.get("dst") == "done":
                    return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_stop_string_across_tokens_1_and_2(servers: LlamaServers, router: RouterProcess, path: str) -> None:
    """A stop string that begins in token 1's text and ends in token 2's: one engine holds
    token 1's tail back, and so must the router (else it sent text the engine takes back)."""
    _, texts = _first_tokens(servers, path)
    whole = servers.prefill.post(path, {**_body(path, 6), "model": servers.model, "stream": False})["choices"][0]
    whole_text = whole["message"]["content"] if path == CHAT else whole["text"]
    n = len(texts[0])
    if not n or len(whole_text) <= n or not whole_text.startswith(texts[0]):
        pytest.skip(f"the tiny model's first tokens have no text to span: {texts}, {whole_text!r}")
    stop = whole_text[n - 1:n + 1]
    got = _compare(servers, router.url, path, _body(path, stop=[stop]))
    assert got["finish"] == "stop", got


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_not_seeded_requests_are_unchanged(servers: LlamaServers, router: RouterProcess, path: str) -> None:
    # n=2 falls back to the decode engine's first token.
    rid = uuid.uuid4().hex
    body = {**_body(path, n=6, temperature=1.0, seed=11), "n": 2, "model": servers.model}
    events, _, _ = _stream(router.url, path, body, rid)
    ref_events, _, _ = _stream(servers.prefill.url, path, body)

    def texts(evs: list[Any]) -> dict[int, str]:
        out: dict[int, str] = {}
        for e in evs:
            for c in e.get("choices", []) if isinstance(e, dict) else []:
                piece = (c.get("delta") or {}).get("content") if path == CHAT else c.get("text")
                out[c["index"]] = out.get(c["index"], "") + (piece or "")
        return out
    assert texts(events) == texts(ref_events) and len(texts(events)) == 2
    assert " seed=n " in _router_line(router, rid)
    # Not streamed: as without the flag.
    body = {**_body(path), "stream": False, "model": servers.model}
    rid = uuid.uuid4().hex
    with contextlib.closing(http.client.HTTPConnection(*router.url.removeprefix("http://").split(":"))) as conn:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "X-Request-Id": rid})
        got = json.loads(conn.getresponse().read())
    ref = servers.prefill.post(path, body)
    key = (lambda c: c["message"]["content"]) if path == CHAT else (lambda c: c["text"])
    assert key(got["choices"][0]) == key(ref["choices"][0]) and got["usage"] == ref["usage"]
    assert " seed=not_streamed " in _router_line(router, rid)


def test_first_chunk_goes_before_the_decode_leg_answers(servers: LlamaServers, router: RouterProcess) -> None:
    rid = uuid.uuid4().hex
    _compare(servers, router.url, COMPLETIONS, _body(COMPLETIONS), rid)
    line = _router_line(router, rid)
    fields = dict(re.findall(r"(\w+)=(\S+)", line))
    # The first chunk was written before the decode leg was even sent.
    assert float(fields["first_ms"]) < float(fields["total_ms"]) - float(fields["decode_ms"]) + 1, line
    with _fake_decode(servers.decode.url, delay=2.0) as slow, _in_process_router(servers.prefill.url, slow) as base:
        body = {**_body(COMPLETIONS), "model": servers.model}
        events, first, total = _stream(base, COMPLETIONS, body)
        ref_events, _, _ = _stream(servers.prefill.url, COMPLETIONS, body)
        assert _summary(COMPLETIONS, events) == _summary(COMPLETIONS, ref_events)
        assert total > 2.0 and first < 1.5, (first, total)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_decode_leg_failing_after_the_first_chunk_ends_the_stream_with_an_error(
        servers: LlamaServers, path: str) -> None:
    with _fake_decode(None) as broken, _in_process_router(servers.prefill.url, broken) as base:
        events, _, _ = _stream(base, path, {**_body(path), "model": servers.model})
    got = _summary(path, events)
    assert got["text"] or got["token_ids"] or got["roles"], events  # the first chunk went out
    assert len(got["errors"]) == 1 and got["errors"][0]["code"] == 500, events
    assert broken in got["errors"][0]["message"] and "injected" in got["errors"][0]["message"]
    assert got["finish"] is None and not got["done"]


# -- fakes --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _in_process_router(prefill: str, decode: str) -> Iterator[str]:
    with serve_app(create_app([prefill], [decode], 60.0, first_token_seeding=True)) as url:
        yield url


@contextlib.contextmanager
def _fake_decode(target: str | None, delay: float = 0.0) -> Iterator[str]:
    """A decode backend: ``target`` (the real one) after ``delay`` s, or (None) HTTP 500 to everything."""
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if target is None:
            return web.json_response({"error": {"message": "injected failure", "type": "InternalServerError",
                                                "code": 500}}, status=500)
        await asyncio.sleep(delay)
        async with aiohttp.ClientSession() as s, s.post(target + request.path, data=body,
                                                        headers={"Content-Type": "application/json",
                                                                 **{k: v for k, v in request.headers.items()
                                                                    if k.lower() == "x-request-id"}}) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers["Content-Type"]})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/{tail:.*}", handle)
    with serve_app(app) as url:
        yield url
