"""kvsm.handshake over real ZMQ sockets on 127.0.0.1 (OS-chosen ports, or ports
from kvsm_testing.ports where a test needs one that it binds, closes or re-binds).

The server runs in a thread driven by a small zmq.Poller loop, as kvsm's loop
thread will drive it; the client is driven from the test thread the same way.
What upstream got wrong and these tests pin down: a malformed message must not
kill the side channel (vLLM #54757), and a dead peer must not delay the others.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from kvsm.handshake import (
    MAX_CLAIMS,
    MAX_FRAME_BYTES,
    MAX_ID_LENGTH,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    ClaimsReply,
    CompatInfo,
    ErrorReply,
    HandshakeClient,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeProtocolError,
    HandshakeRefused,
    HandshakeRejected,
    HandshakeResult,
    HandshakeServer,
    HandshakeTimeout,
    Heartbeat,
    MetadataReply,
    MetadataRequest,
    compat_hash,
    compat_mismatch,
    decode_reply,
    decode_request,
    encode,
    peer_address,
)
from kvsm_testing.ports import free_port

COMPAT = CompatInfo(model="tiny-llama", dtype="float32", num_layers=2, num_kv_heads=2,
                    head_size=64, block_size=16, kv_layout="NHD")
HASH = compat_hash(COMPAT)
MS = 1_000_000


def mp(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def now_ns() -> int:
    return time.monotonic_ns()


# --------------------------------------------------------------------------- harness

class FakePrefill:
    """What the connector would plug in: ranks (0,0) and (1,0), a few leases."""

    def __init__(self) -> None:
        self.version = 1
        self.metadata = b"\x00agent\xff" + os.urandom(8192)  # binary, NULs included
        self.leases = {"req-a": "ok", "req-b": "expired"}
        self.calls: list[tuple[str, str, list[str]]] = []

    def provide(self, tp_rank: int, pp_rank: int) -> tuple[str, bytes, bytes, int] | None:
        if (tp_rank, pp_rank) not in {(0, 0), (1, 0)}:
            return None
        return f"prefill-agent-tp{tp_rank}", self.metadata, b"layout:" + bytes([tp_rank]), self.version

    def on_claims(self, kind: str, requester: str, claims: list[str], readers: int = 1) -> dict[str, str]:
        self.calls.append((kind, requester, list(claims)))
        return {c: self.leases.get(c, "unknown") for c in claims}


class ServerThread:
    """Drives a HandshakeServer the way kvsm's loop thread does: poll, on_readable."""

    def __init__(self, server: HandshakeServer) -> None:
        self.server = server
        self.crash: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="handshake-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.server.sockets():
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(5):
                    self.server.on_readable()
        except BaseException as e:  # recorded: the tests assert it never happens
            self.crash = e
            raise

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.server.close()


@contextmanager
def serving(provide: Callable | None = None, on_claims: Callable | None = None,
            engine_id: str = "prefill-engine-1", port: int = 0,
            ) -> Iterator[tuple[HandshakeServer, ServerThread, FakePrefill]]:
    fake = FakePrefill()
    server = HandshakeServer(engine_id, COMPAT, provide or fake.provide, on_claims or fake.on_claims,
                             port=port)
    thread = ServerThread(server)
    try:
        yield server, thread, fake
    finally:
        thread.stop()
    assert thread.crash is None, f"server loop died: {thread.crash!r}"


def wait_for(predicate: Callable[[], bool], timeout_s: float = 2.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.005)


