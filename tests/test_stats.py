"""Connector statistics: the recorder, merging and summarising, vLLM's transport, Prometheus.

The transport and Prometheus tests go through vLLM's own code: the shared-memory
``MessageQueue`` that carries worker outputs to the engine core, the
``KVOutputAggregator`` that merges workers, the msgpack encoder that carries
``SchedulerStats`` to the front end, and ``KVConnectorLogging`` /
``KVConnectorProm``, which find the connector class through vLLM's factory (a
probe connector defined here stands in for ``kvsm.connector``).
"""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from conftest import examples
from kvsm.vllm.stats import (
    KVSMPromMetrics,
    KVSMStats,
    build_prom_metrics,
    build_stats,
    wrap,
)
from kvsm.worker import stats as stats_mod
from kvsm.worker.stats import StatsRecorder

MIB = 2**20
LABELNAMES = ["model_name", "engine"]  # what vLLM's PrometheusStatLogger passes
PER_ENGINE = {0: ["m", "0"], 1: ["m", "1"]}


def probe_config() -> KVTransferConfig:
    """vLLM's stat loggers find KVSMConnector's stats classes through this config."""
    return KVTransferConfig(kv_connector="KVSMConnector", kv_connector_module_path="kvsm.connector",
                            kv_role="kv_both")


def busy_recorder(source: str, *, xfers: int = 2, max_samples: int = 100) -> StatsRecorder:
    """A recorder with a bit of everything in it."""
    rec = StatsRecorder(source, max_samples=max_samples)
    for i in range(xfers):
        rec.transfer_done(0.01 * (i + 1), (i + 1) * MIB, 4 * (i + 1))
    rec.handshake_done(0.002)
    rec.failure("timeout")
    rec.failure("peer_dead")
    rec.failure("timeout")
    rec.lease_expired()
    rec.read_served()
    rec.set_states("recv", {"transferring": 2, "pending_handshake": 1})
    rec.set_states("send", {"awaiting_pull": 5})
    return rec


def took(rec: StatsRecorder) -> KVSMStats | None:
    """One interval, as the connector hands it to vLLM (``get_kv_connector_stats``)."""
    return wrap(rec.take())


# -- the recorder ---------------------------------------------------------------------------------


def test_recorder_counts_every_kind_of_event() -> None:
    d = busy_recorder("w0").take()
    assert d is not None and type(d) is dict, "the recorder's interval is plain data, no vLLM object"
    assert d["schema"] == stats_mod.SCHEMA
    assert d["xfer_s"] == [0.01, 0.02]
    assert d["xfer_bytes"] == [MIB, 2 * MIB]
    assert d["xfer_descs"] == [4, 8]
    assert d["handshake_s"] == [0.002]
    assert (d["num_xfers"], d["xfer_bytes_total"], d["xfer_descs_total"], d["num_handshakes"]) == (2, 3 * MIB, 12, 1)
    assert d["failures"] == {"timeout": 2, "peer_dead": 1}
    assert (d["leases_expired"], d["reads_served"], d["dropped_samples"]) == (1, 1, 0)
    assert d["states"] == {"w0": {"recv": {"transferring": 2, "pending_handshake": 1}, "send": {"awaiting_pull": 5}}}


def test_take_resets_the_rates_but_keeps_the_gauge() -> None:
    rec = busy_recorder("w0")
    assert rec.take() is not None
    assert rec.take() is None, "nothing happened since the last take"

    rec.failure("handshake")
    d = rec.take()
    assert d is not None
    assert d["failures"] == {"handshake": 1}
    assert d["num_xfers"] == d["leases_expired"] == d["reads_served"] == 0
    assert d["xfer_s"] == [] and d["handshake_s"] == []
    assert d["states"]["w0"]["send"] == {"awaiting_pull": 5}, "the gauge is carried over"


