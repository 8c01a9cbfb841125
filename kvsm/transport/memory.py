"""A deterministic in-memory transport on virtual time, for simulation tests.

Agents share one ``InMemoryFabric``. Reads move real bytes between the
agents' ``bytearray`` pools, but only when the fabric is stepped to the read's
completion time, so a test decides exactly when (and whether) each transfer
lands. Faults are chosen per transfer by a hook: complete, fail, hang (never
complete on its own), corrupt the bytes, or refuse cancellation.

``on_write`` / ``on_read`` hooks let the simulation check that a read never
writes into a block its request no longer holds, and never reads a block that
its sender has freed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsm.lifecycle.clock import Clock
from kvsm.transport.base import TransferState, Transport, XferHandle


class Fault(enum.Enum):
    NONE = "none"
    ERROR = "error"  # completes with an error, writes nothing
    HANG = "hang"  # never completes unless released
    CORRUPT = "corrupt"  # completes, but one byte arrives flipped
    STUCK = "stuck"  # completes late and cannot be cancelled meanwhile


@dataclass
class _Transfer:
    handle: XferHandle
    reader: str
    complete_at_ns: int
    fault: Fault
    state: TransferState = TransferState.PENDING


@dataclass
class InMemoryFabric:
    """The wire between in-memory agents, and the clock it runs on."""

    clock: Clock
    latency_ns: int = 200_000
    fault_for: Callable[[XferHandle], Fault] = field(default=lambda h: Fault.NONE)
    agents: dict[str, InMemoryAgent] = field(default_factory=dict)
    _transfers: dict[XferHandle, _Transfer] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)

    def kill(self, name: str) -> None:
        """The agent's process died: its pending reads (both ways) end in error."""
        self.dead.add(name)

    def next_completion_ns(self) -> int | None:
        pending = [t.complete_at_ns for t in self._transfers.values() if t.state is TransferState.PENDING
                   and t.fault is not Fault.HANG]
        return min(pending) if pending else None

    def step(self) -> None:
        """Land every transfer due at the current virtual time."""
        now = self.clock.monotonic_ns()
        for t in list(self._transfers.values()):
            if t.state is TransferState.PENDING and t.fault is not Fault.HANG and t.complete_at_ns <= now:
                self._land(t)

    def _land(self, t: _Transfer) -> None:
        h = t.handle
        reader = self.agents[t.reader]
        if t.fault is Fault.ERROR or h.peer in self.dead or t.reader in self.dead or h.peer not in self.agents:
            t.state = TransferState.ERROR
            return
        sender = self.agents[h.peer]
        if sender.on_read is not None:
            sender.on_read(h.remote_blocks, h.tag)
        if reader.on_write is not None:
            reader.on_write(h.local_blocks, h.tag)
        for lb, rb in zip(h.local_blocks, h.remote_blocks):
            reader.write_block(lb, sender.read_block(rb))
        if t.fault is Fault.CORRUPT and h.local_blocks:
            lb = h.local_blocks[0]
            off = lb * reader.block_bytes
            reader.memory[off] ^= 0xFF
        t.state = TransferState.DONE
        if h.notif:
            sender.inbox.append((t.reader, h.notif))

    def _post(self, reader: str, handle: XferHandle) -> None:
        fault = self.fault_for(handle)
        delay = self.latency_ns * (5 if fault is Fault.STUCK else 1)
        self._transfers[handle] = _Transfer(handle, reader, self.clock.monotonic_ns() + delay, fault)

    def _find(self, handle: XferHandle) -> _Transfer:
        t = self._transfers.get(handle)
        if t is None:
            raise KeyError("unknown or released transfer handle")
        return t

    def in_flight(self) -> int:
        return sum(1 for t in self._transfers.values() if t.state is TransferState.PENDING)


class InMemoryAgent(Transport):
    """One engine's registered block pool on an ``InMemoryFabric``."""

    def __init__(self, fabric: InMemoryFabric, name: str, num_blocks: int, block_bytes: int) -> None:
        self.fabric = fabric
        self.name = name
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.memory = bytearray(num_blocks * block_bytes)
        self.peers: set[str] = set()
        self.inbox: list[tuple[str, bytes]] = []
        self.on_write: Callable[[Sequence[int], str], None] | None = None
        self.on_read: Callable[[Sequence[int], str], None] | None = None
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
        self.peers.discard(peer)

    def post_read(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                  notif: bytes, tag: str = "") -> XferHandle:
        if peer not in self.peers:
            raise ConnectionError(f"agent {self.name!r} has no peer {peer!r} (handshake first)")
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
        handle = XferHandle(peer, local_blocks, remote_blocks, notif, tag)
        self.fabric._post(self.name, handle)
        return handle

    def check(self, handle: XferHandle) -> TransferState:
        return self.fabric._find(handle).state

    def release(self, handle: XferHandle) -> bool:
        t = self.fabric._find(handle)
        if t.state is TransferState.PENDING:
            if t.fault is Fault.STUCK:
                return False  # still in flight; it will land (and write) later
            t.state = TransferState.ERROR  # cancelled before it wrote anything
        del self.fabric._transfers[handle]
        return True

    def send_notif(self, peer: str, msg: bytes) -> None:
        agent = self.fabric.agents.get(peer)
        if agent is not None and peer not in self.fabric.dead:
            agent.inbox.append((self.name, msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def resources(self) -> dict[str, int]:
        return {"peers": len(self.peers),
                "handles": sum(1 for t in self.fabric._transfers.values() if t.reader == self.name)}