class PollerLoop:
    """What kvsm's loop does with a client's sockets: one long-lived zmq.Poller that
    learns them only through on_socket_added / on_socket_removed. Checks that each
    socket is added once, removed once and only while still open (a closed socket
    left in a zmq.Poller makes poll() fail)."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.live: set[zmq.Socket] = set()
        self.added: list[zmq.Socket] = []
        self.removed: list[zmq.Socket] = []

    def on_added(self, sock: zmq.Socket) -> None:
        assert not sock.closed and sock not in self.live and sock not in self.added
        self.added.append(sock)
        self.live.add(sock)
        self.poller.register(sock, zmq.POLLIN)

    def on_removed(self, sock: zmq.Socket) -> None:
        assert not sock.closed, "on_socket_removed called after the socket was closed"
        assert sock in self.live, "removed a socket never added (or twice)"
        self.removed.append(sock)
        self.live.remove(sock)
        self.poller.unregister(sock)

    def client(self) -> HandshakeClient:
        return HandshakeClient(COMPAT, "decode-engine-7/tp0", on_socket_added=self.on_added,
                               on_socket_removed=self.on_removed)


def pump(client: HandshakeClient, until: Callable[[dict], bool], timeout_s: float,
         loop: PollerLoop | None = None) -> dict[int, tuple[HandshakeResult, int]]:
    """Run the client's side of the loop (poll its sockets, on_readable, expire)
    until ``until(results)`` or timeout_s; returns {request_id: (result, monotonic
    ns when it arrived)}. A result delivered twice fails the test. With ``loop``,
    polls the sockets the client registered with it, else ``client.sockets()``."""
    results: dict[int, tuple[HandshakeResult, int]] = {}
    end = time.monotonic() + timeout_s
    while not until(results) and time.monotonic() < end:
        next_deadline = client.next_deadline_ns()
        wait_ms = 5 if next_deadline is None else max(0, min(5, math.ceil((next_deadline - now_ns()) / MS)))
        got = client.poll_results()
        if loop is not None:
            for sock, _ in loop.poller.poll(wait_ms):
                if sock in loop.live:  # else removed by an earlier on_readable this round
                    got += client.on_readable(sock)
        elif sockets := client.sockets():
            poller = zmq.Poller()
            for sock in sockets:
                poller.register(sock, zmq.POLLIN)
            for sock, _ in poller.poll(wait_ms):
                got += client.on_readable(sock)
        else:
            time.sleep(wait_ms / 1000)
        got += client.expire(now_ns())
        arrived = now_ns()
        for result in got:
            assert result.request_id not in results, f"result delivered twice: {result}"
            results[result.request_id] = (result, arrived)
    return results


def drive(client: HandshakeClient, want: set[int], timeout_s: float = 3.0, loop: PollerLoop | None = None
          ) -> dict[int, tuple[HandshakeResult, int]]:
    """Pump until every request in ``want`` has a result."""
    results = pump(client, lambda r: want <= r.keys(), timeout_s, loop)
    assert want <= results.keys(), f"no result for {sorted(want - results.keys())}"
    return results


def one(client: HandshakeClient, request_id: int, timeout_s: float = 3.0,
        loop: PollerLoop | None = None) -> HandshakeResult:
    return drive(client, {request_id}, timeout_s, loop)[request_id][0]


def dealers(client: HandshakeClient) -> list[zmq.Socket]:
    """The client's DEALER sockets (sockets() also lists each one's monitor)."""
    return [s for s in client.sockets() if s.type == zmq.DEALER]


@pytest.fixture
def client() -> Iterator[HandshakeClient]:
    c = HandshakeClient(COMPAT, "decode-engine-7/tp0")
    yield c
    c.close()


def raw_socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def recv_reply(sock: zmq.Socket, timeout_ms: int = 2000) -> Any:
    assert sock.poll(timeout_ms), "no reply"
    return decode_reply(sock.recv_multipart()[-1])


# --------------------------------------------------------------------------- messages

def test_compat_hash_is_stable_and_covers_every_field() -> None:
    assert compat_hash(COMPAT) == compat_hash(msgspec.structs.replace(COMPAT))
    changed = {"model": "other", "dtype": "bfloat16", "num_layers": 3, "num_kv_heads": 4,
               "head_size": 128, "block_size": 128, "kv_layout": "HND", "protocol_version": PROTOCOL_VERSION + 1,
               "kv_groups": "sliding_window(128)/128x2 full/128x2", "token_layout": "cpu:64x4,1x256/1"}
    assert set(changed) == set(CompatInfo.__struct_fields__)
    hashes = {compat_hash(msgspec.structs.replace(COMPAT, **{k: v})) for k, v in changed.items()}
    assert len(hashes) == len(changed) and HASH not in hashes


def test_compat_mismatch_names_each_differing_field_with_both_values() -> None:
    theirs = msgspec.structs.replace(COMPAT, block_size=128, dtype="bfloat16")
    assert compat_mismatch(COMPAT, theirs) == [
        "dtype: 'float32' here, 'bfloat16' on the peer",
        "block_size: 16 here, 128 on the peer",
    ]
    assert compat_mismatch(COMPAT, COMPAT) == []


def test_largest_valid_request_fits_the_size_limits() -> None:
    biggest = Heartbeat(protocol=PROTOCOL_VERSION, nonce=2**63 - 1, requester="r" * MAX_ID_LENGTH,
                        claims=["c" * MAX_ID_LENGTH] * MAX_CLAIMS)
    data = encode(biggest)
    assert len(data) <= MAX_REQUEST_BYTES < MAX_FRAME_BYTES
    assert decode_request(data) == biggest


@pytest.mark.parametrize("payload, code, fragment", [
    (b"", "malformed", "not valid msgpack"),
    (b"\xc1", "malformed", "not valid msgpack"),
    (mp([1, 2]), "malformed", "not a msgpack map"),
    (mp({"type": "metadata"}), "malformed", "type 'metadata'"),
    (mp({"type": "heartbeat", "protocol": PROTOCOL_VERSION + 1, "requester": "r", "claims": []}),
     "unsupported_protocol", f"protocol {PROTOCOL_VERSION + 1} is not supported"),
    (mp({"type": "heartbeat", "protocol": PROTOCOL_VERSION, "requester": "r"}), "malformed", "`claims`"),
    (mp({"type": "heartbeat", "protocol": PROTOCOL_VERSION, "requester": "r", "claims": [], "x": 1}),
     "malformed", "unknown field `x`"),
    (mp({"type": "heartbeat", "protocol": PROTOCOL_VERSION, "requester": 5, "claims": []}),
     "malformed", "Expected `str`, got `int` - at `$.requester`"),
    (mp({"type": "abandon", "protocol": PROTOCOL_VERSION, "requester": "r", "claims": ["c"] * (MAX_CLAIMS + 1)}),
     "malformed", f"length <= {MAX_CLAIMS} - at `$.claims`"),
    (mp({"type": "abandon", "protocol": PROTOCOL_VERSION, "requester": "r", "claims": ["c" * (MAX_ID_LENGTH + 1)]}),
     "malformed", "at `$.claims[0]`"),
    (b"\x91" * 100_000, "malformed", "msgpack map"),
    (b"\x00" * (MAX_REQUEST_BYTES + 1), "oversized", f"exceeds the {MAX_REQUEST_BYTES}-byte limit"),
])
def test_decode_request_names_what_was_wrong(payload: bytes, code: str, fragment: str) -> None:
    with pytest.raises(HandshakeProtocolError) as caught:
        decode_request(payload)
    assert caught.value.code == code
    assert fragment in caught.value.detail


@settings(max_examples=examples(400), deadline=None)
@given(st.binary(max_size=200))
def test_decode_request_only_ever_raises_protocol_errors(data: bytes) -> None:
    try:
        decode_request(data)
    except HandshakeProtocolError as e:
        assert e.code in {"malformed", "oversized", "unsupported_protocol"}


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
REQUEST_LIKE = st.fixed_dictionaries(
    {"type": st.sampled_from(["metadata_req", "heartbeat", "abandon", "metadata", "error", "?"]) | MSGPACK_VALUES,
     "protocol": st.sampled_from([PROTOCOL_VERSION] * 3 + [PROTOCOL_VERSION + 1, PROTOCOL_VERSION - 1, 0,
                                 str(PROTOCOL_VERSION), None, float(PROTOCOL_VERSION)])},
    optional={"nonce": st.integers(-5, 2**64 - 1), "requester": st.text(max_size=300) | MSGPACK_VALUES,
              "tp_rank": st.integers(-2, 3) | st.text(max_size=2), "pp_rank": st.integers(-1, 2),
              "compat_hash": st.sampled_from([HASH, HASH, "0" * 64, ""]),
              "claims": st.lists(st.sampled_from(["req-a", "req-b", "req-zz", ""]), max_size=4) | MSGPACK_VALUES,
              "extra": MSGPACK_VALUES})
HOSTILE_PAYLOADS = st.one_of(st.binary(max_size=300), MSGPACK_VALUES.map(mp), REQUEST_LIKE.map(mp))
# Requests within every bound (REQUEST_LIKE makes one only now and then).
IDS = st.text(min_size=1, max_size=MAX_ID_LENGTH // 4)
RANKS = st.integers(0, (1 << 16) - 1)
VALID_OPTIONAL = {"nonce": st.integers(0, 2**63 - 1), "pp_rank": RANKS,
                  "claims": st.lists(IDS, max_size=8), "readers": st.integers(1, 1024)}
VALID_REQUESTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("metadata_req"), "protocol": st.just(PROTOCOL_VERSION),
                           "requester": IDS, "tp_rank": RANKS, "compat_hash": st.text(min_size=1, max_size=128)},
                          optional=VALID_OPTIONAL),
    st.fixed_dictionaries({"type": st.sampled_from(["heartbeat", "abandon"]), "protocol": st.just(PROTOCOL_VERSION),
                           "requester": IDS, "claims": st.lists(IDS, max_size=8)},
                          optional={**{k: v for k, v in VALID_OPTIONAL.items() if k != "claims"}, "tp_rank": RANKS}))


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_decode_request_accepts_exactly_what_reencodes(data: st.DataObject) -> None:
    """What decodes re-encodes to itself; a request within every bound always decodes
    (so the round trip is checked on every such example, not only on the rare
    hostile one that happens to be valid)."""
    valid = data.draw(st.booleans(), label="valid")
    value = data.draw(VALID_REQUESTS if valid else REQUEST_LIKE, label="request")
    try:
        request = decode_request(mp(value))
    except HandshakeProtocolError as e:
        assert not valid, f"a valid request was refused: {e.code} {e.detail}"
        return
    assert decode_request(encode(request)) == request
    assert msgspec.to_builtins(request) == {"nonce": 0, "pp_rank": 0, "readers": 1, "claims": [], "tp_rank": 0,
                                            **value}


# --------------------------------------------------------------------------- round trip

def test_round_trip_metadata_claims_and_reregistration(client: HandshakeClient) -> None:
    with serving() as (server, _thread, fake):
        rid = client.fetch_metadata(server.address, tp_rank=1, claims=["req-a", "req-b", "req-c"],
                                    deadline_ns=now_ns() + 2000 * MS, expected_engine_id="prefill-engine-1")
        reply = one(client, rid).outcome
        assert isinstance(reply, MetadataReply), reply
        assert (reply.engine_id, reply.tp_rank, reply.pp_rank) == ("prefill-engine-1", 1, 0)
        assert reply.agent_name == "prefill-agent-tp1"
        assert reply.agent_metadata == fake.metadata  # binary, intact
        assert reply.layout == b"layout:\x01"
        assert reply.compat == COMPAT and reply.compat_hash == HASH
        assert reply.meta_version == 1
        assert reply.claims == {"req-a": "ok", "req-b": "expired", "req-c": "unknown"}
        assert reply.nonce == rid

        hb = one(client, client.heartbeat(server.address, ["req-a", "req-x"], deadline_ns=now_ns() + 2000 * MS))
        assert hb.outcome == ClaimsReply(nonce=hb.request_id, claims={"req-a": "ok", "req-x": "unknown"})
        ab = one(client, client.abandon(server.address, ["req-b"], deadline_ns=now_ns() + 2000 * MS))
        assert isinstance(ab.outcome, ClaimsReply) and ab.outcome.claims == {"req-b": "expired"}
        assert fake.calls == [
            ("claim", "decode-engine-7/tp0", ["req-a", "req-b", "req-c"]),
            ("heartbeat", "decode-engine-7/tp0", ["req-a", "req-x"]),
            ("abandon", "decode-engine-7/tp0", ["req-b"]),
        ]

        # The agent re-registers: served from the next request on, no restart.
        fake.version, fake.metadata = 2, b"re-registered agent"
        again = one(client, client.fetch_metadata(server.address, 1, deadline_ns=now_ns() + 2000 * MS)).outcome
        assert isinstance(again, MetadataReply)
        assert (again.meta_version, again.agent_metadata, again.claims) == (2, b"re-registered agent", {})
        assert len(fake.calls) == 3  # no claims, no on_claims call

        # Another engine now answers on that port: said so, not silently used.
        moved = one(client, client.fetch_metadata(server.address, 0, deadline_ns=now_ns() + 2000 * MS,
                                                  expected_engine_id="prefill-engine-0")).outcome
        assert isinstance(moved, HandshakeError) and moved.code == "engine_mismatch"
        assert "'prefill-engine-0'" in str(moved) and "'prefill-engine-1'" in str(moved)

        wait_for(lambda: server.stats().get("replied") == 5, what="5 replies counted")  # counted after send
        stats = server.stats()
        assert stats["served"] == {"MetadataRequest": 3, "Heartbeat": 1, "Abandon": 1}
        assert stats["errors"] == {} and stats["received"] == 5
    assert client.stats().get("stale_replies", 0) == 0


def test_incompatible_peer_error_names_the_differing_fields() -> None:
    mine = msgspec.structs.replace(COMPAT, block_size=128, dtype="bfloat16")
    client = HandshakeClient(mine, "decode-0")
    try:
        with serving() as (server, _thread, fake):
            result = one(client, client.fetch_metadata(server.address, 0, claims=["req-a"],
                                                       deadline_ns=now_ns() + 2000 * MS))
            error = result.outcome
            assert isinstance(error, HandshakeIncompatible), error
            assert error.differences == ["dtype: 'bfloat16' here, 'float32' on the peer",
                                         "block_size: 128 here, 16 on the peer"]
            assert "block_size: 128 here, 16 on the peer" in str(error)
            assert server.stats()["errors"] == {"incompatible": 1}
            assert fake.calls == []  # an incompatible peer's claims are not applied
    finally:
        client.close()


# --------------------------------------------------------------------------- hostile input

def expected_outcome(payload: bytes) -> str:
    """What the server must answer (error code, or "served"), by the protocol's rules."""
    try:
        request = decode_request(payload)
    except HandshakeProtocolError as e:
        return e.code
    if isinstance(request, MetadataRequest):
        if request.compat_hash != HASH:
            return "incompatible"
        if (request.tp_rank, request.pp_rank) not in {(0, 0), (1, 0)}:
            return "unknown_rank"
    return "served"


