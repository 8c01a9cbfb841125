"""The wire codec: one msgpack frame per message, checked before anything reads it.

No zmq here: the server and client call it on the frames they receive, the
fuzzers and tests on bytes they make up.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvsm.handshake.messages import (
    MAX_DETAIL_LENGTH,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    Abandon,
    ClaimsReply,
    ErrorReply,
    HandshakeProtocolError,
    Heartbeat,
    MetadataReply,
    MetadataRequest,
    Reply,
    Request,
    WriteAsk,
    _Message,
)

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
_REQUEST_TAGS = frozenset(str(t.__struct_config__.tag) for t in (MetadataRequest, Heartbeat, Abandon, WriteAsk))
_REPLY_TAGS = frozenset(str(t.__struct_config__.tag) for t in (MetadataReply, ClaimsReply, ErrorReply))


def _clip(text: str, limit: int = MAX_DETAIL_LENGTH) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "... [clipped]"


def _describe(value: Any) -> str:
    """A short description of a hostile value (never the repr of a 2 MiB list)."""
    if isinstance(value, str):
        return repr(value[:64]) + ("..." if len(value) > 64 else "")
    return f"of kind {type(value).__name__}"


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
