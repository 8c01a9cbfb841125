"""The side channel's messages, errors, bounds and results: plain msgspec data.

Kept apart from the sockets (``server``, ``client``) so that whatever only builds,
checks or encodes messages (the codec, the fuzzers, the simulation) imports
neither zmq nor anything else with I/O.

Wire format (kvsm protocol 1, not upstream-compatible): every ZMQ message is one
frame (DEALER framing; a REQ peer's empty delimiter frame is accepted and echoed)
holding one msgpack map with a ``"type"`` key:

============== ======================================================================
type           fields
============== ======================================================================
metadata_req   protocol, nonce, requester, tp_rank, pp_rank, compat_hash, claims
heartbeat      protocol, nonce, requester, claims, readers, tp_rank, pp_rank
abandon        protocol, nonce, requester, claims, readers, tp_rank, pp_rank
metadata       nonce, engine_id, tp_rank, pp_rank, compat, compat_hash, agent_name,
               agent_metadata (bin), layout (bin), meta_version, claims {id: status}, lease_ms
write_ask      protocol, nonce, requester, tp_rank, pp_rank, agent_metadata (bin),
               writes [{req, notif, readers, src/dst blocks, heads, segments, deadline_wall_ns}]
claims         nonce, claims {id: status}, lease_ms   (answers heartbeat, abandon and write_ask)
error          nonce, code, detail, compat, protocol
============== ======================================================================

Claim status is ``"ok"`` (lease extended / abandon applied), ``"expired"`` (the
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, NamedTuple, TypeAlias

import msgspec

PROTOCOL_VERSION = 2

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

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
Nonce = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Claims = Annotated[list[Id], msgspec.Meta(max_length=MAX_CLAIMS)]
Readers = Annotated[int, msgspec.Meta(ge=1, le=1024)]
ClaimStatus = Literal["ok", "expired", "unknown"]
ClaimAnswers = Annotated[dict[Id, ClaimStatus], msgspec.Meta(max_length=MAX_CLAIMS)]
ShortStr = Annotated[str, msgspec.Meta(max_length=64)]


# --------------------------------------------------------------------------- messages

# The lease is nanoseconds everywhere in kvsm and milliseconds on the wire (the
# protocol's field, kept for compatibility): these are the only conversions.
NS_PER_MS = 1_000_000


def wire_lease_ms(lease_ns: int) -> int:
    """A lease in the wire's unit (whole milliseconds, rounded down as before)."""
    return max(0, lease_ns) // NS_PER_MS


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
    # The KV cache groups (vLLM's hybrid KV cache manager), in order: each one's
    # kind, block size and number of layers ("" for one plain group).
    kv_groups: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # How a block holds its tokens (``kvsm.vllm.token_layout``), "" if not known. Two
    # engines that name the same one may differ in block size: the decode side
    # reads in segments.
    token_layout: ShortStr = ""


def compat_identity(info: CompatInfo) -> CompatInfo:
    """What must be equal between peers: ``info`` without its block size where
    it names a token layout (blocks of any size are then read in segments)."""
    return msgspec.structs.replace(info, block_size=0) if info.token_layout else info


def compat_hash(info: CompatInfo) -> str:
    """sha256 hex of ``compat_identity(info)`` as JSON with sorted keys: stable
    across processes, Python versions and field declaration order."""
    return hashlib.sha256(msgspec.json.encode(compat_identity(info), order="sorted")).hexdigest()


def compat_mismatch(mine: CompatInfo, theirs: CompatInfo) -> list[str]:
    """One line per differing field, e.g. ``"block_size: 16 here, 128 on the peer"``
    (block sizes only where a side does not name its token layout)."""
    differences = []
    for name in mine.__struct_fields__:
        here, there = getattr(mine, name), getattr(theirs, name)
        if name == "block_size":
            if here != there and not (mine.token_layout and theirs.token_layout):
                differences.append(f"block_size: {here!r} here, {there!r} on the peer")
            continue
        if here != there:
            differences.append(f"{name}: {here!r} here, {there!r} on the peer")
    return differences


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
               tag_field="type"):
    """Base of every wire message: a msgpack map tagged by its ``"type"`` key."""


class MetadataRequest(_Message, tag="metadata_req", kw_only=True, frozen=True):
    """Ask for the agent metadata of (tp_rank, pp_rank), and claim the prefill
    requests the requester is about to read (the server extends their leases)."""

    protocol: int  # required on the wire: a peer must say which version it speaks
    nonce: Nonce = 0  # echoed in the reply; 0 = none (HandshakeClient numbers from 1)
    requester: Id
    tp_rank: Rank
    pp_rank: Rank = 0
    compat_hash: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    claims: Claims = []
    # How many ranks of the requester's engine have business with these claims
    # on this rank (tensor parallel sizes that differ); its blocks go once all are through.
    readers: Readers = 1


class Heartbeat(_Message, tag="heartbeat", kw_only=True, frozen=True):
    """Extend the leases of requests the requester still means to read."""

    protocol: int
    nonce: Nonce = 0
    requester: Id
    claims: Claims
    readers: Readers = 1
    tp_rank: Rank = 0  # the rank the claims are for (one side-channel port serves every rank)
    pp_rank: Rank = 0  # and its pipeline parallel stage


