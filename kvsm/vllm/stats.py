"""kvsm's statistics as vLLM wants them: a thin adapter over ``kvsm.worker.stats``.

``kvsm.worker.stats`` holds the recorder and the maths and imports no vLLM, so the
worker layer and the simulation run without it; this module only wraps them in
vLLM's classes for the connector (``kvsm.connector``):

* ``KVSMStats`` is one interval of one worker (or the merge of several). vLLM
  pickles it from each worker to the engine core (shared-memory
  ``MessageQueue``), merges the workers' objects with ``aggregate``
  (``KVOutputAggregator``), ships its ``data`` dict to the front end inside
  ``SchedulerStats`` (msgspec/msgpack), and rebuilds it there with the
  connector's ``build_kv_connector_stats(data)`` = ``build_stats(data)``.
* ``KVSMPromMetrics`` turns each step's ``data`` into Prometheus metrics named
  ``vllm:kvsm_*``, through the metric classes vLLM passes in (plain
  prometheus_client ones, or Ray's wrappers), so vLLM's registry and
  multiprocess handling applies.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvsm.worker import stats
from kvsm.worker.stats import StateCounts, StatsData, sum_states

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "HANDSHAKE_BUCKETS",
    "TRANSFER_BUCKETS",
    "KVSMPromMetrics",
    "KVSMStats",
    "build_prom_metrics",
    "build_stats",
    "wrap",
]

# Seconds. Transfers on this machine range from sub-millisecond to the 10-40 s
# stalls seen with upstream (docs/design.md), so the buckets span both.
TRANSFER_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
HANDSHAKE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class KVSMStats(KVConnectorStats):
    """One interval of kvsm statistics, from one worker or merged from several.

    ``data`` is the whole state (``kvsm.worker.stats.empty_data``'s layout), so the
    object pickles as is and ``build_stats(stats.data)`` rebuilds an equal one.
    Every method delegates to ``kvsm.worker.stats``.
    """

    data: StatsData = field(default_factory=dict)  # as the base declares it; typed here for mypy

    def __post_init__(self) -> None:
        self.data = stats.normalized(self.data)

    def reset(self) -> None:
        """Forget everything, the state snapshots included."""
        self.data = stats.empty_data()

    def is_empty(self) -> bool:
        """True when there is nothing to log: no event counted and no state snapshot."""
        return stats.is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVSMStats:
        """Merge ``other`` into this object and return it (``kvsm.worker.stats.merge``:
        ``other`` is the later report)."""
        if not isinstance(other, KVSMStats):
            raise TypeError(f"cannot aggregate KVSMStats with {type(other).__name__}")
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summary numbers of the interval for vLLM's periodic "KV Transfer metrics" log line."""
        return stats.summary(self.data)


def build_stats(data: dict[str, Any] | None = None) -> KVSMStats:
    """Rebuild stats from the ``data`` dict vLLM shipped (the connector's ``build_kv_connector_stats``)."""
    return KVSMStats(data=data or {})


def wrap(data: StatsData | None) -> KVSMStats | None:
    """What ``StatsRecorder.take`` returned, as vLLM's stats object (None stays None)."""
    return None if data is None else KVSMStats(data=data)


class KVSMPromMetrics(KVConnectorPromMetrics):
    """kvsm's Prometheus metrics (``vllm:kvsm_*``), fed one step's stats ``data`` at a time.

    Metric objects come from the classes in ``metric_types`` (vLLM's choice:
    prometheus_client, or Ray's wrappers), one child per engine. Children with
    an extra label (failure kind, request state) are made on first use with a
    single ``labels()`` call on the parent, which both kinds of class accept.

    The request-state gauge is the sum over every source (worker) this engine
    has reported: a step's payload carries only the workers that had news, so
    the last snapshot of each is remembered, and a state that drops out of all
    snapshots is set back to 0 rather than left at its old value.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = self.per_engine_labelvalues
        histogram, counter = self._histogram_cls, self._counter_cls
        labels = list(labelnames)

        self.transfer_time = create_metric_per_engine(
            histogram(
                name="vllm:kvsm_transfer_time_seconds",
                documentation="Time from posting a request's KV reads to the last one finishing (kvsm).",
                buckets=list(TRANSFER_BUCKETS),
                labelnames=labels,
            ),
            per_engine,
        )
        self.handshake_time = create_metric_per_engine(
            histogram(
                name="vllm:kvsm_handshake_time_seconds",
                documentation="Latency of side-channel handshakes with remote engines (kvsm).",
                buckets=list(HANDSHAKE_BUCKETS),
                labelnames=labels,
            ),
            per_engine,
        )
        self.transfers = self._counter_per_engine(
            "vllm:kvsm_transfers", "Requests whose KV blocks were read from a remote engine (kvsm)."
        )
        self.transfer_bytes = self._counter_per_engine(
            "vllm:kvsm_transfer_bytes", "Bytes of KV cache read from remote engines (kvsm)."
        )
        self.descriptors = self._counter_per_engine(
            "vllm:kvsm_descriptors", "NIXL descriptors posted for KV reads (kvsm)."
        )
        self.leases_expired = self._counter_per_engine(
            "vllm:kvsm_leases_expired",
            "Prefill side: requests whose KV lease expired before a decode engine read them (kvsm).",
        )
        self.reads_served = self._counter_per_engine(
            "vllm:kvsm_reads_served",
            "Prefill side: requests whose KV blocks a decode engine read and released (kvsm).",
        )
        self.dropped_samples = self._counter_per_engine(
            "vllm:kvsm_dropped_samples",
            "Timing samples left out of the kvsm histograms because an interval had too many (kvsm).",
        )
        self._failures_parent = counter(
            name="vllm:kvsm_failures",
            documentation="kvsm failures by kind (handshake, timeout, peer_dead, transfer, lease_expired, ...).",
            labelnames=[*labels, "kind"],
        )
        self._side_channel_parent = counter(
            name="vllm:kvsm_side_channel_messages",
            documentation="Prefill side: side-channel messages by outcome (served, or the refusal's error "
                          "code: malformed, too_large, unknown_rank, ...) (kvsm).",
            labelnames=[*labels, "outcome"],
        )
        self._holds_parent = counter(
            name="vllm:kvsm_holds_ended",
            documentation="Decode side (bidirectional_kv_xfer): holds for next turns that ended unread, by how "
                          "(expired: their time to live; released: over the holds' budget) (kvsm).",
            labelnames=[*labels, "how"],
        )
        self._states_parent = self._gauge_cls(
            name="vllm:kvsm_requests",
            documentation="Requests per kvsm lifecycle and state, summed over the engine's workers.",
            multiprocess_mode="mostrecent",
            labelnames=[*labels, "lifecycle", "state"],
        )
        # Whether the side channel takes only the deployment's engines (CURVE keys
        # configured): 0 says it answers any host that reaches it. Set once here,
        # so it shows from the first scrape, before any request.
        extra = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}) \
            if vllm_config.kv_transfer_config is not None else {}
        keyed = bool(extra.get("side_channel_keys") or os.environ.get("KVSM_SIDE_CHANNEL_KEYS"))
        self.side_channel_authenticated = create_metric_per_engine(
            self._gauge_cls(
                name="vllm:kvsm_side_channel_authenticated",
                documentation="1: the side channel is CURVE-authenticated and encrypted (side_channel_keys); "
                              "0: it answers any host that can reach it (kvsm).",
                multiprocess_mode="mostrecent",
                labelnames=labels,
            ),
            per_engine,
        )
        for gauge in self.side_channel_authenticated.values():
            gauge.set(1 if keyed else 0)
        self._failure_children: dict[tuple[int, str], Any] = {}
        self._side_channel_children: dict[tuple[int, str], Any] = {}
        self._holds_children: dict[tuple[int, str], Any] = {}
        self._state_children: dict[tuple[int, str, str], Any] = {}
        self._states_by_source: dict[int, dict[str, StateCounts]] = {}

    def _counter_per_engine(self, name: str, documentation: str) -> dict[int, Any]:
        return create_metric_per_engine(
            self._counter_cls(name=name, documentation=documentation, labelnames=list(self._labelnames)),
            self.per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's ``KVSMStats.data`` of engine ``engine_idx``."""
        d = transfer_stats_data
        hist = self.transfer_time[engine_idx]
        for seconds in d.get("xfer_s", ()):
            hist.observe(seconds)
        hist = self.handshake_time[engine_idx]
        for seconds in d.get("handshake_s", ()):
            hist.observe(seconds)
        for metric, key in (
            (self.transfers, "num_xfers"),
            (self.transfer_bytes, "xfer_bytes_total"),
            (self.descriptors, "xfer_descs_total"),
            (self.leases_expired, "leases_expired"),
            (self.reads_served, "reads_served"),
            (self.dropped_samples, "dropped_samples"),
        ):
            if n := d.get(key, 0):
                metric[engine_idx].inc(n)
        for kind, n in d.get("failures", {}).items():
            if n:
                self._labelled_child(self._failures_parent, self._failure_children, engine_idx, kind).inc(n)
        for outcome, n in d.get("side_channel", {}).items():
            if n:
                self._labelled_child(self._side_channel_parent, self._side_channel_children, engine_idx,
                                     outcome).inc(n)
        for how, n in d.get("holds_ended", {}).items():
            if n:
                self._labelled_child(self._holds_parent, self._holds_children, engine_idx, how).inc(n)
        if states := d.get("states"):
            self._observe_states(engine_idx, states)

    def _labelled_child(self, parent: Any, children: dict[tuple[int, str], Any], engine_idx: int,
                        label: str) -> Any:
        key = (engine_idx, label)
        child = children.get(key)
        if child is None:
            labelvalues = self.per_engine_labelvalues[engine_idx]
            child = children[key] = parent.labels(*labelvalues, label)
        return child

    def _observe_states(self, engine_idx: int, states: Mapping[str, StateCounts]) -> None:
        known = self._states_by_source.setdefault(engine_idx, {})
        known.update(states)
        total = sum_states(known)
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for lifecycle, counts in total.items():
            for state in counts:
                key = (engine_idx, lifecycle, state)
                if key not in self._state_children:
                    self._state_children[key] = self._states_parent.labels(*labelvalues, lifecycle, state)
        for (idx, lifecycle, state), child in self._state_children.items():
            if idx == engine_idx:
                child.set(total.get(lifecycle, {}).get(state, 0))


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[type[PromMetric], type[PromMetricT]],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVSMPromMetrics:
    """kvsm's Prometheus metrics (the connector's ``build_prom_metrics``)."""
    return KVSMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