def outcome_of(reply: Any) -> str:
    return reply.code if isinstance(reply, ErrorReply) else "served"


def valid_request(nonce: int, **changes: Any) -> dict:
    request = {"type": "metadata_req", "protocol": PROTOCOL_VERSION, "nonce": nonce, "requester": "attacker",
               "tp_rank": 0, "pp_rank": 0, "compat_hash": HASH, "claims": []}
    request.update(changes)
    return {k: v for k, v in request.items() if v is not ...}


# (frames sent by a DEALER, expected answer, nonce the reply must carry)
DETERMINISTIC_CASES: list[tuple[list[bytes], str, int]] = [
    ([b""], "malformed", 0),
    ([b"\xc1 not msgpack at all"], "malformed", 0),
    ([mp(valid_request(11))[:-9]], "malformed", 0),  # truncated
    ([mp([1, 2, 3])], "malformed", 0),
    ([mp(42)], "malformed", 0),
    ([mp("metadata_req")], "malformed", 0),
    ([b"\x81\xa4type\xa2\xff\xfe"], "malformed", 0),  # invalid UTF-8
    ([mp(valid_request(12, tp_rank="0"))], "malformed", 12),
    ([mp(valid_request(13, extra=1))], "malformed", 13),
    ([mp(valid_request(14, compat_hash=...))], "malformed", 14),
    ([mp(valid_request(15, claims=["c"] * (MAX_CLAIMS + 1)))], "malformed", 15),
    ([mp(valid_request(16, claims=["c" * (MAX_ID_LENGTH + 1)]))], "malformed", 16),
    ([mp(valid_request(17, requester=""))], "malformed", 17),
    ([mp(valid_request(18, tp_rank=-1))], "malformed", 18),
    ([mp(valid_request(19, type="metadata"))], "malformed", 19),
    ([mp(valid_request(20, type="nope"))], "malformed", 20),
    ([mp(valid_request(21, type=["nope"]))], "malformed", 21),
    ([mp(valid_request(22, protocol=float(PROTOCOL_VERSION)))], "malformed", 22),
    ([mp(valid_request(2**64 - 1))], "malformed", 0),  # nonce out of range
    ([b"\x91" * 50_000 + b"\x00"], "malformed", 0),  # nested too deeply
    ([mp(valid_request(23, protocol=PROTOCOL_VERSION + 1))], "unsupported_protocol", 23),
    ([mp({"type": "heartbeat", "protocol": 0, "nonce": 24})], "unsupported_protocol", 24),
    ([mp(valid_request(25, tp_rank=7))], "unknown_rank", 25),
    ([mp(valid_request(26, compat_hash="0" * 64))], "incompatible", 26),
    ([mp(valid_request(27, requester="r" * 2_500_000))], "oversized", 0),  # < MAX_FRAME_BYTES
    ([b"a", b"b"], "malformed", 0),  # frame count
    ([b"a", b"b", b"c", b"d", b"e", b"f"], "malformed", 0),
    ([b"", b""], "malformed", 0),  # REQ-style framing, empty payload
    ([mp({"type": "heartbeat", "protocol": PROTOCOL_VERSION, "nonce": 28, "requester": "a", "claims": ["req-a"]})],
     "served", 28),
]