class Abandon(_Message, tag="abandon", kw_only=True, frozen=True):
    """The requester will never read these requests: the server may free them now
    (once the other ``readers`` are through too)."""

    protocol: int
    nonce: Nonce = 0
    requester: Id
    claims: Claims
    readers: Readers = 1
    tp_rank: Rank = 0
    pp_rank: Rank = 0


class MetadataReply(_Message, tag="metadata", kw_only=True, frozen=True):
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
    # finished in time; 0: not stated. Milliseconds on the wire only: kvsm reads
    # it as ``lease_ns`` and writes it with ``wire_lease_ms``.
    lease_ms: Count = 0

    @property
    def lease_ns(self) -> int:
        return self.lease_ms * NS_PER_MS


class ClaimsReply(_Message, tag="claims", kw_only=True, frozen=True):
    """Per-claim answers to a Heartbeat or an Abandon."""

    nonce: Nonce = 0
    claims: ClaimAnswers
    lease_ms: Count = 0  # as MetadataReply's

    @property
    def lease_ns(self) -> int:
        return self.lease_ms * NS_PER_MS


class ErrorReply(_Message, tag="error", kw_only=True, frozen=True, forbid_unknown_fields=False):
    """Why a request was refused. Carries the server's CompatInfo so that the
    client can name the differing fields itself. Unknown fields are tolerated here
    (only here) so that a client can read the refusal of a newer server."""

    nonce: Nonce = 0
    code: ShortStr
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_LENGTH)]
    compat: CompatInfo | None = None
    protocol: int = PROTOCOL_VERSION


MAX_WRITES = 256
MAX_BLOCKS = 1 << 16
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]], msgspec.Meta(max_length=MAX_BLOCKS)]
HeadsRun = tuple[Count, Count, Count]


class WriteSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request's write, as the decode worker asks it (push mode): the prefill
    worker writes its blocks ``src_blocks`` of request ``req`` into the decode
    worker's ``dst_blocks`` (pairwise; ``group_sizes`` as a read's), then NIXL
    tells the decode worker ``notif``. Heads and segments as a read's, from the
    prefill side's point of view (``src_*``: its own). ``deadline_wall_ns``: the
    decode side's wall clock by which the write must be over; the prefill side
    posts nothing later and cancels what is still in flight before it, so the
    decode side may reuse the blocks from then on whatever happened."""

    req: Id
    dst_req: Id  # the decode worker's request (its log's name for the write)
    notif: Annotated[bytes, msgspec.Meta(max_length=2 * MAX_ID_LENGTH)]
    readers: Readers = 1
    src_blocks: BlockIds
    dst_blocks: BlockIds
    group_sizes: Annotated[list[Count], msgspec.Meta(max_length=64)] = []
    src_heads: HeadsRun | None = None
    dst_heads: HeadsRun | None = None
    segment_tokens: Count = 0
    src_segments: BlockIds = []
    dst_segments: BlockIds = []
    src_block_tokens: Count = 0
    dst_block_tokens: Count = 0
    deadline_wall_ns: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    # Streamed push: ``req`` is the join key of a prefill still computing, ``src_blocks``
    # is empty (the prefill worker pairs its blocks by position) and ``dst_blocks`` are
    # the decode's of positions ``dst_first`` on (several KV cache groups: group after
    # group, ``group_sizes`` of them, from positions ``dst_firsts``); each layer is
    # written as it is computed.
    stream: bool = False
    dst_first: Count = 0
    dst_firsts: Annotated[list[Count], msgspec.Meta(max_length=64)] = []


class WriteAsk(_Message, tag="write_ask", kw_only=True, frozen=True):
    """Push mode: the decode worker's blocks are allocated and its agent is in
    ``agent_metadata``: write these requests into them. Answered per request as a
    claim is (``ClaimsReply``): "ok" (the write is posted), "expired" (the blocks
    are gone), "unknown" (not pinned here: nothing will be written)."""

    protocol: int
    nonce: Nonce = 0
    requester: Id
    tp_rank: Rank = 0
    pp_rank: Rank = 0
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_REQUEST_BYTES // 2)]
    writes: Annotated[list[WriteSpec], msgspec.Meta(min_length=1, max_length=MAX_WRITES)]

    @property
    def claims(self) -> list[str]:
        return [w.req for w in self.writes]

    @property
    def readers(self) -> int:
        return max(w.readers for w in self.writes)


Request: TypeAlias = MetadataRequest | Heartbeat | Abandon | WriteAsk
Reply: TypeAlias = MetadataReply | ClaimsReply | ErrorReply


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


# --------------------------------------------------------------------------- results

class HandshakeResult(NamedTuple):
    """The outcome of one request: a reply, or a HandshakeError saying why not."""

    request_id: int
    peer: str
    outcome: MetadataReply | ClaimsReply | HandshakeError

    @property
    def ok(self) -> bool:
        return not isinstance(self.outcome, HandshakeError)
