"""The NIXL block transport: one NIXL agent over one engine worker's KV caches.

Threading: construct it anywhere (``register_kv_caches`` runs in the model
runner's thread), then make every other call from ONE thread, the process's
event-loop thread. The agent is created without NIXL's listener thread (the
handshake is kvsm's own) and therefore with ``NIXL_THREAD_SYNC_NONE``: NIXL
takes no locks, so two threads calling into it concurrently is undefined.

No NIXL progress thread either. NIXL 1.5.1's Python API starts it with a
0 µs poll delay, i.e. a thread that busy-polls UCX: measured here, a full
core per idle process (1.0 CPU-s per second), which on a 2-core machine
starves the engines. Without it, UCX makes progress only inside our calls:
``post_read`` (on the CPU, UCX's ``cma`` transport copies synchronously
inside ``transfer()``, so a big read blocks the loop for its copy: 256 MiB
took 22 ms as 4096 x 64 KiB descriptors in an idle process (45-48 ms
under tools/bench_nixl.py's section 3, 5.2-5.6 GiB/s), 240 ms as 32768 x
8 KiB permuted ones; 64 MiB of vLLM-CPU 128 KiB blocks 20-26 ms), ``check`` and
``get_notifs``. So the loop must poll ``check`` for its posted reads and
``get_notifs`` on a timer; a sender's notifications are only seen when it
calls ``get_notifs``. Each of those calls costs about 1 µs when idle.
(``num_threads`` > 0, upstream's key, adds UCX backend worker threads that
carry a read's descriptors and sleep while idle; the loop still polls.)

What NIXL 1.5.1 + UCX do, as measured on this machine (see
tests/test_nixl_transport.py for the parts that are tested):

* Releasing a transfer that is still in flight (``release_xfer_handle`` on a
  ``PROC`` handle) "succeeds": NIXL asks UCX to cancel and frees the handle.
  But the bytes may already have landed (seen: all of them, the first read
  on a fresh connection is ``PROC`` after the copy, waiting for its
  completion) and the read's notification is then never sent. UCX does not
  promise that a cancelled read stops writing. So ``release`` refuses (False)
  while a read is in flight, and only ``release(h, force=True)`` cancels.
* Checking a transfer whose remote agent was removed (``remove_remote_agent``)
  while it was in flight makes NIXL delete the handle internally (and report
  NOT_FOUND); the Python handle would then free it again. ``remove_peer``
  therefore settles every read to that peer first and never checks them
  again.
* A dead peer: ``transfer()`` raises ``nixlRemoteDisconnectError`` at once
  (UCX saw the connection close); ``send_notif`` raises the same. Loading
  new metadata under a name that is already loaded raises
  ``nixlNotAllowedError`` (so a restarted peer needs ``remove_remote_agent``
  first); loading the very same metadata again is accepted.
* Connections: ``add_remote_agent`` only loads metadata; the UCX wire-up
  happens on first use and only progresses inside our calls. ``add_peer``
  starts it with ``make_connection`` (non-blocking), so a loop that keeps
  polling makes the first read ~2 ms instead of ~55 ms. Likewise a standalone
  notification on a fresh connection leaves only as our agent progresses.
* Notifications ride on the read: NIXL sends ``notif_msg`` to the peer when
  the whole read completes (at ``transfer()`` when it completes inline, else
  in the ``check`` that sees it done). Contiguous descriptors on both sides
  are merged by NIXL itself, so runs of consecutive blocks cost nothing extra.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from kvsm.transport.base import Heads, TransferState, Transport, XferHandle
from kvsm.transport.nixl_state import (
    METADATA_VERSION,
    NixlPeerInfo,
    NixlXferHandle,
    Peer,
    View,
    decode_peer_info,
    nixl_errors,
)
from kvsm.transport.regions import KVLayout, Segments

# NixlPeerInfo and NixlXferHandle are this module's public names too.
__all__ = ["METADATA_VERSION", "NixlPeerInfo", "NixlTransport", "NixlXferHandle"]

log = logging.getLogger(__name__)


class NixlTransport(Transport):
    """One NIXL agent with this worker's KV caches registered, reading peers' blocks."""

    def __init__(self, name: str, layout: KVLayout, *, backends: Sequence[str] = ("UCX",),
                 num_threads: int = 0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.layout = layout
        self._layers = layout.layer_names()
        self.num_groups = layout.num_groups
        self._errors = nixl_errors()
        self._peers: dict[str, Peer] = {}
        self._closed = False
        self._reg = None
        self._local = None
        self._local_cuts: dict[Heads, Any] = {}
        # Our blocks of a subset of our layers, by those layers (pipeline parallel
        # stages that split the model's layers differently), prepped once each.
        self._views: dict[tuple[str, ...], View] = {}
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                   backends=list(backends), num_threads=num_threads)
        # UCX's TCP transport connects *blocking* by default: loading the metadata
        # of a peer whose UCX port does not answer (a partition, a firewall) held
        # the loop thread in connect() for over 40 s here (134 s with Linux's SYN
        # retries). Non-blocking, the load returns at once and a read that cannot
        # reach the peer stalls instead, which the stalled-read probe handles. An
        # operator's own setting wins (UCX reads it when the agent is created).
        os.environ.setdefault("UCX_TCP_CONN_NB", "y")
        self._agent = nixl_agent(name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL agent {name!r}: backends {missing} unavailable "
                               f"(plugins: {self._agent.get_plugin_list()})")
        try:
            regs = np.array(layout.registration_descs(), dtype=np.uint64).reshape(-1, 3)
            self._reg = self._agent.register_memory(regs, layout.mem_type)
            self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", layout.all_block_descs(),
                                                      layout.mem_type)
            self._metadata = msgspec.msgpack.encode(NixlPeerInfo(
                version=METADATA_VERSION, name=name,
                agent_metadata=self._agent.get_agent_metadata(), layout=layout))
        except BaseException:
            self.close()
            raise

    def resources(self) -> dict[str, int]:
        return {"peers": len(self._peers), "handles": sum(len(p.handles) for p in self._peers.values())}

    # -- peers -------------------------------------------------------------------

    def metadata(self) -> bytes:
        return self._metadata

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's ``metadata()``; returns its agent name.

        The same metadata again is a no-op. New metadata under a known name (the
        peer restarted) replaces the old incarnation, settling its reads as
        ``remove_peer`` does. An incompatible KV layout raises ``ValueError``
        naming the first difference, before anything is loaded."""
        self._check_open()
        info = decode_peer_info(metadata, self.name)
        old = self._peers.get(info.name)
        if old is not None and old.raw == metadata:
            return info.name
        mine_layout, theirs = self._shared(info.layout)
        if mine_layout is not None:
            why = mine_layout.mismatch(theirs)
            if why is not None:
                raise ValueError(f"peer {info.name!r} has an incompatible KV layout: {why}")
        if old is not None:  # the peer restarted: forget the old incarnation first
            self._drop_peer(old)
        try:
            loaded = self._agent.add_remote_agent(info.agent_metadata)
        except self._errors as e:  # e.g. UCX could not reach the peer's listener
            raise ConnectionError(f"NIXL could not load peer agent {info.name!r}: {type(e).__name__}: {e}") from e
        if isinstance(loaded, bytes):
            loaded = loaded.decode()
        if loaded != info.name:
            self._agent.remove_remote_agent(loaded)
            raise ValueError(f"peer metadata names agent {info.name!r} but its NIXL metadata "
                             f"is agent {loaded!r}")
        try:
            mine = self._view(mine_layout) if mine_layout is not None else None
            dlist = self._agent.prep_xfer_dlist(info.name, theirs.all_block_descs(),
                                                theirs.mem_type) if mine is not None else None
        except BaseException:
            self._agent.remove_remote_agent(info.name)
            raise
        differ = mine is not None and any(a.block_tokens != b.block_tokens
                                          for a, b in zip(mine.layout.regions, theirs.regions))
        self._peers[info.name] = Peer(info.name, bytes(metadata), theirs, dlist, mine, block_tokens_differ=differ)
        # Start the UCX wire-up now (returns at once; our get_notifs/check polls
        # progress it): the first read then takes ~2 ms instead of ~55 ms.
        try:
            self._agent.make_connection(info.name)
        except self._errors as e:
            log.info("NIXL %s: connecting to %r: %s", self.name, info.name, e)
        return info.name

    def _shared(self, theirs: KVLayout) -> tuple[KVLayout | None, KVLayout]:
        """Our layout and the peer's cut down to the layers both hold (engines of
        different pipeline parallel sizes hold runs of the model's layers); (None,
        theirs) when they share none. The same layers: both as they are."""
        ours = self._layers
        their_names = theirs.layer_names()
        if ours == their_names:
            return self.layout, theirs
        held = set(their_names)
        common = [name for name in ours if name in held]
        if not common:
            return None, theirs
        return self.layout.only(common), theirs.only(common)

    def _view(self, layout: KVLayout) -> View:
        """Our prepped blocks of ``layout``'s layers (prepped once per set of layers)."""
        if layout is self.layout:
            return View(layout, self._local, self._local_cuts)  # (shared: released by close)
        key = layout.layer_names()
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = View(layout, self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", layout.all_block_descs(), layout.mem_type))
        return view

    def layers(self) -> tuple[str, ...]:
        return self._layers

    def layer_groups(self) -> tuple[int, ...]:
        group_of = {r.layer: r.group for r in self.layout.regions}
        return tuple(group_of[name] for name in self._layers)

    def layers_read(self, peer: str) -> tuple[str, ...]:
        """Our layers a read from ``peer`` fills (every one of ours unless its
        pipeline parallel stage holds other layers). Unknown peer: ``ConnectionError``."""
        p = self._peers.get(peer)
        if p is None:
            raise ConnectionError(f"NIXL agent {self.name!r} has no peer {peer!r} (handshake first)")
        return p.mine.layers if p.mine is not None else ()

    def read_layout(self, peer: str) -> KVLayout | None:
        """Our blocks a read from ``peer`` fills (None: none, the read only notifies)."""
        p = self._peers.get(peer)
        return p.mine.layout if p is not None and p.mine is not None else None

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``. Its reads are settled first: finished ones are freed,
        ones still in flight are cancelled (they end in ERROR; see ``release``
        for what a cancelled read may still have written). Unknown peers: no-op."""
        self._check_open()
        p = self._peers.get(peer)
        if p is not None:
            self._drop_peer(p)

    def _drop_peer(self, p: Peer) -> None:
        for h in list(p.handles):
            if h.state is TransferState.PENDING:
                self._poll(h)
            if h.state is TransferState.PENDING:
                h.state = TransferState.ERROR
                h.error = f"cancelled in flight: peer {p.name!r} removed"
            self._free(h)
        p.handles.clear()
        del self._peers[p.name]
        for cut in p.cuts.values():
            cut.release()
        p.cuts.clear()
        try:
            if p.dlist is not None:
                p.dlist.release()
        except self._errors as e:
            log.warning("NIXL %s: releasing the descriptor list of peer %r: %s", self.name, p.name, e)
        try:
            self._agent.remove_remote_agent(p.name)
        except self._errors as e:
            log.warning("NIXL %s: removing peer %r: %s", self.name, p.name, e)

    # -- reads -------------------------------------------------------------------

    def _cut(self, cuts: dict[Heads, Any], agent: str, layout: KVLayout, heads: Heads) -> Any:
        """The prepped descriptor list of run ``heads`` of every block (prepped once)."""
        dlist = cuts.get(heads)
        if dlist is None:
            dlist = cuts[heads] = self._agent.prep_xfer_dlist(agent, layout.sliced(*heads).all_block_descs(),
                                                              layout.mem_type)
        return dlist

    def post_read(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                  notif: bytes, tag: str = "", group_sizes: Sequence[int] = (),
                  local_heads: Heads | None = None, remote_heads: Heads | None = None,
                  segments: Segments | None = None) -> NixlXferHandle:
        return self._post("READ", peer, local_blocks, remote_blocks, notif, tag, group_sizes, local_heads,
                          remote_heads, segments)

    def post_write(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                   notif: bytes, tag: str = "", group_sizes: Sequence[int] = (),
                   local_heads: Heads | None = None, remote_heads: Heads | None = None,
                   segments: Segments | None = None) -> NixlXferHandle:
        """``post_read`` the other way: one NIXL WRITE of our ``local_blocks`` into the
        peer's ``remote_blocks`` (push mode); ``notif`` reaches the peer when it is over."""
        return self._post("WRITE", peer, local_blocks, remote_blocks, notif, tag, group_sizes, local_heads,
                          remote_heads, segments)

    def post_layer_write(self, peer: str, layer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
                         notif: bytes = b"", tag: str = "") -> NixlXferHandle:
        """One NIXL WRITE of ``layer``'s part of ``local_blocks`` into the peer's
        ``remote_blocks`` (whole blocks, of the layer's KV cache group: the streamed
        write's limits). Unknown peer or layer: as ``_post``."""
        p = self._pair_check(peer, local_blocks, remote_blocks)
        mine = p.mine
        if mine is None or p.block_tokens_differ:
            raise ValueError(f"a layer-by-layer write to {peer!r} needs the same layers and blocks of one size "
                             f"on both sides")
        local_idx = mine.layout.layer_desc_index_array(layer, local_blocks)
        remote_idx = p.layout.layer_desc_index_array(layer, remote_blocks)
        return self._launch(p, NixlXferHandle(peer, local_blocks, remote_blocks, notif, tag),
                            lambda: self._agent.make_prepped_xfer("WRITE", mine.dlist, local_idx, p.dlist,
                                                                  remote_idx, notif_msg=notif))

    def _post(self, op: str, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              notif: bytes, tag: str, group_sizes: Sequence[int], local_heads: Heads | None,
              remote_heads: Heads | None, segments: Segments | None) -> NixlXferHandle:
        """Post one NIXL READ (or WRITE: ``op``) of ``remote_blocks`` (every region of their KV cache
        group: ``group_sizes``, see ``KVLayout.desc_index_array``) into ``local_blocks``.

        Unknown peer: ``ConnectionError``; count mismatch or a block id out of
        range: ``ValueError``. A NIXL failure (e.g. the peer died:
        ``nixlRemoteDisconnectError``) does not raise: the handle comes back in
        ERROR with the reason in ``handle.error``. Zero blocks: nothing to read,
        the notification is sent at once and the handle is DONE. Runs of heads
        that cannot be cut out of the blocks, or differ in size: ``ValueError``.
        ``segments``: the two engines' blocks differ in size, so each pair is read
        segment by segment (``KVLayout.segment_desc_array``), with descriptors
        built for this read instead of the prepped lists. A peer of another
        pipeline parallel stage: the layers both hold only; none: the read is
        only its notification.
        """
        p = self._pair_check(peer, local_blocks, remote_blocks)
        mine = p.mine
        if mine is None:  # no layer in common: nothing to move, only the notification
            return self._launch(p, NixlXferHandle(peer, (), (), notif, tag), lambda: None)
        if segments is not None:
            return self._post_segments(op, p, mine.layout, local_blocks, remote_blocks, notif, tag, local_heads,
                                       remote_heads, segments)
        if p.block_tokens_differ:
            raise ValueError(f"the blocks of {peer!r} hold another number of tokens than this engine's: "
                             f"a read must go in segments (the request's params lacked remote_block_size?)")
        local_list, remote_list = mine.dlist, p.dlist
        if local_heads is not None and remote_heads is not None and local_heads[1] != remote_heads[1]:
            raise ValueError(f"heads {local_heads} here and {remote_heads} on {peer!r}: the runs differ in size")
        if local_heads is not None and local_heads[1] != local_heads[2]:
            local_list = self._cut(mine.cuts, "NIXL_INIT_AGENT", mine.layout, local_heads)
        if remote_heads is not None and remote_heads[1] != remote_heads[2]:
            remote_list = self._cut(p.cuts, p.name, p.layout, remote_heads)
        local_idx = mine.layout.desc_index_array(local_blocks, group_sizes)
        remote_idx = p.layout.desc_index_array(remote_blocks, group_sizes)
        return self._launch(p, NixlXferHandle(peer, local_blocks, remote_blocks, notif, tag),
                            lambda: self._agent.make_prepped_xfer(op, local_list, local_idx, remote_list,
                                                                  remote_idx, notif_msg=notif))

    def _pair_check(self, peer: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> Peer:
        """The peer of a transfer (``ConnectionError`` when unknown), its block counts equal."""
        self._check_open()
        p = self._peers.get(peer)
        if p is None:
            raise ConnectionError(f"NIXL agent {self.name!r} has no peer {peer!r} (handshake first)")
        if len(local_blocks) != len(remote_blocks):
            raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
        return p

    def _launch(self, p: Peer, h: NixlXferHandle, make: Callable[[], Any]) -> NixlXferHandle:
        """Create (``make``) and start one READ; nothing to read: only the notification."""
        if not h.local_blocks:
            if h.notif and not self.send_notif(p.name, h.notif):
                h.state, h.error = TransferState.ERROR, f"notification to {p.name!r} failed"
            else:
                h.state = TransferState.DONE
            return h
        try:
            h._nixl = make()
            st = self._agent.transfer(h._nixl)
        except self._errors as e:
            h.state, h.error = TransferState.ERROR, f"{type(e).__name__}: {e}"
            self._free(h)
            return h
        p.handles.add(h)
        self._set(h, st)
        return h

    def _post_segments(self, op: str, p: Peer, mine: KVLayout, local_blocks: Sequence[int],
                       remote_blocks: Sequence[int], notif: bytes, tag: str, local_heads: Heads | None,
                       remote_heads: Heads | None, segments: Segments) -> NixlXferHandle:
        """One READ (or WRITE) of segment pairs (blocks of different sizes), its descriptors built now."""
        if not len(segments.local) == len(segments.remote) == len(local_blocks):
            raise ValueError(f"{len(segments.local)} local and {len(segments.remote)} remote segments for "
                             f"{len(local_blocks)} block pairs")
        mine.check_segments(segments.local_block, segments.tokens)
        p.layout.check_segments(segments.remote_block, segments.tokens)
        local = mine.segment_desc_array(local_blocks, segments.local, segments.tokens, local_heads)
        remote = p.layout.segment_desc_array(remote_blocks, segments.remote, segments.tokens, remote_heads)
        if local.shape != remote.shape or not np.array_equal(local[:, 1], remote[:, 1]):
            raise ValueError(f"segments of {segments.tokens} tokens: {local.shape[0]} byte runs here and "
                             f"{remote.shape[0]} on {p.name!r}, or runs of other lengths (token layouts differ)")
        return self._launch(p, NixlXferHandle(p.name, local_blocks, remote_blocks, notif, tag),
                            lambda: self._agent.initialize_xfer(
                                op, self._agent.get_xfer_descs(local, self.layout.mem_type),
                                self._agent.get_xfer_descs(remote, p.layout.mem_type), p.name, notif_msg=notif))

    def check(self, handle: XferHandle) -> TransferState:
        h = self._own(handle)
        if h.state is TransferState.PENDING:
            self._poll(h)
        return h.state

    def release(self, handle: XferHandle, *, force: bool = False) -> bool:
        """Free a read's NIXL handle. False (and nothing freed) while the read is
        in flight: NIXL would cancel it, but UCX may still have written (or
        still write) the local blocks and the peer's notification would never be
        sent, so the caller keeps waiting. ``force=True`` cancels anyway (the
        handle ends in ERROR; treat its local blocks as garbage). Releasing
        twice is a no-op."""
        h = self._own(handle, released_ok=True)
        if h.released:
            return True
        if h.state is TransferState.PENDING:
            self._poll(h)
            if h.state is TransferState.PENDING:
                if not force:
                    return False
                h.state, h.error = TransferState.ERROR, "cancelled in flight (forced release)"
        if h._nixl is not None and not self._free(h):
            return False
        h.released = True
        p = self._peers.get(h.peer)
        if p is not None:
            p.handles.discard(h)
        return True

    def _poll(self, h: NixlXferHandle) -> None:
        try:
            st = self._agent.check_xfer_state(h._nixl)
        except self._errors as e:
            st = "ERR"
            h.error = f"{type(e).__name__}: {e}"
        self._set(h, st)

    def _set(self, h: NixlXferHandle, st: str) -> None:
        if st == "DONE":
            h.state = TransferState.DONE
        elif st == "PROC":
            h.state = TransferState.PENDING
        else:
            h.state = TransferState.ERROR
            h.error = h.error or f"NIXL reported {st}"

    def _free(self, h: NixlXferHandle) -> bool:
        """Release the NIXL handle (cancelling it if it is still in flight)."""
        if h._nixl is None:
            return True
        try:
            self._agent.release_xfer_handle(h._nixl)
        except self._errors as e:
            log.warning("NIXL %s: releasing a read from %r: %s", self.name, h.peer, e)
            return False
        h._nixl = None
        return True

    def _own(self, handle: XferHandle, released_ok: bool = False) -> NixlXferHandle:
        if not isinstance(handle, NixlXferHandle):
            raise TypeError(f"not a NIXL transfer handle: {handle!r}")
        if handle.released and not released_ok:
            raise KeyError("released transfer handle")
        return handle

    # -- notifications -----------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> bool:
        """Send ``msg`` to ``peer``. Unknown peer: ``ConnectionError``. False if
        NIXL could not send it (peer gone); like a lost message, not an error."""
        self._check_open()
        if peer not in self._peers:
            raise ConnectionError(f"NIXL agent {self.name!r} has no peer {peer!r} (handshake first)")
        try:
            self._agent.send_notif(peer, msg)
        except self._errors as e:
            log.info("NIXL %s: notification to %r not sent: %s", self.name, peer, e)
            return False
        return True

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._check_open()
        got = self._agent.get_new_notifs()
        if not got:
            return []
        return [(peer if isinstance(peer, str) else peer.decode(), bytes(m))
                for peer, msgs in got.items() for m in msgs]

    # -- lifetime ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL transport {self.name!r} is closed")

    def close(self) -> None:
        """Drop every peer (cancelling reads in flight), release the local
        descriptor list, deregister the KV caches. Idempotent."""
        if self._closed:
            return
        self._closed = True
        agent = getattr(self, "_agent", None)
        if agent is None:
            return
        for p in list(self._peers.values()):
            self._drop_peer(p)
        for view in self._views.values():
            view.release()
        self._views.clear()
        for cut in self._local_cuts.values():
            cut.release()
        self._local_cuts.clear()
        if self._local is not None:
            self._local.release()
            self._local = None
        if self._reg is not None:
            try:
                agent.deregister_memory(self._reg)
            except self._errors as e:
                log.warning("NIXL %s: deregistering the KV caches: %s", self.name, e)
            self._reg = None
        self._agent = None

    def __enter__(self) -> NixlTransport:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
