"""NixlTransport moving real bytes between two real processes with NIXL (UCX, DRAM).

This process plays the decode side; tests/nixl_peer.py, started with
subprocess, plays the prefill side (its KV caches filled with a seeded
pattern) and answers commands over a socket pair.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import numpy as np
import pytest

from conftest import require

require("nixl._api")
torch = require("torch")

from nixl_peer import make_caches, pattern

from kvsm.transport.base import TransferState
from kvsm.transport.layout import describe_kv_caches
from kvsm.transport.nixl import NixlTransport

PEER_SCRIPT = Path(__file__).with_name("nixl_peer.py")
REPO = PEER_SCRIPT.parent.parent
GEOM = {"num_blocks": 64, "layers": 2, "kv_heads": 2, "block_size": 16, "head_size": 32}
SHAPE = (GEOM["num_blocks"], GEOM["kv_heads"], GEOM["block_size"], 2 * GEOM["head_size"])
LAYERS = GEOM["layers"]
P_SEED, D_SEED = 11, 22


class Peer:
    """The prefill process: a NixlTransport over pattern-filled caches, driven by commands."""

    def __init__(self, name: str, seed: int, log_path: Path) -> None:
        self.name, self.seed = name, seed
        ours, theirs = socket.socketpair()
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        args = [str(theirs.fileno()), name, str(seed)] + [
            str(GEOM[k]) for k in ("num_blocks", "layers", "kv_heads", "block_size", "head_size")]
        try:
            self.proc = subprocess.Popen([sys.executable, str(PEER_SCRIPT), *args],
                                         pass_fds=(theirs.fileno(),), stdout=self._log,
                                         stderr=subprocess.STDOUT, env=env, cwd=REPO)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        hello = self._recv(30.0, "start-up")
        self.metadata: bytes = hello["metadata"]
        self.pid: int = hello["pid"]

    def _recv(self, timeout: float, what: str, pump=None) -> dict:
        """The next reply. ``pump`` runs while waiting: without a progress thread
        our own agent only moves (e.g. sends a notification) when called."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.001 if pump else timeout):
            if pump is None or time.monotonic() > deadline:
                raise AssertionError(f"peer {self.name!r}: no reply to {what} within {timeout} s; "
                                     f"exit code {self.proc.poll()}; log:\n{self.log()}")
            pump()
        return msgspec.msgpack.decode(self.conn.recv_bytes())

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def call(self, op: str, timeout: float = 10.0, pump=None, **kw) -> dict:
        self.conn.send_bytes(msgspec.msgpack.encode({"op": op, **kw}))
        reply = self._recv(timeout + 5.0, op, pump)
        assert reply.get("ok"), reply
        return reply

    def wait_notifs(self, n: int, timeout: float = 5.0, pump=None) -> list[tuple[str, bytes]]:
        reply = self.call("wait_notifs", timeout=timeout, pump=pump, n=n, within=timeout)
        return [tuple(x) for x in reply["notifs"]]

    def stop(self) -> None:
        """Ask it to exit; kill it if it does not within 5 s. Never leaves it running."""
        try:
            if self.proc.poll() is None:
                try:
                    self.conn.send_bytes(msgspec.msgpack.encode({"op": "exit"}))
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.conn.close()
            self._log.close()


@pytest.fixture
def peers(tmp_path):
    started: list[Peer] = []

    def start(name: str = "prefill", seed: int = P_SEED) -> Peer:
        p = Peer(name, seed, tmp_path / f"{name}-{len(started)}.log")
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
    assert all(p.proc.poll() is not None for p in started), "a peer process outlived its test"


@pytest.fixture
def decode():
    """This process's transport over pattern-filled caches (seed D_SEED)."""
    made: list[NixlTransport] = []

    def make(name: str = "decode", seed: int = D_SEED, num_threads: int = 0):
        caches = make_caches(seed, **GEOM)
        t = NixlTransport(name, describe_kv_caches(caches, num_blocks=GEOM["num_blocks"]), num_threads=num_threads)
        made.append(t)
        return t, caches

    yield make
    for t in made:
        t.close()


