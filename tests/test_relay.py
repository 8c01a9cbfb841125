"""One side-channel port per engine: rank 0's server relays other ranks' requests.

Real ZMQ: rank 0 listens on TCP, rank 1 on its private ``ipc://`` endpoint,
each server driven by a thread of its own as a worker's loop drives it; a
real ``HandshakeClient`` asks rank 1 through rank 0's port. Rank 1's answers
(its agent, its claims) come back unchanged; a rank that does not answer is
answered ``rank_unavailable`` by rank 0 within the relay's timeout; a rank the
engine does not have is ``unknown_rank``; the worker's ports follow the plan
(base + data-parallel index, whatever the tensor parallel size).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from kvsm.handshake import (
    CompatInfo,
    HandshakeClient,
    HandshakeRejected,
    HandshakeServer,
    MetadataReply,
)
from kvsm.handshake.client import HandshakeResult
from kvsm.handshake.relay import internal_endpoint
from kvsm.vllm.config import kvsm_config
from kvsm_testing.reliability import wait_until

COMPAT = CompatInfo(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_size=64, block_size=16,
                    kv_layout="NHD")
MS = 1_000_000


class Rank:
    """One rank's server and the loop thread that drives it (sockets, then expiry)."""

    def __init__(self, rank: int, pp_rank: int = 0, **kw: object) -> None:
        self.calls: list[tuple[str, list[str], int]] = []
        self.server = HandshakeServer("prefill-e", COMPAT, self.provide, self.on_claims, rank=rank,  # type: ignore[arg-type]
                                      pp_rank=pp_rank, **kw)
        self.rank = rank
        self.pp_rank = pp_rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def provide(self, tp_rank: int, pp_rank: int) -> tuple[str, bytes, bytes, int] | None:
        if (tp_rank, pp_rank) != (self.rank, self.pp_rank):
            return None
        return f"agent-tp{tp_rank}" + (f"-pp{pp_rank}" if pp_rank else ""), b"meta", b"layout", 1

    def on_claims(self, kind: str, requester: str, claims: list[str], readers: int = 1) -> dict[str, str]:
        self.calls.append((kind, list(claims), readers))
        return dict.fromkeys(claims, "ok")

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.server.sockets():
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(5):
                self.server.on_readable(sock)
            self.server.expire(time.monotonic_ns())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.server.close()


def results(client: HandshakeClient, rids: set[int], timeout_s: float = 5.0) -> dict[int, HandshakeResult]:
    got: dict[int, HandshakeResult] = {}
    end = time.monotonic() + timeout_s
    while not rids <= set(got) and time.monotonic() < end:
        poller = zmq.Poller()
        for sock in client.sockets():
            poller.register(sock, zmq.POLLIN)
        found = client.poll_results()
        for sock, _ in poller.poll(5):
            found += client.on_readable(sock)
        found += client.expire(time.monotonic_ns())
        got.update({r.request_id: r for r in found})
    assert rids <= set(got), f"no result for {rids - set(got)}"
    return got


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Rank, Rank, HandshakeClient]]:
    monkeypatch.setenv("KVSM_RUNTIME_DIR", str(tmp_path))
    endpoint = internal_endpoint("127.0.0.1", 0, "prefill-e", 1)
    assert endpoint.startswith(f"ipc://{tmp_path}/")
    r1 = Rank(1, internal=endpoint)
    r0 = Rank(0, relay_to={1: endpoint})
    client = HandshakeClient(COMPAT, "decode-agent-0")
    try:
        yield r0, r1, client
    finally:
        client.close()
        r0.stop()
        r1.stop()


def test_a_request_for_rank_1_through_rank_0s_port_is_answered_by_rank_1(engine) -> None:
    r0, r1, client = engine
    deadline = time.monotonic_ns() + 10_000 * MS  # nothing here waits on purpose: room for a loaded machine
    meta = client.fetch_metadata(r0.server.address, tp_rank=1, claims=["req-a"], deadline_ns=deadline,
                                 readers=2)
    beat = client.heartbeat(r0.server.address, ["req-a"], deadline_ns=deadline, tp_rank=1, readers=2)
    own = client.fetch_metadata(r0.server.address, tp_rank=0, claims=["req-b"], deadline_ns=deadline)
    got = results(client, {meta, beat, own})
    reply = got[meta].outcome
    assert isinstance(reply, MetadataReply) and reply.agent_name == "agent-tp1" and reply.tp_rank == 1, reply
    assert reply.claims == {"req-a": "ok"}
    assert getattr(got[beat].outcome, "claims", None) == {"req-a": "ok"}
    assert isinstance(got[own].outcome, MetadataReply) and got[own].outcome.agent_name == "agent-tp0"
    assert r1.calls == [("claim", ["req-a"], 2), ("heartbeat", ["req-a"], 2)]  # rank 1 answered its own
    assert r0.calls == [("claim", ["req-b"], 1)]
    # rank 0's thread counts a reply after sending it, so the client can hold both before the count moves
    wait_until(lambda: r0.server.stats()["relayed_replied"] >= 2, 5, "rank 0 to count both relayed replies")
    assert r0.server.stats()["relayed"] == 2 and r0.server.stats()["relayed_replied"] == 2