def test_a_changed_snapshot_alone_makes_a_take() -> None:
    rec = StatsRecorder("w0")
    assert rec.take() is None
    rec.set_states("recv", {"transferring": 1, "done": 0})
    d = rec.take()
    assert d is not None
    assert d["states"] == {"w0": {"recv": {"transferring": 1}}}, "zero counts are left out"
    assert not stats_mod.is_empty(d)

    rec.set_states("recv", {"transferring": 1})
    assert rec.take() is None, "the same counts again are no change"
    rec.set_states("recv", {})
    d = rec.take()
    assert d is not None and d["states"] == {"w0": {"recv": {}}}


def test_totals_are_cumulative_across_takes() -> None:
    rec = busy_recorder("w0")
    rec.take()
    rec.transfer_done(0.5, 10, 1)
    rec.failure("timeout")
    rec.failure("transfer")
    totals = rec.totals()  # one interval taken, one still open
    assert totals["num_xfers"] == 3
    assert totals["xfer_bytes_total"] == 3 * MIB + 10
    assert totals["xfer_descs_total"] == 13
    assert totals["num_handshakes"] == 1
    assert totals["failures"] == {"timeout": 3, "peer_dead": 1, "transfer": 1}
    assert (totals["leases_expired"], totals["reads_served"], totals["takes"]) == (1, 1, 1)
    assert totals["states"] == {"recv": {"transferring": 2, "pending_handshake": 1}, "send": {"awaiting_pull": 5}}
    rec.take()
    assert rec.totals()["num_xfers"] == 3, "take does not reset totals"
    assert rec.totals()["takes"] == 2


def test_samples_are_capped_and_the_rest_counted() -> None:
    rec = StatsRecorder("w0", max_samples=3)
    for i in range(5):
        rec.transfer_done(float(i), 100, 2)
    for _ in range(4):
        rec.handshake_done(0.1)
    d = rec.take()
    assert d is not None
    assert d["xfer_s"] == [0.0, 1.0, 2.0] and len(d["xfer_bytes"]) == len(d["xfer_descs"]) == 3
    assert d["handshake_s"] == [0.1] * 3
    assert d["dropped_samples"] == 2 + 1
    assert (d["num_xfers"], d["xfer_bytes_total"], d["xfer_descs_total"], d["num_handshakes"]) == (5, 500, 10, 4)
    assert stats_mod.summary(d)["Dropped samples"] == 3

    rec.transfer_done(9.0, 1, 1)  # a new interval has room again
    again = rec.take()
    assert again is not None and again["xfer_s"] == [9.0] and again["dropped_samples"] == 0
    assert rec.totals()["dropped_samples"] == 3


