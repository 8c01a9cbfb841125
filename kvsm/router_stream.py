"""Streamed push in kvsm's router (``--transfer-mode stream``): both legs at once.

Sent one after the other (pull or push), the decode leg waits for the prefill
leg's answer, whose ``kv_transfer_params`` name the prefill engine and the
blocks that hold the prompt's KV. Streamed push has the prefill engine write
each layer's KV into the decode engine's blocks while it computes, so the
decode leg must be there during the prefill: the router sends both legs
together, joined by a key of its own (``kvsm_stream``, also the decode leg's
``remote_request_id``), and names the prefill engine in the decode leg with
what that backend said before (``Coordinates``: learned from any prefill
answer of it that carries ``kvsm_protocol``, kvsm's mark). So the first
request to a prefill backend goes sequentially, with ``transfer_mode`` push
(kvsm's prefill engines serve it, and its answer teaches the coordinates), as
does one whose prefill leg reads a decode engine's hold (that read is a pull of
its own); each streamed prefill answer refreshes the coordinates (an engine
restarted under a new id is learned again by its next answer).

The client's answer is the decode's, as sequentially. The prefill leg's answer
is awaited in the background (at most the router's timeout) and its failure
fails nothing: a decode engine to which no KV comes computes the prompt itself.
It is counted in ``/metrics`` and said on the request's log line, which waits
for the prefill legs so that it tells the whole request. A decode leg that
fails, or a client that goes away, cancels the prefill legs still running (the
prefill engine aborts a request whose connection closes).

Stdlib and aiohttp only: part of ``kvsm.router``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvsm.router_http import BackendError, Trace, since_ms

__all__ = ["KEY_PREFIX", "TRANSFER_MODES", "Coordinates", "StreamMode", "mode_conflict"]

logger = logging.getLogger("kvsm.router")

TRANSFER_MODES = ("pull", "push", "stream")
STREAM = "stream"
# Stream mode's sequential requests: kvsm's prefill engines push, as they do when streaming.
SEQUENTIAL = "push"
KEY_PREFIX = "kvsm-stream-"
PRODUCER_KEY = "kvsm_protocol"  # kvsm's prefill engines add it to their answers' params
# What a streamed decode leg names the prefill engine by, as its answers give them.
COORDINATE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", PRODUCER_KEY)
FALLBACKS = ("unknown_backend", "hold")

# A prefill leg on the backend chosen: its kv_transfer_params in, the backend's answer out.
Leg = Callable[[dict[str, Any] | None], Awaitable[dict[str, Any]]]


def mode_conflict(mode: str | None, seeding: bool, holds: bool) -> str | None:
    """Why these router options cannot go together (None: they can). Seeding and hold reuse
    read the prefill leg's answer before the decode leg goes; streamed, it comes after."""
    if mode not in (None, *TRANSFER_MODES):
        return f"--transfer-mode must be one of {', '.join(TRANSFER_MODES)}, not {mode!r}"
    if mode != STREAM:
        return None
    taken = [flag for flag, on in (("--first-token-seeding", seeding), ("--reuse-holds", holds)) if on]
    if not taken:
        return None
    return (f"--transfer-mode stream conflicts with {' and '.join(taken)}: they need the prefill leg's answer "
            "before the decode leg goes, and streamed push sends both legs at once")


@dataclass(frozen=True)
class Coordinates:
    """Where a prefill backend's engine is, as a streamed decode leg names it."""

    params: dict[str, Any]  # COORDINATE_KEYS' values, and remote_block_size when the engine gave it
    groups: int  # its KV cache groups: the decode leg's remote_block_ids has one (empty) list each

    @classmethod
    def of(cls, params: dict[str, Any]) -> Coordinates | None:
        """From a prefill answer's ``kv_transfer_params``; None from an engine that is not kvsm's
        (or answers without its block ids, whose number is the groups')."""
        ids = params.get("remote_block_ids")
        if PRODUCER_KEY not in params or not isinstance(ids, list):
            return None
        known = {k: params.get(k) for k in COORDINATE_KEYS}
        if "remote_block_size" in params:
            known["remote_block_size"] = params["remote_block_size"]
        return cls(known, len(ids))

    def decode_params(self, key: str) -> dict[str, Any]:
        """A streamed decode leg's ``kv_transfer_params``: no block ids yet (the prefill engine
        allocates as it goes), the join key as the prefill request it reads."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": STREAM, "kvsm_stream": key,
                "remote_request_id": key, "remote_block_ids": [[] for _ in range(self.groups)], **self.params}


def prefill_params(key: str) -> dict[str, Any]:
    """A streamed prefill leg's ``kv_transfer_params``: compute for a remote decode, joined by ``key``."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": STREAM, "kvsm_stream": key}