def test_a_rank_that_does_not_answer_is_named_and_an_unknown_rank_refused(engine) -> None:
    r0, r1, client = engine
    r1.stop()  # rank 1's process is gone
    r0.server._relay.timeout_ns = 200 * MS  # type: ignore[union-attr]
    deadline = time.monotonic_ns() + 3000 * MS
    lost = client.fetch_metadata(r0.server.address, tp_rank=1, claims=["req-a"], deadline_ns=deadline)
    unknown = client.abandon(r0.server.address, ["req-a"], deadline_ns=deadline, tp_rank=5)
    t0 = time.monotonic()
    got = results(client, {lost, unknown})
    assert time.monotonic() - t0 < 2.5, "rank 0 did not answer for its silent rank before the client's deadline"
    e = got[lost].outcome
    assert isinstance(e, HandshakeRejected) and e.code == "rank_unavailable" and "tp_rank 1" in str(e), e
    e = got[unknown].outcome
    assert isinstance(e, HandshakeRejected) and e.code == "unknown_rank" and "tp_rank=5" in str(e), e
    assert r0.server._relay.pending_count() == 0  # type: ignore[union-attr]


def test_a_later_pipeline_stage_is_reached_through_the_engines_port(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipeline parallel: worker (tp 0, pp 1) binds its own private endpoint, and every
    request for it (metadata and claim, heartbeat, abandon) reaches it through stage 0's
    port and is answered by it; stage 0 answers for itself; a stage the engine does not
    have is refused, naming it."""
    monkeypatch.setenv("KVSM_RUNTIME_DIR", str(tmp_path))
    endpoint = internal_endpoint("127.0.0.1", 0, "prefill-e", 0, 1)
    assert endpoint.endswith("-tp0-pp1") and endpoint != internal_endpoint("127.0.0.1", 0, "prefill-e", 0)
    s1 = Rank(0, pp_rank=1, internal=endpoint)
    s0 = Rank(0, relay_to={(0, 1): endpoint})
    client = HandshakeClient(COMPAT, "decode-agent-0")
    try:
        port = s0.server.address
        deadline = time.monotonic_ns() + 10_000 * MS
        meta = client.fetch_metadata(port, tp_rank=0, pp_rank=1, claims=["req-a"], deadline_ns=deadline)
        beat = client.heartbeat(port, ["req-a"], deadline_ns=deadline, tp_rank=0, pp_rank=1)
        gone = client.abandon(port, ["req-a"], deadline_ns=deadline, tp_rank=0, pp_rank=1, readers=2)
        own = client.fetch_metadata(port, tp_rank=0, pp_rank=0, claims=["req-b"], deadline_ns=deadline)
        unknown = client.fetch_metadata(port, tp_rank=0, pp_rank=2, claims=["req-c"], deadline_ns=deadline)
        got = results(client, {meta, beat, gone, own, unknown})
        reply = got[meta].outcome
        assert isinstance(reply, MetadataReply) and (reply.agent_name, reply.pp_rank) == ("agent-tp0-pp1", 1)
        assert isinstance(got[own].outcome, MetadataReply) and got[own].outcome.agent_name == "agent-tp0"
        assert s1.calls == [("claim", ["req-a"], 1), ("heartbeat", ["req-a"], 1), ("abandon", ["req-a"], 2)]
        assert s0.calls == [("claim", ["req-b"], 1)]
        e = got[unknown].outcome
        assert isinstance(e, HandshakeRejected) and e.code == "unknown_rank" and "pp_rank=2" in str(e), e
    finally:
        client.close()
        s0.stop()
        s1.stop()


def _vllm_config(dp_index: int, tp: int, base: int) -> SimpleNamespace:
    kvt = SimpleNamespace(kv_role="kv_producer", kv_buffer_device="cpu", engine_id="e",
                          kv_connector_extra_config={"side_channel_port": base}, kv_load_failure_policy="fail")
    return SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=16),
                           parallel_config=SimpleNamespace(data_parallel_index=dp_index, tensor_parallel_size=tp,
                                                           pipeline_parallel_size=1, decode_context_parallel_size=1),
                           model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 8, use_mla=False))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_port_plan_is_base_plus_the_data_parallel_index_whatever_the_tp(tp: int) -> None:
    ports = [kvsm_config(_vllm_config(i, tp, 6100), env={}).side_channel_port for i in range(3)]
    assert ports == [6100, 6101, 6102]


def test_the_internal_endpoints_are_private_to_this_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSM_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    endpoint = internal_endpoint("10.0.0.1", 5600, "prefill-x", 3)
    directory = Path(endpoint.removeprefix("ipc://")).parent
    assert directory == tmp_path / f"kvsm-{os.getuid()}" and directory.stat().st_mode & 0o777 == 0o700
    assert endpoint.endswith("-tp3") and endpoint != internal_endpoint("10.0.0.1", 5601, "prefill-x", 3)