@pytest.fixture
def eager_thread_switches() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, to interleave takes and records finely."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("eager_thread_switches")
def test_recording_from_many_threads_while_another_takes() -> None:
    writers, per_writer = 4, 5_000
    rec = StatsRecorder("w0", max_samples=writers * per_writer)
    taken: list[stats_mod.StatsData] = []
    done = threading.Event()

    def write(idx: int) -> None:
        for i in range(per_writer):
            rec.transfer_done(0.001, 3, 2)
            rec.handshake_done(0.002)
            rec.failure("timeout" if i % 2 else f"kind{idx}")
            rec.read_served()
            if i % 500 == 0:
                time.sleep(0)  # let the taker in
            if i % 100 == 0:
                rec.set_states("recv", {"transferring": i % 7 + 1})

    def take() -> None:
        while not done.is_set():
            if (s := rec.take()) is not None:
                taken.append(s)
        if (s := rec.take()) is not None:
            taken.append(s)

    taker = threading.Thread(target=take)
    taker.start()
    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    taker.join()

    n = writers * per_writer
    assert len(taken) > 1, "the taker should have interleaved with the writers"
    for d in taken:  # every take is one consistent cut: no record half in one take, half in the next
        assert len(d["xfer_s"]) == len(d["xfer_bytes"]) == len(d["xfer_descs"]) == d["num_xfers"]
        assert (d["xfer_bytes_total"], d["xfer_descs_total"]) == (3 * d["num_xfers"], 2 * d["num_xfers"])
        assert len(d["handshake_s"]) == d["num_handshakes"]
    d = stats_mod.empty_data()  # the vLLM-free maths that KVSMStats.aggregate delegates to
    for s in taken:
        stats_mod.merge(d, s)
    assert (d["num_xfers"], d["xfer_bytes_total"], d["xfer_descs_total"]) == (n, 3 * n, 2 * n)
    kept = min(n, stats_mod.MAX_SAMPLES)  # each take fits, but the merge of them all is capped again
    assert len(d["xfer_s"]) == len(d["xfer_bytes"]) == len(d["handshake_s"]) == kept
    assert d["dropped_samples"] == 2 * (n - kept)
    assert d["reads_served"] == n
    assert sum(d["failures"].values()) == n and d["failures"]["timeout"] == n // 2
    totals = rec.totals()
    assert totals["num_xfers"] == totals["num_handshakes"] == totals["reads_served"] == n
    assert totals["xfer_bytes_total"] == 3 * n
    assert totals["failures"] == {"timeout": n // 2, **{f"kind{i}": per_writer // 2 for i in range(writers)}}
    assert totals["takes"] == len(taken)


def test_bad_max_samples_is_refused() -> None:
    with pytest.raises(ValueError):
        StatsRecorder(max_samples=-1)


def test_default_sources_are_distinct() -> None:
    assert StatsRecorder().source != StatsRecorder().source


# -- merging and summarising ------------------------------------------------------------------------


def two_workers() -> tuple[KVSMStats, KVSMStats]:
    a = took(busy_recorder("w0", xfers=2))
    b = StatsRecorder("w1")
    b.transfer_done(0.5, 4 * MIB, 1)
    b.failure("timeout")
    b.failure("handshake")
    b.handshake_done(0.008)
    b.set_states("recv", {"transferring": 3, "remote_known": 1})
    bs = took(b)
    assert a is not None and bs is not None
    return a, bs


def test_aggregate_of_two_workers_adds_counts_and_concatenates_samples() -> None:
    a, b = two_workers()
    merged = a.aggregate(b)
    assert merged is a, "like vLLM's own stats, aggregate merges in place and returns the accumulator"
    d = merged.data
    assert d["xfer_s"] == [0.01, 0.02, 0.5]
    assert d["xfer_bytes"] == [MIB, 2 * MIB, 4 * MIB]
    assert d["xfer_descs"] == [4, 8, 1]
    assert d["handshake_s"] == [0.002, 0.008]
    assert (d["num_xfers"], d["xfer_bytes_total"], d["xfer_descs_total"], d["num_handshakes"]) == (3, 7 * MIB, 13, 2)
    assert d["failures"] == {"timeout": 3, "peer_dead": 1, "handshake": 1}
    assert set(d["states"]) == {"w0", "w1"}
    reduced = merged.reduce()
    assert reduced["Reqs recv/transferring"] == 5, "across workers the state counts add up"
    assert reduced["Reqs recv/pending_handshake"] == 1
    assert reduced["Reqs recv/remote_known"] == 1
    assert reduced["Reqs send/awaiting_pull"] == 5


def test_aggregate_over_time_keeps_the_latest_snapshot() -> None:
    rec = StatsRecorder("w0")
    rec.set_states("recv", {"transferring": 4})
    first = took(rec)
    rec.set_states("recv", {"transferring": 1, "done": 2})
    second = took(rec)
    assert first is not None and second is not None
    first.aggregate(second)
    assert first.data["states"] == {"w0": {"recv": {"transferring": 1, "done": 2}}}
    assert first.reduce()["Reqs recv/transferring"] == 1


def test_aggregate_caps_merged_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_mod, "MAX_SAMPLES", 4)
    a, b = StatsRecorder("a"), StatsRecorder("b")
    for i in range(3):
        a.transfer_done(float(i), 1, 1)
        b.transfer_done(10.0 + i, 2, 2)
        b.handshake_done(0.5)
    sa, sb = took(a), took(b)
    assert sa is not None and sb is not None
    d = sa.aggregate(sb).data
    assert d["xfer_s"] == [0.0, 1.0, 2.0, 10.0] and d["xfer_bytes"] == [1, 1, 1, 2] and d["xfer_descs"] == [1, 1, 1, 2]
    assert d["handshake_s"] == [0.5] * 3
    assert d["dropped_samples"] == 2
    assert (d["num_xfers"], d["xfer_bytes_total"]) == (6, 9), "counts stay exact"


