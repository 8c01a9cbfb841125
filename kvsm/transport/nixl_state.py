"""What ``NixlTransport`` keeps: the record a peer sends in the handshake, a
posted read's handle, and the prepped descriptor lists of a peer and of our own
blocks. Plain records, apart from the transport's NIXL calls, so the transport
module holds only what it does with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvsm.transport.base import Heads, TransferState, XferHandle
from kvsm.transport.regions import KVLayout

METADATA_VERSION = 1


class NixlPeerInfo(msgspec.Struct, frozen=True):
    """What a peer needs to read our blocks: sent in the handshake."""

    version: int
    name: str
    agent_metadata: bytes
    layout: KVLayout


_DECODER = msgspec.msgpack.Decoder(NixlPeerInfo)


def decode_peer_info(metadata: bytes, own_name: str) -> NixlPeerInfo:
    """A peer's ``metadata()`` decoded; ``ValueError`` when it is malformed, of
    another version or carries our own agent name."""
    try:
        info = _DECODER.decode(metadata)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed NIXL peer metadata ({len(metadata)} bytes): {e}") from e
    if info.version != METADATA_VERSION:
        raise ValueError(f"peer {info.name!r}: metadata version {info.version}, "
                         f"expected {METADATA_VERSION}")
    if info.name == own_name:
        raise ValueError(f"peer metadata carries our own agent name {own_name!r}")
    return info


def nixl_errors() -> tuple[type[BaseException], ...]:
    import nixl._bindings as b

    return tuple(getattr(b, n) for n in dir(b) if n.startswith("nixl") and n.endswith("Error")
                 and isinstance(getattr(b, n), type))


class NixlXferHandle(XferHandle):
    """A posted read: the base handle plus the NIXL handle and what we know of it."""

    __slots__ = ("_nixl", "error", "released", "state")

    def __init__(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                 notif: bytes, tag: str = "") -> None:
        super().__init__(peer, local_blocks, remote_blocks, notif, tag)
        self._nixl = None  # nixl_xfer_handle while NIXL holds it
        self.state = TransferState.PENDING
        self.error = ""  # why it ended in ERROR
        self.released = False  # the caller gave it up

    def __repr__(self) -> str:
        return (f"NixlXferHandle(peer={self.peer!r}, blocks={len(self.local_blocks)}, "
                f"state={self.state.value}, tag={self.tag!r})")


@dataclass
class View:
    """Our blocks of some of our layers (the layers a peer of another pipeline
    parallel stage shares with us), with their prepped descriptor lists."""

    layout: KVLayout
    dlist: Any  # nixl_prepped_dlist_handle of all its blocks (local agent)
    cuts: dict[Heads, Any] = field(default_factory=dict)  # prepped lists of runs of heads
    layers: tuple[str, ...] = ()  # its layer names (computed once: a read asks for them)

    def __post_init__(self) -> None:
        self.layers = self.layout.layer_names()

    def release(self) -> None:
        for cut in self.cuts.values():
            cut.release()
        self.cuts.clear()
        if self.dlist is not None:
            self.dlist.release()
            self.dlist = None


@dataclass
class Peer:
    """A peer's agent as loaded: its blocks of the layers we share, prepped once."""

    name: str
    raw: bytes  # the metadata it was added with (add_peer is idempotent on it)
    layout: KVLayout  # its blocks of the layers we share (all of its own unless pipeline stages differ)
    dlist: Any  # nixl_prepped_dlist_handle of all its blocks of those layers
    mine: View | None  # our blocks of those layers; None: we share no layer (a read only notifies)
    handles: set[NixlXferHandle] = field(default_factory=set)
    cuts: dict[Heads, Any] = field(default_factory=dict)  # prepped lists of runs of heads
    block_tokens_differ: bool = False  # its blocks hold another number of tokens: segment reads only