def wait(t: NixlTransport, h, timeout: float = 10.0) -> TransferState:
    deadline = time.monotonic() + timeout
    while (s := t.check(h)) is TransferState.PENDING:
        if time.monotonic() > deadline:
            raise AssertionError(f"read still in flight after {timeout} s: {h!r}")
        time.sleep(0.0005)
    return s


def mismatches(caches, local_blocks, remote_blocks, remote_seed: int, local_seed: int = D_SEED):
    """(layer, local block) pairs whose bytes are not what the read should have left:
    the remote pattern's block for each read block, our own pattern everywhere else."""
    remote = pattern(remote_seed, LAYERS, SHAPE)
    local = pattern(local_seed, LAYERS, SHAPE)
    src = dict(zip(local_blocks, remote_blocks))
    bad = []
    for li, t in enumerate(caches.values()):
        got = t.view(torch.int32).numpy().view(np.uint32)
        for b in range(SHAPE[0]):
            want = remote[li][src[b]] if b in src else local[li][b]
            if not np.array_equal(got[b], want):
                bad.append((li, b))
    return bad


REMOTE = [5, 63, 0, 17, 42, 8, 9, 10]
LOCAL = [0, 1, 2, 30, 31, 32, 50, 7]


def test_read_moves_exactly_the_requested_blocks(peers, decode):
    p = peers()
    t, caches = decode()
    assert mismatches(caches, [], [], P_SEED) == []  # nothing read yet
    assert t.add_peer(p.metadata) == "prefill"
    h = t.post_read("prefill", LOCAL, REMOTE, b"req-1", tag="req-1")
    if t.check(h) is TransferState.PENDING:
        # The first read on a fresh connection is usually still in flight here.
        assert t.release(h) is False and not h.released
    assert wait(t, h) is TransferState.DONE
    assert mismatches(caches, LOCAL, REMOTE, P_SEED) == []
    assert p.wait_notifs(1) == [("decode", b"req-1")]
    assert t.release(h) is True and t.release(h) is True
    with pytest.raises(KeyError):
        t.check(h)


def test_reads_with_ucx_backend_threads(peers, decode):
    """``num_threads`` (upstream's key): the agent's UCX backend threads carry the
    read; its bytes and its notification are the same as without them."""
    p = peers()
    t, caches = decode(num_threads=4)
    assert t.add_peer(p.metadata) == "prefill"
    for i in range(3):
        h = t.post_read("prefill", LOCAL, REMOTE, f"req-mt-{i}".encode(), tag=f"req-mt-{i}")
        assert wait(t, h) is TransferState.DONE
        assert t.release(h) is True
    assert mismatches(caches, LOCAL, REMOTE, P_SEED) == []
    assert p.wait_notifs(3) == [("decode", f"req-mt-{i}".encode()) for i in range(3)]


def test_byte_check_detects_a_block_changed_before_the_read(peers, decode):
    p = peers()
    t, caches = decode()
    t.add_peer(p.metadata)
    p.call("overwrite", block=17, byte=0xAB)  # after filling, before the read
    h = t.post_read("prefill", LOCAL, REMOTE, b"req-2")
    assert wait(t, h) is TransferState.DONE
    t.release(h)
    local_of_17 = LOCAL[REMOTE.index(17)]
    assert mismatches(caches, LOCAL, REMOTE, P_SEED) == [(li, local_of_17) for li in range(LAYERS)]
    for cache in caches.values():  # and what arrived is the overwritten block
        assert bool((cache[local_of_17].view(torch.uint8) == 0xAB).all())
    # Reading the wrong remote blocks is caught too.
    h = t.post_read("prefill", [3, 4], [20, 21], b"")
    assert wait(t, h) is TransferState.DONE
    assert (0, 3) in mismatches(caches, LOCAL + [3, 4], REMOTE + [21, 20], P_SEED)