@dataclass
class _Pair:
    """One prompt's prefill/decode pair, as the log line tells it."""

    transfer: str  # stream, or sequential
    outcome: str = "running"  # a streamed prefill leg's: ok, error or cancelled
    task: asyncio.Task[None] | None = None


@dataclass
class _Request:
    """A client request's pairs (one a prompt: a list of prompts has several)."""

    pairs: list[_Pair] = field(default_factory=list)
    error: str | None = None  # the first failed prefill leg's

    def fields(self) -> str:
        text = " transfer=" + ",".join(p.transfer for p in self.pairs)
        streamed = [p.outcome for p in self.pairs if p.task is not None]
        if streamed:
            text += " prefill_stream=" + ",".join(streamed)
        return text + (f" prefill_stream_error={self.error!r}" if self.error else "")


class StreamMode:
    """The router's ``--transfer-mode``: what the prefill leg is told, and in stream mode the
    prefill backends' coordinates, the pairs sent at once, their counts and log lines."""

    def __init__(self, mode: str | None, timeout_s: float, background: set[asyncio.Task[None]]) -> None:
        if mode not in (None, *TRANSFER_MODES):
            raise ValueError(mode_conflict(mode, False, False))
        self.mode = mode
        self.timeout_s = timeout_s
        self.known: dict[str, Coordinates] = {}  # prefill backend URL -> its engine's
        self.counts = dict.fromkeys(("pairs", "prefill_errors", "prefill_cancelled"), 0)
        self.fallbacks = dict.fromkeys(FALLBACKS, 0)
        self._requests: dict[int, _Request] = {}  # id(trace) -> its pairs, until its log line
        self._background = background  # the router's: its shutdown waits for them

    @property
    def on(self) -> bool:
        return self.mode == STREAM

    def prefill_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """A prefill leg's ``kv_transfer_params`` with the mode asked (stream mode's sequential
        pairs: push). Params saying their own (a streamed leg's, a decode hold's) keep it."""
        if self.mode is None or "transfer_mode" in params:
            return dict(params)
        return {**params, "transfer_mode": SEQUENTIAL if self.on else self.mode}

    def learn(self, url: str, params: dict[str, Any]) -> None:
        """Remember where ``url``'s engine is, from a prefill answer's ``kv_transfer_params``."""
        if self.on and (coordinates := Coordinates.of(params)) is not None:
            self.known[url] = coordinates

    def streams(self, trace: Trace, url: str, hold: dict[str, Any] | None) -> bool:
        """Does this prompt's pair go at once? Not before ``url``'s coordinates are known, nor
        with a decode hold to read (counted: both go sequentially)."""
        if not self.on:
            return False
        reason = "hold" if hold is not None else None if url in self.known else "unknown_backend"
        if reason is None:
            return True
        self.fallbacks[reason] += 1
        self._request(trace).pairs.append(_Pair("sequential"))
        return False

    def start(self, trace: Trace, url: str, leg: Leg) -> dict[str, Any]:
        """Send the prefill leg in the background; return the decode leg's params, shaped as the
        prefill's answer that carries them is in a sequential pair."""
        key = KEY_PREFIX + uuid.uuid4().hex
        request = self._request(trace)
        pair = _Pair(STREAM)
        pair.task = asyncio.ensure_future(self._prefill(trace, request, pair, leg, prefill_params(key)))
        self._keep(pair.task)
        request.pairs.append(pair)
        self.counts["pairs"] += 1
        return {"kv_transfer_params": self.known[url].decode_params(key)}

    def log(self, trace: Trace) -> None:
        """The request's log line: at once, or once its streamed prefill legs have ended (cancelled
        first where the client's request failed or went away: no decode reads them)."""
        request = self._requests.pop(id(trace), None)
        if request is None:
            logger.info("%s", trace.line())
            return
        running = [p for p in request.pairs if p.task is not None and not p.task.done()]
        if trace.status >= 400:
            for pair in running:
                assert pair.task is not None
                pair.task.cancel()
                pair.outcome = "cancelled"
                self.counts["prefill_cancelled"] += 1
        if not running:
            logger.info("%s%s", trace.line(), request.fields())
            return
        self._keep(asyncio.ensure_future(self._log_after(trace, request, [p.task for p in running if p.task])))

    def prometheus(self) -> str:
        """The counts in Prometheus' text format (the router's ``/metrics``)."""
        lines = ["# HELP kvsm_router_stream_pairs_total Prefill/decode pairs sent at once (--transfer-mode stream).",
                 "# TYPE kvsm_router_stream_pairs_total counter",
                 f"kvsm_router_stream_pairs_total {self.counts['pairs']}",
                 "# HELP kvsm_router_stream_prefill_errors_total Streamed prefill legs that failed (the decode "
                 "engine then computes the prompt; the client's request goes on).",
                 "# TYPE kvsm_router_stream_prefill_errors_total counter",
                 f"kvsm_router_stream_prefill_errors_total {self.counts['prefill_errors']}",
                 "# HELP kvsm_router_stream_prefill_cancelled_total Streamed prefill legs cancelled: their decode "
                 "leg failed or the client went away.",
                 "# TYPE kvsm_router_stream_prefill_cancelled_total counter",
                 f"kvsm_router_stream_prefill_cancelled_total {self.counts['prefill_cancelled']}",
                 "# HELP kvsm_router_stream_fallback_sequential_total Pairs that went sequentially in stream mode, "
                 "and why: unknown_backend (the prefill backend's coordinates not learned yet), hold (the prefill "
                 "leg reads a decode hold).",
                 "# TYPE kvsm_router_stream_fallback_sequential_total counter"]
        lines += [f'kvsm_router_stream_fallback_sequential_total{{reason="{r}"}} {self.fallbacks[r]}'
                  for r in FALLBACKS]
        lines += ["# HELP kvsm_router_stream_backends_known Prefill backends whose coordinates the router knows.",
                  "# TYPE kvsm_router_stream_backends_known gauge",
                  f"kvsm_router_stream_backends_known {len(self.known)}",
                  "# HELP kvsm_router_transfer_mode The transfer mode the router asks the prefill leg for "
                  '(mode="" for the engines\' own).',
                  "# TYPE kvsm_router_transfer_mode gauge", f'kvsm_router_transfer_mode{{mode="{self.mode or ""}"}} 1']
        return "\n".join(lines) + "\n"

    # -- inside ---------------------------------------------------------------------------------

    def _request(self, trace: Trace) -> _Request:
        return self._requests.setdefault(id(trace), _Request())

    def _keep(self, task: asyncio.Task[None]) -> None:
        """A task the client's answer does not wait for; the router's shutdown does."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefill(self, trace: Trace, request: _Request, pair: _Pair, leg: Leg, params: dict[str, Any]) -> None:
        """A streamed prefill leg, to its end: its failure is counted and logged, never raised
        (a cancellation is ``log``'s, which counts it)."""
        t = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                await leg(params)
        except Exception as e:  # noqa: BLE001 - whatever failed, the client's answer is the decode's
            message = (e.message if isinstance(e, BackendError) else
                       f"the prefill leg did not answer within {self.timeout_s:g} s" if isinstance(e, TimeoutError) else
                       f"{type(e).__name__}: {e}")
            pair.outcome, request.error = "error", request.error or message
            self.counts["prefill_errors"] += 1
            logger.warning("req=%s: streamed prefill leg failed (the decode engine computes the prompt): %s",
                           trace.request_id, message)
            return
        pair.outcome = "ok"
        trace.prefill_ms = max(trace.prefill_ms or 0.0, since_ms(t))

    @staticmethod
    async def _log_after(trace: Trace, request: _Request, running: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*running, return_exceptions=True)
        logger.info("%s%s", trace.line(), request.fields())
