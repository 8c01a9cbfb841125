"""What the router's steps share: the error a client is answered with, the
per-request trace its log line reports, and small helpers on both."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvsm.router_affinity import Choice
from kvsm.router_decider import Decision

__all__ = ["BackendError", "Trace", "end_with_error", "error_text", "since_ms", "stream_broken", "trace_headers"]


class BackendError(Exception):
    """A failure to be answered to the client as an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, type_: str, backend: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.backend = status, message, type_, backend

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "backend": self.backend,
                          "code": self.status}}

    def response(self, request_id: str) -> web.Response:
        return web.json_response(self.payload(), status=self.status, headers={"X-Request-Id": request_id})


@dataclass
class Trace:
    """What the per-request log line reports."""

    request_id: str
    path: str
    stream: bool = False
    prefill: str | None = None
    decode: str | None = None
    prefill_ms: float | None = None
    decode_ttfb_ms: float | None = None
    decode_ms: float | None = None
    status: int = 500
    error: str | None = None
    disagg: Decision | None = None  # the first prompt's, for a list
    affinity: list[Choice] = field(default_factory=list)  # the first prompt's, for a list
    seed: str | None = None  # with --first-token-seeding: "1", or why not
    first_ms: float | None = None  # a seeded stream's first chunk written, since t0
    hold: str | None = None  # a decode hold read by the prefill leg: client:N, store:N, or miss
    t0: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"
        text = (f"req={self.request_id} {self.path} stream={int(self.stream)} status={self.status} "
                f"prefill={self.prefill or '-'} prefill_ms={ms(self.prefill_ms)} "
                f"decode={self.decode or '-'} decode_ttfb_ms={ms(self.decode_ttfb_ms)} "
                f"decode_ms={ms(self.decode_ms)} total_ms={ms((time.monotonic() - self.t0) * 1e3)}")
        if self.disagg is not None:
            text += " " + self.disagg.fields()
        if self.affinity:
            text += " affinity=" + ",".join(c.field() for c in self.affinity)
        if self.seed is not None:
            text += f" seed={self.seed} first_ms={ms(self.first_ms)}"
        if self.hold is not None:
            text += f" hold={self.hold}"
        return f"{text} error={self.error!r}" if self.error else text


def since_ms(t: float) -> float:
    return (time.monotonic() - t) * 1e3


def error_text(body: bytes) -> tuple[str, str | None]:
    """The message (and type) of a backend's error body: vLLM's/OpenAI's JSON or plain text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()[:2000] or "(empty body)", None
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        message = err.get("message") or err.get("detail") or json.dumps(err)
        return str(message), err.get("type") if isinstance(err.get("type"), str) else None
    return str(err), None


def trace_headers(trace: Trace) -> dict[str, str]:
    """Where the request went and how long its prefill took, for clients that
    measure (tools/pd_demo.py splits TTFT into prefill and decode with it)."""
    headers = {"X-Request-Id": trace.request_id, "X-KVSM-Prefill-Backend": trace.prefill or "",
               "X-KVSM-Decode-Backend": trace.decode or ""}
    if trace.prefill_ms is not None:
        headers["X-KVSM-Prefill-Ms"] = f"{trace.prefill_ms:.3f}"
    return headers


def stream_broken(url: str, e: BaseException) -> BackendError:
    """A decode stream that broke off after its headers were out: 504 for a timeout, else 502."""
    return BackendError(504 if isinstance(e, TimeoutError) else 502, f"decode backend {url} broke off the stream: "
                        f"{type(e).__name__}: {e}", "backend_stream_error", url)


async def end_with_error(out: web.StreamResponse, trace: Trace, err: BackendError) -> None:
    """Too late for an error status: record ``err`` and end the stream with an error event."""
    trace.status, trace.error = err.status, err.message
    with contextlib.suppress(ConnectionResetError):
        await out.write(f"data: {json.dumps(err.payload())}\n\n".encode())


def stream_chunk(raw: bytes) -> dict[str, Any] | None:
    """The JSON chunk of one server-sent event of a backend's stream, or None for an
    event that goes on as it is (``[DONE]``, not JSON, the backend's own error)."""
    lines = [ln for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    data = b"\n".join(ln[5:].strip() for ln in lines)
    if not lines or data == b"[DONE]":
        return None
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) and "error" not in chunk else None


class EventFeed:
    """A backend's stream cut into whole server-sent events, each passed through
    ``_event`` (what to send on for it); what a read leaves of an event waits for
    the next read."""

    _buf = b""

    def _event(self, raw: bytes) -> bytes:
        raise NotImplementedError

    def feed(self, data: bytes) -> bytes:
        """The bytes to pass on, of those just read (whole events only)."""
        self._buf += data.replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        return b"".join(self._event(e) for e in events if e.strip())

    def rest(self) -> bytes:
        """The last event, once the stream has ended."""
        out = self._event(self._buf) if self._buf.strip() else b""
        self._buf = b""
        return out