def test_notifications_both_ways(peers, decode):
    p = peers()
    t, _ = decode()
    t.add_peer(p.metadata)
    inbox: list[tuple[str, bytes]] = []

    def pump():  # what the event loop does on its timer
        inbox.extend(t.get_notifs())

    assert t.send_notif("prefill", b"nothing-to-read") is True
    # Our agent must keep progressing for the message to leave (first contact).
    assert p.wait_notifs(1, pump=pump) == [("decode", b"nothing-to-read")]
    assert p.call("add_peer", metadata=t.metadata(), pump=pump)["peer"] == "decode"
    assert p.call("send_notif", peer="decode", msg=b"heartbeat", pump=pump)["sent"] is True
    deadline = time.monotonic() + 5
    while not inbox and time.monotonic() < deadline:
        pump()
        time.sleep(0.001)
    assert inbox == [("prefill", b"heartbeat")]
    # An empty read reads nothing but still notifies.
    h = t.post_read("prefill", [], [], b"empty")
    assert t.check(h) is TransferState.DONE
    assert p.wait_notifs(1, pump=pump) == [("decode", b"empty")]
    assert inbox == [("prefill", b"heartbeat")]


def test_restarted_peer_is_replaced(peers, decode):
    t, caches = decode()
    p1 = peers("prefill", seed=P_SEED)
    assert t.add_peer(p1.metadata) == "prefill"
    assert t.add_peer(p1.metadata) == "prefill"  # idempotent
    h = t.post_read("prefill", [1], [2], b"one")
    assert wait(t, h) is TransferState.DONE
    t.release(h)
    p1.stop()  # the prefill engine dies...
    h = t.post_read("prefill", [3], [4], b"dead")
    assert wait(t, h, timeout=5) is TransferState.ERROR, "a read from a dead peer must fail"
    assert h.error
    assert t.release(h) is True
    assert t.send_notif("prefill", b"to-the-dead") is False
    p2 = peers("prefill", seed=P_SEED + 1)  # ...and comes back under the same name
    assert p2.metadata != p1.metadata
    assert t.add_peer(p2.metadata) == "prefill"
    assert t.peers == ["prefill"]
    h = t.post_read("prefill", [5, 6], [7, 8], b"two")
    assert wait(t, h) is TransferState.DONE
    t.release(h)
    got = pattern(P_SEED + 1, LAYERS, SHAPE)
    for li, cache in enumerate(caches.values()):
        arr = cache.view(torch.int32).numpy().view(np.uint32)
        assert np.array_equal(arr[1], pattern(P_SEED, LAYERS, SHAPE)[li][2])  # from p1
        assert np.array_equal(arr[5], got[li][7]) and np.array_equal(arr[6], got[li][8])
    assert p2.wait_notifs(1) == [("decode", b"two")]
    t.remove_peer("prefill")
    with pytest.raises(ConnectionError, match="prefill"):
        t.post_read("prefill", [0], [0], b"")
    assert t.add_peer(p2.metadata) == "prefill"  # removed, then added again
    h = t.post_read("prefill", [9], [9], b"")
    assert wait(t, h) is TransferState.DONE


