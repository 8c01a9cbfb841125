"""kvsm's side channel: how a decode worker learns a prefill worker's NIXL agent
and claims the prefill requests it is about to read.

Why it looks the way it does (compare vLLM's NixlConnector side channel):

* Upstream runs a listener thread that dies on the first malformed message
  (vLLM issue #54757) and a one-worker handshake executor in which one dead
  peer delays every other handshake. Here nothing owns a thread: the process's
  single event-loop thread polls :meth:`HandshakeServer.sockets` /
  :meth:`HandshakeClient.sockets` and calls ``on_readable``; every call drains
  what is ready with ``NOBLOCK`` and returns. The server never raises out of
  :meth:`HandshakeServer.on_readable`, whatever arrives; the client keeps one
  DEALER socket per peer, so a dead peer only ever delays its own requests.
* A prefill worker whose process is gone is known at once, not at a deadline:
  each peer's DEALER has a socket monitor, and a connection attempt that the
  peer's host refuses (nothing listens on the port) fails that peer's pending
  requests with :class:`HandshakeRefused`. A peer that accepts the connection
  and then never answers still fails at its deadline (:class:`HandshakeTimeout`).
* Messages are msgspec Structs in a tagged union (``"type"`` field) encoded as
  msgpack maps, so a decode failure names the field that was wrong
  (``Expected `int`, got `str` - at `$.tp_rank```) instead of crashing a thread.
* Every request and reply carries a ``nonce`` (the client's request id): a reply
  that arrives after its request timed out, or twice, is recognised and dropped.
* Compatibility is a hash of :class:`CompatInfo`, and every reply carries the
  server's full :class:`CompatInfo`, so the *client* can say exactly which fields
  differ ("block_size: 16 here, 128 on the peer") rather than "hash mismatch".

Wire format (kvsm protocol 1, not upstream-compatible): every ZMQ message is one
frame (DEALER framing; a REQ peer's empty delimiter frame is accepted and echoed)
holding one msgpack map with a ``"type"`` key:

============== ======================================================================
type           fields
============== ======================================================================
metadata_req   protocol, nonce, requester, tp_rank, pp_rank, compat_hash, claims
heartbeat      protocol, nonce, requester, claims
abandon        protocol, nonce, requester, claims
metadata       nonce, engine_id, tp_rank, pp_rank, compat, compat_hash, agent_name,
               agent_metadata (bin), layout (bin), meta_version, claims {id: status}, lease_ms
claims         nonce, claims {id: status}, lease_ms   (answers heartbeat and abandon)
error          nonce, code, detail, compat, protocol
============== ======================================================================

Claim status is ``"ok"`` (lease extended / abandon applied), ``"expired"`` (the
lease ran out, the blocks may be reused: do not read) or ``"unknown"``.

Nothing here imports vLLM, NIXL or torch; nothing here starts a thread.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NamedTuple, TypeAlias

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "CLAIM_STATUSES",
    "ERROR_CODES",
    "MAX_CLAIMS",
    "MAX_FRAME_BYTES",
    "MAX_ID_LENGTH",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "PROTOCOL_VERSION",
    "Abandon",
    "ClaimsHandler",
    "ClaimsReply",
    "CompatInfo",
    "ErrorReply",
    "HandshakeClient",
    "HandshakeError",
    "HandshakeIncompatible",
    "HandshakeProtocolError",
    "HandshakeRefused",
    "HandshakeRejected",
    "HandshakeResult",
    "HandshakeServer",
    "HandshakeTimeout",
    "Heartbeat",
    "MetadataProvider",
    "MetadataReply",
    "MetadataRequest",
    "Reply",
    "Request",
    "compat_hash",
    "compat_mismatch",
    "decode_reply",
    "decode_request",
    "encode",
    "peer_address",
]

log = logging.getLogger("kvsm.handshake")

PROTOCOL_VERSION = 1

# Bounds. The largest valid request (MAX_CLAIMS ids of MAX_ID_LENGTH bytes) is about
# 1.04 MiB, so it fits MAX_REQUEST_BYTES with room to spare (a test checks it).
MAX_CLAIMS = 4096
MAX_ID_LENGTH = 256
MAX_REQUEST_BYTES = 2 * 1024 * 1024
# libzmq's per-frame limit on the server (ZMQ_MAXMSGSIZE): a larger frame makes
# libzmq drop the connection before any of it reaches Python. Between
# MAX_REQUEST_BYTES and this, the server reads the frame and answers "oversized".
MAX_FRAME_BYTES = 2 * MAX_REQUEST_BYTES
# Replies carry NIXL agent metadata (registered regions; tens of KiB to a few MiB).
MAX_REPLY_BYTES = 64 * 1024 * 1024
MAX_DETAIL_LENGTH = 1024

CLAIM_STATUSES = ("ok", "expired", "unknown")
ERROR_CODES = ("malformed", "oversized", "unsupported_protocol", "incompatible",
               "unknown_rank", "internal")

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
Nonce = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Claims = Annotated[list[Id], msgspec.Meta(max_length=MAX_CLAIMS)]
ClaimStatus = Literal["ok", "expired", "unknown"]
ClaimAnswers = Annotated[dict[Id, ClaimStatus], msgspec.Meta(max_length=MAX_CLAIMS)]
ShortStr = Annotated[str, msgspec.Meta(max_length=64)]


# --------------------------------------------------------------------------- messages

class CompatInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What must agree between a prefill and a decode worker for a read of the
    prefill's KV blocks to land in the right place with the right meaning."""

    model: Annotated[str, msgspec.Meta(max_length=1024)]
    dtype: ShortStr
    num_layers: Count
    num_kv_heads: Count
    head_size: Count
    block_size: Count
    kv_layout: ShortStr
    protocol_version: int = PROTOCOL_VERSION


