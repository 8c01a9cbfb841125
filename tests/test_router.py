"""``kvsm.router`` in front of a real prefill + decode pair of vLLM API servers.

One pair of servers (tiny local model, KVSMConnector, event logs on) serves
the whole module; it takes ~25 s to start. The main router runs as a
subprocess through its CLI (``python -m kvsm.router``); routers with broken
backends run in-process (``create_app`` in a thread with its own loop).

The reference for a prompt is the prefill server's own greedy completion
(``temperature=0``, ``ignore_eos``, no ``kv_transfer_params``): the tiny
model's greedy outputs are deterministic, and the decode server can only give
the same tokens if it read the right KV. That it did read it remotely is
checked in its event log: each request has a ``recv`` machine that went from
``matched`` to ``done``.

Not tested with a real server: a prefill backend whose KV connector is missing
entirely. The decode server (``kv_consumer``) stands in for it: it answers a
``do_remote_decode`` request with ``kv_transfer_params: null``, which is the
same case for the router.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import Any

import pytest

from conftest import LlamaServers, require

require("vllm")

from kvsm.lifecycle.table import LIFECYCLES
from kvsm.router import create_app
from kvsm_testing.http_app import serve_app
from kvsm_testing.servers import RouterProcess, VLLMServer, free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RECV_TERMINAL = LIFECYCLES["recv"].terminal
RNG = random.Random(20261130)


def _ids(n: int) -> list[int]:
    """A prompt of exactly ``n`` token ids (token-id prompts get no BOS added)."""
    return [RNG.randrange(10, 1100) for _ in range(n)]


@dataclass
class Pair:
    model: str
    prefill: VLLMServer
    decode: VLLMServer
    events: Path
    router: str = ""  # the CLI router's URL
    router_log: Path | None = None


@pytest.fixture(scope="module")
def pair(llama_servers: LlamaServers) -> Pair:
    """The session's shared servers and router (conftest.py's ``llama_servers``)."""
    s = llama_servers
    return Pair(s.model, s.prefill, s.decode, s.events, s.router.url, s.router.log_path)


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"router exited with {proc.returncode}"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(url)


@contextlib.contextmanager
def _router(prefill: list[str], decode: list[str], timeout: float = 60.0, cancel: bool = True) -> Iterator[str]:
    """An in-process router on a free port, served by its own loop in a thread.

    ``cancel``: aiohttp's handler_cancellation, as the CLI sets it (without it, the
    router notices a client gone only when its next write fails)."""
    with serve_app(create_app(prefill, decode, timeout), cancel) as url:
        yield url


def _closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def _silent_backend() -> Iterator[str]:
    """A backend that accepts connections (the kernel does) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


# -- HTTP helpers -------------------------------------------------------------------------


def _post(base: str, path: str, body: Any, headers: dict[str, str] | None = None,
          timeout: float = 120) -> tuple[int, dict[str, Any], Message]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _get(url: str) -> tuple[int, dict[str, Any]]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, json.loads(r.read())


def _open_stream(base: str, path: str, body: dict[str, Any],
                 rid: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "X-Request-Id": rid})
    return conn, conn.getresponse()


def _sse_events(resp: http.client.HTTPResponse) -> Iterator[tuple[float, str]]:
    """(arrival time, payload) of each ``data:`` line, as the lines arrive."""
    while line := resp.readline():
        if line.startswith(b"data: "):
            yield time.monotonic(), line[6:].decode().strip()


