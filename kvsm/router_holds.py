"""Decode-to-prefill reuse in kvsm's router: a conversation's next turn reads
the blocks its last decode engine holds (engines with ``bidirectional_kv_xfer``).

A decode engine with ``bidirectional_kv_xfer`` (kv_role ``kv_both``) holds a
finished request's KV blocks (its prompt and generated tokens, full blocks) for
a while, and its non-streamed answer carries ``kv_transfer_params`` offering
them in upstream's shape (``do_remote_decode``, ``remote_block_ids``, the
decode engine's ``remote_*``) plus ``kvsm_hold_digests``: one chained digest of
the tokens up to the end of each held block (``kvsm.hold_digests``). Sent as
the next turn's prefill leg's ``kv_transfer_params``, they make the prefill
engine read the held blocks its prompt starts with (it checks the digests
itself, so a wrong offer costs only the compute) instead of computing them.

Two ways to get there:

* The client passes the previous answer's ``kv_transfer_params`` in its next
  request (upstream's contract; always on): the router sends them to the
  prefill leg, and never to the decode leg.
* ``--reuse-holds``: the router learns the offers itself (``HoldStore``), from
  non-streamed decode answers, and for a streamed P/D request by asking the
  decode leg for token ids (``StreamTap``) and, once the stream has ended,
  sending the decode backend the conversation so far with ``max_tokens`` 1
  and ``kv_transfer_params: {"kvsm_hold": true}`` (its prefix is in that
  engine's prefix cache, so it costs about one token; its answer carries the
  offer). A P/D request whose prompt token ids the router knows gets the
  longest learned hold its prompt starts with (matched by digest at the
  hold's block size), and its decode leg goes to the backend that holds it.

Stdlib and the hold digests only: part of ``kvsm.router``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvsm.hold_digests import block_digests
from kvsm.router_http import BackendError, EventFeed, stream_chunk

__all__ = ["HOLD_CAPACITY", "Hold", "HoldStore", "StreamTap", "client_hold", "hold_body", "hold_offer",
           "learn_later"]

logger = logging.getLogger("kvsm.router")

HOLD_CAPACITY = 4096  # learned holds kept; the least recently learned go first
MAX_BLOCK_SIZES = 8  # distinct engine block sizes matched against (one in practice)
CHAT = "/v1/chat/completions"


def hold_offer(params: Any) -> dict[str, Any] | None:
    """``params`` when they offer a hold a prefill leg can read (upstream's shape), else None."""
    if isinstance(params, dict) and params.get("do_remote_decode") is True and params.get("remote_block_ids"):
        return params
    return None


def client_hold(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The client's body without a hold offer in its ``kv_transfer_params``, and the offer (or None).
    Other ``kv_transfer_params`` stay where they are, as before."""
    offer = hold_offer(body.get("kv_transfer_params"))
    if offer is None:
        return body, None
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}, offer


@dataclass
class Hold:
    """One learned offer: its params, the decode backend that answered with it, and its blocks."""

    params: dict[str, Any]
    url: str
    block_size: int
    digests: list[str]

    @property
    def tokens(self) -> int:
        return self.block_size * len(self.digests)


class HoldStore:
    """The holds learned from decode answers (``--reuse-holds``), keyed by their last block's
    digest, and which decode backend each engine id answered from."""

    EVENTS = ("learned", "used", "missed", "client", "expired", "learn_failed")

    def __init__(self, on: bool = False, capacity: int = HOLD_CAPACITY) -> None:
        self.on, self.capacity = on, capacity
        self._holds: OrderedDict[str, Hold] = OrderedDict()
        self._block_sizes: OrderedDict[int, None] = OrderedDict()
        self.engines: dict[str, str] = {}  # remote_engine_id -> the decode backend's URL
        self.counts = dict.fromkeys(self.EVENTS, 0)

    def __len__(self) -> int:
        return len(self._holds)

    def learn(self, url: str, params: Any) -> bool:
        """Keep the hold ``params`` offer (from decode backend ``url``); False when they offer none."""
        offer = hold_offer(params)
        if offer is None:
            return False
        digests, size = offer.get("kvsm_hold_digests"), offer.get("remote_block_size")
        engine = offer.get("remote_engine_id")
        if isinstance(engine, str):
            self.engines[engine] = url
        if (not isinstance(digests, list) or not digests or not all(isinstance(d, str) for d in digests)
                or not isinstance(size, int) or size < 1):
            return False  # an upstream offer without digests: nothing to match a prompt against
        self._holds[digests[-1]] = Hold(dict(offer), url, size, list(digests))
        self._holds.move_to_end(digests[-1])
        while len(self._holds) > self.capacity:
            self._holds.popitem(last=False)
        self._block_sizes[size] = None
        self._block_sizes.move_to_end(size)
        while len(self._block_sizes) > MAX_BLOCK_SIZES:
            self._block_sizes.popitem(last=False)
        self.counts["learned"] += 1
        return True

    def learn_answer(self, url: str, raw: bytes | dict[str, Any]) -> bool:
        """``learn`` from a decode backend's non-streamed answer (its JSON body, or the bytes of it)."""
        if isinstance(raw, bytes):
            try:
                raw = json.loads(raw)
            except ValueError:
                return False
        return isinstance(raw, dict) and self.learn(url, raw.get("kv_transfer_params"))

    def take(self, tokens: list[int]) -> Hold | None:
        """The longest learned hold ``tokens`` starts with, removed from the store (its read
        releases it on the decode engine); counts it used, or the prompt missed."""
        best: Hold | None = None
        now = time.time()
        for size in list(self._block_sizes):
            digests = block_digests(tokens, size, len(tokens) // size)
            for n in range(len(digests), 0, -1):
                if best is not None and n * size <= best.tokens:
                    break
                hold = self._holds.get(digests[n - 1])
                if hold is None or hold.block_size != size or hold.digests != digests[:n]:
                    continue
                expiry = hold.params.get("remote_blocks_expiry_time")
                if isinstance(expiry, int | float) and expiry <= now:
                    del self._holds[digests[n - 1]]  # released on the engine already
                    self.counts["expired"] += 1
                    continue
                best = hold
                break
        if best is None:
            self.counts["missed"] += 1
            return None
        del self._holds[best.digests[-1]]
        self.counts["used"] += 1
        return best

    def pick(self, offer: dict[str, Any] | None, tokens: list[int] | None) -> tuple[dict[str, Any] | None, str | None]:
        """The hold a P/D prompt's prefill leg reads: the client's ``offer``, else (on) the longest
        learned one its ``tokens`` start with; and what the log line says (``hold=``)."""
        if offer is not None:
            self.forget(offer)
            return offer, f"client:{offer.get('remote_num_tokens', '-')}"
        if not self.on or tokens is None:
            return None, None
        found = self.take(tokens)
        return (found.params, f"store:{found.tokens}") if found else (None, "miss")

    def forget(self, params: dict[str, Any]) -> None:
        """A client passed this offer itself: not to be given to another request too."""
        digests = params.get("kvsm_hold_digests")
        if isinstance(digests, list) and digests and isinstance(digests[-1], str):
            self._holds.pop(digests[-1], None)
        self.counts["client"] += 1

    def backend_of(self, params: dict[str, Any], urls: list[str]) -> str | None:
        """The decode backend (of ``urls``) that holds the offer's blocks, when the router knows it."""
        engine = params.get("remote_engine_id")
        url = self.engines.get(engine) if isinstance(engine, str) else None
        return url if url in urls else None

    def prometheus(self) -> str:
        """The counts in Prometheus' text format (the router's ``/metrics``)."""
        lines = ["# HELP kvsm_router_holds_total Decode holds (bidirectional_kv_xfer): learned from decode "
                 "answers, used by a prefill leg, missed (a P/D prompt of known tokens that starts with no "
                 "learned hold), client (passed by the client itself), expired (dropped unused), learn_failed "
                 "(the call asking a streamed turn's hold failed).",
                 "# TYPE kvsm_router_holds_total counter"]
        lines += [f'kvsm_router_holds_total{{event="{e}"}} {self.counts[e]}' for e in self.EVENTS]
        lines += ["# HELP kvsm_router_holds_stored Learned holds the router keeps for a next turn.",
                  "# TYPE kvsm_router_holds_stored gauge", f"kvsm_router_holds_stored {len(self._holds)}",
                  "# HELP kvsm_router_reuse_holds Whether the router learns and reuses decode holds (1) or not (0).",
                  "# TYPE kvsm_router_reuse_holds gauge", f"kvsm_router_reuse_holds {int(self.on)}"]
        return "\n".join(lines) + "\n"


def hold_body(model: Any, token_ids: list[int]) -> dict[str, Any]:
    """The call that makes a decode engine hold a streamed turn: the conversation so far, one token."""
    return {"model": model, "prompt": token_ids, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"kvsm_hold": True}}


def _ids(value: Any) -> list[int] | None:
    return value if isinstance(value, list) and all(isinstance(t, int) for t in value) else None


class StreamTap(EventFeed):
    """A streamed P/D request's decode stream, read for its prompt and generated token ids
    (asked with ``return_token_ids``, and taken out again where the client did not ask)."""

    @classmethod
    def of(cls, on: bool, path: str, body: dict[str, Any]) -> StreamTap | None:
        """The tap of a streamed P/D request with hold reuse ``on``; None where there is none to learn."""
        tap = cls(path, body) if on and body.get("stream") else None
        return tap if tap is not None and tap.ok else None

    def __init__(self, path: str, body: dict[str, Any]) -> None:
        self.chat = path == CHAT
        asked = bool(body.get("return_token_ids"))
        # One choice only (one conversation), and not completions' echo unasked: there
        # return_token_ids changes the echoed text.
        self.ok = ((body.get("n") or 1) == 1 and (body.get("best_of") or 1) == 1
                   and not body.get("use_beam_search") and (asked or self.chat or not body.get("echo")))
        self.ours = self.ok and not asked
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.finished = False

    def leg_fields(self) -> dict[str, Any]:
        """What the decode leg gets on top of the client's body."""
        return {"return_token_ids": True} if self.ours else {}

    def close(self) -> bytes:
        return self.rest()

    def token_ids(self) -> list[int] | None:
        """The conversation so far (prompt, then generated), once the stream finished; else None."""
        if not self.finished or not self.prompt_ids or not self.generated:
            return None
        return self.prompt_ids + self.generated

    def _event(self, raw: bytes) -> bytes:
        chunk = stream_chunk(raw)
        if chunk is None:
            return raw + b"\n\n"
        self._read(chunk)
        if not self.ours:
            return raw + b"\n\n"
        chunk.pop("prompt_token_ids", None)  # chat's, on its first chunk
        for c in chunk.get("choices") or []:
            if isinstance(c, dict):
                for key in ("token_ids", "prompt_token_ids"):
                    if key in c:
                        c[key] = None  # as vLLM streams them unasked
        return b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def _read(self, chunk: dict[str, Any]) -> None:
        if self.prompt_ids is None:
            self.prompt_ids = _ids(chunk.get("prompt_token_ids"))
        for c in chunk.get("choices") or []:
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            if self.prompt_ids is None:
                self.prompt_ids = _ids(c.get("prompt_token_ids"))
            self.generated += _ids(c.get("token_ids")) or []
            if c.get("finish_reason") is not None:
                self.finished = True


def learn_later(router: Any, url: str, headers: dict[str, str], model: Any, token_ids: list[int] | None) -> None:
    """Have decode backend ``url`` hold a streamed turn (``token_ids``: its prompt and generated ids;
    None: nothing to learn) and learn the hold, in the background: off the client's critical path
    (``router``: the ``kvsm.router.Router``; its shutdown waits for the task)."""
    if token_ids is None or not router.holds.on:
        return
    task = asyncio.ensure_future(_learn(router, url, headers, model, token_ids))
    router._releases.add(task)
    task.add_done_callback(router._releases.discard)


async def _learn(router: Any, url: str, headers: dict[str, str], model: Any, token_ids: list[int]) -> None:
    rid = headers.get("X-Request-Id")
    try:
        answer = await router._post_json("decode", url, "/v1/completions", {**headers, "X-Request-Id": f"{rid}-hold"},
                                         hold_body(model, token_ids))
    except (BackendError, aiohttp.ClientError, TimeoutError) as e:
        router.holds.counts["learn_failed"] += 1
        logger.warning("req=%s: asking decode backend %s to hold the turn (%d tokens) failed: %s", rid, url,
                       len(token_ids), e.message if isinstance(e, BackendError) else repr(e))
        return
    if not router.holds.learn_answer(url, answer):
        router.holds.counts["learn_failed"] += 1
        logger.warning("req=%s: decode backend %s offered no hold for the turn (%d tokens): does it run with "
                       "bidirectional_kv_xfer?", rid, url, len(token_ids))