def compat_hash(info: CompatInfo) -> str:
    """sha256 hex of ``info`` as JSON with sorted keys: stable across processes,
    Python versions and field declaration order."""
    return hashlib.sha256(msgspec.json.encode(info, order="sorted")).hexdigest()


def compat_mismatch(mine: CompatInfo, theirs: CompatInfo) -> list[str]:
    """One line per differing field, e.g. ``"block_size: 16 here, 128 on the peer"``."""
    differences = []
    for name in mine.__struct_fields__:
        here, there = getattr(mine, name), getattr(theirs, name)
        if here != there:
            differences.append(f"{name}: {here!r} here, {there!r} on the peer")
    return differences


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
               tag_field="type"):
    """Base of every wire message: a msgpack map tagged by its ``"type"`` key."""


class MetadataRequest(_Message, tag="metadata_req", kw_only=True):
    """Ask for the agent metadata of (tp_rank, pp_rank), and claim the prefill
    requests the requester is about to read (the server extends their leases)."""

    protocol: int  # required on the wire: a peer must say which version it speaks
    nonce: Nonce = 0  # echoed in the reply; 0 = none (HandshakeClient numbers from 1)
    requester: Id
    tp_rank: Rank
    pp_rank: Rank = 0
    compat_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    claims: Claims = []


class Heartbeat(_Message, tag="heartbeat", kw_only=True):
    """Extend the leases of requests the requester still means to read."""

    protocol: int
    nonce: Nonce = 0
    requester: Id
    claims: Claims


class Abandon(_Message, tag="abandon", kw_only=True):
    """The requester will never read these requests: the server may free them now."""

    protocol: int
    nonce: Nonce = 0
    requester: Id
    claims: Claims


class MetadataReply(_Message, tag="metadata", kw_only=True):
    """A rank's NIXL agent, how its KV cache is laid out, and the claim answers.
    ``meta_version`` changes whenever the agent re-registers its memory."""

    nonce: Nonce = 0
    engine_id: Id
    tp_rank: Rank
    pp_rank: Rank
    compat: CompatInfo
    compat_hash: Annotated[str, msgspec.Meta(max_length=128)]
    agent_name: Id
    agent_metadata: bytes
    layout: bytes
    meta_version: int
    claims: ClaimAnswers = {}
    # How long an "ok" claim keeps the blocks pinned from the moment it was
    # answered (the server's lease), so the client can tell whether its read
    # finished in time; 0: not stated.
    lease_ms: Count = 0


class ClaimsReply(_Message, tag="claims", kw_only=True):
    """Per-claim answers to a Heartbeat or an Abandon."""

    nonce: Nonce = 0
    claims: ClaimAnswers
    lease_ms: Count = 0


class ErrorReply(_Message, tag="error", kw_only=True, forbid_unknown_fields=False):
    """Why a request was refused. Carries the server's CompatInfo so that the
    client can name the differing fields itself. Unknown fields are tolerated here
    (only here) so that a client can read the refusal of a newer server."""

    nonce: Nonce = 0
    code: ShortStr
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_LENGTH)]
    compat: CompatInfo | None = None
    protocol: int = PROTOCOL_VERSION


Request: TypeAlias = MetadataRequest | Heartbeat | Abandon
Reply: TypeAlias = MetadataReply | ClaimsReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class _Probe(msgspec.Struct):
    """The few fields read before full validation: the version (so an old or new
    peer gets "unsupported_protocol", not a list of field errors) and the nonce (so
    even a refusal can be matched to its request)."""

    type: Any = None
    protocol: Any = None
    nonce: Any = None


_probe_decoder = msgspec.msgpack.Decoder(_Probe)
_REQUEST_TAGS = frozenset(t.__struct_config__.tag for t in (MetadataRequest, Heartbeat, Abandon))
_REPLY_TAGS = frozenset(t.__struct_config__.tag for t in (MetadataReply, ClaimsReply, ErrorReply))


# --------------------------------------------------------------------------- errors

class HandshakeError(Exception):
    """A handshake request that did not succeed. ``code`` is machine-readable."""

    def __init__(self, code: str, detail: str, *, peer: str = "", nonce: int | None = None) -> None:
        super().__init__(f"{code}: {detail}" + (f" (peer {peer})" if peer else ""))
        self.code = code
        self.detail = detail
        self.peer = peer
        self.nonce = nonce


class HandshakeProtocolError(HandshakeError):
    """Bytes that are not a valid message of this protocol (either direction)."""


class HandshakeRejected(HandshakeError):
    """The peer answered with an ErrorReply."""


class HandshakeIncompatible(HandshakeError):
    """The peer's KV layout differs from ours; ``differences`` names each field."""

    def __init__(self, differences: list[str], *, peer: str = "", nonce: int | None = None) -> None:
        detail = ("incompatible KV cache: " + "; ".join(differences) if differences else
                  "incompatible KV cache: compat hashes differ but every CompatInfo field "
                  "matches (the peers hash differently: different kvsm versions?)")
        super().__init__("incompatible", detail, peer=peer, nonce=nonce)
        self.differences = differences


class HandshakeTimeout(HandshakeError):
    """No reply before the request's deadline: a peer that accepted the connection
    and never answered (hung, overloaded), a host that does not answer connection
    attempts at all, a slow peer."""


class HandshakeRefused(HandshakeError):
    """The peer's host refused the TCP connection: nothing listens on that port (the
    process is gone, or not started yet). Known from the socket monitor within about
    a millisecond of the attempt (or a reconnect interval after a live connection
    dropped), not at the deadline; code ``"refused"``. Retrying is the caller's call:
    the next request to that address tries a fresh connection."""


def _clip(text: str, limit: int = MAX_DETAIL_LENGTH) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "... [clipped]"


def _describe(value: Any) -> str:
    """A short description of a hostile value (never the repr of a 2 MiB list)."""
    if isinstance(value, str):
        return repr(value[:64]) + ("..." if len(value) > 64 else "")
    return f"of kind {type(value).__name__}"


