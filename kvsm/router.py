"""A prefill/decode router for disaggregated serving with kvsm (or any pull-mode connector).

::

    python -m kvsm.router --prefill http://p1:8100 [--prefill URL ...] \\
                          --decode http://d1:8200 [--decode URL ...] --port 8000

It speaks the contract of vLLM's toy disaggregated proxy (pull mode, as used
with ``NixlConnector``), so clients talk to it as to one OpenAI server:

1. ``POST /v1/completions`` or ``/v1/chat/completions`` goes first to a
   prefill backend (round robin) with ``kv_transfer_params.do_remote_decode``,
   ``max_tokens=1`` and ``stream=false``; its response carries the
   ``kv_transfer_params`` that say where the KV blocks are.
2. The client's original request goes to a decode backend (round robin) with
   those ``kv_transfer_params``; the decode engine pulls the blocks and
   generates. Its response goes back to the client as it comes: JSON, or
   server-sent events passed through chunk by chunk.

A non-streamed ``/v1/completions`` request with a list of prompts goes as one
prefill/decode pair per prompt (concurrently), and the answers are merged as
vLLM would answer the list: vLLM's prefill response carries the first
prompt's ``kv_transfer_params`` only, so forwarding the list whole would read
one prompt by transfer and leave the others' blocks pinned until their lease
ends. A streamed list is forwarded whole.

Every failure is a JSON error naming the backend (``{"error": {"message",
"type", "backend", "code"}}``): 502 for a backend that cannot be reached or a
prefill backend without a KV connector, the backend's own status for its
errors, 504 for a timeout, 400 for a malformed client body. A client that
disconnects mid-stream closes the decode connection, and vLLM aborts the
request. Both backends get the same ``X-Request-Id`` so their logs correlate;
one log line per request says where it went and how long each step took.

Selective disaggregation (``--disagg-threshold N``, ``kvsm.router_decider``): a
prompt with fewer than ``N`` tokens uncached on its decode backend (by the
router's own count of the prompts it sent there) goes to that decode backend
alone, which computes it; the others go by prefill and transfer. Text prompts
and chat messages are counted by the decode backend's ``/tokenize`` (a failure
there means P/D, never a failed request). ``GET /metrics`` counts each path.

Prefix affinity (``--prefix-affinity``, ``kvsm.router_affinity``): the backends
holding the longest prefix of a prompt, by the same count, take it in place of
the round robin (a conversation's turns meet their cached blocks), unless too
loaded; ``GET /metrics`` counts each choice and why.

First-token seeding (``--first-token-seeding``, ``kvsm.router_seeding``): a
streamed request of one choice gets its first token from the prefill leg's
answer, sent at once, and the decode's stream goes on after it (its token 1,
checked against the one sent, taken out).

Decode-to-prefill reuse (``kvsm.router_holds``; ``--reuse-holds`` learns them):
a decode engine's hold offered in the client's ``kv_transfer_params`` goes to
the prefill leg, which reads the blocks; the decode leg goes to their holder.

Streamed push (``--transfer-mode stream``, ``kvsm.router_stream``): both legs go
at once, joined by a key of the router's (``kvsm_stream``), so the decode
engine allocates blocks that the prefill engine fills layer by layer as it
computes; the decode leg names the prefill engine by what that backend's
earlier answers said, so a backend's first request goes sequentially (push).
The client's answer is the decode's; a failed prefill leg is counted, not
answered (the decode engine computes the prompt). ``pull`` or ``push`` only
set the prefill leg's ``transfer_mode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from kvsm.router_affinity import Balancer, Choice
from kvsm.router_cli import parse_args
from kvsm.router_decider import Decider, Decision, tokenize_body
from kvsm.router_holds import HoldStore, StreamTap, client_hold, learn_later
from kvsm.router_http import BackendError, Trace, end_with_error, error_text, since_ms, stream_broken, trace_headers
from kvsm.router_lists import merge_completions, prompt_list
from kvsm.router_seeding import Seed, decode_seeded, leg_body, prefill_extra, seed_reason
from kvsm.router_stream import StreamMode, mode_conflict

__all__ = ["create_app", "main"]

logger = logging.getLogger("kvsm.router")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


# What the prefill engine is asked for: compute the prompt's KV and keep it for
# a remote decode (the keys NixlConnector's routers send; kvsm reads the same).
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}

class Router:
    """Backends, how they are chosen, and the one client session (connection pool) to them."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout: float,
                 decider: Decider | None = None, balancer: Balancer | None = None, seeding: bool = False,
                 holds: HoldStore | None = None, transfer_mode: str | None = None) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the router needs at least one prefill and one decode backend")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.decider = decider or Decider()
        self.balancer = balancer or Balancer(self.prefill_urls, self.decode_urls, self.decider.index)
        self.timeout_s = timeout
        self.seeding = seeding
        self.holds = holds if holds is not None else HoldStore()
        self._releases: set[asyncio.Task[None]] = set()
        self.stream = StreamMode(transfer_mode, timeout, self._releases)
        # No total limit: a long stream is fine as long as the backend keeps talking.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """One session for the app's lifetime: connections to the backends are reused."""
        # limit=0: the backends do their own admission; a pool cap would queue requests here unseen.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout,
                                              auto_decompress=False)
        yield
        await asyncio.gather(*self._releases, return_exceptions=True)
        await self._session.close()

    # -- calling a backend -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def call(self, role: str, url: str, method: str, path: str, headers: dict[str, str],
                   body: dict[str, Any] | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request to one backend, with its failures turned into errors that name it."""
        assert self._session is not None, "the app is not running"
        try:
            async with self._session.request(method, url + path, json=body, headers=headers) as resp:
                try:
                    yield resp
                except BaseException:
                    resp.close()  # not back to the pool: vLLM aborts a request whose connection closes
                    raise
        except TimeoutError as e:
            raise BackendError(504, f"{role} backend {url} did not answer within {self.timeout_s:g} s",
                               "backend_timeout", url) from e
        except aiohttp.ClientConnectorError as e:
            raise BackendError(502, f"cannot connect to {role} backend {url}: {e}",
                               "backend_unreachable", url) from e
        except aiohttp.ClientError as e:
            raise BackendError(502, f"{role} backend {url} failed: {type(e).__name__}: {e}",
                               "backend_connection_error", url) from e

    @staticmethod
    async def check_status(role: str, url: str, resp: aiohttp.ClientResponse) -> None:
        """Pass a backend's error on with its status, saying which backend it was."""
        if resp.status < 400:
            return
        message, type_ = error_text(await resp.read())
        raise BackendError(resp.status, f"{role} backend {url} returned {resp.status}: {message}",
                           type_ or "backend_error", url)

    # -- handlers -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """The router's own liveness (it does not probe the backends)."""
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's counters (Prometheus text): prompts by path taken, backend choices."""
        return web.Response(text=self.decider.prometheus() + self.balancer.prometheus() + self.holds.prometheus()
                            + self.stream.prometheus(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        """What the decode engines serve (the first one answers for all)."""
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        url = self.decode_urls[0]
        try:
            async with self.call("decode", url, "GET", "/v1/models", self._headers(request, rid)) as resp:
                await self.check_status("decode", url, resp)
                return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
        except BackendError as e:
            return e.response(rid)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Prefill on one backend, then decode on another with the KV it left behind."""
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        trace = Trace(rid, request.path)
        try:
            body, offer = client_hold(await self._client_body(request))
            trace.stream = bool(body.get("stream"))
            headers = self._headers(request, rid)
            prompts = prompt_list(request.path, body)
            if prompts is not None and not trace.stream:
                return await self._generate_each(request.path, trace, body, prompts, headers)
            # A streamed list goes whole, by P/D (see the module's docstring).
            decode, trace.disagg, hashes, tokens = await self._route(request.path, body, body.get("prompt"), headers,
                                                                     countable=prompts is None)
            hold, decode = ((None, decode) if trace.disagg.local else  # a list's prompts: no one offer fits all
                            self._hold(trace, None if prompts else offer, tokens, decode))
            trace.decode, trace.affinity = decode.url, [decode]
            if self.seeding:
                trace.seed = "local" if trace.disagg.local else seed_reason(request.path, body) or "1"
            seeded = trace.seed == "1"
            seed: Seed | None = None
            with self.balancer.hold(decode):
                if not trace.disagg.local:
                    t = time.monotonic()
                    answer = await self._prefill_on(trace, trace.affinity, request.path, body, hashes, headers,
                                                    prefill_extra(request.path, body) if seeded else None, hold)
                    trace.prefill_ms = since_ms(t)
                    body = {**body, "kv_transfer_params": answer["kv_transfer_params"]}
                    seed = self._seed(trace, request.path, body, answer) if seeded else None
                learn = self.holds.on and seed is None and prompts is None and not trace.disagg.local
                tap = StreamTap.of(learn, request.path, body)
                out = (await self._decode(request, trace, {**body, **(tap.leg_fields() if tap else {})}, headers,
                                          tap) if seed is None else
                       await self._decode_seeded(request, trace, {**body, **leg_body(request.path, body)}, headers,
                                                 seed))
            if hashes is not None and trace.status < 400:
                self.balancer.record(decode, hashes)
            return out
        except BackendError as e:
            trace.status, trace.error = e.status, e.message
            return e.response(rid)
        except asyncio.CancelledError:
            trace.status, trace.error = 499, "client disconnected"
            raise
        finally:
            self.stream.log(trace)  # at once, or after the request's streamed prefill legs

    async def _generate_each(self, path: str, trace: Trace, body: dict[str, Any], prompts: list[Any],
                             headers: dict[str, str]) -> web.Response:
        """One prefill/decode pair per prompt of a list, answered as one response."""
        async def one(prompt: Any) -> dict[str, Any]:
            single = {**body, "prompt": prompt}
            decode, decision, hashes, tokens = await self._route(path, single, prompt, headers)
            hold, decode = (None, decode) if decision.local else self._hold(trace, None, tokens, decode)
            trace.decode, trace.disagg = trace.decode or decode.url, trace.disagg or decision
            choices = [decode]
            with self.balancer.hold(decode):
                if not decision.local:
                    single["kv_transfer_params"] = (await self._prefill_on(trace, choices, path, single, hashes,
                                                                           headers, None, hold))["kv_transfer_params"]
                trace.affinity = trace.affinity or choices
                out = await self._post_json("decode", decode.url, path, headers, single)
            if self.holds.on:
                self.holds.learn_answer(decode.url, out)
            if not isinstance(out.get("choices"), list):
                raise BackendError(502, f"decode backend {decode.url} returned no choices: {str(out)[:200]}",
                                   "backend_error", decode.url)
            if hashes is not None:
                self.balancer.record(decode, hashes)
            return out

        t = time.monotonic()
        answers = await asyncio.gather(*(one(p) for p in prompts))
        trace.decode_ms, trace.status = since_ms(t), 200
        return web.json_response(merge_completions(answers), headers=self._trace_headers(trace))

    # -- the steps --------------------------------------------------------------------------

    async def _route(self, path: str, body: dict[str, Any], prompt: Any, headers: dict[str, str],
                     countable: bool = True) -> tuple[Choice, Decision, list[int] | None, list[int] | None]:
        """One prompt's decode backend, P/D or that backend alone, its block hashes and token ids
        (``Balancer.route``; counted with ``--reuse-holds`` too, for the holds' match)."""
        return await self.balancer.route(self.decider, str(body.get("model")), countable,
                                         lambda url: self._tokens(url, path, body, prompt, headers),
                                         want_tokens=self.holds.on)

    def _hold(self, trace: Trace, offer: dict[str, Any] | None, tokens: list[int] | None,
              decode: Choice) -> tuple[dict[str, Any] | None, Choice]:
        """The hold a P/D prompt's prefill leg reads (``HoldStore.pick``), and the decode backend
        holding it in place of ``decode`` when known (a conversation's turns meet its blocks)."""
        hold, note = self.holds.pick(offer, tokens)
        trace.hold = trace.hold or note
        url = self.holds.backend_of(hold, self.decode_urls) if hold else None
        return hold, decode if url is None or url == decode.url else self.balancer.replace(decode, url, "hold")

    async def _tokens(self, url: str, path: str, body: dict[str, Any], prompt: Any,
                      headers: dict[str, str]) -> tuple[list[int] | None, str | None]:
        """A prompt's token ids (asking ``url``'s ``/tokenize`` for text or chat), or None and why."""
        ask = tokenize_body(path, body, prompt)
        if ask is None:
            return None, "a prompt of neither text nor token ids"
        if isinstance(ask, list):
            return ask, None
        try:
            return await self._tokenize(url, ask, headers), None
        except (BackendError, TimeoutError) as e:
            note = e.message if isinstance(e, BackendError) else "/tokenize timed out"
            logger.warning("req=%s: counting the prompt's tokens failed (so no threshold, no affinity): %s",
                           headers.get("X-Request-Id"), note)
            return None, note

    async def _tokenize(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> list[int]:
        """The prompt's token ids, as the decode backend's vLLM counts them (``POST /tokenize``)."""
        async with asyncio.timeout(min(self.timeout_s, 10.0)):
            tokens = (await self._post_json("decode", url, "/tokenize", headers, body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BackendError(502, f"decode backend {url} /tokenize returned no token ids", "backend_error", url)
        return tokens

    @staticmethod
    async def _client_body(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            raise BackendError(400, f"request body is not valid JSON: {e}", "invalid_request_error") from e
        if not isinstance(body, dict):
            raise BackendError(400, "request body must be a JSON object", "invalid_request_error")
        needed = "messages" if request.path.endswith("/chat/completions") else "prompt"
        if needed not in body:
            raise BackendError(400, f"request body has no {needed!r}", "invalid_request_error")
        return body

    @staticmethod
    def _headers(request: web.Request, rid: str) -> dict[str, str]:
        headers = {"X-Request-Id": rid}
        if "Authorization" in request.headers:  # backends started with --api-key
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _post_json(self, role: str, url: str, path: str, headers: dict[str, str],
                         body: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed answer of a backend, as the JSON object it must be."""
        async with self.call(role, url, "POST", path, headers, body) as resp:
            await self.check_status(role, url, resp)
            raw = await resp.read()
        try:
            out = json.loads(raw)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise BackendError(502, f"{role} backend {url} returned no JSON object: {raw[:200]!r}",
                               "backend_error", url)
        return out

    async def _prefill_on(self, trace: Trace, choices: list[Choice], path: str, body: dict[str, Any],
                          hashes: list[int] | None, headers: dict[str, str], extra: dict[str, Any] | None = None,
                          kv: dict[str, Any] | None = None) -> dict[str, Any]:
        """``_prefill`` on the prefill backend chosen for the prompt (added to ``choices``); with
        ``--transfer-mode stream``, started in the background when it can be (``kvsm.router_stream``),
        and the answer is then the decode leg's params, at once."""
        prefill = self.balancer.pick("prefill", hashes)
        trace.prefill = trace.prefill or prefill.url
        choices.append(prefill)

        async def leg(params: dict[str, Any] | None) -> dict[str, Any]:
            with self.balancer.hold(prefill):
                answer = await self._prefill(prefill.url, path, body, headers, extra, params)
            if hashes is not None:
                self.balancer.record(prefill, hashes)
            return answer

        if self.stream.streams(trace, prefill.url, kv):
            return self.stream.start(trace, prefill.url, leg)
        return await leg(kv)

    async def _prefill(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str],
                       extra: dict[str, Any] | None = None, kv: dict[str, Any] | None = None) -> dict[str, Any]:
        """Compute the prompt's KV on a prefill backend; return its answer, whose
        ``kv_transfer_params`` say where the decode side finds it (``extra``: fields to add;
        ``kv``: a decode engine's hold to read, or a streamed leg's params, in place of ``PREFILL_KV_PARAMS``)."""
        prefill_body = {**body, "kv_transfer_params": self.stream.prefill_params(kv or PREFILL_KV_PARAMS),
                        "max_tokens": 1, "stream": False}
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        # Meaningless for a one-token, non-streamed answer (min_tokens > 1 would be refused).
        for key in ("stream_options", "min_tokens", "best_of"):
            prefill_body.pop(key, None)
        # One prefill for n samples: vLLM's answer carries one sample's params, and the
        # other samples' prefill requests would stay pinned until their lease ends.
        if "n" in prefill_body:
            prefill_body["n"] = 1
        answer = await self._post_json("prefill", url, path, headers, {**prefill_body, **(extra or {})})
        kv_params = answer.get("kv_transfer_params")
        if not isinstance(kv_params, dict) or not kv_params:
            raise BackendError(502, f"prefill backend {url} returned no kv_transfer_params: it does not appear "
                               "to run a KV connector with kv_role kv_producer or kv_both",
                               "no_kv_transfer_params", url)
        self.stream.learn(url, kv_params)
        return answer

    @staticmethod
    def _seed(trace: Trace, path: str, body: dict[str, Any], answer: dict[str, Any]) -> Seed | None:
        """The seeded stream of the prefill's answer, or None (then the request goes unseeded)."""
        try:
            return Seed(path, body, answer)
        except ValueError as e:
            trace.seed = "fallback"
            logger.warning("req=%s: not seeding the first token: %s", trace.request_id, e)
            return None

    async def _decode_seeded(self, request: web.Request, trace: Trace, body: dict[str, Any],
                             headers: dict[str, str], seed: Seed) -> web.StreamResponse:
        return await decode_seeded(self, request, trace, body, headers, seed)

    @staticmethod
    def _trace_headers(trace: Trace) -> dict[str, str]:
        return trace_headers(trace)

    async def _decode(self, request: web.Request, trace: Trace, body: dict[str, Any],
                      headers: dict[str, str], tap: StreamTap | None = None) -> web.StreamResponse:
        """Generate on a decode backend and hand its answer to the client as it comes
        (``tap``: a stream read for its token ids, ``--reuse-holds``)."""
        url = trace.decode
        assert url is not None
        t = time.monotonic()
        async with self.call("decode", url, "POST", request.path, headers, body) as resp:
            await self.check_status("decode", url, resp)
            if not trace.stream:
                data = await resp.read()
                trace.decode_ms, trace.status = since_ms(t), resp.status
                if self.holds.on:
                    self.holds.learn_answer(url, data)
                return web.Response(body=data, status=resp.status, content_type=resp.content_type,
                                    headers=self._trace_headers(trace))
            trace.decode_ttfb_ms = since_ms(t)  # headers are out; refined at the first chunk below
            out = web.StreamResponse(status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache", **self._trace_headers(trace)})
            trace.status = resp.status
            first = True
            try:
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    if first:
                        trace.decode_ttfb_ms, first = since_ms(t), False
                    await out.write(tap.feed(chunk) if tap else chunk)
                if tap:
                    await out.write(tap.close())
                    learn_later(self, url, headers, body.get("model"), tap.token_ids())
            except ConnectionResetError:
                # The client went away (aiohttp's reset error on writing is also a ClientError,
                # so this comes first, and the backend is not blamed for it).
                trace.status, trace.error = 499, "client disconnected"
                resp.close()  # vLLM aborts a request whose connection closes
                return out
            except (TimeoutError, aiohttp.ClientError) as e:
                err = stream_broken(url, e)
                resp.close()
                await end_with_error(out, trace, err)
            trace.decode_ms = since_ms(t)
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out


def create_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout: float = 300.0, *,
               disagg_threshold: int = 0, prefix_block_size: int = 16, prefix_capacity: int = 100_000,
               prefix_affinity: bool = False, affinity_max_inflight: int | None = None,
               first_token_seeding: bool = False, reuse_holds: bool = False,
               transfer_mode: str | None = None) -> web.Application:
    """The router as an aiohttp application (run it with ``web.run_app`` or an ``AppRunner``);
    ``disagg_threshold`` 0 (here the default) sends every request by P/D, ``prefix_affinity``
    False (the default) picks backends round robin, ``first_token_seeding`` (off by default)
    streams a request's first token from the prefill leg (``kvsm.router_seeding``), ``reuse_holds``
    (off by default) learns decode engines' holds for the next turns (``kvsm.router_holds``),
    ``transfer_mode`` (None by default: the engines' own) is the prefill leg's, ``stream`` sending
    both legs at once (``kvsm.router_stream``; not with seeding or holds: a ValueError)."""
    conflict = mode_conflict(transfer_mode, first_token_seeding, reuse_holds)
    if conflict:
        raise ValueError(conflict)
    decider = Decider(disagg_threshold, prefix_block_size, prefix_capacity)
    balancer = Balancer([u.rstrip("/") for u in prefill_urls], [u.rstrip("/") for u in decode_urls], decider.index,
                        on=prefix_affinity, max_inflight=affinity_max_inflight)
    router = Router(prefill_urls, decode_urls, timeout, decider, balancer, seeding=first_token_seeding,
                    holds=HoldStore(on=reuse_holds), transfer_mode=transfer_mode)
    app = web.Application(client_max_size=64 * 2**20)  # long prompts, or images as data URLs
    app.cleanup_ctx.append(router.session_ctx)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics)
    app.router.add_get("/v1/models", router.models)
    for path in GENERATE_PATHS:
        app.router.add_post(path, router.generate)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvsm.router`` (its flags: ``kvsm.router_cli``)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(args.prefill, args.decode, args.timeout, disagg_threshold=args.disagg_threshold,
                     prefix_block_size=args.prefix_block_size, prefix_affinity=args.prefix_affinity,
                     affinity_max_inflight=args.affinity_max_inflight, first_token_seeding=args.first_token_seeding,
                     reuse_holds=args.reuse_holds,
                     **({"transfer_mode": args.transfer_mode} if args.transfer_mode else {}))
    logger.info("routing prefill=%s decode=%s on http://%s:%d; disagg threshold %d tokens, prefix blocks of %d, "
                "prefix affinity %s, first-token seeding %s, hold reuse %s", args.prefill, args.decode, args.host,
                args.port, args.disagg_threshold, args.prefix_block_size, "on" if args.prefix_affinity else "off",
                "on" if args.first_token_seeding else "off", "on" if args.reuse_holds else "off")
    # handler_cancellation: a client that goes away cancels its handler at once, which closes
    # the backend connection even while the backend is silent (vLLM then aborts the request).
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