def test_release_refuses_while_in_flight(peers, decode, monkeypatch):
    p = peers()
    t, _ = decode()
    t.add_peer(p.metadata)
    agent = t._agent
    real_transfer = agent.transfer
    released = []
    real_release = agent.release_xfer_handle
    # Make NIXL report the read as still in flight, whatever UCX did.
    monkeypatch.setattr(agent, "transfer", lambda h, *a: (real_transfer(h, *a), "PROC")[1])
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC")
    monkeypatch.setattr(agent, "release_xfer_handle", lambda h: (released.append(h), real_release(h)))
    h = t.post_read("prefill", [1, 2], [3, 4], b"slow")
    assert t.check(h) is TransferState.PENDING
    assert t.release(h) is False
    assert released == [] and not h.released  # NIXL was not asked to cancel
    monkeypatch.undo()
    assert wait(t, h) is TransferState.DONE
    assert t.release(h) is True
    assert p.wait_notifs(1) == [("decode", b"slow")]
    # A forced release cancels: the handle ends in ERROR.
    monkeypatch.setattr(agent, "transfer", lambda h, *a: (real_transfer(h, *a), "PROC")[1])
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC")
    h = t.post_read("prefill", [5], [6], b"")
    assert t.release(h, force=True) is True
    assert h.state is TransferState.ERROR and "cancelled" in h.error
    monkeypatch.undo()
    # remove_peer settles reads still in flight the same way.
    monkeypatch.setattr(agent, "transfer", lambda h, *a: (real_transfer(h, *a), "PROC")[1])
    monkeypatch.setattr(agent, "check_xfer_state", lambda h: "PROC")
    h = t.post_read("prefill", [5], [6], b"")
    t.remove_peer("prefill")
    monkeypatch.undo()
    assert t.check(h) is TransferState.ERROR and "removed" in h.error
    assert t.release(h) is True


def test_argument_errors(decode):
    t, _ = decode()
    with pytest.raises(ConnectionError, match="'nobody'"):
        t.post_read("nobody", [0], [0], b"")
    with pytest.raises(ConnectionError, match="'nobody'"):
        t.send_notif("nobody", b"x")
    other, _ = decode("other")
    t.add_peer(other.metadata())
    with pytest.raises(ValueError, match="2 local blocks for 1 remote"):
        t.post_read("other", [0, 1], [0], b"")
    with pytest.raises(ValueError, match="block id 64 out of range"):
        t.post_read("other", [0], [64], b"")
    with pytest.raises(ValueError, match="malformed"):
        t.add_peer(b"\x01garbage")
    with pytest.raises(ValueError, match="own agent name"):
        t.add_peer(t.metadata())
    t.remove_peer("other")
    t.remove_peer("other")  # unknown: no-op
    assert t.peers == []


def test_incompatible_layouts_are_named(decode):
    """A layout whose blocks differ is refused, naming the first difference. A peer
    holding some of our layers (a pipeline parallel stage) is loaded, and a read
    from it fills those layers only; one sharing none of them, only notifies."""
    t, _ = decode()
    geom = dict(GEOM, head_size=64)  # twice the block bytes
    wide = NixlTransport("wide", describe_kv_caches(make_caches(1, **geom), num_blocks=64))
    one = NixlTransport("one-layer", describe_kv_caches(make_caches(1, **dict(GEOM, layers=1)),
                                                        num_blocks=64))
    other = NixlTransport("other-layers", describe_kv_caches(
        {f"model.other.{i}": c for i, c in enumerate(make_caches(1, **GEOM).values())}, num_blocks=64))
    try:
        with pytest.raises(ValueError, match=r"'wide'.*block_bytes of region 0.*local 8192, remote 16384"):
            t.add_peer(wide.metadata())
        assert t.peers == []
        assert t.add_peer(one.metadata()) == "one-layer"
        assert t.layers_read("one-layer") == ("model.layers.0.self_attn.attn",)
        assert t.read_layout("one-layer") is not None and len(t.read_layout("one-layer").regions) == 1
        assert t.add_peer(other.metadata()) == "other-layers"
        assert t.layers_read("other-layers") == () and t.read_layout("other-layers") is None
        h = t.post_read("other-layers", [1, 2], [3, 4], b"nothing-shared")
        assert t.check(h) is TransferState.DONE and t.release(h)
        deadline = time.monotonic() + 5
        got: list = []
        while not got and time.monotonic() < deadline:
            t.get_notifs()
            got = other.get_notifs()
        assert got == [(t.name, b"nothing-shared")]
    finally:
        wide.close()
        one.close()
        other.close()
    t.close()
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.get_notifs()