def test_aggregate_with_itself_doubles() -> None:
    a, _ = two_workers()
    a.aggregate(a)
    assert a.data["num_xfers"] == 4 and a.data["xfer_s"] == [0.01, 0.02, 0.01, 0.02]


def test_aggregate_refuses_foreign_stats() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    with pytest.raises(TypeError):
        KVSMStats().aggregate(KVConnectorStats(data={"x": 1}))


def test_reduce_against_hand_computed_values() -> None:
    stats = KVSMStats()
    for seconds, mib, descs in [(0.010, 1, 1), (0.020, 1, 2), (0.030, 2, 3), (0.040, 4, 4), (0.100, 8, 10)]:
        rec = StatsRecorder("x")
        rec.transfer_done(seconds, mib * MIB, descs)
        s = took(rec)
        assert s is not None
        stats.aggregate(s)
    rec = StatsRecorder("x")
    rec.handshake_done(0.005)
    rec.handshake_done(0.015)
    rec.failure("timeout")
    rec.failure("incompatible")
    rec.lease_expired()
    for _ in range(3):
        rec.read_served()
    s = took(rec)
    assert s is not None
    r = stats.aggregate(s).reduce()
    # 5 transfers: mean 40 ms; p90 at rank 3.6 of the sorted list: 40 + 0.6 * (100 - 40) = 76 ms.
    assert r["Num successful transfers"] == 5
    assert r["Avg xfer time (ms)"] == pytest.approx(40.0)
    assert r["P90 xfer time (ms)"] == pytest.approx(76.0)
    assert r["P90 xfer time (ms)"] == pytest.approx(np.percentile([10, 20, 30, 40, 100], 90))
    assert r["Total MB"] == 16.0
    assert r["Throughput (MB/s)"] == pytest.approx(16 / 0.2)
    assert r["Avg descriptors"] == 4.0
    # 2 handshakes: mean 10 ms, p90 at rank 0.9: 5 + 0.9 * 10 = 14 ms.
    assert r["Num handshakes"] == 2
    assert r["Avg handshake (ms)"] == pytest.approx(10.0)
    assert r["P90 handshake (ms)"] == pytest.approx(14.0)
    assert r["Num failures"] == 2
    assert r["Failures timeout"] == 1 and r["Failures incompatible"] == 1
    assert r["Leases expired"] == 1 and r["Reads served"] == 3
    assert "Dropped samples" not in r


def test_reduce_of_failures_only() -> None:
    rec = StatsRecorder("x")
    rec.failure("peer_dead")
    s = took(rec)
    assert s is not None
    r = s.reduce()
    assert r["Num successful transfers"] == 0
    assert r["Avg xfer time (ms)"] == r["P90 xfer time (ms)"] == r["Throughput (MB/s)"] == 0
    assert r["Avg handshake (ms)"] == 0 and r["Avg descriptors"] == 0
    assert r["Num failures"] == 1 and r["Failures peer_dead"] == 1


def test_is_empty_and_reset() -> None:
    assert KVSMStats().is_empty()
    assert build_stats(None).is_empty() and build_stats({}).is_empty()
    for record in (
        lambda r: r.failure("x"),
        lambda r: r.lease_expired(),
        lambda r: r.read_served(),
        lambda r: r.handshake_done(0.1),
        lambda r: r.transfer_done(0.1, 1, 1),
        lambda r: r.set_states("send", {"awaiting_pull": 1}),
    ):
        rec = StatsRecorder("x")
        record(rec)
        s = took(rec)
        assert s is not None and not s.is_empty()
        s.reset()
        assert s.is_empty()
        assert s == KVSMStats()