def _completion(pair: Pair, prompt: str | list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {"model": pair.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def _chat(pair: Pair, text: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"model": pair.model, "messages": [{"role": "user", "content": text}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, **extra}


def _reference(pair: Pair, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's own answer, without any KV transfer."""
    return pair.prefill.post(path, body)["choices"][0]


def _rid() -> str:
    return uuid.uuid4().hex


# -- event log ------------------------------------------------------------------------------


def _recv_machines(pair: Pair, rid: str) -> dict[str, list[dict[str, Any]]]:
    """The decode worker's recv-lifecycle records of the engine requests named after ``rid``."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in pair.events.glob("decode.worker.*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("lifecycle") == "recv" and rid in (rec.get("req") or ""):
                out.setdefault(rec["req"], []).append(rec)
    return out


def _recv_final(pair: Pair, rid: str, timeout: float = 15) -> list[dict[str, Any]]:
    """The records of ``rid``'s one recv machine, once it is terminal (the log flushes every 50 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        machines = _recv_machines(pair, rid)
        assert len(machines) <= 1, machines
        recs = next(iter(machines.values()), [])
        if recs and recs[-1].get("dst") in RECV_TERMINAL:
            return recs
        if time.monotonic() > deadline:
            raise AssertionError(f"no terminal recv machine for {rid}: {recs}")
        time.sleep(0.05)


def _router_line(pair: Pair, rid: str, timeout: float = 10) -> str:
    """The router's log line for ``rid``: written once the response is over, which
    the client may see a moment before the router logs it."""
    assert pair.router_log is not None
    deadline = time.monotonic() + timeout
    while True:
        line = next((ln for ln in pair.router_log.read_text().splitlines() if f"req={rid} " in ln), None)
        if line is not None:
            return line
        assert time.monotonic() < deadline, f"no router log line for {rid} within {timeout} s"
        time.sleep(0.05)


def _assert_loaded_remotely(pair: Pair, rid: str, prompt_tokens: int | None = None) -> None:
    recs = _recv_final(pair, rid)
    events = [r["event"] for r in recs if r["kind"] == "transition"]
    assert events[0] == "matched" and recs[-1]["dst"] == "done", events
    matched = recs[[r["event"] for r in recs].index("matched")]["input"]
    assert rid in matched["remote_req"], matched  # the prefill engine got the same X-Request-Id
    if prompt_tokens is not None:
        assert matched["num_tokens"] == prompt_tokens, matched


# -- tests ------------------------------------------------------------------------------------


def test_health_and_models(pair: Pair) -> None:
    assert _get(pair.router + "/health") == (200, {"status": "ok"})
    status, models = _get(pair.router + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [pair.model]


def test_completions_equal_reference_and_load_remotely(pair: Pair) -> None:
    prompts: list[str | list[int]] = [_ids(1), "The decode engine pulls those blocks", _ids(40), _ids(300)]
    for prompt in prompts:
        body = _completion(pair, prompt, 16)
        ref = _reference(pair, "/v1/completions", body)
        rid = _rid()
        status, out, headers = _post(pair.router, "/v1/completions", body, {"X-Request-Id": rid})
        assert status == 200, out
        assert headers["X-Request-Id"] == rid
        # Where it went and how long its prefill took, for clients that measure.
        assert (headers["X-KVSM-Prefill-Backend"], headers["X-KVSM-Decode-Backend"]) == (pair.prefill.url,
                                                                                          pair.decode.url)
        assert float(headers["X-KVSM-Prefill-Ms"]) > 0
        choice = out["choices"][0]
        assert (choice["text"], choice["token_ids"]) == (ref["text"], ref["token_ids"])
        assert len(choice["token_ids"]) == 16
        _assert_loaded_remotely(pair, rid, out["usage"]["prompt_tokens"])
    # The router logs one line per request, with both backends and the timings.
    line = _router_line(pair, rid)
    assert re.search(rf"status=200 prefill={pair.prefill.url} prefill_ms=[\d.]+ decode={pair.decode.url} "
                     r"decode_ttfb_ms=- decode_ms=[\d.]+", line), line


def test_a_list_of_prompts_goes_as_one_pair_per_prompt(pair: Pair) -> None:
    """A completions request with several prompts: each prompt is prefilled and
    decoded on its own (vLLM's prefill answer to a list carries the first prompt's
    kv_transfer_params only), and the answer is the one vLLM gives for the list:
    choices in prompt order, usage summed; every prompt's KV by transfer."""
    for prompts in (["The decode engine pulls those blocks", "Mountains rise above the valley", "Red"],
                    [_ids(40), _ids(300)]):
        body = _completion(pair, prompts, 8)
        ref = pair.prefill.post("/v1/completions", body)
        rid = _rid()
        status, out, _ = _post(pair.router, "/v1/completions", body, {"X-Request-Id": rid})
        assert status == 200, out
        assert [(c["index"], c["text"], c["token_ids"]) for c in out["choices"]] == [
            (c["index"], c["text"], c["token_ids"]) for c in sorted(ref["choices"], key=lambda c: c["index"])]
        assert {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
            k: ref["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert "kv_transfer_params" not in out or out["kv_transfer_params"] is None
        deadline = time.monotonic() + 15
        while True:
            machines = _recv_machines(pair, rid)
            if len(machines) == len(prompts) and all(m[-1].get("dst") == "done" for m in machines.values()):
                break
            assert time.monotonic() < deadline, machines
            time.sleep(0.05)


def test_a_streamed_list_of_prompts_is_forwarded_whole_and_right(pair: Pair) -> None:
    """Streamed, a list goes whole (one prefill, one decode request): its first
    prompt by transfer, the others computed on the decode engine (their params are
    the first prompt's, which kvsm's prompt fingerprint refuses); every text right."""
    body = _completion(pair, ["The decode engine pulls those blocks and keeps generating",
                              "Mountains rise above the valley"], 6)
    ref = {c["index"]: c["text"] for c in pair.prefill.post("/v1/completions", body)["choices"]}
    conn, resp = _open_stream(pair.router, "/v1/completions", body, _rid())
    try:
        assert resp.status == 200
        got: dict[int, str] = {}
        for _, payload in _sse_events(resp):
            if payload != "[DONE]":
                for c in json.loads(payload).get("choices", []):
                    got[c["index"]] = got.get(c["index"], "") + c["text"]
    finally:
        conn.close()
    assert got == ref


def test_n_samples_share_one_prefill(pair: Pair) -> None:
    """n > 1: one prefill request (its answer carries one set of params); on the
    decode engine the first sample reads it and the others compute the prompt."""
    body = {**_completion(pair, _ids(200), 6, temperature=1.0, seed=7), "n": 3}
    rid = _rid()
    status, out, _ = _post(pair.router, "/v1/completions", body, {"X-Request-Id": rid})
    assert status == 200, out
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    assert all(len(c["token_ids"]) == 6 for c in out["choices"])
    recs = _recv_final(pair, rid)  # one recv machine for the three samples, done
    assert recs[-1]["dst"] == "done"


def test_chat_completions(pair: Pair) -> None:
    """The tiny model ships a chat template, so chat works (and streams) like completions."""
    for extra in ({}, {"max_completion_tokens": 12}):
        body = _chat(pair, f"Tell me about blocks {extra}", 12, **extra)
        ref = _reference(pair, "/v1/chat/completions", body)["message"]["content"]
        rid = _rid()
        status, out, _ = _post(pair.router, "/v1/chat/completions", body, {"X-Request-Id": rid})
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] == ref
        assert out["usage"]["completion_tokens"] == 12
        _assert_loaded_remotely(pair, rid)

    body = _chat(pair, "And now stream it", 12)
    ref = _reference(pair, "/v1/chat/completions", body)["message"]["content"]
    rid = _rid()
    conn, resp = _open_stream(pair.router, "/v1/chat/completions", body, rid)
    with contextlib.closing(conn):
        assert resp.status == 200
        payloads = [p for _, p in _sse_events(resp)]
    assert payloads[-1] == "[DONE]"
    text = "".join(json.loads(p)["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert text == ref
    _assert_loaded_remotely(pair, rid)


def test_streaming_passes_chunks_through_as_they_come(pair: Pair) -> None:
    body = _completion(pair, "Streaming one token at a time through the router", 200)
    ref = _reference(pair, "/v1/completions", body)
    rid = _rid()
    conn, resp = _open_stream(pair.router, "/v1/completions", {**body, "stream_options": {"include_usage": True}},
                              rid)
    with contextlib.closing(conn):
        assert resp.status == 200
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        assert resp.getheader("X-Request-Id") == rid
        events = list(_sse_events(resp))
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(p) for _, p in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 200  # stream_options reached the decode backend
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == ref["text"]
    # 200 tokens take a few hundred ms to generate: a buffering router would deliver them all at once.
    times = [t for t, _ in events]
    assert times[-1] - times[0] > 0.1, f"all {len(times)} events within {times[-1] - times[0]:.3f} s"
    assert len({round(t, 3) for t in times}) > 10
    _assert_loaded_remotely(pair, rid)
    line = _router_line(pair, rid)
    assert re.search(r"stream=1 status=200 .* decode_ttfb_ms=[\d.]+ decode_ms=[\d.]+", line), line


def test_concurrent_requests(pair: Pair) -> None:
    bodies = [_completion(pair, _ids(RNG.choice([1, 7, 60, 130, 250])), 24) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        refs = list(pool.map(lambda b: _reference(pair, "/v1/completions", b), bodies))
        rids = [_rid() for _ in bodies]
        results = list(pool.map(lambda br: _post(pair.router, "/v1/completions", br[0], {"X-Request-Id": br[1]}),
                                zip(bodies, rids)))
    for (status, out, _), ref, rid in zip(results, refs, rids):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == ref["token_ids"]
        _assert_loaded_remotely(pair, rid)


@pytest.mark.parametrize("router", ["cli", "no_handler_cancellation"])
def test_client_disconnect_mid_stream_aborts_on_decode(pair: Pair, router: str) -> None:
    """Closing the decode connection makes vLLM abort: whether the router's handler is cancelled
    (the CLI) or finds out from a failed write (an app run without handler_cancellation)."""
    with contextlib.ExitStack() as stack:
        url = pair.router if router == "cli" else stack.enter_context(
            _router([pair.prefill.url], [pair.decode.url], cancel=False))
        rid = _rid()
        body = _completion(pair, f"A client that leaves early ({router})", 450)  # 1-2 s of decoding if left to run
        conn, resp = _open_stream(url, "/v1/completions", body, rid)
        assert resp.status == 200
        first = next(_sse_events(resp))[1]
        assert json.loads(first)["choices"][0]["text"] is not None
        resp.close()
        conn.close()
        t_closed = time.monotonic()
        # vLLM aborts the decode request when the router closes the connection (so well before its
        # 450 tokens are generated), and the request's KV machine is finished.
        pattern = re.compile(rf"Request \S*{rid}\S* aborted")
        while not pattern.search(pair.decode.tail(200_000)):
            assert time.monotonic() - t_closed < 10, "decode server never aborted the request"
            time.sleep(0.05)
        assert _recv_final(pair, rid)[-1]["dst"] in RECV_TERMINAL
        if router == "cli":
            line = _router_line(pair, rid)
            assert "status=499" in line and "client disconnected" in line, line
        # The next request goes through as usual.
        body = _completion(pair, f"After the disconnect ({router})", 8)
        status, out, _ = _post(url, "/v1/completions", body)
        assert status == 200
        assert out["choices"][0]["token_ids"] == _reference(pair, "/v1/completions", body)["token_ids"]


def test_selective_disaggregation_sends_short_prompts_to_decode_alone(pair: Pair, tmp_path: Path) -> None:
    """With --disagg-threshold 64, prompts of fewer tokens go to the decode engine
    alone (counted by the router from token ids, or by the decode engine's
    /tokenize for text and chat): nothing reaches the prefill engine, nothing is
    read by transfer; a longer one goes by P/D. Every answer is the reference."""
    def prefill_prompt_tokens() -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in pair.prefill.metrics().splitlines()
                   if ln.startswith("vllm:prompt_tokens_total{"))

    short = [("/v1/completions", _completion(pair, _ids(20), 8)),
             ("/v1/completions", _completion(pair, "A short text prompt", 8)),
             ("/v1/chat/completions", _chat(pair, "Hi there", 8))]
    long = _completion(pair, _ids(300), 8)
    refs = [_reference(pair, path, body) for path, body in [*short, ("/v1/completions", long)]]
    with RouterProcess([pair.prefill.url], [pair.decode.url], tmp_path, disagg_threshold=64,
                       extra_args=["--prefix-block-size", "128"]) as router:
        router.start()
        before = prefill_prompt_tokens()
        rids = [_rid() for _ in short]
        for (path, body), ref, rid in zip(short, refs, rids):
            status, out, headers = _post(router.url, path, body, {"X-Request-Id": rid})
            assert status == 200, out
            got = out["choices"][0]
            assert (got.get("text"), (got.get("message") or {}).get("content")) == (
                ref.get("text"), (ref.get("message") or {}).get("content"))
            assert headers["X-KVSM-Prefill-Backend"] == ""
        assert prefill_prompt_tokens() == before  # the prefill engine saw none of them
        rid = _rid()
        status, out, headers = _post(router.url, "/v1/completions", long, {"X-Request-Id": rid})
        assert status == 200 and out["choices"][0]["token_ids"] == refs[-1]["token_ids"], out
        _assert_loaded_remotely(pair, rid, 300)
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        log = router.log_path.read_text()
    assert 'kvsm_router_disagg_total{path="local",reason="below_threshold"} 3' in metrics, metrics
    assert 'kvsm_router_disagg_total{path="pd",reason="above_threshold"} 1' in metrics, metrics
    for r in rids:
        line = next(ln for ln in log.splitlines() if f"req={r} " in ln)
        assert re.search(r"prefill=- .* disagg=local disagg_reason=below_threshold uncached=\d+ threshold=64", line)
        assert _recv_machines(pair, r) == {}  # nothing read by transfer
    assert re.search(rf"req={rid} .* disagg=pd disagg_reason=above_threshold uncached=300 threshold=64", log)


def test_backend_down_is_502_naming_it(pair: Pair) -> None:
    body = _completion(pair, "nobody home", 4)
    dead = _closed_port_url()
    with _router([pair.prefill.url], [dead]) as router:
        status, out, _ = _post(router, "/v1/completions", body)
    assert status == 502, out
    err = out["error"]
    assert err["backend"] == dead and err["type"] == "backend_unreachable"
    assert err["message"].startswith(f"cannot connect to decode backend {dead}: ") and "Connect" in err["message"]

    with _router([dead], [pair.decode.url]) as router:
        status, out, _ = _post(router, "/v1/chat/completions", _chat(pair, "hi", 4))
    assert status == 502 and out["error"]["backend"] == dead
    assert out["error"]["message"].startswith(f"cannot connect to prefill backend {dead}: ")


def test_round_robin(pair: Pair) -> None:
    """Backends take turns: with one dead prefill backend of two, every other request fails."""
    dead = _closed_port_url()
    body = _completion(pair, "take turns", 4)
    with _router([pair.prefill.url, dead], [pair.decode.url]) as router:
        statuses = [_post(router, "/v1/completions", body)[0] for _ in range(4)]
    assert statuses == [200, 502, 200, 502]


def test_backend_error_is_passed_through_naming_it(pair: Pair) -> None:
    body = _completion(pair, _ids(600), 4)  # over max_model_len 512
    status, out, _ = _post(pair.router, "/v1/completions", body)
    assert status == 400, out
    err = out["error"]
    assert err["backend"] == pair.prefill.url and err["type"] == "BadRequestError"
    assert err["message"].startswith(f"prefill backend {pair.prefill.url} returned 400: ")
    assert "maximum context length is 512" in err["message"]


def test_prefill_without_kv_connector_output(pair: Pair) -> None:
    """A kv_consumer engine (here: the decode server) returns no kv_transfer_params for do_remote_decode."""
    with _router([pair.decode.url], [pair.decode.url]) as router:
        status, out, _ = _post(router, "/v1/completions", _completion(pair, "wrong role", 4))
    assert status == 502, out
    assert out["error"]["backend"] == pair.decode.url and out["error"]["type"] == "no_kv_transfer_params"
    assert "kv_producer" in out["error"]["message"] and "kv_both" in out["error"]["message"]


def test_timeout_is_504_naming_the_backend(pair: Pair) -> None:
    body = _completion(pair, "are you there", 4)
    with _silent_backend() as silent:
        for prefill, decode, role in (([silent], [pair.decode.url], "prefill"),
                                      ([pair.prefill.url], [silent], "decode")):
            with _router(prefill, decode, timeout=1.0) as router:
                t = time.monotonic()
                status, out, _ = _post(router, "/v1/completions", body)
            assert status == 504, out
            assert out["error"]["backend"] == silent and out["error"]["type"] == "backend_timeout"
            assert out["error"]["message"] == f"{role} backend {silent} did not answer within 1 s"
            assert time.monotonic() - t < 10


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/v1/completions", b"not json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", "must be a JSON object"),
    ("/v1/completions", b'{"model": "m", "max_tokens": 3}', "no 'prompt'"),
    ("/v1/chat/completions", b'{"model": "m", "prompt": "hi"}', "no 'messages'"),
])
def test_malformed_client_body_is_400(pair: Pair, path: str, body: bytes, needle: str) -> None:
    status, out, _ = _post(pair.router, path, body)
    assert status == 400 and needle in out["error"]["message"], out
