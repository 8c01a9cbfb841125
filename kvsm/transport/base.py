"""What kvsm needs from a block transport, whatever moves the bytes.

The receiving side reads the sender's blocks and the read carries a
notification the sender receives when it is done (pull mode); a transport that
can also write (``post_write``) lets the sender write them instead (push mode). Every method is
called from the owning process's event-loop thread only, and none blocks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsm.transport.regions import Segments

# Heads ``(start, count, of)``: a run of a block's heads (a tensor parallel
# rank's share); None: the whole block.
Heads = tuple[int, int, int]


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class XferHandle:
    """An opaque posted transfer; transports subclass or wrap their own handle."""

    __slots__ = ("peer", "local_blocks", "remote_blocks", "notif", "tag")

    def __init__(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                 notif: bytes, tag: str = "") -> None:
        self.peer = peer
        self.local_blocks = tuple(local_blocks)
        self.remote_blocks = tuple(remote_blocks)
        self.notif = notif
        self.tag = tag


class Transport(ABC):
    """A registered block pool that can read from peers' pools and notify them."""

    name: str
    # KV cache groups of the registered pool (vLLM's hybrid KV cache manager);
    # a read gives its blocks group by group (``post_read``'s ``group_sizes``).
    num_groups: int = 1

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (sent in the handshake)."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (dead, or replaced by a restarted engine)."""

    @abstractmethod
    def post_read(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                  notif: bytes, tag: str = "", group_sizes: Sequence[int] = (),
                  local_heads: Heads | None = None, remote_heads: Heads | None = None,
                  segments: Segments | None = None) -> XferHandle:
        """Read ``remote_blocks`` of ``peer`` into ``local_blocks``; ``notif`` reaches the
        peer when the read completes. ``group_sizes``: the blocks are that many of
        each KV cache group in turn (empty: one group). ``remote_heads`` /
        ``local_heads``: only that run of each block's heads, on either side
        (tensor parallel sizes that differ); the two runs hold as many heads.
        ``segments``: the engines' block sizes differ, and each pair moves one
        segment of that many tokens (a block id may then appear more than once)."""

    def post_write(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                   notif: bytes, tag: str = "", group_sizes: Sequence[int] = (),
                   local_heads: Heads | None = None, remote_heads: Heads | None = None,
                   segments: Segments | None = None) -> XferHandle:
        """``post_read`` the other way (push mode): write our ``local_blocks`` into
        ``remote_blocks`` of ``peer``; ``notif`` reaches the peer when the write is
        over. A transport that cannot write raises ``NotImplementedError``."""
        raise NotImplementedError(f"transport {self.name!r} does not write into its peers (push mode)")

    def post_layer_write(self, peer: str, layer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                         notif: bytes = b"", tag: str = "") -> XferHandle:
        """``post_write`` of one layer's regions only (streamed push: each layer is
        written once its forward pass is done); ``notif`` (if any) reaches the
        peer when it is over. A transport that cannot raises ``NotImplementedError``."""
        raise NotImplementedError(f"transport {self.name!r} does not write layer by layer (streamed push)")

    @abstractmethod
    def check(self, handle: XferHandle) -> TransferState:
        """Where a posted read stands, without waiting."""

    @abstractmethod
    def release(self, handle: XferHandle, *, force: bool = False) -> bool:
        """Give up a transfer handle. False when the transfer is still in flight and
        could not be cancelled: it may still write, so the caller keeps waiting.
        ``force``: cancel it anyway (bytes already on the way may still land)."""

    @abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> bool:
        """A notification without a transfer (nothing-to-read, abandon); False
        when it could not be handed to the peer."""

    @abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call: (peer name, message)."""

    def layers(self) -> tuple[str, ...] | None:
        """The layers of the registered pool, in order (None: a pool without layers)."""
        return None

    def layer_groups(self) -> tuple[int, ...]:
        """The KV cache group of each of ``layers()``, in that order: a streamed
        write of a layer gives that group's blocks (one group: all 0)."""
        return (0,) * len(self.layers() or ())

    def layers_read(self, peer: str) -> tuple[str, ...] | None:
        """Our layers a read from ``peer`` fills: all of ours, unless the peer is a
        pipeline parallel stage that holds other layers (None: a pool without layers)."""
        return None

    def resources(self) -> dict[str, int]:
        """How many peers and unreleased transfer handles this transport holds
        (for leak checks: both return to their idle values once requests end)."""
        return {}
