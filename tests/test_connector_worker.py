"""KVSMConnector's worker role as vLLM's model runner uses it: registration of
real KV cache tensors with NIXL, the loop thread's life, and the calls a step
makes. The transfers themselves are in test_worker_nixl.py and test_pd_offline.py."""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvsm.runtime.loop import THREAD_NAME_PREFIX
from kvsm.vllm.connector import KVSMConnector
from kvsm.vllm.metadata import KVSMConnectorMetadata
from kvsm_testing.ports import free_port as _free_port
from kvsm_testing.reliability import wait_until
from kvsm_testing.scheduler import make_scheduler


def kv_caches(num_blocks: int = 8, layers: int = 2) -> dict[str, torch.Tensor]:
    # vLLM-CPU's layout for the tiny model: [num_blocks, kv_heads, block_size, 2 * head_size].
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, 2, 16, 64) for i in range(layers)}


def worker_connector(kv_role: str = "kv_both", **extra: Any) -> KVSMConnector:
    cfg = {"side_channel_host": "127.0.0.1", "side_channel_port": _free_port(), **extra}
    h = make_scheduler(kv_role=kv_role, extra_config=cfg, engine_id=f"w-{kv_role}")
    h.close()
    return KVSMConnector(h.vllm_config, KVConnectorRole.WORKER, h.scheduler.kv_cache_config)


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


@pytest.fixture
def connector() -> Iterator[KVSMConnector]:
    before = set(loop_threads())
    c = worker_connector()
    try:
        yield c
    finally:
        c.shutdown()
        assert set(loop_threads()) == before, "the connector's loop thread outlived shutdown"


def test_registration_starts_the_loop_and_the_side_channel(connector: KVSMConnector) -> None:
    connector.register_kv_caches(kv_caches())
    worker = connector.worker_half
    assert worker is not None and worker.compat is not None
    assert worker.compat.num_layers == 2 and worker.compat.block_size == 16
    # H: the heads dim, whatever this rank's share of the heads (tensor parallel sizes may differ);
    # T: the tokens of a block, whatever their number (the token layout says how they lie).
    assert worker.compat.dtype == "float32" and worker.compat.kv_layout == "block-major HxTx64"
    assert worker.compat.token_layout == "cpu:32x4,1x128/1"  # vLLM-CPU's vec16 kernel at block 16, head 32
    state = worker.debug_state()
    assert state["server"] is not None and state["client"] is not None  # kv_both: serves and reads
    # The side channel answers on its port.
    with socket.create_connection(("127.0.0.1", connector.cfg.side_channel_port), timeout=2):
        pass


def test_a_step_with_nothing_to_do_reports_nothing(connector: KVSMConnector) -> None:
    connector.register_kv_caches(kv_caches())
    connector.bind_connector_metadata(KVSMConnectorMetadata(1))
    connector.start_load_kv(None)  # type: ignore[arg-type]
    results = connector.get_transfer_results(set())
    assert not (results.finished_sending or results.finished_recving or results.failed_recving)
    assert connector.get_block_ids_with_load_errors() == set()
    connector.clear_connector_metadata()


def test_idle_loop_burns_no_cpu(connector: KVSMConnector) -> None:
    connector.register_kv_caches(kv_caches())
    t0 = time.process_time()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)  # the idle second that is measured
    used = time.process_time() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    assert used < 0.05, f"{used:.3f} CPU-s in 1 s of idling (busy polling?)"
    assert r1.ru_nvcsw - r0.ru_nvcsw < 200, "the loop woke up far more than its timers ask for"


def test_stats_carry_the_request_state_counts(connector: KVSMConnector) -> None:
    """The stats a step hands vLLM carry how many requests of each lifecycle are
    in each state (a level: sent when it changes), under this worker's source."""
    from kvsm.vllm.metadata import SendFinish, SendStart

    connector.register_kv_caches(kv_caches())
    connector.get_kv_connector_stats()  # start from an empty interval
    worker = connector.worker_half
    assert worker is not None
    meta = KVSMConnectorMetadata(1)
    meta.send_start += [SendStart("pinned-1"), SendStart("pinned-2"), SendStart("prefilling-1")]
    meta.send_finish += [SendFinish("pinned-1", ok=True, block_ids=(1, 2)),
                         SendFinish("pinned-2", ok=True, block_ids=(3,))]
    worker.submit(meta)
    expected = {"pinned-1": "awaiting_pull", "pinned-2": "awaiting_pull", "prefilling-1": "prefilling"}
    deadline = time.monotonic() + 5.0
    while worker.debug_state()["send"] != expected:
        assert time.monotonic() < deadline, worker.debug_state()["send"]
        time.sleep(0.01)
    stats = connector.get_kv_connector_stats()
    assert stats is not None and not stats.is_empty()
    assert stats.data["states"] == {"w-kv_both/tp0": {"recv": {}, "send": {"awaiting_pull": 2, "prefilling": 1}}}
    line = stats.reduce()  # vLLM's periodic log line
    assert (line["Reqs send/awaiting_pull"], line["Reqs send/prefilling"]) == (2, 1), line
    assert not any(k.startswith("Reqs recv/") for k in line), line
    # Nothing changed since: nothing to report; vLLM rebuilds what it was sent.
    assert connector.get_kv_connector_stats() is None
    rebuilt = type(connector).build_kv_connector_stats(stats.data)
    assert rebuilt is not None and rebuilt.data == stats.data
    assert type(connector).build_kv_connector_stats(None) is not None