def test_hostile_input_never_stops_the_server(client: HandshakeClient) -> None:
    with serving() as (server, thread, _fake):
        host, port = "127.0.0.1", server.port
        expected = Counter()

        def disconnects() -> int:
            return server.stats()["connections"].get("disconnected", 0)

        # Raw TCP: an HTTP probe left half-open; ZMTP 1.0-framed bytes (libzmq still
        # accepts unversioned peers, so raw bytes *can* reach the handler).
        http_probe = socket.create_connection((host, port))
        http_probe.sendall(b"GET / HTTP/1.1\r\nHost: prefill\r\n\r\n")
        v1_framed = socket.create_connection((host, port))
        v1_framed.sendall(b"\x01\x00" + b"\x05\x00junk")
        expected["malformed"] += 1
        try:
            # A real handshake proceeds while the attack is under way.
            rid = client.fetch_metadata(server.address, 0, claims=["req-a"], deadline_ns=now_ns() + 3000 * MS)

            # Hand-written cases through a DEALER; replies come back in order.
            attacker = raw_socket(zmq.DEALER)
            attacker.connect(server.address)
            for frames, _, _ in DETERMINISTIC_CASES:
                attacker.send_multipart(frames)
            for frames, want, nonce in DETERMINISTIC_CASES:
                reply = recv_reply(attacker)
                assert (outcome_of(reply), reply.nonce) == (want, nonce), (frames[0][:60], reply)
                if want != "served":
                    assert reply.compat == COMPAT  # lets a client name the differing fields
                expected[want] += 1
            assert isinstance(one(client, rid).outcome, MetadataReply)
            expected["served"] += 1

            # Hypothesis-generated garbage: each payload answered, as the rules say.
            @settings(max_examples=examples(8), deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(st.lists(HOSTILE_PAYLOADS, min_size=20, max_size=50))
            def fuzz(payloads: list[bytes]) -> None:
                for payload in payloads:
                    attacker.send(payload)
                for payload in payloads:
                    reply = recv_reply(attacker)
                    want = expected_outcome(payload)
                    assert outcome_of(reply) == want, (payload[:80], reply)
                    expected[want] += 1
            fuzz()
            assert sum(expected.values()) > 200

            # A REQ peer: refused, then served, in REQ framing; another never reads.
            req = raw_socket(zmq.REQ)
            req.connect(server.address)
            req.send(b"\xffgarbage")
            assert recv_reply(req).code == "malformed"
            req.send(mp(valid_request(40)))
            assert isinstance(recv_reply(req), MetadataReply)
            deaf_req = raw_socket(zmq.REQ)
            deaf_req.connect(server.address)
            deaf_req.send(mp(valid_request(41)))
            expected.update({"malformed": 1, "served": 2})

            # A frame over libzmq's limit: the connection is dropped before Python
            # sees anything; a wrong socket type fails ZMTP. Both counted.
            before = disconnects()
            huge = raw_socket(zmq.DEALER)
            huge.connect(server.address)
            huge.send(b"\x00" * (MAX_FRAME_BYTES + 1))
            assert not huge.poll(200), "an over-limit frame got an answer"
            wait_for(lambda: disconnects() >= before + 1, what="oversized drop")
            huge.close()
            push = raw_socket(zmq.PUSH)
            push.connect(server.address)
            push.send(mp(valid_request(42)))
            wait_for(lambda: disconnects() >= before + 2, what="PUSH drop")
            push.close()
            noise = socket.create_connection((host, port))
            noise.sendall(bytes(range(256)) * 8)
            wait_for(lambda: disconnects() >= before + 3, what="noise drop")
            noise.close()

            # The ZMTP 1.0 peer got its refusal back over raw TCP.
            v1_framed.settimeout(2)
            received = b""
            while b"malformed" not in received:
                chunk = v1_framed.recv(4096)
                assert chunk, f"ZMTP 1.0 peer closed without a refusal: {received!r}"
                received += chunk

            # Still serving, still the same thread, and every message accounted for.
            assert thread.alive()
            after = one(client, client.fetch_metadata(server.address, 1, claims=["req-b"],
                                                      deadline_ns=now_ns() + 2000 * MS))
            assert isinstance(after.outcome, MetadataReply)
            assert after.outcome.claims == {"req-b": "expired"}
            expected["served"] += 1
            total = sum(expected.values())
            wait_for(lambda: server.stats().get("replied") == total, what="every message answered")
            stats = server.stats()
            assert stats["received"] == total
            assert "reply_dropped_full" not in stats  # a client that reads loses nothing
            assert stats["errors"] == {k: v for k, v in expected.items() if k != "served"}
            assert sum(stats["served"].values()) == expected["served"]
            assert stats["connections"]["accepted"] >= 9
            for sock in (attacker, req, deaf_req):
                sock.close()
        finally:
            http_probe.close()
            v1_framed.close()
        assert thread.alive()


def test_callback_failures_are_answered_internal_and_serving_continues(client: HandshakeClient) -> None:
    fake = FakePrefill()
    failures = iter([RuntimeError("provider exploded"), "not a tuple", None])

    def provide(tp_rank: int, pp_rank: int) -> Any:
        failure = next(failures, None)
        if isinstance(failure, Exception):
            raise failure
        return failure if failure is not None else fake.provide(tp_rank, pp_rank)

    def on_claims(kind: str, requester: str, claims: list[str], readers: int = 1) -> dict[str, str]:
        if kind == "heartbeat":
            raise KeyError("lifecycle table lost req-a")
        if kind == "abandon":
            return {}  # forgets to answer
        return fake.on_claims(kind, requester, claims)

    with serving(provide=provide, on_claims=on_claims) as (server, thread, _):
        deadline = now_ns() + 2000 * MS
        ids = [client.fetch_metadata(server.address, 0, deadline_ns=deadline),
               client.fetch_metadata(server.address, 0, deadline_ns=deadline),
               client.heartbeat(server.address, ["req-a"], deadline_ns=deadline),
               client.abandon(server.address, ["req-a"], deadline_ns=deadline),
               client.fetch_metadata(server.address, 0, claims=["req-a"], deadline_ns=deadline)]
        results = drive(client, set(ids))
        errors = [results[i][0].outcome for i in ids[:4]]
        assert all(isinstance(e, HandshakeRejected) and e.code == "internal" for e in errors), errors
        assert "RuntimeError: provider exploded" in errors[0].detail
        assert "provide() must return" in errors[1].detail and "str" in errors[1].detail
        assert "KeyError" in errors[2].detail and "lifecycle table lost req-a" in errors[2].detail
        assert "missing ['req-a']" in errors[3].detail
        served = results[ids[4]][0].outcome
        assert isinstance(served, MetadataReply) and served.claims == {"req-a": "ok"}
        assert server.stats()["errors"] == {"internal": 4}
        assert thread.alive()


def test_client_that_never_reads_cannot_wedge_the_server(client: HandshakeClient) -> None:
    fake = FakePrefill()
    fake.metadata = b"m" * (256 * 1024)  # replies big enough to fill every buffer
    server = HandshakeServer("p", COMPAT, fake.provide, fake.on_claims, sndhwm=4)
    thread = ServerThread(server)
    deaf = raw_socket(zmq.DEALER)
    deaf.setsockopt(zmq.RCVHWM, 1)
    deaf.setsockopt(zmq.RCVBUF, 4096)
    try:
        deaf.connect(server.address)
        for nonce in range(100):
            deaf.send(mp(valid_request(nonce)))
        wait_for(lambda: server.stats().get("received", 0) == 100, what="100 requests read")
        # Answered, hence before its deadline (a wedged server makes it a HandshakeTimeout).
        result = one(client, client.fetch_metadata(server.address, 0, deadline_ns=now_ns() + 2000 * MS))
        assert isinstance(result.outcome, MetadataReply), result
        # (the server counts a reply right after sending it: the client may have it first)
        wait_for(lambda: sum(server.stats().get(k, 0) for k in ("reply_dropped_full", "replied")) >= 101,
                 what="101 replies counted")
        stats = server.stats()
        assert stats["reply_dropped_full"] > 0
        assert stats["reply_dropped_full"] + stats["replied"] == 101
        assert thread.alive()
    finally:
        deaf.close()
        thread.stop()
    assert thread.crash is None


def test_server_handles_at_most_max_batch_per_call() -> None:
    fake = FakePrefill()
    server = HandshakeServer("p", COMPAT, fake.provide, fake.on_claims, max_batch=5)
    dealer = raw_socket(zmq.DEALER)
    try:
        dealer.connect(server.address)
        for nonce in range(12):
            dealer.send(mp(valid_request(nonce)))
        router = server.sockets()[0]
        # Handle them as they arrive: no call takes more than five, and the cap binds
        # (the twelve come back to back, so at least five are queued at some point).
        handled: list[int] = []
        end = time.monotonic() + 2.0
        while sum(handled) < 12:
            assert time.monotonic() < end, f"handled {handled} of 12"
            if router.poll(5):
                handled.append(server.on_readable())
        assert all(1 <= n <= 5 for n in handled) and 5 in handled, handled
        assert [recv_reply(dealer).nonce for _ in range(12)] == list(range(12))
    finally:
        dealer.close()
        server.close()
    assert server.on_readable() == 0 and server.sockets() == []


# --------------------------------------------------------------------------- dead peers

def test_dead_peer_delays_only_itself_and_late_replies_are_dropped(client: HandshakeClient) -> None:
    dead = raw_socket(zmq.ROUTER)  # accepts connections, never answers
    dead_address = f"tcp://127.0.0.1:{dead.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        with serving() as (server, _thread, _fake):
            sent = now_ns()
            dead_deadline = sent + 500 * MS
            stuck = client.fetch_metadata(dead_address, 0, deadline_ns=dead_deadline)
            healthy = client.fetch_metadata(server.address, 0, deadline_ns=sent + 3000 * MS)
            results = drive(client, {stuck, healthy})
            reply, healthy_at = results[healthy]
            assert isinstance(reply.outcome, MetadataReply)
            timeout, timed_out_at = results[stuck]
            assert isinstance(timeout.outcome, HandshakeTimeout) and timeout.peer == dead_address
            # Not held up behind the dead peer: answered before the dead one's deadline.
            assert healthy_at < dead_deadline, f"healthy peer answered after {(healthy_at - sent) / MS:.0f} ms"
            assert dead_deadline <= timed_out_at < dead_deadline + 250 * MS
            assert client.stats()["socket_resets"] == 1
            assert len(dealers(client)) == 1  # the dead peer's socket is gone
            assert len(client.sockets()) == client.socket_count() == 2  # the healthy one and its monitor

        # The "dead" peer wakes up: answers the timed-out request late, to the old
        # connection, then a new request with a stale reply first, then a duplicate.
        assert dead.poll(1000)
        old_identity, old_payload = dead.recv_multipart()
        assert decode_request(old_payload).nonce == stuck
        late = MetadataReply(nonce=stuck, engine_id="late", tp_rank=0, pp_rank=0, compat=COMPAT,
                             compat_hash=HASH, agent_name="a", agent_metadata=b"old",
                             layout=b"", meta_version=1)
        dead.send_multipart([old_identity, encode(late)])
        fresh = client.fetch_metadata(dead_address, 0, deadline_ns=now_ns() + 2000 * MS)
        assert dead.poll(1000)
        identity, payload = dead.recv_multipart()
        assert identity != old_identity and decode_request(payload).nonce == fresh
        answer = msgspec.structs.replace(late, nonce=fresh, agent_metadata=b"new")
        dead.send_multipart([identity, encode(late)])
        dead.send_multipart([identity, encode(answer)])
        dead.send_multipart([identity, encode(answer)])
        result = one(client, fresh)
        assert isinstance(result.outcome, MetadataReply) and result.outcome.agent_metadata == b"new"
        assert pump(client, lambda r: client.stats().get("stale_replies", 0) == 2, 1.0) == {}
        assert client.stats()["stale_replies"] == 2
    finally:
        dead.close()


@pytest.fixture
def looped() -> Iterator[tuple[HandshakeClient, PollerLoop]]:
    """A client whose sockets a PollerLoop learns through the callbacks; every
    socket it was given is removed again, while still open, by close()."""
    loop = PollerLoop()
    c = loop.client()
    yield c, loop
    c.close()
    assert loop.live == set() and sorted(map(id, loop.removed)) == sorted(map(id, loop.added))
    assert all(sock.closed for sock in loop.added) and c.socket_count() == 0


def at_once(at: int, since: int, deadline: int) -> bool:
    """A refusal came at once, not at the deadline it had to beat: within a fifth
    of the time the request had left (one reconnect interval is 100 ms)."""
    return at - since < (deadline - since) / 5


def is_refused(outcome: Any, address: str) -> bool:
    return (isinstance(outcome, HandshakeRefused) and outcome.code == "refused"
            and f"connection refused by {address}" in str(outcome) and outcome.peer == address)


def test_closed_port_is_refused_at_once_not_at_its_deadline(looped: tuple[HandshakeClient, PollerLoop]) -> None:
    client, loop = looped
    address = peer_address("127.0.0.1", free_port())  # nothing listens there
    sent = now_ns()
    deadline = sent + 5000 * MS
    ids = {client.fetch_metadata(address, 0, deadline_ns=deadline),
           client.heartbeat(address, ["req-a"], deadline_ns=deadline)}
    assert client.next_deadline_ns() == deadline
    results = drive(client, ids, timeout_s=1.0, loop=loop)
    for result, at in results.values():
        assert is_refused(result.outcome, address), result
        assert at_once(at, sent, deadline), f"refused after {(at - sent) / MS:.0f} ms"
    assert client.stats()["refused"] == 2 and client.stats()["refused_sockets"] == 1
    assert "timeouts" not in client.stats()
    assert client.sockets() == [] and client.pending_count() == 0 and client.next_deadline_ns() is None
    assert loop.live == set() and len(loop.added) == len(loop.removed) == 2  # DEALER and monitor

    # The next request tries again on a fresh socket: refused again, just as fast.
    again = client.abandon(address, ["req-a"], deadline_ns=now_ns() + 5000 * MS)
    assert len(client.sockets()) == client.socket_count() == 2 and loop.live == set(client.sockets())
    assert is_refused(one(client, again, timeout_s=1.0, loop=loop).outcome, address)
    assert client.stats()["refused_sockets"] == 2 and loop.live == set()


def test_tcp_listener_that_accepts_and_stays_silent_times_out(looped: tuple[HandshakeClient, PollerLoop]) -> None:
    client, loop = looped
    port = free_port()
    listener = socket.socket()
    listener.bind(("127.0.0.1", port))
    listener.listen(8)
    listener.setblocking(False)
    accepted: list[socket.socket] = []

    def accept_and_never_read(results: dict) -> bool:
        try:
            accepted.append(listener.accept()[0])
        except BlockingIOError:
            pass
        return bool(results)

    try:
        deadline = now_ns() + 400 * MS
        rid = client.fetch_metadata(peer_address("127.0.0.1", port), 0, deadline_ns=deadline)
        result, at = pump(client, accept_and_never_read, 2.0, loop)[rid]
        assert accepted, "the listener never saw the connection"
        assert isinstance(result.outcome, HandshakeTimeout), result
        assert deadline <= at < deadline + 250 * MS
        assert "refused" not in client.stats()
    finally:
        for conn in accepted:
            conn.close()
        listener.close()


def test_zmq_peer_that_never_replies_times_out(looped: tuple[HandshakeClient, PollerLoop]) -> None:
    client, loop = looped
    port = free_port()
    silent = raw_socket(zmq.ROUTER)
    silent.bind(peer_address("127.0.0.1", port))
    try:
        deadline = now_ns() + 400 * MS
        rid = client.heartbeat(peer_address("127.0.0.1", port), ["req-a"], deadline_ns=deadline)
        result, at = drive(client, {rid}, loop=loop)[rid]
        assert isinstance(result.outcome, HandshakeTimeout), result
        assert deadline <= at < deadline + 250 * MS
        assert silent.poll(0), "the request never reached the peer"
        assert "refused" not in client.stats() and client.stats()["socket_resets"] == 1
    finally:
        silent.close()


def test_peer_that_dies_with_requests_pending_is_refused_on_reconnect(
        looped: tuple[HandshakeClient, PollerLoop]) -> None:
    client, loop = looped
    address = peer_address("127.0.0.1", free_port())
    peer = raw_socket(zmq.ROUTER)
    peer.bind(address)
    try:
        deadline = now_ns() + 5000 * MS
        rid = client.fetch_metadata(address, 0, deadline_ns=deadline)
        assert peer.poll(1000)  # connected and delivered; no answer
        assert pump(client, bool, 0.2, loop) == {}  # connected and silent: nothing yet
    finally:
        peer.close()  # the process dies
    died = now_ns()
    result, at = drive(client, {rid}, timeout_s=1.0, loop=loop)[rid]
    assert is_refused(result.outcome, address), result
    assert at_once(at, died, deadline), f"refused {(at - died) / MS:.0f} ms after the peer died"
    assert client.sockets() == [] and loop.live == set()


def test_server_closed_is_refused_then_a_new_one_on_that_port_answers(
        looped: tuple[HandshakeClient, PollerLoop]) -> None:
    client, loop = looped
    port = free_port()
    with serving(port=port, engine_id="prefill-engine-1") as (server, _thread, _fake):
        address = server.address
        assert address == peer_address("127.0.0.1", port)
        first = one(client, client.fetch_metadata(address, 0, deadline_ns=now_ns() + 5000 * MS), loop=loop)
        assert isinstance(first.outcome, MetadataReply) and first.outcome.engine_id == "prefill-engine-1"
    # The server is closed, its port unbound: the next request is refused, quickly.
    sent = now_ns()
    deadline = sent + 5000 * MS
    refused, at = drive(client, {client.fetch_metadata(address, 0, deadline_ns=deadline)},
                        timeout_s=1.0, loop=loop).popitem()[1]
    assert is_refused(refused.outcome, address), refused
    assert at_once(at, sent, deadline), f"refused after {(at - sent) / MS:.0f} ms"
    # A new server on that port: the request after that goes out on a fresh socket and is answered.
    with serving(port=port, engine_id="prefill-engine-2") as (server, _thread, _fake):
        again = one(client, client.fetch_metadata(address, 0, deadline_ns=now_ns() + 5000 * MS), loop=loop)
        assert isinstance(again.outcome, MetadataReply) and again.outcome.engine_id == "prefill-engine-2"
    stats = client.stats()
    assert stats["refused"] == 1 and stats["completed"] == 2 and "timeouts" not in stats
    assert len(loop.added) == 4  # two DEALER + monitor pairs: the refused one was replaced


def test_sockets_and_callbacks_balance_through_refusals_timeouts_and_close() -> None:
    loop = PollerLoop()
    client = loop.client()
    silent = raw_socket(zmq.ROUTER)
    silent_address = peer_address("127.0.0.1", free_port())
    silent.bind(silent_address)
    closed_address = peer_address("127.0.0.1", free_port())

    def balanced() -> None:
        assert set(client.sockets()) == loop.live
        assert client.socket_count() == len(loop.live) == len(loop.added) - len(loop.removed)
        assert sum(s.type == zmq.PAIR for s in loop.live) == len(dealers(client))  # one monitor each

    try:
        with serving() as (server, _thread, _fake):
            for _ in range(3):
                ids = {client.fetch_metadata(server.address, 0, deadline_ns=now_ns() + 3000 * MS),
                       client.heartbeat(silent_address, ["req-a"], deadline_ns=now_ns() + 150 * MS),
                       client.abandon(closed_address, ["req-a"], deadline_ns=now_ns() + 3000 * MS)}
                balanced()
                assert client.socket_count() == 6
                results = drive(client, ids, loop=loop)
                outcomes = sorted(type(r.outcome).__name__ for r, _ in results.values())
                assert outcomes == ["HandshakeRefused", "HandshakeTimeout", "MetadataReply"]
                balanced()
                assert client.socket_count() == 2  # the server's pair; the others were closed
        stats = client.stats()
        assert (stats["refused"], stats["timeouts"], stats["socket_resets"]) == (3, 3, 3)
        assert len(loop.added) == 2 + 3 * 2 * 2
    finally:
        client.close()
        silent.close()
    assert loop.live == set() and len(loop.removed) == len(loop.added)
    assert all(sock.closed for sock in loop.added) and client.sockets() == [] and client.socket_count() == 0


def test_refusal_waiting_at_the_deadline_wins_over_the_timeout(client: HandshakeClient) -> None:
    """expire() reads the monitor too: a refusal already reported is the verdict (virtual clock)."""
    address = peer_address("127.0.0.1", free_port())
    rid = client.heartbeat(address, ["req-a"], deadline_ns=1_000)
    monitor = next(s for s in client.sockets() if s.type == zmq.PAIR)
    assert monitor.poll(1000)  # the refusal arrived, but the loop has not read it yet
    (result,) = client.expire(1_000)
    assert result.request_id == rid and is_refused(result.outcome, address), result
    assert "timeouts" not in client.stats() and client.sockets() == [] and client.next_deadline_ns() is None


def test_reply_waiting_at_the_deadline_wins_over_the_timeout(client: HandshakeClient) -> None:
    """expire() reads what already arrived before declaring a timeout (virtual clock)."""
    peer = raw_socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        rid = client.heartbeat(address, ["req-a"], deadline_ns=1_000)
        assert peer.poll(1000)
        identity, _payload = peer.recv_multipart()
        peer.send_multipart([identity, encode(ClaimsReply(nonce=rid, claims={"req-a": "ok"}))])
        (sock,) = dealers(client)
        assert sock.poll(1000)  # arrived, but the loop has not read it yet
        assert client.expire(999) == []
        (result,) = client.expire(1_000)
        assert result.ok and result.outcome == ClaimsReply(nonce=rid, claims={"req-a": "ok"})
        assert client.stats().get("timeouts", 0) == 0 and client.stats().get("socket_resets", 0) == 0
    finally:
        peer.close()


def test_timeout_resends_the_peers_other_pending_requests_on_a_fresh_socket(client: HandshakeClient) -> None:
    slow = raw_socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{slow.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        short = client.fetch_metadata(address, 0, deadline_ns=now_ns() + 100 * MS)
        long = client.heartbeat(address, ["req-a"], deadline_ns=now_ns() + 3000 * MS)
        assert isinstance(drive(client, {short})[short][0].outcome, HandshakeTimeout)
        # The peer now reads and answers every heartbeat it sees: only the copy
        # re-sent on the fresh socket can reach the client.
        def answer_heartbeats(results: dict) -> bool:
            while slow.poll(0):
                identity, payload = slow.recv_multipart()
                request = decode_request(payload)
                if isinstance(request, Heartbeat):
                    reply = ClaimsReply(nonce=request.nonce, claims={"req-a": "ok"})
                    slow.send_multipart([identity, encode(reply)])
            return long in results
        result = pump(client, answer_heartbeats, 2.0)[long][0]
        assert client.stats()["socket_resets"] == 1
        assert result.outcome == ClaimsReply(nonce=long, claims={"req-a": "ok"})
    finally:
        slow.close()


# --------------------------------------------------------------------------- bad replies, bad input

def test_client_survives_bad_replies(client: HandshakeClient) -> None:
    peer = raw_socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"

    def ask_and_answer(answer: Callable[[int], list[bytes]], **kwargs: Any) -> Any:
        rid = client.fetch_metadata(address, kwargs.pop("tp_rank", 0), deadline_ns=now_ns() + 1000 * MS, **kwargs)
        assert peer.poll(1000)
        identity, payload = peer.recv_multipart()
        assert decode_request(payload).nonce == rid
        for frames in answer(rid):
            peer.send_multipart([identity, *frames])
        return one(client, rid).outcome

    def metadata(nonce: int, **changes: Any) -> bytes:
        reply = MetadataReply(nonce=nonce, engine_id="p", tp_rank=0, pp_rank=0, compat=COMPAT,
                              compat_hash=HASH, agent_name="a", agent_metadata=b"m", layout=b"",
                              meta_version=1)
        return encode(msgspec.structs.replace(reply, **changes))

    try:
        # Unattributable garbage is counted and dropped; the right reply still lands.
        ok = ask_and_answer(lambda n: [[b"\xc1garbage"], [b"two", b"frames"], [metadata(n)]])
        assert isinstance(ok, MetadataReply)
        assert client.stats()["malformed_replies"] == 2

        wrong_type = ask_and_answer(lambda n: [[encode(ClaimsReply(nonce=n, claims={}))]])
        assert isinstance(wrong_type, HandshakeProtocolError) and wrong_type.code == "unexpected_reply"

        other = msgspec.structs.replace(COMPAT, block_size=128)
        incompatible = ask_and_answer(lambda n: [[metadata(n, compat=other, compat_hash=compat_hash(other))]])
        assert isinstance(incompatible, HandshakeIncompatible)
        assert incompatible.differences == ["block_size: 16 here, 128 on the peer"]

        via_error = ask_and_answer(lambda n: [[encode(ErrorReply(nonce=n, code="incompatible", detail="x",
                                                                  compat=other))]])
        assert isinstance(via_error, HandshakeIncompatible)
        assert via_error.differences == ["block_size: 16 here, 128 on the peer"]

        wrong_rank = ask_and_answer(lambda n: [[metadata(n, tp_rank=1)]])
        assert isinstance(wrong_rank, HandshakeProtocolError) and wrong_rank.code == "wrong_rank"

        bad_field = ask_and_answer(lambda n: [[mp({"type": "metadata", "nonce": n, "engine_id": 5})]])
        assert isinstance(bad_field, HandshakeProtocolError) and bad_field.code == "malformed"
        assert "engine_id" in bad_field.detail or "missing" in bad_field.detail

        future = ask_and_answer(lambda n: [[mp({"type": "error", "nonce": n, "code": "unknown_rank",
                                                "detail": "no such rank", "protocol": 2, "hint": "v2"})]])
        assert isinstance(future, HandshakeRejected) and future.code == "unknown_rank"
    finally:
        peer.close()


def test_requests_the_server_would_refuse_are_not_sent(client: HandshakeClient) -> None:
    deadline = now_ns() + 1000 * MS
    too_many = client.heartbeat("tcp://127.0.0.1:9", [f"r{i}" for i in range(MAX_CLAIMS + 1)], deadline_ns=deadline)
    too_long = client.fetch_metadata("tcp://127.0.0.1:9", 0, claims=["x" * 300], deadline_ns=deadline)
    bad_address = client.fetch_metadata("not an address", 0, deadline_ns=deadline)
    unencodable = client.heartbeat("tcp://127.0.0.1:9", [object()], deadline_ns=deadline)  # type: ignore[list-item]
    results = {r.request_id: r.outcome for r in client.poll_results()}
    assert results[unencodable].code == "malformed" and "cannot be encoded" in results[unencodable].detail
    assert isinstance(results[too_many], HandshakeProtocolError) and "$.claims" in results[too_many].detail
    assert isinstance(results[too_long], HandshakeProtocolError) and "$.claims[0]" in results[too_long].detail
    assert results[bad_address].code == "bad_address" and "not an address" in str(results[bad_address])
    assert client.stats().get("sent", 0) == 0 and client.pending_count() == 0
    assert client.sockets() == [] and client.socket_count() == 0  # nothing left half-made
    with pytest.raises(TypeError, match="MetadataRequest, Heartbeat, Abandon or WriteAsk, got ClaimsReply"):
        client.send("tcp://127.0.0.1:9", ClaimsReply(claims={}), deadline)  # type: ignore[arg-type]


def test_cancelled_request_reply_is_dropped(client: HandshakeClient) -> None:
    with serving() as (server, _thread, _fake):
        cancelled = client.heartbeat(server.address, ["req-a"], deadline_ns=now_ns() + 2000 * MS)
        assert client.cancel(cancelled) and not client.cancel(cancelled)
        kept = client.heartbeat(server.address, ["req-b"], deadline_ns=now_ns() + 2000 * MS)
        results = drive(client, {kept})
        assert cancelled not in results
        assert pump(client, lambda r: client.stats().get("stale_replies", 0) == 1, 1.0) == {}
        assert client.stats()["stale_replies"] == 1


def test_peer_address_brackets_ipv6() -> None:
    assert peer_address("10.0.0.1", 5600) == "tcp://10.0.0.1:5600"
    assert peer_address("::1", 5600) == "tcp://[::1]:5600"
    assert peer_address("[::1]", 5600) == "tcp://[::1]:5600"


def test_peer_address_of_an_inproc_host_names_an_inproc_endpoint() -> None:
    assert peer_address("inproc:sim-prefill", 5600) == "inproc://sim-prefill-5600"
    assert peer_address("inproc:sim-prefill", 5601) == "inproc://sim-prefill-5601"


def test_inproc_server_and_client_on_one_context_exchange_a_claim() -> None:
    """Engines sharing one process (the simulation) use the host ``inproc:NAME``:
    the server binds exactly peer_address(host, port) on the context it is given,
    and a client on that context reaches it at that address."""
    host, port = "inproc:sim-prefill", 5600
    address = peer_address(host, port)
    ctx = zmq.Context()
    fake = FakePrefill()
    server = HandshakeServer("prefill-sim", COMPAT, fake.provide, fake.on_claims, host=host, port=port,
                             context=ctx, lease_ns=1500 * MS)
    client = HandshakeClient(COMPAT, "decode-sim/tp0", context=ctx)
    try:
        assert (server.address, server.port) == (address, port)
        with pytest.raises(OSError, match="could not bind"):  # the endpoint is taken
            HandshakeServer("twin", COMPAT, fake.provide, fake.on_claims, host=host, port=port, context=ctx)

        def exchange(request_id: int) -> HandshakeResult:
            """Drive both sides from this one thread until the request's result."""
            for _ in range(2000):  # a bound against a hang, not a timing check
                poller = zmq.Poller()
                for sock in [*server.sockets(), *client.sockets()]:
                    poller.register(sock, zmq.POLLIN)
                ready = dict(poller.poll(5))
                if any(sock in ready for sock in server.sockets()):
                    server.on_readable()
                results = [r for sock in client.sockets() if sock in ready for r in client.on_readable(sock)]
                results += client.poll_results()
                if results:
                    assert [r.request_id for r in results] == [request_id]
                    return results[0]
            raise AssertionError("no result over inproc")

        far = now_ns() + 600_000 * MS
        meta = exchange(client.fetch_metadata(address, 1, claims=["req-a", "req-b", "req-x"], deadline_ns=far))
        assert meta.ok and meta.peer == address, meta
        assert isinstance(meta.outcome, MetadataReply)
        assert (meta.outcome.engine_id, meta.outcome.agent_name) == ("prefill-sim", "prefill-agent-tp1")
        assert meta.outcome.claims == {"req-a": "ok", "req-b": "expired", "req-x": "unknown"}
        assert meta.outcome.lease_ms == 1500 and meta.outcome.lease_ns == 1500 * MS  # ms on the wire only
        beat = exchange(client.heartbeat(address, ["req-a"], deadline_ns=far))
        assert isinstance(beat.outcome, ClaimsReply) and beat.outcome.claims == {"req-a": "ok"}
        assert fake.calls == [("claim", "decode-sim/tp0", ["req-a", "req-b", "req-x"]),
                              ("heartbeat", "decode-sim/tp0", ["req-a"])]
        assert server.stats()["served"] == {"MetadataRequest": 1, "Heartbeat": 1}
    finally:
        client.close()
        server.close()
        ctx.term()
