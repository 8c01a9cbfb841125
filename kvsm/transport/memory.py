"""A deterministic in-memory transport on virtual time, for simulation tests.

Agents share one ``InMemoryFabric``. Reads move real bytes between the
agents' ``bytearray`` pools, but only when the fabric is stepped to the read's
completion time, so a test decides exactly when (and whether) each transfer
lands. Faults are chosen per transfer by a hook: complete, fail, fail as a
disconnected peer, hang (never complete on its own), corrupt the bytes, or
refuse cancellation.

It behaves like ``kvsm.transport.nixl`` where the worker can tell: a read
that ended in error says why in ``handle.error`` (a dead peer's reads say
``Disconnect``, as NIXL's ``nixlRemoteDisconnectError`` does), a read that
cannot be cancelled makes ``release`` return False until it settles, and
``remove_peer`` settles every read from that peer (none writes afterwards).

An agent built with a token layout (``token_layout_of``: one region over its
pool, tokens laid out by ``TokenPlanes``) also reads blocks of another size in
segments, byte run by byte run, from the descriptors the real layout code
builds (``KVLayout.segment_desc_array``, as the NIXL transport uses them).

An agent built with layers (``layers``: how many, or their names) splits each
block's bytes into that many equal slices, one per layer in order, and writes
one layer's slice of blocks at a time (``post_layer_write``, streamed push). A
layer write reads its source bytes when it is posted (the earliest a DMA engine
may): the bytes a layer holds after the write was posted never go with it, so a
write posted before its layer was computed delivers what the block held before.
Whole-block transfers read their source when they land.

``on_write`` / ``on_read`` hooks let the simulation check that a read never
writes into a block its request no longer holds, and never reads a block that
its sender has freed. ``cancel_lies`` plants a transport bug (for tests that
show those checks can fail): ``release`` of a read that cannot be cancelled
says it was, and the read still lands later.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsm.lifecycle.clock import Clock
from kvsm.transport.base import Heads, TransferState, Transport, XferHandle
from kvsm.transport.regions import KVLayout, Region, Segments, TokenPlanes


class Fault(enum.Enum):
    NONE = "none"
    ERROR = "error"  # completes with an error, writes nothing
    DISCONNECT = "disconnect"  # completes with the error of a peer whose process is gone
    HANG = "hang"  # never completes unless released
    CORRUPT = "corrupt"  # completes, but one byte arrives flipped
    STUCK = "stuck"  # completes late and cannot be cancelled meanwhile
    NOTIF_LOST = "notif_lost"  # completes, but its notification never reaches the sender (the network went)


DISCONNECT_ERROR = "nixlRemoteDisconnectError: the peer's agent disconnected"
# What a layer write carries of a source block freed while it was in flight (``InMemoryAgent.freed``).
POISON = b"\xee"


class MemoryXferHandle(XferHandle):
    """A posted in-memory read; ``error`` says why it ended in ERROR."""

    __slots__ = ("error", "local_heads", "remote_heads", "runs", "write", "span", "sent", "frees")

    def __init__(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                 notif: bytes, tag: str = "", local_heads: Heads | None = None,
                 remote_heads: Heads | None = None) -> None:
        super().__init__(peer, local_blocks, remote_blocks, notif, tag)
        self.error = ""
        self.local_heads = local_heads
        self.remote_heads = remote_heads
        # A read in segments: (local offset, remote offset, length) of each byte run.
        self.runs: list[tuple[int, int, int]] | None = None
        self.write = False  # a write of our blocks into the peer's (push mode), not a read
        # A layer write: (offset, length) of the layer's slice in every block, and
        # the source bytes of each block's slice as they were when it was posted.
        self.span: tuple[int, int] | None = None
        self.sent: list[bytes] | None = None
        self.frees: tuple[int, ...] = ()  # each source block's free count when it was posted


@dataclass(eq=False)
class _Transfer:
    handle: MemoryXferHandle
    reader: str
    complete_at_ns: int
    fault: Fault
    state: TransferState = TransferState.PENDING
    lied: bool = False  # released under ``cancel_lies`` while in flight: lands, nobody watches


@dataclass
class InMemoryFabric:
    """The wire between in-memory agents, and the clock it runs on."""

    clock: Clock
    latency_ns: int = 200_000
    fault_for: Callable[[XferHandle], Fault] = field(default=lambda h: Fault.NONE)
    # How long a read takes to settle (None: latency_ns, five times that when STUCK).
    delay_for: Callable[[XferHandle, Fault], int] | None = None
    agents: dict[str, InMemoryAgent] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    cancel_lies: bool = False
    _transfers: dict[MemoryXferHandle, _Transfer] = field(default_factory=dict)
    # (complete_at_ns, order, transfer) of every read that will land on its own.
    _due: list[tuple[int, int, _Transfer]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def kill(self, name: str) -> None:
        """The agent's process died: its pending reads (both ways) end in error."""
        self.dead.add(name)

    def next_completion_ns(self) -> int | None:
        """When the next read lands (or fails), or None."""
        due = self._due
        while due and due[0][2].state is not TransferState.PENDING:
            heapq.heappop(due)
        return due[0][0] if due else None

    def step(self) -> int:
        """Land every transfer due at the current virtual time; returns how many."""
        now = self.clock.monotonic_ns()
        due = self._due
        landed = 0
        while due and due[0][0] <= now:
            _, _, t = heapq.heappop(due)
            if t.state is TransferState.PENDING:
                self._land(t)
                landed += 1
        return landed

    def _land(self, t: _Transfer) -> None:
        h = t.handle
        if t.fault is Fault.ERROR:
            self._fail(t, "NIXL reported ERR")
            return
        if t.fault is Fault.DISCONNECT or h.peer in self.dead or t.reader in self.dead:
            self._fail(t, DISCONNECT_ERROR)
            return
        if h.peer not in self.agents or t.reader not in self.agents:
            self._fail(t, "NIXL reported ERR: agent unknown")
            return
        poster, peer = self.agents[t.reader], self.agents[h.peer]
        # (a read fills the poster's blocks from the peer's; a write the peer's from the poster's)
        dst, src = (peer, poster) if h.write else (poster, peer)
        dst_blocks, src_blocks = (h.remote_blocks, h.local_blocks) if h.write else (h.local_blocks, h.remote_blocks)
        dst_heads, src_heads = (h.remote_heads, h.local_heads) if h.write else (h.local_heads, h.remote_heads)
        # A layer write's source blocks freed under it (``freed``): it lands POISON there,
        # which the receiver's content check judges; the read itself is no one's fault.
        poisoned = {k for k, sb in enumerate(src_blocks) if h.frees and src.frees.get(sb, 0) != h.frees[k]}
        read = [sb for k, sb in enumerate(src_blocks) if k not in poisoned]
        if src.on_read is not None and (read or not poisoned):
            src.on_read(read, h.tag)
        if dst.on_write is not None:
            dst.on_write(dst_blocks, h.tag)
        if h.span is not None:
            at, n = h.span
            for k, (db, sb) in enumerate(zip(dst_blocks, src_blocks)):
                to = db * dst.block_bytes + at
                frm = sb * src.block_bytes + at
                if k in poisoned:
                    dst.memory[to:to + n] = POISON * n
                else:
                    dst.memory[to:to + n] = h.sent[k] if h.sent is not None else src.memory[frm:frm + n]
        elif h.runs is not None:
            for local_at, remote_at, n in h.runs:
                at, frm = (remote_at, local_at) if h.write else (local_at, remote_at)
                dst.memory[at:at + n] = src.memory[frm:frm + n]
        elif dst_heads is None and src_heads is None:
            for db, sb in zip(dst_blocks, src_blocks):
                dst.write_block(db, src.read_block(sb))
        else:
            do, dn = _byte_run(dst.block_bytes, dst_heads)
            so, sn = _byte_run(src.block_bytes, src_heads)
            if dn != sn:
                self._fail(t, f"NIXL reported ERR: {sn} source bytes per block for {dn} destination ones")
                return
            for db, sb in zip(dst_blocks, src_blocks):
                at = db * dst.block_bytes + do
                dst.memory[at:at + dn] = src.memory[sb * src.block_bytes + so:][:sn]
        if t.fault is Fault.CORRUPT and dst_blocks:
            dst.memory[dst_blocks[0] * dst.block_bytes + (h.span[0] if h.span is not None else 0)] ^= 0xFF
        t.state = TransferState.DONE
        if t.lied:
            self._transfers.pop(h, None)
        if h.notif and t.fault is not Fault.NOTIF_LOST:
            peer.inbox.append((t.reader, h.notif))

    @staticmethod
    def _fail(t: _Transfer, why: str) -> None:
        t.state = TransferState.ERROR
        t.handle.error = why

    def _post(self, reader: str, handle: MemoryXferHandle) -> None:
        fault = self.fault_for(handle)
        if self.delay_for is not None:
            delay = self.delay_for(handle, fault)
        else:
            delay = self.latency_ns * (5 if fault is Fault.STUCK else 1)
        t = _Transfer(handle, reader, self.clock.monotonic_ns() + delay, fault)
        self._transfers[handle] = t
        if fault is not Fault.HANG:
            heapq.heappush(self._due, (t.complete_at_ns, next(self._order), t))

    def _compact_due(self) -> None:
        """Drop settled reads from the landing heap once they outnumber the live
        ones: a caller that lands reads itself (``_land``) and never steps the
        fabric must not keep every read it ever posted (bounded like TimerHeap)."""
        due = self._due
        if len(due) > 2 * len(self._transfers) + 8:
            self._due = [e for e in due if e[2].state is TransferState.PENDING]
            heapq.heapify(self._due)

    def _find(self, handle: XferHandle) -> _Transfer:
        t = self._transfers.get(handle)  # type: ignore[call-overload]
        if t is None:
            raise KeyError("unknown or released transfer handle")
        return t

    def _settle_from(self, reader: str, peer: str | None, why: str) -> None:
        """Every read of ``reader`` (from ``peer``, or from anyone) still in flight
        ends in error and writes nothing; so does every write into it from there."""
        for t in list(self._transfers.values()):
            if (t.reader == reader and t.state is TransferState.PENDING and not t.lied
                    and peer in (None, t.handle.peer)):
                self._fail(t, why)
            # A write of that peer's into ``reader`` (push mode) stops too, even one its
            # poster let go: the connection it came by is gone.
            elif (t.handle.write and t.handle.peer == reader and peer in (None, t.reader)
                  and t.state is TransferState.PENDING):
                self._fail(t, why)
                if t.lied:
                    self._transfers.pop(t.handle, None)

    def in_flight(self) -> int:
        """Reads that have not settled yet (a released read that lies lands later: counted)."""
        return sum(1 for t in self._transfers.values() if t.state is TransferState.PENDING)


