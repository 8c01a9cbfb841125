"""First-token seeding for kvsm's router (``--first-token-seeding``, off by default).

Without it the client's first token waits for the decode leg: the prefill
engine computes the prompt and samples token 1 (``max_tokens=1``), the decode
engine reads the KV and samples token 1 again, and only then does the client
see it. With it, for a streamed request of one choice, the router streams the
prefill engine's token 1 to the client as soon as the prefill leg answers,
then forwards the decode engine's stream with its token 1 taken out: TTFT is
the prefill engine's plus the router's hop.

Why the outputs stay equal to one engine's, greedy and seeded: the decode
engine samples token 1 from the same prompt KV with a fresh generator of the
same seed, so it samples the prefill's token 1 (and goes on from the state one
engine would be in). The router does not take that on trust: the decode's
token 1 is compared with what was sent, by token id where both legs return ids
(``return_token_ids``, which the router asks both legs for unless the client
did, and takes out again), by the logprobs' token strings when logprobs were
asked for, and always by text: the text the decode streams must begin with the
text the router sent. A mismatch ends the stream with an SSE error event
(``type: decode_diverged``), never silently.

Text is dropped by prefix, not by chunk: vLLM's incremental detokenizer may
stream token 1's text late (held back for a stop string, or an incomplete
UTF-8 character), so the router sends the prefix of token 1's text that one
engine would have sent at that point (vLLM's hold-back for stop strings, less
any trailing U+FFFD) and drops exactly that many characters from the start of
the decode's text, wherever they come. Token ids and logprobs entries are
dropped by count (token 1's, plus the prompt's for ``echo``).

What is seeded: streamed ``/v1/completions`` of one prompt and
``/v1/chat/completions``, ``n`` 1, no ``best_of`` > 1, no beam search, no
``stream_options.continuous_usage_stats``; chat without ``tools``, ``echo`` or
``return_prompt_text`` (and a prefill answer with reasoning or tool calls,
from an engine's parser, falls back); completions ``echo`` only with some
``max_tokens`` above 0. Everything else goes as without the flag. When token 1
ends the request (a stop token, a stop string, ``max_tokens`` 1), the
router finishes the stream from the prefill's answer (its usage when
``stream_options.include_usage``) and still sends the decode leg, with
``max_tokens`` 1 and not streamed, and discards it: the decode reading the KV
is what lets the prefill engine release the blocks it pinned for it.

With ``--reuse-holds`` (``kvsm.router_holds``) a seeded stream's token ids
(the prefill's prompt ids and token 1, the decode's ids after it) are kept and,
once the stream has finished, the decode backend is asked to hold the turn, as
for an unseeded stream; a stream whose ids the legs do not return (completions'
``echo`` without ``return_token_ids``) is not learned. The release leg of a
request token 1 ended is not streamed: its answer's hold is learned as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvsm.router_holds import learn_later
from kvsm.router_http import (
    BackendError,
    EventFeed,
    Trace,
    end_with_error,
    since_ms,
    stream_broken,
    stream_chunk,
    trace_headers,
)

__all__ = ["Diverged", "Seed", "decode_seeded", "leg_body", "prefill_extra", "release", "release_body",
           "seed_reason"]

logger = logging.getLogger("kvsm.router")

CHAT = "/v1/chat/completions"


class Diverged(Exception):
    """The decode engine's token 1 is not the one the router already sent."""


def seed_reason(path: str, body: dict[str, Any]) -> str | None:
    """Why this request is not seeded (a word for the log line), or None when it is."""
    if not body.get("stream"):
        return "not_streamed"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1 or body.get("use_beam_search"):
        return "n"
    options = body.get("stream_options") or {}
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "continuous_usage"
    if path == CHAT:
        if body.get("tools") or body.get("echo") or body.get("return_prompt_text"):
            return "chat_tools_or_echo"
    elif not isinstance(body.get("prompt"), str | list) or (
            isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int)):
        return "prompt_list"
    elif body.get("echo") and body.get("max_tokens") == 0:
        return "echo_max_tokens_0"
    return None


