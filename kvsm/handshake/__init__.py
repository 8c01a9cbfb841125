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

The package: ``messages`` (structs, errors, bounds, results) and ``codec``
(encode/decode) need no zmq, so the simulation and the no-I/O tests use them
alone; ``server`` and ``client`` hold the sockets and are imported only when
one of their names is first asked for here, so that importing
``kvsm.handshake.messages`` does not import zmq. Every name is re-exported
here. Nothing here imports vLLM, NIXL or torch; nothing here starts a thread.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvsm.handshake.address import peer_address
from kvsm.handshake.codec import decode_reply, decode_request, encode
from kvsm.handshake.messages import (
    CLAIM_STATUSES,
    MAX_CLAIMS,
    MAX_FRAME_BYTES,
    MAX_ID_LENGTH,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    Abandon,
    ClaimsReply,
    CompatInfo,
    ErrorReply,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeProtocolError,
    HandshakeRefused,
    HandshakeRejected,
    HandshakeResult,
    HandshakeTimeout,
    Heartbeat,
    MetadataReply,
    MetadataRequest,
    Reply,
    Request,
    compat_hash,
    compat_mismatch,
)

if TYPE_CHECKING:  # pragma: no cover
    from kvsm.handshake.client import HandshakeClient
    from kvsm.handshake.server import ClaimsHandler, HandshakeServer, MetadataProvider

__all__ = [
    "CLAIM_STATUSES",
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

# The names that need zmq, and the submodule each comes from.
_LAZY = {
    "HandshakeClient": "kvsm.handshake.client",
    "HandshakeServer": "kvsm.handshake.server",
    "ClaimsHandler": "kvsm.handshake.server",
    "MetadataProvider": "kvsm.handshake.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
