"""Connector statistics without vLLM: what each worker measures, and the maths on it.

The worker layer (``kvsm.worker``, the simulation) uses this module alone;
``kvsm.vllm.stats`` is the thin adapter that hands the same numbers to vLLM
(its ``KVConnectorStats`` and Prometheus classes), so nothing here imports vLLM.

* ``StatsRecorder`` is written to by the worker's event-loop thread as things
  happen (a transfer finished, a handshake came back, a lease expired) and
  drained by the model-runner thread once per step, in
  ``get_kv_connector_stats``. Recording is a lock and an append: the loop
  thread owns all I/O and must never wait on statistics. ``take`` returns one
  interval as a plain ``data`` dict (the layout of ``empty_data``).
* ``merge`` adds one interval's ``data`` to another's, ``summary`` turns one
  into the few numbers of a log line, ``sum_states`` adds up the request-state
  snapshots. ``data`` holds only str-keyed dicts, lists and numbers, because
  vLLM pickles it (worker -> engine core) and then msgpacks it (engine core ->
  front end).

Memory stays bounded: an interval keeps at most ``MAX_SAMPLES`` samples per
list (and so does a merge); what does not fit is counted in
``dropped_samples``. The exact counters (transfers, bytes, descriptors,
handshakes) count every event, sampled or not, so only the timing
distributions lose detail under overload.

Request-state counts are a gauge, not a rate. Each recorder reports its
latest snapshot under its own ``source`` name; merging keeps one snapshot per
source (the later one, i.e. ``theirs``, for the same source) and readers sum
over sources. That one rule makes "across workers the counts add up" and
"across time the latest snapshot wins" both hold, whichever way vLLM merges.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

__all__ = [
    "MAX_SAMPLES",
    "SCHEMA",
    "StateCounts",
    "StatsData",
    "StatsRecorder",
    "empty_data",
    "is_empty",
    "merge",
    "normalized",
    "sum_states",
    "summary",
]

SCHEMA: Final = 1
"""Version of the ``data`` layout; bumped when a key changes meaning."""

MAX_SAMPLES: Final = 10_000
"""Most samples one list of one interval (or one merge) keeps."""

_SAMPLE_KEYS: Final = ("xfer_s", "xfer_bytes", "xfer_descs", "handshake_s")
_COUNTER_KEYS: Final = (
    "num_xfers",
    "xfer_bytes_total",
    "xfer_descs_total",
    "num_handshakes",
    "leases_expired",
    "reads_served",
    "dropped_samples",
)
_KEYED_KEYS: Final = ("failures", "side_channel", "holds_ended")
"""Counters broken down by a label: ``{key: {label value: count}}``."""

StateCounts: TypeAlias = dict[str, dict[str, int]]
"""``{lifecycle: {state: number of requests}}``, zero counts left out."""

StatsData: TypeAlias = dict[str, Any]
"""One interval of statistics (or a merge of several), laid out as ``empty_data``."""


def empty_data() -> StatsData:
    """An interval in which nothing happened: the ``data`` layout, key by key."""
    return {
        "schema": SCHEMA,
        # One entry per finished request's reads; the three lists run in parallel.
        "xfer_s": [],
        "xfer_bytes": [],
        "xfer_descs": [],
        "handshake_s": [],
        # Exact counts, including events whose samples were dropped.
        "num_xfers": 0,
        "xfer_bytes_total": 0,
        "xfer_descs_total": 0,
        "num_handshakes": 0,
        "dropped_samples": 0,
        "failures": {},  # kind -> count
        # Prefill side: side-channel messages by outcome ("served", or the refusal's error code).
        "side_channel": {},
        # Decode side (bidirectional_kv_xfer): holds for next turns ended unread, by how
        # ("expired": their time to live; "released": over the holds' budget).
        "holds_ended": {},
        "leases_expired": 0,  # prefill side
        "reads_served": 0,  # prefill side: requests whose blocks a decode peer read and released
        "states": {},  # source -> StateCounts (a gauge: latest snapshot per source)
    }


def normalized(data: Mapping[str, Any] | None) -> StatsData:
    """A private copy of ``data`` in the current layout (missing keys filled in).

    A copy, because vLLM hands the same decoded dict to several stat loggers and
    ``merge`` extends lists in place.
    """
    out = empty_data()
    if not data:
        return out
    for key in _SAMPLE_KEYS:
        out[key] = list(data.get(key, ()))
    for key in _COUNTER_KEYS:
        out[key] = int(data.get(key, 0))
    for key in _KEYED_KEYS:
        out[key] = {str(k): int(v) for k, v in data.get(key, {}).items()}
    out["states"] = {
        str(src): {str(lc): {str(st): int(n) for st, n in counts.items()} for lc, counts in snap.items()}
        for src, snap in data.get("states", {}).items()
    }
    return out


def is_empty(data: StatsData) -> bool:
    """True when there is nothing to log: no event counted and no state snapshot."""
    return not (data["states"] or any(data[k] for k in _KEYED_KEYS) or any(data[k] for k in _COUNTER_KEYS))


def merge(mine: StatsData, theirs: StatsData) -> None:
    """Merge ``theirs`` into ``mine`` (both in the full layout), in place.

    Counts add up and samples concatenate (capped at ``MAX_SAMPLES``, the
    rest counted as dropped). For state snapshots ``theirs`` is taken to be
    the later report: it replaces ``mine``'s snapshot of the same source, and
    snapshots of other sources are kept side by side. vLLM merges workers of
    one step (distinct sources) and consecutive steps in time order
    (``KVConnectorLogging``), so both cases come out right.
    """
    if theirs is mine:
        theirs = normalized(theirs)
    for key in _COUNTER_KEYS:
        mine[key] += theirs[key]
    mine["dropped_samples"] += _extend_capped(mine, theirs, ("xfer_s", "xfer_bytes", "xfer_descs"))
    mine["dropped_samples"] += _extend_capped(mine, theirs, ("handshake_s",))
    _add_keyed(mine, theirs)
    mine["states"].update(theirs["states"])


def summary(data: StatsData) -> dict[str, int | float]:
    """Summary numbers of an interval (vLLM's periodic "KV Transfer metrics" log line).

    Times and sizes come from the kept samples; counts are exact. Request
    states are summed over sources and shown as ``Reqs <lifecycle>/<state>``.
    """
    d = data
    xfer_s: list[float] = d["xfer_s"]
    hs_s: list[float] = d["handshake_s"]
    out: dict[str, int | float] = {
        "Num successful transfers": d["num_xfers"],
        "Avg xfer time (ms)": _ms(sum(xfer_s) / len(xfer_s)) if xfer_s else 0,
        "P90 xfer time (ms)": _ms(_percentile(xfer_s, 90)) if xfer_s else 0,
        "Total MB": round(d["xfer_bytes_total"] / 2**20, 3),
        "Throughput (MB/s)": _throughput(d["xfer_bytes"], xfer_s),
        "Avg descriptors": round(d["xfer_descs_total"] / d["num_xfers"], 1) if d["num_xfers"] else 0,
        "Num handshakes": d["num_handshakes"],
        "Avg handshake (ms)": _ms(sum(hs_s) / len(hs_s)) if hs_s else 0,
        "P90 handshake (ms)": _ms(_percentile(hs_s, 90)) if hs_s else 0,
        "Num failures": sum(d["failures"].values()),
    }
    for kind in sorted(d["failures"]):
        out[f"Failures {kind}"] = d["failures"][kind]
    out["Leases expired"] = d["leases_expired"]
    out["Reads served"] = d["reads_served"]
    for outcome in sorted(d["side_channel"]):
        out[f"Side channel {outcome}"] = d["side_channel"][outcome]
    for how in sorted(d["holds_ended"]):
        out[f"Holds ended {how}"] = d["holds_ended"][how]
    if d["dropped_samples"]:
        out["Dropped samples"] = d["dropped_samples"]
    for lifecycle, counts in sorted(sum_states(d["states"]).items()):
        for state, n in sorted(counts.items()):
            out[f"Reqs {lifecycle}/{state}"] = n
    return out


def sum_states(states: Mapping[str, StateCounts]) -> StateCounts:
    """Add the snapshots of all sources up, per lifecycle and state."""
    total: StateCounts = {}
    for snap in states.values():
        for lifecycle, counts in snap.items():
            acc = total.setdefault(lifecycle, {})
            for state, n in counts.items():
                acc[state] = acc.get(state, 0) + n
    return total


def _percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default method)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _extend_capped(mine: StatsData, theirs: StatsData, keys: tuple[str, ...]) -> int:
    """Append ``theirs``' parallel sample lists to ``mine`` up to ``MAX_SAMPLES``; return how many did not fit."""
    room = max(0, MAX_SAMPLES - len(mine[keys[0]]))
    incoming = len(theirs[keys[0]])
    for key in keys:
        mine[key].extend(theirs[key][:room])
    return max(0, incoming - room)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _throughput(num_bytes: list[int], seconds: list[float]) -> float:
    """MB/s over the sampled transfers (bytes and times of the same transfers)."""
    total_s = sum(seconds)
    return round(sum(num_bytes) / 2**20 / total_s, 3) if total_s > 0 else 0


_SOURCE_IDS = itertools.count()


class StatsRecorder:
    """Collects statistics as they happen; ``take`` hands one interval over per step.

    Called from two threads: the event loop records, the model runner takes.
    One small lock guards everything; each record call appends at most three
    numbers and bumps a few counters under it.

    ``source`` names this recorder's state snapshot in merged stats; give each
    worker its own (e.g. ``"<engine_id>/tp<rank>"``) so the engines' and
    workers' counts add up instead of replacing each other.
    """

    def __init__(self, source: str | None = None, *, max_samples: int = MAX_SAMPLES) -> None:
        if max_samples < 0:
            raise ValueError(f"max_samples must be >= 0, got {max_samples}")
        self.source: Final = source if source is not None else f"pid{os.getpid()}.{next(_SOURCE_IDS)}"
        self._max: Final = max_samples
        self._lock = threading.Lock()
        # The current interval.
        self._xfer_s: list[float] = []
        self._xfer_bytes: list[int] = []
        self._xfer_descs: list[int] = []
        self._handshake_s: list[float] = []
        self._num_xfers = 0
        self._bytes = 0
        self._descs = 0
        self._num_handshakes = 0
        self._dropped = 0
        self._failures: dict[str, int] = {}
        self._side_channel: dict[str, int] = {}
        self._holds_ended: dict[str, int] = {}
        self._leases_expired = 0
        self._reads_served = 0
        # The gauge: replaced (never mutated) on change, so ``take`` may share it.
        self._states: StateCounts = {}
        self._states_changed = False
        # Everything handed over by ``take`` so far.
        self._taken: dict[str, Any] = {key: 0 for key in _COUNTER_KEYS}
        for key in _KEYED_KEYS:
            self._taken[key] = {}
        self._takes = 0

    # -- recording (event-loop thread) ------------------------------------------------

    def transfer_done(self, seconds: float, num_bytes: int, num_descs: int) -> None:
        """All reads of one request finished: how long they took, what they moved."""
        with self._lock:
            self._num_xfers += 1
            self._bytes += num_bytes
            self._descs += num_descs
            if len(self._xfer_s) < self._max:
                self._xfer_s.append(seconds)
                self._xfer_bytes.append(num_bytes)
                self._xfer_descs.append(num_descs)
            else:
                self._dropped += 1

    def handshake_done(self, seconds: float) -> None:
        """A handshake with a peer completed after ``seconds``."""
        with self._lock:
            self._num_handshakes += 1
            if len(self._handshake_s) < self._max:
                self._handshake_s.append(seconds)
            else:
                self._dropped += 1

    def failure(self, kind: str) -> None:
        """Something failed; ``kind`` is free text such as "handshake", "timeout", "peer_dead"."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1

    def lease_expired(self) -> None:
        """Prefill side: a request's lease ran out before its blocks were read."""
        with self._lock:
            self._leases_expired += 1

    def hold_ended(self, how: str) -> None:
        """Decode side: a hold for a next turn ended unread (``how``: expired, released)."""
        with self._lock:
            self._holds_ended[how] = self._holds_ended.get(how, 0) + 1

    def read_served(self) -> None:
        """Prefill side: a decode peer read a request's blocks and they were released."""
        with self._lock:
            self._reads_served += 1

    def side_channel(self, counts: Mapping[str, int]) -> None:
        """Side-channel messages handled since the last call, by outcome."""
        with self._lock:
            mine = self._side_channel
            for outcome, n in counts.items():
                if n:
                    mine[outcome] = mine.get(outcome, 0) + n

    def set_states(self, lifecycle: str, counts: Mapping[str, int]) -> None:
        """Replace the snapshot of how many requests of ``lifecycle`` are in each state."""
        snap = {str(state): int(n) for state, n in counts.items() if n}
        with self._lock:
            if self._states.get(lifecycle) != snap:
                self._states = {**self._states, lifecycle: snap}
                self._states_changed = True

    # -- draining (model-runner thread) -------------------------------------------------

    def take(self) -> StatsData | None:
        """Everything recorded since the last take (counters restart), in the ``data``
        layout (``empty_data``), or None if nothing happened. ``kvsm.vllm.stats``
        wraps it for vLLM.

        The state snapshot is a level, not a rate: it is included in every
        non-empty take and kept for the next; a changed snapshot alone makes a
        take non-empty.
        """
        with self._lock:
            if not (
                self._num_xfers
                or self._num_handshakes
                or self._failures
                or self._side_channel
                or self._holds_ended
                or self._leases_expired
                or self._reads_served
                or self._states_changed
            ):
                return None
            data: StatsData = {
                "schema": SCHEMA,
                "xfer_s": self._xfer_s,
                "xfer_bytes": self._xfer_bytes,
                "xfer_descs": self._xfer_descs,
                "handshake_s": self._handshake_s,
                **self._interval_counters(),
            }
            states = self._states
            self._xfer_s, self._xfer_bytes, self._xfer_descs, self._handshake_s = [], [], [], []
            self._num_xfers = self._bytes = self._descs = self._num_handshakes = self._dropped = 0
            self._failures = {}
            self._side_channel = {}
            self._holds_ended = {}
            self._leases_expired = self._reads_served = 0
            self._states_changed = False
            _add_counts(self._taken, data)
            self._takes += 1
        data["states"] = {self.source: states} if states else {}
        return data

    def _interval_counters(self) -> dict[str, Any]:
        """The counters since the last take (call with the lock held)."""
        return {
            "num_xfers": self._num_xfers,
            "xfer_bytes_total": self._bytes,
            "xfer_descs_total": self._descs,
            "num_handshakes": self._num_handshakes,
            "dropped_samples": self._dropped,
            "failures": self._failures,
            "side_channel": self._side_channel,
            "holds_ended": self._holds_ended,
            "leases_expired": self._leases_expired,
            "reads_served": self._reads_served,
        }

    def totals(self) -> dict[str, Any]:
        """Cumulative counts since creation (``take`` does not reset them), and the current states."""
        with self._lock:
            out = {key: self._taken[key] for key in _COUNTER_KEYS}
            for key in _KEYED_KEYS:
                out[key] = dict(self._taken[key])
            _add_counts(out, self._interval_counters())
            out["states"] = {lc: dict(counts) for lc, counts in self._states.items()}
            out["takes"] = self._takes
        out["source"] = self.source
        return out


def _add_counts(acc: dict[str, Any], data: Mapping[str, Any]) -> None:
    for key in _COUNTER_KEYS:
        acc[key] += data[key]
    _add_keyed(acc, data)


def _add_keyed(acc: dict[str, Any], data: Mapping[str, Any]) -> None:
    for key in _KEYED_KEYS:
        mine = acc[key]
        for label, n in data[key].items():
            mine[label] = mine.get(label, 0) + n
