"""The pin channel: a scheduler's finishes reach its workers at once, and nobody
else's do (kvsm.handoff.pins; real ZMQ sockets, a real second process)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvsm.handoff.facts import SendFinish
from kvsm.handoff.pins import (
    MAX_MESSAGE_BYTES,
    MAX_PINS_PER_MESSAGE,
    PinChannelClient,
    PinTarget,
    decode_pins,
    encode_pins,
)
from kvsm_testing.peer_process import PeerProcess
from kvsm_testing.pins import PinWorker

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def worker() -> Iterator[PinWorker]:
    w = PinWorker("pin-test")
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[PeerProcess]:
    p = PeerProcess("pins", REPO / "tests" / "pin_peer.py", {}, tmp_path, root=REPO).ready(timeout=60)
    try:
        yield p
    finally:
        if p.proc.poll() is None:
            try:
                p.call("quit", timeout=10)
            finally:
                p.proc.wait(timeout=10)
        p.close_stderr()


def _target(hello: dict) -> PinTarget:
    return PinTarget(tp_rank=1, pid=hello["pid"], endpoint=hello["endpoint"], token=bytes.fromhex(hello["token"]))


def _wait_received(p: PeerProcess, n: int, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        reply = p.call("received")
        if len(reply["received"]) >= n or time.monotonic() > deadline:
            return reply
        time.sleep(0.01)


def test_codec_round_trip_and_bounds() -> None:
    pins = [SendFinish(req="r-1", ok=True, block_ids=(3, 4, 5), pinned_ns=123),
            SendFinish(req="r-2", ok=False, reason="FINISHED_ABORTED"),
            # A decode engine's hold (its time to live for a lease) and its release, with a long why.
            SendFinish(req="h-1", ok=True, block_ids=(7,), pinned_ns=5, lease_ns=480_000_000_000, hold=True),
            SendFinish(req="h-1", ok=False, reason="released under memory pressure: " + "x" * 200, release=True,
                       lease_ns=30_000_000_000)]
    assert decode_pins(encode_pins(pins)) == pins
    # An older scheduler's five-field pins still decode.
    assert decode_pins(msgspec.msgpack.encode([["r", True, [1], "", 0]])) == [
        SendFinish(req="r", ok=True, block_ids=(1,))]
    with pytest.raises(msgspec.ValidationError, match="length"):
        decode_pins(encode_pins([SendFinish(req=f"r{i}", ok=True) for i in range(MAX_PINS_PER_MESSAGE + 1)]))
    with pytest.raises(msgspec.ValidationError):
        decode_pins(encode_pins([SendFinish(req="", ok=True)]))  # an empty request id
    with pytest.raises(msgspec.ValidationError):
        decode_pins(msgspec.msgpack.encode([["r", True, [-1], "", 0]]))  # a negative block id


def test_in_process_worker_gets_the_pin_at_once(worker: PinWorker) -> None:
    client = PinChannelClient([worker.server.target(0)])
    assert client.via == "in_process" and client.workers == 1
    sent_ns = time.monotonic_ns()
    assert client.send([SendFinish(req="p-1", ok=True, block_ids=(7, 8), pinned_ns=sent_ns)]) == []
    assert worker.arrived.wait(2.0), "the pin never reached the worker's loop"
    (finish, via, at_ns), = worker.got
    assert (finish.req, finish.block_ids, finish.pinned_ns, via) == ("p-1", (7, 8), sent_ns, "in_process")
    # "At once" is the tested thing (not with the next engine step): a loop post,
    # typically tens of microseconds.
    assert at_ns - sent_ns < 200_000_000
    client.close()


def test_a_stopped_worker_loop_is_reported_not_swallowed(worker: PinWorker) -> None:
    client = PinChannelClient([worker.server.target(0)])
    worker.close()
    failed = client.send([SendFinish(req="p-2", ok=True, block_ids=(1,))])
    assert [rank for rank, _ in failed] == [0] and "did not take" in failed[0][1]
    assert worker.got == []


def test_worker_in_another_process_gets_the_pin_over_its_socket(peer: PeerProcess) -> None:
    client = PinChannelClient([_target(peer.hello)])
    try:
        assert client.via == "local_socket"
        t0 = time.monotonic_ns()
        for i in range(50):
            assert client.send([SendFinish(req=f"p-{i}", ok=True, block_ids=(i, i + 1), pinned_ns=t0)]) == []
        reply = _wait_received(peer, 50)
        got = reply["received"]
        assert [g["req"] for g in got] == [f"p-{i}" for i in range(50)]  # all, in order
        assert {g["via"] for g in got} == {"local_socket"} and got[3]["block_ids"] == [3, 4]
        assert got[0]["received_ns"] - t0 < 1_000_000_000  # at once, not with a later engine step
        assert reply["stats"] == {"accepted_local_socket": 50, "pins": 50}
    finally:
        client.close()


def test_a_worker_socket_that_takes_nothing_is_reported(tmp_path: Path) -> None:
    """Nobody reads the socket (a worker that stopped): once its queue is full the
    send fails, and says so, instead of blocking the scheduler."""
    target = PinTarget(tp_rank=3, pid=-1, endpoint=f"ipc://{tmp_path}/nobody", token=b"t" * 32)
    client = PinChannelClient([target], send_hwm=2)
    try:
        results = [client.send([SendFinish(req=f"p-{i}", ok=True, block_ids=(i,))]) for i in range(50)]
        failed = [r for r in results if r]
        assert failed and failed[0][0][0] == 3 and "Again" in failed[0][0][1], results[:5]
        start = time.monotonic()
        client.send([SendFinish(req="p-x", ok=True)])
        assert time.monotonic() - start < 0.1  # never blocks
    finally:
        client.close()


def test_socket_is_private_to_this_user_and_removed_at_close(peer: PeerProcess) -> None:
    directory = Path(peer.hello["dir"])
    path = Path(peer.hello["endpoint"].removeprefix("ipc://"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert directory.stat().st_uid == os.getuid()
    peer.call("quit", timeout=10)
    peer.proc.wait(timeout=10)
    assert not directory.exists()


def test_nothing_but_its_own_scheduler_can_pin(peer: PeerProcess) -> None:
    """Whatever a local process sends to the socket, only a message with the
    engine's token pins anything, and the channel keeps serving."""
    token = bytes.fromhex(peer.hello["token"])
    good = encode_pins([SendFinish(req="real", ok=True, block_ids=(1,))])
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(peer.hello["endpoint"])
    hostile = [
        [b"x" * 32, good],  # a wrong token of the right size
        [token[:16], good],  # a short token
        [good],  # no token
        [token, good, b"more"],  # an extra frame
        [token, b"\xc1garbage"],  # not msgpack
        [token, msgspec.msgpack.encode({"req": "r"})],  # the wrong shape
        [token, msgspec.msgpack.encode([["r", True, ["a"], "", 0]])],  # wrong types
        [token, encode_pins([SendFinish(req=f"r{i}", ok=True) for i in range(MAX_PINS_PER_MESSAGE + 1)])],
    ]
    for frames in hostile:
        sock.send_multipart(frames)
    # Over libzmq's frame limit: the connection is dropped, nothing reaches Python.
    big = ctx.socket(zmq.PUSH)
    big.setsockopt(zmq.LINGER, 1000)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big.connect(peer.hello["endpoint"])
    big.send_multipart([token, b"\0" * (MAX_MESSAGE_BYTES + 1)])
    # The peer drops that connection: wait until it has (the sender sees it go).
    assert monitor.poll(5000), "the oversized message's connection was not dropped"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    sock.send_multipart([token, good])  # still served afterwards
    reply = _wait_received(peer, 1)
    assert [g["req"] for g in reply["received"]] == ["real"]
    stats = reply["stats"]
    assert stats["accepted_local_socket"] == 1 and stats["bad_token"] == 2 and stats["malformed"] == 6, stats
    sock.close()
    big.disable_monitor()
    monitor.close()
    big.close()
