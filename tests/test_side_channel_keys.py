"""The side channel with the deployment's CURVE keys (issue 31), on real sockets
in one process: a keyed server answers a keyed client; a client without keys,
with a stranger's keys, a raw ZMQ peer and raw TCP get nothing (and are
counted); the key directory is checked with errors that name the file; keys
rotate under a live client without failing a request, and a rotated-out key is
refused afterwards. The servers' own tests (test_side_channel_auth) do the same
against real vLLM engines."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvsm.handshake import (
    CompatInfo,
    HandshakeClient,
    HandshakeError,
    HandshakeResult,
    HandshakeServer,
    MetadataReply,
)
from kvsm.handshake.keys import KeyPair, SideChannelKeys, SideChannelKeysError, directory_digest, load_keys

COMPAT = CompatInfo(model="tiny-llama", dtype="float32", num_layers=2, num_kv_heads=2,
                    head_size=64, block_size=16, kv_layout="NHD")
METADATA = b"\x00agent-metadata" + os.urandom(64)


def make_keys(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        zmq.auth.create_certificates(str(directory), name)
    return directory


class Pair:
    """A keyed (or open) server and a client driven by one thread, as a loop would."""

    def __init__(self, server_keys: SideChannelKeys | None, client_keys: SideChannelKeys | None) -> None:
        self.ctx = zmq.Context()
        self.claims: list[str] = []
        self.server = HandshakeServer("prefill-1", COMPAT, self._provide, self._on_claims, context=self.ctx,
                                      keys=server_keys)
        self.client = HandshakeClient(COMPAT, "decode-1/tp0", context=self.ctx, keys=client_keys)
        self.address = self.server.address

    def _provide(self, tp: int, pp: int) -> tuple[str, bytes, bytes, int] | None:
        return ("prefill-agent", METADATA, b"layout", 1) if (tp, pp) == (0, 0) else None

    def _on_claims(self, kind: str, requester: str, claims: list[str], readers: int) -> dict[str, str]:
        self.claims += claims
        return {c: "ok" for c in claims}

    def pump(self, until: Callable[[], bool], timeout_s: float = 5.0) -> list[HandshakeResult]:
        results: list[HandshakeResult] = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            poller = zmq.Poller()
            for sock in (*self.server.sockets(), *self.client.sockets()):
                poller.register(sock, zmq.POLLIN)
            for sock, _ in poller.poll(5):
                if sock in self.server.sockets():
                    self.server.on_readable(sock)
                elif sock in self.client.sockets():
                    results += self.client.on_readable(sock)
            results += self.client.expire(time.monotonic_ns())
            results += self.client.poll_results()
            self._results = results
            if until():
                break
        return results

    def fetch(self, claim: str, timeout_s: float = 5.0) -> MetadataReply | HandshakeError:
        rid = self.client.fetch_metadata(self.address, 0, claims=[claim],
                                         deadline_ns=time.monotonic_ns() + int(timeout_s * 1e9))
        got: dict[int, HandshakeResult] = {}

        def done() -> bool:
            got.update({r.request_id: r for r in self._results})
            return rid in got
        self._results = []
        self.pump(done, timeout_s + 1)
        outcome = got[rid].outcome
        assert isinstance(outcome, (MetadataReply, HandshakeError)), outcome
        return outcome

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.ctx.term()


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


def test_a_keyed_server_answers_only_peers_holding_the_deployments_key(tmp_path: Path,
                                                                       pairs: list[Pair]) -> None:
    keys = load_keys(str(make_keys(tmp_path / "deployment", "current")))
    stranger = load_keys(str(make_keys(tmp_path / "stranger", "current")))
    pair = Pair(keys, keys)
    pairs.append(pair)
    reply = pair.fetch("req-1")
    assert isinstance(reply, MetadataReply) and reply.agent_metadata == METADATA
    assert reply.claims == {"req-1": "ok"}

    # kvsm's own client without keys: a fast, named failure, never an answer.
    pair.client.set_keys(None)
    refused = pair.fetch("req-2")
    assert isinstance(refused, HandshakeError) and refused.code == "handshake_failed", refused
    # ... with another deployment's keys: it cannot even prove the server is ours.
    pair.client.set_keys(stranger)
    refused = pair.fetch("req-3")
    assert isinstance(refused, HandshakeError) and refused.code == "unauthenticated", refused
    assert "serves with none of this engine's" in refused.detail
    # ... and knowing the server's public key (it is public) with a key of its own:
    # the ZAP handler refuses that key.
    knows_public = SideChannelKeys(stranger.directory, (stranger.own, KeyPair("theirs", keys.own.public,
                                                                              stranger.own.secret)), "")
    pair.client.set_keys(knows_public)
    refused = pair.fetch("req-4")
    assert isinstance(refused, HandshakeError) and refused.code == "unauthenticated", refused
    assert "does not trust this engine's key" in refused.detail and stranger.own.key_id in refused.detail
    assert pair.claims == ["req-1"]  # nothing else reached the handler

    # A raw ZMQ DEALER (no CURVE) and raw TCP get nothing but libzmq's greeting.
    raw = pair.ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pair.address)
    raw.send(b"\x81\xa4type\xacmetadata_req")
    port = int(pair.address.rsplit(":", 1)[1])
    tcp = socket.create_connection(("127.0.0.1", port), timeout=2)
    tcp.sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 48)
    received = b""
    tcp.settimeout(0.1)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pair.pump(lambda: False, 0.05)
        try:
            chunk = tcp.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:  # the server closed on us: that is nothing, too
            break
        if not chunk:
            break
        received += chunk
    tcp.close()
    assert raw.poll(0) == 0
    raw.close()
    assert len(received) <= 64 and b"compat" not in received and METADATA not in received, received
    stats = pair.server.stats()
    assert stats["served"] == {"MetadataRequest": 1}
    assert stats["auth"]["refused"] >= 1 and stats["auth"]["accepted"] >= 1
    assert stats["connections"].get("zmtp_failed", 0) >= 2  # the keyless client, the raw peers


def test_rotation_under_a_live_client_fails_nothing_and_then_refuses_the_old_key(tmp_path: Path,
                                                                                  pairs: list[Pair]) -> None:
    d = make_keys(tmp_path / "keys", "current")
    old_only = load_keys(str(d))
    pair = Pair(old_only, old_only)
    pairs.append(pair)
    assert isinstance(pair.fetch("r0"), MetadataReply)
    # 1. the next key beside the current one, on the server first, then the client
    make_keys(d, "next")
    step1 = load_keys(str(d))
    assert step1.own.public == old_only.own.public and len(step1.pairs) == 2
    assert pair.server.set_keys(step1) is False  # nothing removed, same key in use: no rebind
    pair.client.set_keys(step1)
    assert isinstance(pair.fetch("r1"), MetadataReply)
    # 2. the next key becomes current: the client switches first (it still finds the
    # server's old key), then the server (it rebinds; the client follows)
    os.rename(d / "current.key_secret", d / "previous.key_secret")
    os.rename(d / "next.key_secret", d / "current.key_secret")
    step2 = load_keys(str(d))
    assert step2.own.public != old_only.own.public
    pair.client.set_keys(step2)
    assert isinstance(pair.fetch("r2"), MetadataReply)
    rid = pair.client.fetch_metadata(pair.address, 0, claims=["r3"], deadline_ns=time.monotonic_ns() + 5 * 10**9)
    assert pair.server.set_keys(step2) is True  # rebound while r3 may be on its way
    pair._results = []
    results = pair.pump(lambda: any(r.request_id == rid for r in pair._results))
    assert isinstance(next(r for r in results if r.request_id == rid).outcome, MetadataReply)
    assert isinstance(pair.fetch("r4"), MetadataReply)
    # 3. the old key goes: a peer that holds only it is refused
    os.remove(d / "previous.key_secret")
    step3 = load_keys(str(d))
    assert pair.server.set_keys(step3) is True
    pair.client.set_keys(step3)
    assert isinstance(pair.fetch("r5"), MetadataReply)
    pair.client.set_keys(old_only)
    refused = pair.fetch("r6")
    assert isinstance(refused, HandshakeError) and refused.code == "unauthenticated", refused
    assert set(pair.claims) == {f"r{i}" for i in range(6)}  # (r3 may have been sent twice)
    print(pair.client.stats())
    assert pair.client.stats()["server_key_switches"] >= 2  # it found the server's key each time


def test_the_key_directory_is_checked_and_its_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(SideChannelKeysError, match="cannot read the directory"):
        load_keys(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SideChannelKeysError, match=r"holds no \*\.key_secret file.*create_certificates"):
        load_keys(str(empty))
    two = make_keys(tmp_path / "two", "alpha", "beta")
    with pytest.raises(SideChannelKeysError, match="none named current.key_secret"):
        load_keys(str(two))
    os.rename(two / "beta.key_secret", two / "current.key_secret")
    keys = load_keys(str(two))
    assert [p.name for p in keys.pairs] == ["current", "alpha"]
    assert keys.own.secret not in repr(keys).encode() and keys.own.key_id in keys.describe()
    broken = tmp_path / "broken"
    shutil.copytree(two, broken)
    (broken / "alpha.key_secret").write_text("not a certificate")
    with pytest.raises(SideChannelKeysError, match="alpha.key_secret"):
        load_keys(str(broken))
    public_only = tmp_path / "public-only"
    make_keys(public_only, "current")
    (public_only / "current.key_secret").write_text((public_only / "current.key").read_text())
    with pytest.raises(SideChannelKeysError, match="holds no secret key"):
        load_keys(str(public_only))
    before = directory_digest(str(two))
    make_keys(two, "next")
    assert directory_digest(str(two)) != before