def _our_ids(path: str, body: dict[str, Any]) -> bool:
    """Does the router ask for token ids the client did not? (Not with completions' echo:
    there ``return_token_ids`` changes the echoed text.)"""
    return not body.get("return_token_ids") and not (path != CHAT and body.get("echo"))


def leg_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The fields both legs get on top of the client's, for a seeded request."""
    return {"return_token_ids": True} if _our_ids(path, body) else {}


def prefill_extra(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The fields the prefill leg of a seeded request gets on top of today's: ``leg_body``'s,
    and ``min_tokens`` 1 where the client asked for some (today's leg drops it): token 1
    must be sampled as the decode samples it, stop tokens masked alike."""
    return {**leg_body(path, body), **({"min_tokens": 1} if body.get("min_tokens") else {})}


def release_body(body: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of a request that token 1 ended: read the KV, one token, not streamed."""
    out = {**body, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "logprobs", "top_logprobs", "echo"):
        out.pop(key, None)
    if out.get("min_tokens"):
        out["min_tokens"] = 1
    return out


def _hold_back(body: dict[str, Any]) -> int:
    """Characters vLLM's detokenizer keeps back from a stream for stop strings (``stop_buffer_length``)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    if not stops or body.get("include_stop_str_in_output"):
        return 0
    return max(len(s) for s in stops) - 1


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _lp_tokens(path: str, logprobs: Any) -> list[Any]:
    """The token strings of a logprobs object (chat's ``content`` list, completions' ``tokens``)."""
    if not isinstance(logprobs, dict):
        return []
    if path == CHAT:
        return [e.get("token") for e in logprobs.get("content") or [] if isinstance(e, dict)]
    return list(logprobs.get("tokens") or [])


class Seed(EventFeed):
    """One seeded request: its first chunks, built from the prefill's answer, and the
    filter the decode's stream goes through (``feed``, then ``close``)."""

    def __init__(self, path: str, body: dict[str, Any], answer: dict[str, Any]) -> None:
        self.path, self.chat = path, path == CHAT
        self.our_ids = _our_ids(path, body)
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ValueError(f"the prefill's answer has not one choice: {str(answer)[:200]}")
        choice = choices[0]
        self.id, self.created, self.model = answer.get("id"), answer.get("created"), answer.get("model")
        # The prefill leg always ends by length (max_tokens 1): the client's request ends
        # with it only when it asked for one token; a stop token or string ends it anyway.
        finish = choice.get("finish_reason")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        self.finish = finish if finish == "stop" or (finish == "length" and limit == 1) else None
        message = choice.get("message") or {}
        if self.chat and (message.get("tool_calls") or message.get("reasoning") or message.get("reasoning_content")):
            raise ValueError("the prefill's answer has reasoning or tool calls (an engine's parser)")
        text = (message.get("content") if self.chat else choice.get("text")) or ""
        if self.finish is None:  # what one engine would have streamed by now (see the module's docstring)
            text = text[:max(0, len(text) - _hold_back(body))].rstrip("\ufffd")
        self.text_left = text
        self.ids_left = list(choice.get("token_ids") or [])
        self.generated = list(self.ids_left)  # token 1's, then the decode's (--reuse-holds learns them)
        self.finished = False
        self.logprobs = choice.get("logprobs")
        self.lp_left = _lp_tokens(path, self.logprobs)
        self.role_left = self.chat
        self.prompt_ids = answer.get("prompt_token_ids") if self.chat else choice.get("prompt_token_ids")
        self.answer, self.choice, self.sent_text = answer, choice, text

    def token_ids(self) -> list[int] | None:
        """The conversation so far (prompt, then generated), once the stream finished; else None."""
        if not self.finished or not isinstance(self.prompt_ids, list) or not self.prompt_ids or not self.generated:
            return None
        return [*self.prompt_ids, *self.generated]

    @property
    def final(self) -> bool:
        """Did token 1 end the request (the prefill's answer says so)?"""
        return self.finish is not None

    def _chunk(self, choice: dict[str, Any], **top: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice], **top}

    def head(self) -> bytes:
        """The first chunk(s), as one engine streams them; the whole stream when token 1 ended it."""
        c = self.choice
        ids = None if self.our_ids else c.get("token_ids")
        end: dict[str, Any] = {"finish_reason": self.finish}
        if self.final:
            end["stop_reason"] = c.get("stop_reason")
        out = b""
        if self.chat:
            role = (c.get("message") or {}).get("role") or "assistant"
            top = {} if self.our_ids or self.prompt_ids is None else {"prompt_token_ids": self.prompt_ids}
            out += _event(self._chunk({"index": 0, "delta": {"role": role, "content": ""}, "logprobs": None,
                                       "finish_reason": None}, **top))
            out += _event(self._chunk({"index": 0, "delta": {"content": self.sent_text},
                                       "logprobs": self.logprobs, **end, "token_ids": ids}))
        else:
            out += _event(self._chunk({"index": 0, "text": self.sent_text, "logprobs": self.logprobs,
                                       "finish_reason": self.finish, "stop_reason": end.get("stop_reason"),
                                       "prompt_token_ids": None if self.our_ids else self.prompt_ids,
                                       "token_ids": ids}))
        if self.final:
            usage = self.answer.get("usage")
            if self.usage and isinstance(usage, dict):
                usage = {k: v for k, v in usage.items() if v is not None}  # as vLLM streams it
                out += _event({**self._chunk({}), "choices": [], "usage": usage})
            out += b"data: [DONE]\n\n"
        return out

    # -- the decode's stream ----------------------------------------------------------------

    def close(self) -> bytes:
        """The end of the decode's stream: what is left, checking token 1 was all there."""
        out = self.rest()
        if self.text_left or self.ids_left or self.lp_left or self.role_left:
            raise Diverged(f"the decode stream ended before repeating token 1 (left: text {self.text_left!r}, "
                           f"ids {self.ids_left}, logprobs {self.lp_left})")
        return out

    def _event(self, raw: bytes) -> bytes:
        chunk = stream_chunk(raw)
        if chunk is None:
            return raw + b"\n\n"  # [DONE], or the decode engine's own error event, goes on as it is
        chunk = self._filter(chunk)
        return b"" if chunk is None else _event(chunk)

    def _filter(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """A decode chunk without what the router already sent (None: nothing left of it)."""
        chunk.update(id=self.id, created=self.created, model=self.model)
        if self.chat:
            chunk.pop("prompt_token_ids", None)
        choices = chunk.get("choices") or []
        if not choices:
            return chunk  # the usage chunk
        c = choices[0]
        if self.chat:
            delta = c.get("delta") or {}
            if self.role_left and "role" in delta:
                self.role_left = False  # one engine's role chunk: the router sent its own
                return None
        elif self.our_ids or self.prompt_ids is not None:
            # Sent in the first chunk, or asked for by the router only. (vLLM streams them with
            # echo even unasked, which its non-streamed answer does not: those pass through.)
            c["prompt_token_ids"] = None
        key, holder = ("content", c.get("delta") or {}) if self.chat else ("text", c)
        text = holder.get(key) or ""
        if self.text_left and text:
            n = min(len(text), len(self.text_left))
            if text[:n] != self.text_left[:n]:
                raise Diverged(f"the decode's text {text!r} does not go on from the {self.sent_text!r} sent")
            text, self.text_left = text[n:], self.text_left[n:]
            holder[key] = text
        ids = c.get("token_ids")
        if self.ids_left and ids:
            n = min(len(ids), len(self.ids_left))
            if ids[:n] != self.ids_left[:n]:
                raise Diverged(f"the decode's token ids {ids[:n]} are not the {self.ids_left[:n]} sent")
            ids, self.ids_left = ids[n:], self.ids_left[n:]
            c["token_ids"] = ids
        if isinstance(ids, list):
            self.generated += ids
        self.finished = self.finished or c.get("finish_reason") is not None
        if self.our_ids:
            c["token_ids"] = ids = None
        lp_count = self._drop_logprobs(c)
        if (not text and not ids and not lp_count and c.get("finish_reason") is None and not chunk.get("usage")
                and not c.get("prompt_token_ids")
                and not (self.chat and any(v for k, v in (c.get("delta") or {}).items() if k != "content"))):
            return None
        return chunk

    def _drop_logprobs(self, c: dict[str, Any]) -> int:
        """Take token 1's logprobs entries out of a decode chunk; how many entries are left in it."""
        lp = c.get("logprobs")
        if not isinstance(lp, dict):
            return 0
        fields = ["content"] if self.chat else ["tokens", "token_logprobs", "top_logprobs", "text_offset"]
        got = _lp_tokens(self.path, lp)
        n = min(len(got), len(self.lp_left))
        if n:
            if got[:n] != self.lp_left[:n]:
                raise Diverged(f"the decode's logprobs tokens {got[:n]} are not the {self.lp_left[:n]} sent")
            self.lp_left = self.lp_left[n:]
            for f in fields:
                if isinstance(lp.get(f), list):
                    lp[f] = lp[f][n:]
        return len(got) - n


# --------------------------------------------------------------- the seeded stream

async def decode_seeded(router: Any, request: web.Request, trace: Trace, body: dict[str, Any],
                        headers: dict[str, str], seed: Seed) -> web.StreamResponse:
    """Stream token 1 from the prefill's answer at once, then the decode's stream after its token 1
    (``router``: the ``kvsm.router.Router`` serving the request: its backend calls)."""
    url = trace.decode
    assert url is not None
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  **trace_headers(trace)})
    trace.status = 200
    await out.prepare(request)
    await out.write(seed.head())
    trace.first_ms, t = since_ms(trace.t0), time.monotonic()
    if seed.final:  # token 1 ended it; the decode leg still reads the KV, so the prefill frees it
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        # Not awaited here: the client has its answer (and may go, cancelling this handler).
        task = asyncio.ensure_future(release(router, url, request.path, headers, release_body(body)))
        router._releases.add(task)
        task.add_done_callback(router._releases.discard)
        return out
    try:
        async with router.call("decode", url, "POST", request.path, headers, body) as resp:
            await router.check_status("decode", url, resp)
            try:
                async for chunk in resp.content.iter_any():
                    if trace.decode_ttfb_ms is None:
                        trace.decode_ttfb_ms = since_ms(t)
                    if data := seed.feed(chunk):
                        await out.write(data)
                await out.write(seed.close())
                learn_later(router, url, headers, body.get("model"), seed.token_ids())
            except ConnectionResetError:
                trace.status, trace.error = 499, "client disconnected"
                resp.close()  # vLLM aborts a request whose connection closes
                return out
            except (TimeoutError, aiohttp.ClientError) as e:
                raise stream_broken(url, e) from e
    except (BackendError, Diverged) as e:
        # Too late for an error status (token 1 is out): end the stream with an error event.
        err = e if isinstance(e, BackendError) else BackendError(
            502, f"decode backend {url} diverged from the first token sent: {e}", "decode_diverged", url)
        await end_with_error(out, trace, err)
    trace.decode_ms = since_ms(t)
    with contextlib.suppress(ConnectionResetError):
        await out.write_eof()
    return out

async def release(router: Any, url: str, path: str, headers: dict[str, str], body: dict[str, Any]) -> None:
    """A decode leg whose answer nobody reads: it makes the decode engine read (so the prefill free) the KV."""
    try:
        answer = await router._post_json("decode", url, path, headers, body)
        if router.holds.on:
            router.holds.learn_answer(url, answer)
    except BackendError as e:
        logger.warning("req=%s: the decode leg of a request its first token ended failed: %s",
                       headers.get("X-Request-Id"), e.message)