def test_kv_buffer_device_must_match_where_the_caches_are() -> None:
    c = worker_connector(kv_role="kv_consumer")
    c.cfg = type(c.cfg)(**{**c.cfg.__dict__, "kv_buffer_device": "cuda"})
    try:
        with pytest.raises(ValueError, match="kv_buffer_device is 'cuda' but the KV caches are in DRAM"):
            c.register_kv_caches(kv_caches())
    finally:
        c.shutdown()


def test_a_layout_that_cannot_be_described_is_refused_naming_the_layer(connector: KVSMConnector) -> None:
    caches = kv_caches()
    caches["model.layers.1.self_attn.attn"] = torch.zeros(8, 2, 16, 64)[:, :, ::2]  # not contiguous
    with pytest.raises(ValueError, match=r"model\.layers\.1"):
        connector.register_kv_caches(caches)


def test_scheduler_side_calls_on_a_worker_instance_say_so(connector: KVSMConnector) -> None:
    with pytest.raises(RuntimeError, match="scheduler-side method"):
        connector.build_connector_meta(None)  # type: ignore[arg-type]


def test_the_worker_carries_out_every_effect_the_table_names(connector: KVSMConnector) -> None:
    """A table change that adds an effect must come with the I/O that does it."""
    from kvsm.lifecycle.table import PEER, RECV, SEND

    def effects(spec: object) -> set[str]:
        return {e for rules in spec.rules.values() for r in rules for e in r.effects}  # type: ignore[attr-defined]

    worker = connector.worker_half
    assert worker is not None
    assert set(worker.receiver.effects) == effects(RECV)
    assert set(worker.sender.effects) == effects(SEND)
    assert set(worker.peers_and_claims.effects) == effects(PEER)


def test_side_channel_refusals_are_counted_in_the_stats(connector: KVSMConnector) -> None:
    """Every message the side channel handles shows up in the stats by outcome
    (hence in ``vllm:kvsm_side_channel_messages``), refusals by error code."""
    import zmq

    connector.register_kv_caches(kv_caches())
    connector.get_kv_connector_stats()  # start from an empty interval
    ctx = zmq.Context()
    try:
        for payload in (b"\x00garbage", b"\xc1", b"x" * 10):
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(f"tcp://127.0.0.1:{connector.cfg.side_channel_port}")
            req.send(payload)
            assert req.poll(5000), "the side channel did not answer a malformed message"
            req.recv()
            req.close()
    finally:
        ctx.term()
    deadline = time.monotonic() + 5.0
    counted: dict[str, int] = {}
    while sum(counted.values()) < 3:
        assert time.monotonic() < deadline, f"side-channel outcomes counted: {counted}"
        stats = connector.get_kv_connector_stats()
        for outcome, n in (stats.data["side_channel"] if stats else {}).items():
            counted[outcome] = counted.get(outcome, 0) + n
        time.sleep(0.02)
    assert counted.get("served", 0) == 0 and sum(counted.values()) == 3, counted
    rebuilt = type(connector).build_kv_connector_stats({"side_channel": counted})
    assert rebuilt is not None and not rebuilt.is_empty()
    line = rebuilt.reduce()  # vLLM's periodic log line
    assert all(line[f"Side channel {outcome}"] == n for outcome, n in counted.items()), line


