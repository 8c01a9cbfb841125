"""A request the decode side's client has in flight, and how its reply is
judged: the reply, or the error that says why it is not what was asked."""

from __future__ import annotations

from dataclasses import dataclass

from kvsm.handshake.messages import (
    ClaimsReply,
    CompatInfo,
    ErrorReply,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeProtocolError,
    HandshakeRejected,
    MetadataReply,
    Reply,
    compat_identity,
    compat_mismatch,
)


@dataclass(slots=True)
class Pending:
    request_id: int
    peer: str
    payload: bytes
    deadline_ns: int
    expects: type
    tp_rank: int = -1
    pp_rank: int = -1
    expected_engine_id: str | None = None
    resends: int = 0  # after a dropped connection (a keyed server rebinding)


def judge(pending: Pending, reply: Reply, compat: CompatInfo,
          compat_hash: str) -> MetadataReply | ClaimsReply | HandshakeError:
    """The reply if it is what this request needed, else the error saying why not."""
    peer, nonce = pending.peer, pending.request_id
    if isinstance(reply, ErrorReply):
        if reply.code == "incompatible":
            differences = compat_mismatch(compat, reply.compat) if reply.compat else []
            return HandshakeIncompatible(differences, peer=peer, nonce=nonce)
        return HandshakeRejected(reply.code, reply.detail, peer=peer, nonce=nonce)
    if not isinstance(reply, pending.expects):
        return HandshakeProtocolError("unexpected_reply", f"expected {pending.expects.__name__}, "
                                      f"got {type(reply).__name__}", peer=peer, nonce=nonce)
    if isinstance(reply, MetadataReply):
        if compat_identity(reply.compat) != compat_identity(compat):
            return HandshakeIncompatible(compat_mismatch(compat, reply.compat),
                                         peer=peer, nonce=nonce)
        if reply.compat_hash != compat_hash:
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