# --------------------------------------------------------------------------- encoding

def encode(msg: Request | Reply) -> bytes:
    """The one-frame wire form of ``msg``."""
    if not isinstance(msg, _Message):
        raise TypeError(f"encode() takes a handshake message, got {type(msg).__name__}")
    return _encoder.encode(msg)


def _probe(data: bytes | memoryview, limit: int, what: str) -> _Probe:
    if len(data) > limit:
        raise HandshakeProtocolError(
            "oversized", f"{what} of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        return _probe_decoder.decode(data)
    except msgspec.ValidationError as e:
        raise HandshakeProtocolError(
            "malformed", f"{what} is not a msgpack map with a 'type' field: {e}") from None
    except msgspec.DecodeError as e:
        raise HandshakeProtocolError("malformed", f"{what} is not valid msgpack: {e}") from None
    except RecursionError:
        raise HandshakeProtocolError("malformed", f"{what} is nested too deeply") from None


def _probed_nonce(probe: _Probe) -> int | None:
    nonce = probe.nonce
    return nonce if type(nonce) is int and 0 <= nonce < 1 << 63 else None


def _decode(data: bytes | memoryview, decoder: msgspec.msgpack.Decoder, limit: int,
            what: str, check_protocol: bool) -> Any:
    probe = _probe(data, limit, what)
    nonce = _probed_nonce(probe)
    tags = _REQUEST_TAGS if check_protocol else _REPLY_TAGS
    if not (type(probe.type) is str and probe.type in tags):
        found = "no 'type' field" if probe.type is None else f"type {_describe(probe.type)}"
        raise HandshakeProtocolError(
            "malformed", _clip(f"{what} has {found}; expected type to be one of "
                               f"{', '.join(sorted(tags))}"), nonce=nonce)
    if check_protocol and type(probe.protocol) is int and probe.protocol != PROTOCOL_VERSION:
        raise HandshakeProtocolError(
            "unsupported_protocol",
            f"kvsm handshake protocol {probe.protocol} is not supported; "
            f"this side speaks {PROTOCOL_VERSION}", nonce=nonce)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        raise HandshakeProtocolError(
            "malformed", _clip(f"invalid {what} (type {probe.type!r}): {e}"), nonce=nonce) from None
    except (msgspec.DecodeError, RecursionError) as e:  # the probe skipped it; be safe anyway
        raise HandshakeProtocolError("malformed", _clip(f"{what} could not be decoded: {e}"),
                                     nonce=nonce) from None


def decode_request(data: bytes | memoryview) -> Request:
    """Parse and validate one request frame, or raise HandshakeProtocolError whose
    ``code`` is malformed | oversized | unsupported_protocol and whose ``detail``
    says what was wrong (and ``nonce`` when one could be read, for the reply)."""
    return _decode(data, _request_decoder, MAX_REQUEST_BYTES, "request", check_protocol=True)


def decode_reply(data: bytes | memoryview, limit: int = MAX_REPLY_BYTES) -> Reply:
    """Parse and validate one reply frame (client side); HandshakeProtocolError if bad."""
    return _decode(data, _reply_decoder, limit, "reply", check_protocol=False)


def peer_address(host: str, port: int | str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed, as ZMQ wants them."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


# --------------------------------------------------------------------------- server

MetadataProvider = Callable[[int, int], "tuple[str, bytes, bytes, int] | None"]
"""(tp_rank, pp_rank) -> (agent_name, agent_metadata, layout, meta_version), or None
for a rank this engine does not have. Called per request: a re-registered agent
is served from the next request on."""

ClaimsHandler = Callable[[str, str, list[str]], dict[str, str]]
"""(kind, requester, claims) -> {claim: "ok" | "expired" | "unknown"} for every
claim; kind is "claim" (with a metadata request), "heartbeat" or "abandon"."""

_CLAIM_KIND = {MetadataRequest: "claim", Heartbeat: "heartbeat", Abandon: "abandon"}
_MONITOR_EVENTS = {
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "zmtp_ok",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "zmtp_failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "zmtp_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "zmtp_failed",
}
_MAX_FRAMES = 3  # [identity, (empty delimiter from REQ), payload]


class _Refusal(Exception):
    """Internal: answer this request with ErrorReply(code, detail)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


def _rate_limited(count: int) -> bool:
    """Log the 1st, 10th, 100th... occurrence: a flood must not flood the logs."""
    while count >= 10 and count % 10 == 0:
        count //= 10
    return count == 1


class HandshakeServer:
    """Prefill side: answers metadata requests, heartbeats and abandons.

    One ROUTER socket: any number of clients of any socket type (DEALER, REQ) are
    served concurrently and none can wedge it (a REQ that never reads its reply
    only fills its own pipe; replies are sent NOBLOCK with ROUTER_MANDATORY so a
    reply that cannot be delivered is counted, not blocked on). ROUTER_HANDOVER
    stays off so that a peer cannot take over another client's routing id.

    Call :meth:`on_readable` from the loop thread whenever any socket in
    :meth:`sockets` is readable (the second one is a monitor counting TCP
    connections, ZMTP failures and disconnects: a frame over MAX_FRAME_BYTES is
    dropped by libzmq, which closes that connection, and it shows only there).
    Readiness must be level-triggered (zmq.Poller): at most ``max_batch``
    messages are handled per call so a flood cannot starve the loop's timers.

    Memory per hostile connection is bounded by rcvhwm x MAX_FRAME_BYTES inbound
    (libzmq has no limit on frames per multipart message, so a peer that sends
    endless frames in one message is not bounded: a known libzmq limitation) and
    by sndhwm replies outbound for a peer that never reads them.
    """

    def __init__(self, engine_id: str, compat: CompatInfo, provide: MetadataProvider,
                 on_claims: ClaimsHandler, *, host: str = "127.0.0.1", port: int = 0,
                 context: zmq.Context | None = None, max_batch: int = 1024,
                 rcvhwm: int = 16, sndhwm: int = 1000, lease_ms: int = 0) -> None:
        self.engine_id = engine_id
        self.lease_ms = lease_ms
        self.compat = compat
        self.compat_hash = compat_hash(compat)
        self._provide = provide
        self._on_claims = on_claims
        self._max_batch = max_batch
        self._ctx = context or zmq.Context.instance()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._served: Counter[str] = Counter()
        self._connections: Counter[str] = Counter()
        self._closed = False

        router = self._ctx.socket(zmq.ROUTER)
        try:
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Inbound: a small queue per connection is only flow control (libzmq stops
            # reading that TCP connection), and bounds what a hostile peer can park
            # here to rcvhwm x MAX_FRAME_BYTES. Outbound: a reply that finds its
            # peer's queue full is dropped and counted, never waited for; keep that
            # queue deep, since libzmq learns of reads only every sndhwm/2 messages.
            router.setsockopt(zmq.RCVHWM, rcvhwm)
            router.setsockopt(zmq.SNDHWM, sndhwm)
            # A peer stalled in the ZMTP 3 greeting is dropped after 5 s. (Bytes that
            # do not start like ZMTP 3 are read as ZMTP 1.0 frames, libzmq's legacy
            # path: such a peer stays connected until it closes; it costs an fd.)
            router.setsockopt(zmq.HANDSHAKE_IVL, 5000)
            # Drop connections of clients that vanished without a FIN.
            router.setsockopt(zmq.HEARTBEAT_IVL, 10_000)
            router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
            if ":" in host:
                router.setsockopt(zmq.IPV6, 1)
            router.bind(peer_address(host, port or "*"))  # "*": the OS chooses; see self.port
        except zmq.ZMQError as e:
            router.close(linger=0)
            raise OSError(f"handshake server could not bind {host}:{port or '*'}: {e}") from e
        self._router = router
        self.address: str = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(self.address.rsplit(":", 1)[1])
        events = 0
        for event in _MONITOR_EVENTS:
            events |= event
        self._monitor = router.get_monitor_socket(events=events)

    # ---- loop interface

    def sockets(self) -> list[zmq.Socket]:
        """The sockets the loop must poll for reading; both go to on_readable()."""
        return [] if self._closed else [self._router, self._monitor]

    def on_readable(self, sock: zmq.Socket | None = None) -> int:
        """Handle what is ready on both sockets (``sock`` is accepted for the loop's
        callback signature and ignored): at most max_batch requests; returns how
        many were handled. Never raises."""
        if self._closed:
            return 0
        self._drain_monitor()
        handled = 0
        while handled < self._max_batch:
            try:
                frames = self._recv_frames()
            except zmq.Again:
                break
            except zmq.ZMQError as e:  # ETERM / ENOTSOCK during shutdown
                self._count_error("recv_failed", f"recv failed: {e}")
                break
            handled += 1
            try:
                self._handle(frames)
            except Exception:  # noqa: BLE001 - never let a message kill the loop
                self._count_error("internal", "unexpected failure handling a message", exc_info=True)
        return handled

    def stats(self) -> dict[str, Any]:
        """Counters: received/replied totals, requests served by type, refusals by
        error code, replies that could not be delivered, connection events."""
        return {
            **dict(self._counts),
            "served": dict(self._served),
            "errors": dict(self._errors),
            "connections": dict(self._connections),
        }

    def close(self) -> None:
        """Close both sockets (unregister them from the poller first)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._router.close(linger=0)

    # ---- internals

    def _recv_frames(self) -> list[bytes]:
        """One multipart message; beyond _MAX_FRAMES+1 frames the rest is read and
        dropped without being kept (the message is malformed anyway)."""
        frames = [self._router.recv(zmq.NOBLOCK)]
        extra = 0
        while self._router.getsockopt(zmq.RCVMORE):
            frame = self._router.recv(zmq.NOBLOCK)  # the rest of a message is already here
            if len(frames) <= _MAX_FRAMES:
                frames.append(frame)
            else:
                extra += 1
        if extra:
            frames.append(b"")  # keep the count wrong; content is never read
        return frames

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except Exception:  # noqa: BLE001 - a monitor hiccup is not worth dying for
                self._connections["monitor_unreadable"] += 1
                return
            self._connections[_MONITOR_EVENTS.get(event["event"], f"event_{event['event']}")] += 1

    def _handle(self, frames: list[bytes]) -> None:
        self._counts["received"] += 1
        identity = frames[0]
        if len(frames) == 2:
            envelope, payload = [identity], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            envelope, payload = [identity, b""], frames[2]
        else:
            # Reply in the framing the peer most likely uses, so it can read the refusal.
            envelope = [identity, b""] if len(frames) > 1 and frames[1] == b"" else [identity]
            shape = "1 frame" if len(frames) == 1 else f"{len(frames) - 1} frames"
            self._refuse(envelope, None, "malformed",
                         f"expected one payload frame (DEALER) or an empty delimiter and one "
                         f"payload frame (REQ), got {shape} after the routing id")
            return
        try:
            request = decode_request(payload)
        except HandshakeProtocolError as e:
            self._refuse(envelope, e.nonce, e.code, e.detail)
            return
        try:
            reply = self._answer(request)
        except _Refusal as r:
            self._refuse(envelope, request.nonce, r.code, r.detail)
            return
        except Exception as e:  # noqa: BLE001 - a callback bug must not stop the server
            self._refuse(envelope, request.nonce, "internal",
                         f"the prefill side failed answering {type(request).__name__}: "
                         f"{type(e).__name__}: {e}", exc_info=True)
            return
        self._served[type(request).__name__] += 1
        self._send(envelope, reply)

    def _answer(self, request: Request) -> Reply:
        if isinstance(request, MetadataRequest):
            if request.compat_hash != self.compat_hash:
                raise _Refusal("incompatible",
                               f"compat hash {request.compat_hash[:16]}... differs from this "
                               f"engine's {self.compat_hash[:16]}...; the reply's compat field "
                               f"holds this engine's CompatInfo to compare against")
            provided = self._provide(request.tp_rank, request.pp_rank)
            if provided is None:
                raise _Refusal("unknown_rank",
                               f"engine {self.engine_id} has no worker tp_rank={request.tp_rank} "
                               f"pp_rank={request.pp_rank}")
            agent_name, agent_metadata, layout, meta_version = _check_provided(provided)
            claims = self._claims("claim", request)
            return MetadataReply(
                nonce=request.nonce, engine_id=self.engine_id, tp_rank=request.tp_rank,
                pp_rank=request.pp_rank, compat=self.compat, compat_hash=self.compat_hash,
                agent_name=agent_name, agent_metadata=agent_metadata, layout=layout,
                meta_version=meta_version, claims=claims, lease_ms=self.lease_ms)
        return ClaimsReply(nonce=request.nonce, claims=self._claims(_CLAIM_KIND[type(request)], request),
                           lease_ms=self.lease_ms)

    def _claims(self, kind: str, request: Request) -> dict[str, str]:
        if not request.claims:
            return {}
        answers = self._on_claims(kind, request.requester, list(request.claims))
        if not isinstance(answers, dict):
            raise TypeError(f"on_claims returned {type(answers).__name__}, expected a dict")
        missing = [c for c in request.claims if c not in answers]
        bad = {c: s for c, s in answers.items() if s not in CLAIM_STATUSES}
        if missing or bad:
            raise ValueError(f"on_claims({kind!r}) answered badly: missing {missing[:5]}, "
                             f"invalid statuses {dict(list(bad.items())[:5])}")
        return {c: answers[c] for c in request.claims}

    def _refuse(self, envelope: list[bytes], nonce: int | None, code: str, detail: str,
                exc_info: bool = False) -> None:
        self._count_error(code, detail, exc_info=exc_info)
        self._send(envelope, ErrorReply(nonce=nonce or 0, code=code, detail=_clip(detail),
                                        compat=self.compat))

    def _count_error(self, code: str, detail: str, exc_info: bool = False) -> None:
        self._errors[code] += 1
        n = self._errors[code]
        if _rate_limited(n):
            log.warning("handshake server %s: refused %d %s message(s) so far; latest: %s",
                        self.engine_id, n, code, _clip(detail, 300), exc_info=exc_info)

    def _send(self, envelope: list[bytes], reply: Reply) -> None:
        try:
            payload = encode(reply)
            if len(payload) > MAX_REPLY_BYTES:
                raise ValueError(f"reply of {len(payload)} bytes exceeds {MAX_REPLY_BYTES}")
        except Exception as e:  # noqa: BLE001 - e.g. the provider returned huge metadata
            self._count_error("internal", f"could not encode {type(reply).__name__}: {e}")
            payload = encode(ErrorReply(nonce=reply.nonce, code="internal", compat=self.compat,
                                        detail=_clip(f"could not encode the reply: {e}")))
        try:
            self._router.send_multipart([*envelope, payload], zmq.NOBLOCK)
        except zmq.Again:  # that peer's pipe is full: it does not read its replies
            self._counts["reply_dropped_full"] += 1
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer disconnected meanwhile
            self._counts["reply_unroutable" if e.errno == zmq.EHOSTUNREACH else "reply_failed"] += 1
        else:
            self._counts["replied"] += 1


def _check_provided(provided: Any) -> tuple[str, bytes, bytes, int]:
    """The provider's answer, type-checked so that a bug says what was wrong."""
    if not isinstance(provided, tuple) or len(provided) != 4:
        raise TypeError(f"provide() must return (agent_name, agent_metadata, layout, "
                        f"meta_version) or None, got {type(provided).__name__}")
    agent_name, agent_metadata, layout, meta_version = provided
    if not isinstance(agent_name, str) or not 0 < len(agent_name) <= MAX_ID_LENGTH:
        raise TypeError(f"provide(): agent_name must be a non-empty str of at most "
                        f"{MAX_ID_LENGTH} chars, got {agent_name!r:.80}")
    if not isinstance(agent_metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"provide(): agent_metadata must be bytes, got {type(agent_metadata).__name__}")
    if not isinstance(layout, (bytes, bytearray, memoryview)):
        raise TypeError(f"provide(): layout must be bytes, got {type(layout).__name__}")
    if type(meta_version) is not int or not -(1 << 63) <= meta_version < 1 << 63:
        raise TypeError(f"provide(): meta_version must be an int64, got {meta_version!r:.40}")
    if len(agent_metadata) + len(layout) > MAX_REPLY_BYTES - 64 * 1024:
        raise ValueError(f"provide(): {len(agent_metadata) + len(layout)} bytes of metadata and "
                         f"layout do not fit a {MAX_REPLY_BYTES}-byte reply")
    return agent_name, bytes(agent_metadata), bytes(layout), meta_version


# --------------------------------------------------------------------------- client

class HandshakeResult(NamedTuple):
    """The outcome of one request: a reply, or a HandshakeError saying why not."""

    request_id: int
    peer: str
    outcome: MetadataReply | ClaimsReply | HandshakeError

    @property
    def ok(self) -> bool:
        return not isinstance(self.outcome, HandshakeError)


@dataclass(slots=True)
class _Pending:
    request_id: int
    peer: str
    payload: bytes
    deadline_ns: int
    expects: type
    tp_rank: int = -1
    pp_rank: int = -1
    expected_engine_id: str | None = None


@dataclass(slots=True)
class _Peer:
    address: str
    sock: zmq.Socket
    monitor: zmq.Socket
    pending: set[int] = field(default_factory=set)
    # A TCP connection is up (monitor: CONNECTED or ZMTP handshake seen since the
    # socket was made or since the last DISCONNECTED).
    connected: bool = False


# What the client's monitors report. A connect attempt that fails on an opened fd
# (ECONNREFUSED: nothing listens; or an ICMP-unreachable host) closes that fd:
# EVENT_CLOSED, then EVENT_CONNECT_RETRIED. CLOSED alone is the signal: a
# CONNECT_RETRIED also follows every DISCONNECTED (it announces the reconnect timer,
# before any attempt) and every failed name lookup, and a peer that accepts TCP
# and stays silent shows only CONNECTED (plus ZMTP success for a ZMQ peer).
_CLIENT_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                          | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)


class HandshakeClient:
    """Decode side: sends requests to any number of prefill peers, one DEALER
    socket per peer so that a dead or slow peer only delays its own requests.

    Everything is driven by the owning loop thread: ``send``/``fetch_metadata``/
    ``heartbeat``/``abandon`` queue a request and return its id; the loop polls
    :meth:`sockets` and calls :meth:`on_readable` for a readable one, and calls
    :meth:`expire` at :meth:`next_deadline_ns` (same clock as the deadlines you
    pass). Each of those, and :meth:`poll_results`, returns the results that became
    known, each exactly once. No method raises on bad data (a bad address, a
    too-long claim id from ``kv_transfer_params``, a garbage reply): that becomes
    the request's result.

    Connecting is lazy (ZMQ): nothing fails at send time; the request is queued
    on the peer's socket and delivered once the connection is up. Each peer socket
    has a monitor (in :meth:`sockets` too; hand it to :meth:`on_readable` like the
    DEALER) so that a connection the peer's host *refuses* (a closed port: the
    process is gone or not started yet; a host reported unreachable counts the
    same) fails every request pending on that peer with :class:`HandshakeRefused`
    about a millisecond after the attempt, and a peer that was connected and died
    fails them when its reconnect is refused (a reconnect interval, 100 ms, later).
    The refused socket is closed; the next request to that address makes a fresh
    one and tries again. A peer that accepts the connection and never answers, and
    a host that drops connection attempts without a word, still time out at the
    deadline. ZMQ_IMMEDIATE is left off on purpose: with it a send fails while the
    connection is still being set up, even to a live peer.

    A timeout closes that peer's socket, so nothing queued for or arriving from the
    dead connection can ever be read, and re-sends that peer's other pending
    requests on a fresh socket. Replies carry the request's nonce; one that matches
    no pending request (late, duplicated, forged) is dropped and counted. A reply
    already waiting on the socket wins over a timeout or a refusal noticed with it.

    Register sockets with the poller through ``on_socket_added`` and unregister them
    through ``on_socket_removed``, which is called *before* a socket is closed (a
    closed socket left in a zmq.Poller makes poll() fail).
    """

    def __init__(self, compat: CompatInfo, requester: str, *, context: zmq.Context | None = None,
                 on_socket_added: Callable[[zmq.Socket], None] | None = None,
                 on_socket_removed: Callable[[zmq.Socket], None] | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES) -> None:
        self.compat = compat
        self.compat_hash = compat_hash(compat)
        self.requester = requester
        self._ctx = context or zmq.Context.instance()
        self._on_added = on_socket_added
        self._on_removed = on_socket_removed
        self._max_reply_bytes = max_reply_bytes
        self._ids = itertools.count(1)
        self._peers: dict[str, _Peer] = {}
        self._by_socket: dict[zmq.Socket, _Peer] = {}
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ns, request_id), lazily pruned
        self._results: list[HandshakeResult] = []
        self._stats: Counter[str] = Counter()
        self._closed = False

    # ---- requests

    def fetch_metadata(self, peer: str, tp_rank: int, pp_rank: int = 0,
                       claims: Iterable[str] = (), *, deadline_ns: int,
                       expected_engine_id: str | None = None) -> int:
        """Ask ``peer`` for the agent of (tp_rank, pp_rank) and claim ``claims``.
        With ``expected_engine_id``, a reply from another engine (the prefill engine
        restarted on the same port) is an error, not a silent switch."""
        request = MetadataRequest(protocol=PROTOCOL_VERSION, requester=self.requester,
                                  tp_rank=tp_rank, pp_rank=pp_rank,
                                  compat_hash=self.compat_hash, claims=list(claims))
        return self.send(peer, request, deadline_ns, expected_engine_id=expected_engine_id)

    def heartbeat(self, peer: str, claims: Iterable[str], *, deadline_ns: int) -> int:
        """Extend the leases of ``claims`` on ``peer``."""
        request = Heartbeat(protocol=PROTOCOL_VERSION, requester=self.requester, claims=list(claims))
        return self.send(peer, request, deadline_ns)

    def abandon(self, peer: str, claims: Iterable[str], *, deadline_ns: int) -> int:
        """Tell ``peer`` these requests will never be read."""
        request = Abandon(protocol=PROTOCOL_VERSION, requester=self.requester, claims=list(claims))
        return self.send(peer, request, deadline_ns)

    def send(self, peer: str, request: Request, deadline_ns: int, *,
             expected_engine_id: str | None = None) -> int:
        """Queue ``request`` (its nonce is replaced by the returned request id)."""
        if not isinstance(request, (MetadataRequest, Heartbeat, Abandon)):
            raise TypeError(f"send() takes a MetadataRequest, Heartbeat or Abandon, "
                            f"got {type(request).__name__}")
        request_id = next(self._ids)
        if self._closed:
            self._fail(request_id, peer, HandshakeError("closed", "the handshake client is closed"))
            return request_id
        try:
            payload = encode(msgspec.structs.replace(request, nonce=request_id))
            decode_request(payload)  # encoding does not check bounds; the server would refuse it
        except HandshakeProtocolError as e:
            self._fail(request_id, peer, HandshakeProtocolError(
                e.code, f"not sent, the server would refuse it: {e.detail}", peer=peer, nonce=request_id))
            return request_id
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            self._fail(request_id, peer, HandshakeProtocolError(
                "malformed", f"not sent, cannot be encoded: {e}", peer=peer, nonce=request_id))
            return request_id
        pending = _Pending(request_id, peer, payload, deadline_ns,
                           MetadataReply if isinstance(request, MetadataRequest) else ClaimsReply,
                           expected_engine_id=expected_engine_id)
        if isinstance(request, MetadataRequest):
            pending.tp_rank, pending.pp_rank = request.tp_rank, request.pp_rank
        try:
            target = self._peer(peer)
        except (zmq.ZMQError, TypeError, ValueError) as e:  # the address came from kv_transfer_params
            self._fail(request_id, peer, HandshakeError(
                "bad_address", f"cannot connect to {peer!r}: {e}", peer=peer, nonce=request_id))
            return request_id
        self._pending[request_id] = pending
        target.pending.add(request_id)
        heapq.heappush(self._deadlines, (deadline_ns, request_id))
        self._transmit(target, pending)
        return request_id

    def cancel(self, request_id: int) -> bool:
        """Forget a pending request; its reply, if one comes, is dropped."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return False
        peer = self._peers.get(pending.peer)
        if peer is not None:
            peer.pending.discard(request_id)
        return True

    # ---- loop interface

    def sockets(self) -> list[zmq.Socket]:
        """The sockets to poll for reading right now: per peer in use, its DEALER
        and that DEALER's monitor."""
        return [s for p in self._peers.values() for s in (p.sock, p.monitor)]

    def on_readable(self, sock: zmq.Socket) -> list[HandshakeResult]:
        """Read every reply (DEALER) or connection event (monitor) waiting on
        ``sock``; returns the results that became known."""
        peer = self._by_socket.get(sock)
        if peer is None:
            pass  # a socket already replaced: nothing to read
        elif sock is peer.monitor:
            self._drain_monitor(peer)
        else:
            self._drain(peer)
        return self.poll_results()

    def expire(self, now_ns: int) -> list[HandshakeResult]:
        """Time out every request whose deadline is <= now_ns; reset those peers'
        sockets. Returns the results that became known (timeouts and others)."""
        due: list[_Pending] = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            deadline_ns, request_id = heapq.heappop(self._deadlines)
            pending = self._pending.get(request_id)
            if pending is not None and pending.deadline_ns == deadline_ns:
                due.append(pending)
        # A reply that already arrived wins over a deadline the loop noticed first,
        # and so does a refusal (the more precise verdict).
        for address in {pending.peer for pending in due}:
            if (peer := self._peers.get(address)) is not None:
                self._drain(peer)
                self._drain_monitor(peer)
        reset: set[str] = set()
        for pending in due:
            if pending.request_id not in self._pending:
                continue  # answered by that drain
            request_id = pending.request_id
            self._take(request_id)
            self._stats["timeouts"] += 1
            self._results.append(HandshakeResult(request_id, pending.peer, HandshakeTimeout(
                "timeout", f"no reply from {pending.peer} by the deadline",
                peer=pending.peer, nonce=request_id)))
            reset.add(pending.peer)
        for address in reset:
            self._reset_peer(address)
        return self.poll_results()

    def next_deadline_ns(self) -> int | None:
        """When expire() next has something to do, or None."""
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def poll_results(self) -> list[HandshakeResult]:
        """Results not returned yet (e.g. requests refused before reaching the wire)."""
        results, self._results = self._results, []
        return results

    def pending_count(self) -> int:
        return len(self._pending)

    def socket_count(self) -> int:
        """Sockets open for peers: a DEALER and its monitor per peer address (a
        timed-out or refused peer's pair is replaced)."""
        return len(self._by_socket)

    def stats(self) -> dict[str, int]:
        """sent, replies, stale_replies, malformed_replies, timeouts, socket_resets,
        refused (requests failed as refused), refused_sockets (peer sockets closed
        on a refusal)..."""
        return dict(self._stats)

    def close(self) -> None:
        """Close every socket, monitors included (on_socket_removed first); pending
        requests are dropped without a result."""
        self._closed = True
        for address in list(self._peers):
            self._drop_peer(address)
        self._pending.clear()
        self._deadlines.clear()

    # ---- internals

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        sock = self._ctx.socket(zmq.DEALER)
        monitor: zmq.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 10_000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
            # Before connect(): the first attempt's refusal comes within a millisecond.
            monitor = sock.get_monitor_socket(events=_CLIENT_MONITOR_EVENTS)
            monitor.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        except Exception:  # send() turns a bad address into the request's result
            self._close_pair(sock, monitor)
            raise
        peer = _Peer(address, sock, monitor)
        self._peers[address] = peer
        self._by_socket[sock] = peer
        self._by_socket[monitor] = peer
        if self._on_added is not None:
            self._on_added(sock)
            self._on_added(monitor)
        return peer

    def _transmit(self, peer: _Peer, pending: _Pending) -> None:
        try:
            peer.sock.send(pending.payload, zmq.NOBLOCK)
            self._stats["sent"] += 1
        except zmq.Again:  # SNDHWM requests already queued for a peer that is not reading
            self._take(pending.request_id)
            self._fail(pending.request_id, peer.address, HandshakeError(
                "send_queue_full", f"too many requests queued for {peer.address}",
                peer=peer.address, nonce=pending.request_id))

    def _drain(self, peer: _Peer) -> None:
        while True:
            try:
                frames = peer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                self._stats["recv_failed"] += 1
                log.warning("handshake client: recv from %s failed: %s", peer.address, e)
                return
            try:
                self._on_reply(peer, frames)
            except Exception:  # a hostile peer must not break the loop
                self._stats["internal"] += 1
                log.exception("handshake client: failed handling a reply from %s", peer.address)

    def _drain_monitor(self, peer: _Peer) -> None:
        """Track the peer's connection; a connect attempt that failed while no
        connection was up means the peer's host refuses it: fail its requests now."""
        while True:
            try:
                event = parse_monitor_message(peer.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            except Exception:  # noqa: BLE001 - a monitor hiccup is not worth failing requests over
                self._stats["monitor_unreadable"] += 1
                return
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_SUCCEEDED):
                peer.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                peer.connected = False
            elif event == zmq.EVENT_CLOSED and not peer.connected:
                self._refused(peer)
                return  # its sockets are closed; later events are moot

    def _refused(self, peer: _Peer) -> None:
        """Fail every request pending on ``peer`` as refused and close its sockets,
        so the next request to that address connects afresh."""
        self._drain(peer)  # a reply that arrived before the connection went wins
        self._drop_peer(peer.address)
        self._stats["refused_sockets"] += 1
        for request_id in sorted(peer.pending):
            if request_id not in self._pending:
                continue
            self._take(request_id)
            self._stats["refused"] += 1
            self._results.append(HandshakeResult(request_id, peer.address, HandshakeRefused(
                "refused", f"connection refused by {peer.address}", peer=peer.address, nonce=request_id)))

    def _on_reply(self, peer: _Peer, frames: list[bytes]) -> None:
        self._stats["replies"] += 1
        if len(frames) != 1:
            self._stats["malformed_replies"] += 1
            return
        try:
            reply = decode_reply(frames[0], self._max_reply_bytes)
        except HandshakeProtocolError as e:
            self._stats["malformed_replies"] += 1
            if e.nonce is not None and e.nonce in peer.pending:
                self._take(e.nonce)
                self._fail(e.nonce, peer.address, HandshakeProtocolError(
                    e.code, f"bad reply: {e.detail}", peer=peer.address, nonce=e.nonce))
            return
        if reply.nonce not in peer.pending:  # late (after a timeout), duplicated or forged
            self._stats["stale_replies"] += 1
            return
        pending = self._take(reply.nonce)
        self._stats["completed"] += 1
        self._results.append(HandshakeResult(pending.request_id, peer.address,
                                             self._judge(pending, reply)))

    def _judge(self, pending: _Pending, reply: Reply) -> MetadataReply | ClaimsReply | HandshakeError:
        """The reply if it is what this request needed, else the error saying why not."""
        peer, nonce = pending.peer, pending.request_id
        if isinstance(reply, ErrorReply):
            if reply.code == "incompatible":
                differences = compat_mismatch(self.compat, reply.compat) if reply.compat else []
                return HandshakeIncompatible(differences, peer=peer, nonce=nonce)
            return HandshakeRejected(reply.code, reply.detail, peer=peer, nonce=nonce)
        if not isinstance(reply, pending.expects):
            return HandshakeProtocolError("unexpected_reply", f"expected {pending.expects.__name__}, "
                                          f"got {type(reply).__name__}", peer=peer, nonce=nonce)
        if isinstance(reply, MetadataReply):
            if reply.compat != self.compat:
                return HandshakeIncompatible(compat_mismatch(self.compat, reply.compat),
                                             peer=peer, nonce=nonce)
            if reply.compat_hash != self.compat_hash:
                return HandshakeIncompatible([], peer=peer, nonce=nonce)
            if (reply.tp_rank, reply.pp_rank) != (pending.tp_rank, pending.pp_rank):
                return HandshakeProtocolError(
                    "wrong_rank", f"asked for tp_rank={pending.tp_rank} pp_rank={pending.pp_rank}, "
                    f"got tp_rank={reply.tp_rank} pp_rank={reply.pp_rank}", peer=peer, nonce=nonce)
            if pending.expected_engine_id is not None and reply.engine_id != pending.expected_engine_id:
                return HandshakeError(
                    "engine_mismatch", f"expected engine {pending.expected_engine_id!r}, "
                    f"{peer} is now engine {reply.engine_id!r} (restarted?)", peer=peer, nonce=nonce)
        return reply

    def _take(self, request_id: int) -> _Pending:
        pending = self._pending.pop(request_id)
        peer = self._peers.get(pending.peer)
        if peer is not None:
            peer.pending.discard(request_id)
        return pending

    def _fail(self, request_id: int, peer: str, error: HandshakeError) -> None:
        self._stats[f"failed_{error.code}"] += 1
        self._results.append(HandshakeResult(request_id, peer, error))

    def _drop_peer(self, address: str) -> _Peer | None:
        peer = self._peers.pop(address, None)
        if peer is None:
            return None
        for sock in (peer.sock, peer.monitor):
            del self._by_socket[sock]
            if self._on_removed is not None:
                try:
                    self._on_removed(sock)
                except Exception:
                    log.exception("handshake client: on_socket_removed failed")
        self._close_pair(peer.sock, peer.monitor)
        return peer

    @staticmethod
    def _close_pair(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
        """Close a DEALER and its monitor (unregistered from the loop already)."""
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
        sock.close(linger=0)

    def _reset_peer(self, address: str) -> None:
        """Fresh socket for a peer that missed a deadline; re-send what is still pending
        (requests are idempotent: a claim or heartbeat applied twice extends a lease
        twice)."""
        old = self._drop_peer(address)
        if old is None:
            return
        self._stats["socket_resets"] += 1
        still_pending = sorted(old.pending)
        if not still_pending:
            return  # a new socket is made when one is next needed
        try:
            peer = self._peer(address)
        except zmq.ZMQError as e:  # cannot happen for an address that connected before
            for request_id in still_pending:
                self._take(request_id)
                self._fail(request_id, address, HandshakeError(
                    "bad_address", f"cannot reconnect to {address!r}: {e}", peer=address))
            return
        for request_id in still_pending:
            peer.pending.add(request_id)
            self._transmit(peer, self._pending[request_id])