def test_a_clean_shutdown_ends_the_log_with_what_was_live(tmp_path: Any) -> None:
    """A clean stop ends every live request (closed at shutdown, its pinned blocks
    freed) and then writes the clean-stop record, so replay finds nothing open; the
    same log cut before the stop reads as a crash."""
    import json

    from kvsm.vllm.metadata import SendFinish, SendStart

    c = worker_connector(event_log_dir=str(tmp_path), kv_lease_duration=60)
    try:
        c.register_kv_caches(kv_caches())
        meta = KVSMConnectorMetadata(1)
        meta.send_start.append(SendStart("pinned-1"))
        meta.send_finish.append(SendFinish("pinned-1", ok=True, block_ids=(1, 2)))
        c.worker_half.submit(meta)  # type: ignore[union-attr]
        deadline = time.monotonic() + 5.0
        while c.worker_half.debug_state()["send"] != {"pinned-1": "awaiting_pull"}:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held = c.worker_half.debug_state()["resources"]  # type: ignore[union-attr]
        assert held["send_machines"] == 1 and held["send_io"] == 1, held
    finally:
        c.shutdown()
    (path,) = [p for p in tmp_path.iterdir() if ".worker." in p.name]
    lines = path.read_text().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    last = records[-1]
    assert last["event"] == "worker.shutdown" and last["clean"] is True, last
    # The pinned request ended closed at shutdown (its blocks freed) before the record.
    (closing,) = [i for i, r in enumerate(records) if r.get("event") == "shutdown"]
    assert (records[closing]["src"], records[closing]["dst"]) == ("awaiting_pull", "closed_at_shutdown")
    assert "free_blocks" in records[closing]["effects"], records[closing]
    assert last["live"] == {"recv": {}, "send": {}}
    assert last["resources"]["send_machines"] == 0 and last["resources"]["recv_io"] == 0
    assert last["side_channel"]["served"] == {} and last["side_channel"]["errors"] == {}, last["side_channel"]
    # Replay finds every request ended; the same log cut before the stop is a crash.
    from kvsm.replay import analyse

    report = analyse([path])
    assert report.exit_code == 0, [str(f) for f in report.findings]
    assert report.open_at_shutdown == []
    assert [m.final_state for m in report.machines if m.req == "pinned-1"] == ["closed_at_shutdown"]
    crashed = tmp_path / "crashed.jsonl"
    crashed.write_text("".join(lines[:closing]))
    assert [f.kind for f in analyse([crashed]).findings] == ["not_terminal_at_end"]