def test_build_stats_fills_in_missing_keys_and_copies() -> None:
    payload = {"num_xfers": 2, "xfer_s": [0.1, 0.2], "failures": {"timeout": 1}}
    s = build_stats(payload)
    assert s.data["xfer_bytes_total"] == 0 and s.data["states"] == {} and s.data["schema"] == stats_mod.SCHEMA
    s.aggregate(build_stats({"xfer_s": [0.3], "num_xfers": 1}))
    assert payload["xfer_s"] == [0.1, 0.2], "a rebuilt object never changes the payload it came from"


@settings(max_examples=examples(50), deadline=None)
@given(
    events=st.lists(
        st.tuples(
            st.integers(0, 2),  # which worker
            st.sampled_from(["xfer", "hs", "fail", "lease", "read"]),
            st.integers(0, 10**9),
        ),
        max_size=60,
    ),
    cuts=st.lists(st.integers(0, 60), max_size=4),
)
def test_merging_any_takes_of_any_workers_matches_the_totals(
    events: list[tuple[int, str, int]], cuts: list[int]
) -> None:
    recs = [StatsRecorder(f"w{i}") for i in range(3)]
    takes: list[KVSMStats] = []
    for i, (worker, what, n) in enumerate(events):
        if i in cuts:
            takes.extend(s for r in recs if (s := took(r)) is not None)
        rec = recs[worker]
        if what == "xfer":
            rec.transfer_done(n / 1e9, n, n % 97)
        elif what == "hs":
            rec.handshake_done(n / 1e9)
        elif what == "fail":
            rec.failure(f"k{n % 3}")
        elif what == "lease":
            rec.lease_expired()
        else:
            rec.read_served()
    takes.extend(s for r in recs if (s := took(r)) is not None)
    merged = KVSMStats()
    for s in takes:
        merged.aggregate(s)
    for key in ("num_xfers", "xfer_bytes_total", "xfer_descs_total", "num_handshakes", "leases_expired"):
        assert merged.data[key] == sum(r.totals()[key] for r in recs)
    assert sum(merged.data["failures"].values()) == sum(sum(r.totals()["failures"].values()) for r in recs)
    assert len(merged.data["xfer_s"]) == merged.data["num_xfers"]


# -- vLLM's transport ---------------------------------------------------------------------------------


@pytest.fixture
def worker_to_engine_queue() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    """vLLM's shared-memory queue that carries each worker's ModelRunnerOutput to the engine core."""
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(timeout=10)
    yield writer, reader
    reader.shutdown()
    writer.shutdown()


def test_round_trip_through_vllms_transport(worker_to_engine_queue: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = worker_to_engine_queue
    a, b = two_workers()
    expected = build_stats(a.data).aggregate(build_stats(b.data))

    # Worker -> engine core: each worker's ModelRunnerOutput is pickled through the shm queue.
    received: list[ModelRunnerOutput | None] = []
    for stats in (a, b):
        kv_output = KVConnectorOutput(kv_connector_stats=stats)
        writer.enqueue(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=kv_output))
        received.append(reader.dequeue(timeout=10))
    got = [o.kv_connector_output.kv_connector_stats for o in received if o and o.kv_connector_output]
    assert got == [a, b] and all(type(s) is KVSMStats for s in got)

    # Engine core: the workers' stats are merged, and the scheduler ships ``to_dict()``.
    merged_output = KVOutputAggregator(expected_finished_count=2).aggregate(received)
    assert merged_output is not None and merged_output.kv_connector_output is not None
    merged = merged_output.kv_connector_output.kv_connector_stats
    assert merged == expected
    assert merged is not None
    sched_stats = SchedulerStats(kv_connector_stats=merged.to_dict())

    # Engine core -> front end: msgpack of EngineCoreOutputs; the front end rebuilds the stats.
    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=sched_stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert decoded.scheduler_stats is not None
    data = decoded.scheduler_stats.kv_connector_stats
    assert data is not None
    rebuilt = build_stats(data)
    assert rebuilt == expected
    assert rebuilt.reduce() == expected.reduce()