def _byte_run(block_bytes: int, heads: Heads | None) -> tuple[int, int]:
    """(offset, length) of a run of heads within a block (the whole block: None)."""
    if heads is None:
        return 0, block_bytes
    start, count, of = heads
    unit = block_bytes // of
    return start * unit, count * unit


def token_layout_of(name: str, num_blocks: int, block_tokens: int, planes: TokenPlanes, heads: int) -> KVLayout:
    """The layout of an in-memory pool of ``num_blocks`` blocks of ``block_tokens``
    tokens, ``heads`` heads each laid out by ``planes``: one region at offset 0."""
    block_bytes = heads * planes.head_bytes(block_tokens)
    region = Region(layer=name, part=0, base_addr=0, num_blocks=num_blocks, block_bytes=block_bytes,
                    block_stride=block_bytes, device_id=0, heads=heads, block_tokens=block_tokens, tokens=planes)
    return KVLayout(regions=(region,), mem_type="DRAM", num_blocks=num_blocks)


class InMemoryAgent(Transport):
    """One engine's registered block pool on an ``InMemoryFabric``."""

    def __init__(self, fabric: InMemoryFabric, name: str, num_blocks: int, block_bytes: int,
                 num_groups: int = 1, layout: KVLayout | None = None, layers: int | Sequence[str] = 0) -> None:
        if layout is not None and (layout.num_blocks != num_blocks or len(layout.regions) != 1
                                   or layout.regions[0].block_bytes != block_bytes
                                   or layout.regions[0].base_addr != 0):
            raise ValueError(f"agent {name!r}: the layout is not one region over {num_blocks} blocks of "
                             f"{block_bytes} bytes at offset 0 (build it with token_layout_of)")
        names = tuple(f"layer.{i}" for i in range(layers)) if isinstance(layers, int) else tuple(layers)
        if names and (layout is not None or block_bytes % len(names) or len(set(names)) != len(names)):
            raise ValueError(f"agent {name!r}: {len(names)} layers must be distinct and split blocks of "
                             f"{block_bytes} bytes evenly (and a token layout keeps no layers)")
        self.fabric = fabric
        self.name = name
        # Blocks of another size are read in segments only where a token layout says how.
        self.layout = layout
        # Groups share the one pool (block ids are global): only the split of a read is checked.
        self.num_groups = num_groups
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        # Each block's bytes, split evenly: one slice per layer, in this order (none: no layers).
        self._layers = names
        self.memory = bytearray(num_blocks * block_bytes)
        self.peers: set[str] = set()
        self.inbox: list[tuple[str, bytes]] = []
        self.on_write: Callable[[Sequence[int], str], None] | None = None
        self.on_read: Callable[[Sequence[int], str], None] | None = None
        self.closed = False
        self.frees: dict[int, int] = {}  # block -> how often its owner freed it (``freed``)
        fabric.agents[name] = self

    # -- memory ---------------------------------------------------------------

    def read_block(self, block: int) -> bytes:
        off = block * self.block_bytes
        return bytes(self.memory[off:off + self.block_bytes])

    def write_block(self, block: int, data: bytes) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"block {block}: {len(data)} bytes, expected {self.block_bytes}")
        off = block * self.block_bytes
        self.memory[off:off + self.block_bytes] = data

    def freed(self, blocks: Sequence[int]) -> None:
        """The engine freed ``blocks`` (vLLM preempted their request): a layer write
        from them that lands later read them after the free, as RDMA may, and
        carries bytes that are no longer the request's (``POISON``)."""
        for b in blocks:
            self.frees[b] = self.frees.get(b, 0) + 1

    # -- Transport ------------------------------------------------------------

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        if name not in self.fabric.agents:
            raise ConnectionError(f"no agent named {name!r} on the fabric")
        self.peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; its reads still in flight end in error (none writes afterwards)."""
        self.peers.discard(peer)
        self.fabric._settle_from(self.name, peer, f"cancelled in flight: peer {peer!r} removed")

    def post_read(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                  notif: bytes, tag: str = "", group_sizes: Sequence[int] = (),
                  local_heads: Heads | None = None, remote_heads: Heads | None = None,
                  segments: Segments | None = None) -> MemoryXferHandle:
        return self._post(False, peer, local_blocks, remote_blocks, notif, tag, group_sizes, local_heads,
                          remote_heads, segments)

    def post_write(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                   notif: bytes, tag: str = "", group_sizes: Sequence[int] = (),
                   local_heads: Heads | None = None, remote_heads: Heads | None = None,
                   segments: Segments | None = None) -> MemoryXferHandle:
        """Our blocks into the peer's (push mode); the notification reaches the peer."""
        return self._post(True, peer, local_blocks, remote_blocks, notif, tag, group_sizes, local_heads,
                          remote_heads, segments)

    def layers(self) -> tuple[str, ...] | None:
        return self._layers or None

    def layer_span(self, layer: str) -> tuple[int, int]:
        """(offset, length) of ``layer``'s slice in each block; ``ValueError``
        naming a layer this pool does not hold."""
        if layer not in self._layers:
            raise ValueError(f"layer {layer!r} is not in agent {self.name!r}'s pool")
        size = self.block_bytes // len(self._layers)
        return self._layers.index(layer) * size, size

    def _pair_check(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> None:
        """A transfer's peer is known (``ConnectionError``), its block counts equal."""
        if self.closed:
            raise RuntimeError(f"agent {self.name!r} is closed")
        if peer not in self.peers:
            raise ConnectionError(f"agent {self.name!r} has no peer {peer!r} (handshake first)")
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")

    def post_layer_write(self, peer: str, layer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                         notif: bytes = b"", tag: str = "") -> MemoryXferHandle:
        """Our ``layer``'s slice of ``local_blocks`` into the same slice of the peer's
        ``remote_blocks`` (streamed push), read here now; refused as the NIXL
        transport refuses it: layers, block sizes or KV cache groups that differ."""
        self._pair_check(peer, local_blocks, remote_blocks)
        theirs = self.fabric.agents[peer]
        if (not self._layers or theirs._layers != self._layers or theirs.block_bytes != self.block_bytes
                or self.num_groups != 1):
            raise ValueError(f"a layer-by-layer write to {peer!r} needs the same layers, one KV cache group and "
                             f"blocks of one size on both sides")
        at, n = self.layer_span(layer)
        for blocks, pool in ((local_blocks, self), (remote_blocks, theirs)):
            bad = [b for b in blocks if not 0 <= b < pool.num_blocks]
            if bad:
                raise ValueError(f"blocks {bad[:4]} are not in {pool.name!r}'s pool of {pool.num_blocks} blocks")
        handle = MemoryXferHandle(peer, local_blocks, remote_blocks, notif, tag)
        handle.write = True
        handle.span = (at, n)
        mem = self.memory
        handle.sent = [bytes(mem[b * self.block_bytes + at:b * self.block_bytes + at + n]) for b in local_blocks]
        handle.frees = tuple(self.frees.get(b, 0) for b in local_blocks)
        self.fabric._post(self.name, handle)
        return handle

    def _post(self, write: bool, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              notif: bytes, tag: str, group_sizes: Sequence[int], local_heads: Heads | None,
              remote_heads: Heads | None, segments: Segments | None) -> MemoryXferHandle:
        self._pair_check(peer, local_blocks, remote_blocks)
        if group_sizes and (sum(group_sizes) != len(local_blocks) or len(group_sizes) != self.num_groups):
            raise ValueError(f"group sizes {list(group_sizes)} for {len(local_blocks)} blocks of "
                             f"{self.num_groups} KV cache group(s)")
        for heads in (local_heads, remote_heads):
            if heads is not None and not (0 <= heads[0] and 0 < heads[1] and heads[0] + heads[1] <= heads[2]):
                raise ValueError(f"heads {heads}: not a run of a block's heads")
        if local_heads is not None and remote_heads is not None and local_heads[1] != remote_heads[1]:
            raise ValueError(f"heads {local_heads} here and {remote_heads} on {peer!r}: the runs differ in size")
        handle = MemoryXferHandle(peer, local_blocks, remote_blocks, notif, tag, local_heads, remote_heads)
        if segments is None and local_heads is None and remote_heads is None:
            theirs = self.fabric.agents[peer].block_bytes
            if theirs != self.block_bytes:
                raise ValueError(f"blocks of {theirs} bytes on {peer!r} and {self.block_bytes} here: whole blocks "
                                 f"cannot be read across sizes, they must go in segments")
        if segments is not None:
            handle.runs = self._segment_runs(peer, local_blocks, remote_blocks, local_heads, remote_heads, segments)
        handle.write = write
        self.fabric._post(self.name, handle)
        return handle

    def _segment_runs(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                      local_heads: Heads | None, remote_heads: Heads | None,
                      segments: Segments) -> list[tuple[int, int, int]]:
        """The byte runs of a read in segments, checked as the NIXL transport checks them."""
        mine, theirs = self.layout, self.fabric.agents[peer].layout
        if mine is None or theirs is None:
            raise ValueError(f"agent {self.name if mine is None else peer!r} keeps its blocks as opaque bytes (no "
                             f"token layout): they move whole, and blocks of another size cannot be read in segments")
        if not len(segments.local) == len(segments.remote) == len(local_blocks):
            raise ValueError(f"{len(segments.local)} local and {len(segments.remote)} remote segments for "
                             f"{len(local_blocks)} block pairs")
        mine.check_segments(segments.local_block, segments.tokens)
        theirs.check_segments(segments.remote_block, segments.tokens)
        local = mine.segment_desc_array(local_blocks, segments.local, segments.tokens, local_heads)
        remote = theirs.segment_desc_array(remote_blocks, segments.remote, segments.tokens, remote_heads)
        if local.shape != remote.shape or (local[:, 1] != remote[:, 1]).any():
            raise ValueError(f"segments of {segments.tokens} tokens: {local.shape[0]} byte runs here and "
                             f"{remote.shape[0]} on {peer!r}, or runs of other lengths (token layouts differ)")
        return [(int(a), int(b), int(n)) for a, b, n in zip(local[:, 0], remote[:, 0], local[:, 1])]

    def check(self, handle: XferHandle) -> TransferState:
        return self.fabric._find(handle).state

    def release(self, handle: XferHandle, *, force: bool = False) -> bool:
        """As NIXL's: a transfer that cannot be cancelled (STUCK) is refused, or with
        ``force`` let go while it still lands later (as a forced NIXL cancel may)."""
        fabric = self.fabric
        t = fabric._find(handle)
        if t.state is TransferState.PENDING:
            if t.fault is Fault.STUCK:
                if force:
                    t.lied = True  # let go: it lands later all the same, nobody watching
                    return True
                if not fabric.cancel_lies:
                    return False  # still in flight; it will land (and write) later
                t.lied = True  # the planted bug: "cancelled", yet it lands later
                return True
            fabric._fail(t, "cancelled before it wrote anything")
        del fabric._transfers[t.handle]
        fabric._compact_due()
        return True

    def send_notif(self, peer: str, msg: bytes) -> bool:
        agent = self.fabric.agents.get(peer)
        if agent is not None and peer not in self.fabric.dead:
            agent.inbox.append((self.name, msg))
            return True
        return False

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def resources(self) -> dict[str, int]:
        return {"peers": len(self.peers),
                "handles": sum(1 for t in self.fabric._transfers.values() if t.reader == self.name and not t.lied)}

    def close(self) -> None:
        """The worker shuts down: its reads still in flight end in error."""
        if not self.closed:
            self.closed = True
            self.fabric._settle_from(self.name, None, f"agent {self.name!r} closed")