def test_each_pipeline_stage_registers_its_layers_behind_the_engines_one_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine of pipeline parallel 2 (the tiny model's two layers, one per stage, as
    vLLM splits them): each stage's worker registers its own layer under an agent of its
    own, both say the model's layer count (so a decode engine of another split agrees
    with them), stage 0 binds the engine's port, and a decode side asking for stage 1
    there gets stage 1's agent and its layer's layout through the relay."""
    import msgspec

    from kvsm.handshake import HandshakeClient, MetadataReply
    from kvsm.transport.nixl import NixlPeerInfo

    cfg = {"side_channel_host": "127.0.0.1", "side_channel_port": _free_port()}
    h = make_scheduler(kv_role="kv_producer", extra_config=cfg, engine_id="w-pp", pipeline_parallel_size=2)
    h.close()
    stages = []
    try:
        for stage in (1, 0):  # stage 1 first: its endpoint exists before stage 0 relays to it
            monkeypatch.setenv("KVSM_PP_RANK", str(stage))
            c = KVSMConnector(h.vllm_config, KVConnectorRole.WORKER, h.worker_kv_cache_configs[stage])
            stages.append(c)
            name = f"model.layers.{stage}.self_attn.attn"
            c.register_kv_caches({name: torch.zeros(8, 2, 16, 64)})
            worker = c.worker_half
            assert worker is not None and worker.compat is not None and worker.pp_rank == stage
            assert worker.agent_name == "kvsm-w-pp-dp0-tp0" + ("-pp1" if stage else "")
            assert worker.compat.num_layers == 2
        s1, s0 = (c.worker_half for c in stages)
        assert s0 is not None and s1 is not None and s0.server is not None and s1.server is not None
        assert s0.server.address.endswith(f":{cfg['side_channel_port']}") and "-tp0-pp1" in s1.server.address
        assert s0.compat is not None
        client = HandshakeClient(s0.compat, "decode-agent")
        try:
            rid = client.fetch_metadata(f"tcp://127.0.0.1:{cfg['side_channel_port']}", tp_rank=0, pp_rank=1,
                                        deadline_ns=time.monotonic_ns() + 10 * 10**9)
            end = time.monotonic() + 10
            got = []
            while not got and time.monotonic() < end:
                got = client.poll_results() or [r for s in client.sockets() for r in client.on_readable(s)]
                time.sleep(0.005)
            (result,) = got
            reply = result.outcome
            assert result.request_id == rid and isinstance(reply, MetadataReply), reply
            assert reply.agent_name == "kvsm-w-pp-dp0-tp0-pp1" and reply.pp_rank == 1
            info = msgspec.msgpack.decode(reply.agent_metadata, type=NixlPeerInfo)
            assert info.layout.layer_names() == ("model.layers.1.self_attn.attn",)
        finally:
            client.close()
    finally:
        for c in stages:
            c.shutdown()


def test_hostile_write_asks_are_refused_naming_what_was_wrong(connector: KVSMConnector) -> None:
    """Push mode's side-channel message from strangers: an agent that cannot be
    loaded, a request not pinned here, blocks that are not the request's: each is
    answered, nothing written, the refusals name what was wrong, and the pinned
    request stays pinned for its real reader. A deadline already past writes
    nothing either."""
    import zmq

    from kvsm.handoff.facts import SendFinish, SendStart, StepFacts
    from kvsm.handshake.codec import decode_reply, encode
    from kvsm.handshake.messages import PROTOCOL_VERSION, ClaimsReply, ErrorReply, WriteAsk, WriteSpec

    connector.register_kv_caches(kv_caches())
    other = worker_connector("kv_consumer")  # a real decode agent to load (another engine)
    other.register_kv_caches(kv_caches())
    worker = connector.worker_half
    assert worker is not None and other.worker_half is not None
    metadata = other.worker_half.transport.metadata()  # type: ignore[union-attr]
    worker.loop.call(lambda: worker.sender._on_pins([SendFinish(req="p-1", ok=True, block_ids=(1, 2),
                                                                pinned_ns=worker.loop.now_ns())], "test"),
                     timeout=5.0, label="pin")
    ctx = zmq.Context()

    def ask(**spec: Any) -> ClaimsReply | ErrorReply:
        fields = {"req": "p-1", "dst_req": "d-1", "notif": b"n", "src_blocks": [1, 2], "dst_blocks": [3, 4],
                  "deadline_wall_ns": time.time_ns() + 10 * 10**9, **spec}
        agent = fields.pop("agent", metadata)
        msg = WriteAsk(protocol=PROTOCOL_VERSION, requester="stranger", agent_metadata=agent,
                       writes=[WriteSpec(**fields)])
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{connector.cfg.side_channel_port}")
        try:
            sock.send(encode(msg))
            assert sock.poll(5000), "the side channel did not answer a write ask"
            reply = decode_reply(sock.recv())
        finally:
            sock.close()
        assert isinstance(reply, (ClaimsReply, ErrorReply))
        return reply

    try:
        bad_agent = ask(agent=b"\x00not an agent")
        assert isinstance(bad_agent, ErrorReply) and bad_agent.code == "refused", bad_agent
        assert "agent cannot be loaded" in bad_agent.detail
        unknown = ask(req="p-nobody")
        assert isinstance(unknown, ClaimsReply) and unknown.claims == {"p-nobody": "unknown"}
        stolen = ask(src_blocks=[1, 7])
        assert isinstance(stolen, ErrorReply) and stolen.code == "refused", stolen
        assert "[7]" in stolen.detail and "not the request's" in stolen.detail
        assert worker.debug_state()["send"] == {"p-1": "awaiting_pull"}  # still pinned for its reader
        # An ask past its deadline writes nothing; its asker is through, as by an abandon
        # (the one reader here: the blocks go at once, not at the lease's end).
        late = ask(deadline_wall_ns=time.time_ns() - 10**9)
        assert isinstance(late, ClaimsReply) and late.claims == {"p-1": "expired"}
        assert worker.debug_state()["send"] == {}
        # A streamed ask whose blocks come in KV cache groups this pool does not have
        # (one group here): never written, so its asker hears so at once.
        facts = StepFacts(1)
        facts.send_start = [SendStart(req="p-s", stream="key-s")]
        worker.submit(facts)
        wait_until(lambda: "p-s" in worker.debug_state()["send"], 5, "the streamed prefill known")
        grouped = ask(req="key-s", src_blocks=[], dst_blocks=[3, 4], group_sizes=[1, 1], dst_firsts=[0, 0],
                      stream=True)
        assert isinstance(grouped, ClaimsReply) and grouped.claims == {"key-s": "expired"}, grouped
        assert not worker.sender.writer.streamer.streams
    finally:
        ctx.term()
        other.shutdown()