def test_stats_pickle_and_empty_payload() -> None:
    a, _ = two_workers()
    assert pickle.loads(pickle.dumps(a, protocol=pickle.HIGHEST_PROTOCOL)) == a
    assert build_stats(None) == KVSMStats() == build_stats(KVSMStats().to_dict())


def test_vllms_log_line_through_kvconnectorlogging() -> None:
    logging_ = KVConnectorLogging(probe_config())
    a, b = two_workers()
    logging_.observe(a.to_dict())
    logging_.observe(b.to_dict())
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    line = lines[0]
    assert "Num successful transfers=3" in line
    assert "Failures timeout=3" in line
    assert "Reqs recv/transferring=5" in line
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1, "the accumulator is reset after each log line"


# -- Prometheus ---------------------------------------------------------------------------------------


def registry_metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """prometheus_client's classes, registering in ``registry`` instead of the global one."""

    def bind(cls: type) -> type:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("registry", registry)
            cls.__init__(self, *args, **kwargs)

        return type(cls.__name__, (cls,), {"__init__": __init__})

    return {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}


@pytest.fixture
def prom() -> tuple[KVSMPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    vllm_config = VllmConfig(kv_transfer_config=probe_config())
    metrics = build_prom_metrics(vllm_config, registry_metric_types(registry), LABELNAMES, PER_ENGINE)
    return metrics, registry


def value(registry: CollectorRegistry, name: str, engine: str = "0", **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})


def test_prometheus_metrics_from_stats_data(prom: tuple[KVSMPromMetrics, CollectorRegistry]) -> None:
    metrics, registry = prom
    a, b = two_workers()
    metrics.observe(a.aggregate(b).to_dict(), engine_idx=0)

    assert value(registry, "vllm:kvsm_transfer_time_seconds_count") == 3
    assert value(registry, "vllm:kvsm_transfer_time_seconds_sum") == pytest.approx(0.53)
    assert value(registry, "vllm:kvsm_transfer_time_seconds_bucket", le="0.01") == 1
    assert value(registry, "vllm:kvsm_transfer_time_seconds_bucket", le="0.025") == 2
    assert value(registry, "vllm:kvsm_transfer_time_seconds_bucket", le="+Inf") == 3
    assert value(registry, "vllm:kvsm_handshake_time_seconds_count") == 2
    assert value(registry, "vllm:kvsm_handshake_time_seconds_sum") == pytest.approx(0.01)
    assert value(registry, "vllm:kvsm_transfers_total") == 3
    assert value(registry, "vllm:kvsm_transfer_bytes_total") == 7 * MIB
    assert value(registry, "vllm:kvsm_descriptors_total") == 13
    assert value(registry, "vllm:kvsm_leases_expired_total") == 1
    assert value(registry, "vllm:kvsm_reads_served_total") == 1
    assert value(registry, "vllm:kvsm_failures_total", kind="timeout") == 3
    assert value(registry, "vllm:kvsm_failures_total", kind="peer_dead") == 1
    assert value(registry, "vllm:kvsm_failures_total", kind="handshake") == 1
    assert value(registry, "vllm:kvsm_failures_total", kind="lease_expired") is None, "kinds appear on first use"
    assert value(registry, "vllm:kvsm_requests", lifecycle="recv", state="transferring") == 5
    assert value(registry, "vllm:kvsm_requests", lifecycle="recv", state="remote_known") == 1
    assert value(registry, "vllm:kvsm_requests", lifecycle="send", state="awaiting_pull") == 5
    assert value(registry, "vllm:kvsm_transfers_total", engine="1") == 0, "engine 1 saw nothing"

    rec = StatsRecorder("w9")
    rec.failure("brand new kind")
    later = took(rec)
    assert later is not None
    metrics.observe(later.to_dict(), engine_idx=1)
    assert value(registry, "vllm:kvsm_failures_total", engine="1", kind="brand new kind") == 1
    assert value(registry, "vllm:kvsm_failures_total", engine="0", kind="brand new kind") is None
    assert value(registry, "vllm:kvsm_failures_total", engine="0", kind="timeout") == 3


