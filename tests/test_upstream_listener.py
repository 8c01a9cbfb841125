"""vLLM issue #54757, reproduced: upstream NixlConnector's handshake listener thread
dies on the first malformed message; kvsm's HandshakeServer on kvsm's EventLoop
refuses the same bytes and keeps answering.

Upstream's listener (``NixlBaseConnectorScheduler._nixl_handshake_listener``, a
static method run in a daemon thread) does, per message::

    identity, _, msg = sock.recv_multipart()
    msg, target_pp_rank, target_tp_rank = msgspec.msgpack.decode(msg)
    ... encoded_data[(target_pp_rank, target_tp_rank)] ...

with no exception handling, so any message that is not exactly a REQ-framed
msgpack triple naming a known rank raises out of the thread. Its ``with
zmq_ctx(...)`` then destroys the context: the port closes, and every later
handshake to that prefill engine times out (5 s each on the decode side).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from conftest import require

upstream = require("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler")

from kvsm.handshake import (
    PROTOCOL_VERSION,
    CompatInfo,
    ErrorReply,
    HandshakeServer,
    MetadataReply,
    MetadataRequest,
    compat_hash,
    decode_reply,
    encode,
)
from kvsm.runtime.loop import EventLoop
from kvsm_testing.ports import free_port

GET_META_MSG = b"get_meta_msg"
HOST = "127.0.0.1"
PAYLOAD = b"upstream-handshake-payload"

# (name, frames as a REQ/DEALER client sends them, what upstream raises on it)
MALFORMED = [
    ("not_msgpack", "req", [b"\xc1garbage"], "DecodeError"),
    ("msgpack_not_a_triple", "req", [msgspec.msgpack.encode(7)], "TypeError"),
    ("unknown_rank", "req", [msgspec.msgpack.encode((GET_META_MSG, 0, 9))], "KeyError"),
    ("dealer_one_frame", "dealer", [msgspec.msgpack.encode((GET_META_MSG, 0, 0))], "ValueError"),
]


def send_raw(ctx: zmq.Context, port: int, kind: str, frames: list[bytes]) -> None:
    sock = ctx.socket(zmq.REQ if kind == "req" else zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(f"tcp://{HOST}:{port}")
    sock.send_multipart(frames)
    sock.close()  # lingers until the message is out


def ask_upstream(ctx: zmq.Context, port: int, timeout_ms: int = 500) -> list[bytes] | None:
    """A valid upstream metadata query (as base_worker sends it); None if unanswered."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(f"tcp://{HOST}:{port}")
    try:
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        return sock.recv_multipart()
    except zmq.Again:
        return None
    finally:
        sock.close(linger=0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    try:
        yield c
    finally:
        c.destroy(linger=0)


@pytest.mark.parametrize(("name", "kind", "frames", "raised"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_upstream_listener_dies_on_one_malformed_message(ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch,
                                                         name: str, kind: str, frames: list[bytes],
                                                         raised: str) -> None:
    died: list[threading.ExceptHookArgs] = []
    default_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and args.thread.name == "upstream-listener":
            died.append(args)
        else:
            default_hook(args)

    monkeypatch.setattr(threading, "excepthook", hook)
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(target=upstream.NixlBaseConnectorScheduler._nixl_handshake_listener,
                                args=({(0, 0): PAYLOAD}, ready, stop, HOST, port), daemon=True,
                                name="upstream-listener")
    listener.start()
    try:
        assert ready.wait(5)
        reply = ask_upstream(ctx, port, timeout_ms=5000)
        assert reply is not None and reply[0] == PAYLOAD, "upstream does not answer even a valid query"
        send_raw(ctx, port, kind, frames)
        listener.join(timeout=5)
        assert not listener.is_alive(), "upstream's listener survived a malformed message"
        assert [type(a.exc_value).__name__ for a in died] == [raised]
        assert ask_upstream(ctx, port) is None, "a dead listener still answered"
    finally:
        stop.set()
        listener.join(timeout=3)


def test_kvsm_server_on_the_loop_keeps_answering(ctx: zmq.Context) -> None:
    compat = CompatInfo(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_size=32, block_size=16,
                        kv_layout="block-major 2x16x64")
    errors: list[object] = []
    loop = EventLoop("upstream-compare", on_error=errors.append).start()
    try:
        def open_server() -> HandshakeServer:
            server = HandshakeServer("prefill", compat, lambda tp, pp: ("agent", b"meta", b"", 1) if (tp, pp) == (0, 0)
                                     else None, lambda kind, who, claims, readers=1: dict.fromkeys(claims, "unknown"),
                                     host=HOST, port=0, context=loop.context)
            for sock in server.sockets():
                loop.add_reader(sock, server.on_readable, label="handshake server")
            return server

        server = loop.call(open_server, timeout=10)
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.setsockopt(zmq.RCVTIMEO, 5000)
        client.connect(f"tcp://{HOST}:{server.port}")

        def ask(nonce: int) -> MetadataReply:
            client.send(encode(MetadataRequest(protocol=PROTOCOL_VERSION, nonce=nonce, requester="decode",
                                               tp_rank=0, compat_hash=compat_hash(compat))))
            while True:  # skip the refusals of what the same socket sent before
                reply = decode_reply(client.recv())
                if isinstance(reply, MetadataReply):
                    assert reply.nonce == nonce and reply.agent_name == "agent"
                    return reply
                assert isinstance(reply, ErrorReply)

        ask(1)
        for i, (_, kind, frames, _) in enumerate(MALFORMED, start=2):
            send_raw(ctx, server.port, kind, frames)
            # Upstream's own (valid) query is not kvsm's protocol either: refused, not fatal.
            send_raw(ctx, server.port, "req", [msgspec.msgpack.encode((GET_META_MSG, 0, 0))])
            ask(i)
        deadline = time.monotonic() + 5
        while sum((stats := loop.call(server.stats, timeout=5))["errors"].values()) < 2 * len(MALFORMED):
            assert time.monotonic() < deadline, stats
            time.sleep(0.01)
        assert stats["errors"] == {"malformed": 2 * len(MALFORMED)}
        assert stats["served"] == {"MetadataRequest": 1 + len(MALFORMED)}
        assert errors == [] and loop.thread is not None and loop.thread.is_alive()
        client.close(linger=0)

        def close_server() -> None:
            for sock in server.sockets():
                loop.remove_reader(sock)
            server.close()

        loop.call(close_server, timeout=5)
    finally:
        loop.stop(timeout=5)