def test_prometheus_state_gauge_sums_workers_and_follows_the_latest(
    prom: tuple[KVSMPromMetrics, CollectorRegistry],
) -> None:
    metrics, registry = prom
    w0, w1 = StatsRecorder("w0"), StatsRecorder("w1")
    w0.set_states("recv", {"transferring": 2, "pending_handshake": 1})
    w1.set_states("recv", {"transferring": 3})

    def step(*recs: StatsRecorder) -> None:
        merged = KVSMStats()
        for r in recs:
            if (s := took(r)) is not None:
                merged.aggregate(s)
        metrics.observe(merged.to_dict(), engine_idx=0)

    def gauge(state: str) -> float | None:
        return value(registry, "vllm:kvsm_requests", lifecycle="recv", state=state)

    step(w0, w1)
    assert (gauge("transferring"), gauge("pending_handshake")) == (5, 1)

    w0.set_states("recv", {"transferring": 1, "done": 4})  # pending_handshake drained
    step(w0, w1)  # w1 has no news this step: its 3 still count
    assert (gauge("transferring"), gauge("pending_handshake"), gauge("done")) == (4, 0, 4)

    w1.failure("timeout")  # a take without a state change still carries w1's snapshot
    step(w0, w1)
    assert gauge("transferring") == 4


def test_prometheus_through_vllms_kvconnectorprom() -> None:
    """The path PrometheusStatLogger takes: KVConnectorProm finds the connector class and its metrics."""
    unregister_vllm_metrics()
    try:
        vllm_config = VllmConfig(kv_transfer_config=probe_config())
        kv_prom = KVConnectorProm(vllm_config, LABELNAMES, PER_ENGINE)
        assert isinstance(kv_prom.prom_metrics, KVSMPromMetrics)
        a, _ = two_workers()
        kv_prom.observe(a.to_dict(), engine_idx=1)
        labels = {"model_name": "m", "engine": "1"}
        assert REGISTRY.get_sample_value("vllm:kvsm_transfer_bytes_total", labels) == 3 * MIB
        assert REGISTRY.get_sample_value("vllm:kvsm_failures_total", {**labels, "kind": "timeout"}) == 2
        assert (
            REGISTRY.get_sample_value("vllm:kvsm_requests", {**labels, "lifecycle": "send", "state": "awaiting_pull"})
            == 5
        )
    finally:
        unregister_vllm_metrics()
    assert REGISTRY.get_sample_value("vllm:kvsm_transfer_bytes_total", {"model_name": "m", "engine": "1"}) is None


def test_side_channel_outcomes_add_up_across_workers_takes_and_prometheus(
    prom: tuple[KVSMPromMetrics, CollectorRegistry],
) -> None:
    metrics, registry = prom
    w0, w1 = StatsRecorder("w0"), StatsRecorder("w1")
    w0.side_channel({"served": 2, "malformed": 1})
    w0.side_channel({"served": 1, "too_large": 0})
    w1.side_channel({"malformed": 4})
    a, b = took(w0), took(w1)
    assert a is not None and b is not None, "side-channel counts alone make a take non-empty"
    assert a.data["side_channel"] == {"served": 3, "malformed": 1}
    merged = build_stats(a.to_dict()).aggregate(b)
    assert merged.data["side_channel"] == {"served": 3, "malformed": 5}
    assert merged.reduce()["Side channel malformed"] == 5
    assert took(w0) is None and w0.totals()["side_channel"] == {"served": 3, "malformed": 1}
    metrics.observe(merged.to_dict(), engine_idx=0)
    metrics.observe(b.to_dict(), engine_idx=0)
    assert value(registry, "vllm:kvsm_side_channel_messages_total", outcome="served") == 3
    assert value(registry, "vllm:kvsm_side_channel_messages_total", outcome="malformed") == 9
    assert value(registry, "vllm:kvsm_side_channel_messages_total", outcome="too_large") is None
