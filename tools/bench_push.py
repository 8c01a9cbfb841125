#!/usr/bin/env python3
"""Section 11 of tools/bench.py: push and streamed push against pull, the handover tail by prompt length.

    python tools/bench.py --only push [--repeat N] [--quick] [--json FILE]
    python tools/bench_push.py [--quick] [--repeat N] [--topology one|two|both] [--configs ...] [--json FILE]

Five setups, each a pair of real vLLM API servers (the tiny Llama, prefill on
core 0, decode on core 1, ``max_model_len`` 2048, the prefill server's
``--max-num-batched-tokens`` ``CHUNK``: a long prompt is computed in chunks, as
on a deployment), one pair at a time:

* ``kvsm pull``: KVSMConnector as deployed (the decode worker reads);
* ``kvsm push``: KVSMConnector with ``kv_connector_extra_config``
  ``{"transfer_mode": "push"}`` on both engines (the prefill worker writes);
* ``kvsm stream``: KVSMConnector as deployed, each request with
  ``transfer_mode`` "stream": both legs at once with one join key, as kvsm's
  router sends them (``--transfer-mode stream``; its first request to the pair
  goes sequentially in push mode and teaches the client the prefill server's
  side channel); the prefill worker writes each layer of each chunk into the
  decode engine's blocks as its forward pass ends;
* ``upstream pull``: vLLM's ``NixlConnector``;
* ``upstream push``: vLLM's ``NixlPushConnector`` (same package).

Two topologies: ``one host`` (both servers on 127.0.0.1; UCX picks its
shared-memory transports) and ``two hosts`` (each server in a network
namespace of its own, ``kvsm_testing.netns.TwoHosts``, UCX on TCP over the KV
veth link only, ``UCX_TLS=tcp UCX_NET_DEVICES=kv0``, the link capped with
``TwoHosts.rate_limit`` at ``RATE``, see below).

A P/D request is played by this client itself, no router: the prefill leg
(``kv_transfer_params`` ``{"do_remote_decode": true, ...}`` as llm-d sends it,
``max_tokens`` 1, not streamed), then the decode leg with the prefill's
``kv_transfer_params`` verbatim, streamed. One request at a time, a fresh
random prompt of token ids each (nothing in any prefix cache), ``max_tokens``
2 on the decode leg. Every pair is warmed up first (its first handshake, one
request of every length). Each repetition sends ``per_rep`` requests of every
length (the order of the lengths alternates repetition by repetition; a pair
stops at ``PAIR_BUDGET_S`` of measuring, between batches, and says so); each
repetition's value is the median of its requests, the rows give the median over
the repetitions and their spread. The prefill's answer must echo the setup's
``transfer_mode`` (``pull`` / ``push``): a setup whose answers say otherwise is
marked FAILED (it did not run the mode it names).

What each row measures:

* **handover tail**: from the prefill engine's end of computing the prompt to
  the decode worker holding the whole KV. Start: the prefill *scheduler*'s
  ``request_finished`` for the request (vLLM calls it in the step that
  computed the prompt, right after the model ran). End: the decode *worker*
  knowing every block has landed. kvsm: from its event logs (``event_log_dir``):
  the start is the prefill scheduler's ``sched.pinned`` record's ``pinned_ns``
  (else its ``prefill_finished`` transition), the end the decode worker's first
  transition of the request into ``done``; both ``CLOCK_MONOTONIC``, which every
  process on the machine shares (network namespaces too). Upstream (vLLM not
  patched): vLLM's own debug log lines of the nixl package, turned on for that
  package alone by a logging config (``VLLM_LOGGING_CONFIG_PATH``) whose format
  starts each line with ``%(created)`` (wall clock, µs): the start is the
  prefill scheduler's ``request_finished(<id>)`` line, the end the first
  ``get_finished: ... N requests done recving`` line (N >= 1) of the decode
  worker after its ``start_load_kv ... for request <id>`` line (one request at
  a time, so the next completion is that request's). Both ends are the same
  hooks for both connectors. In pull mode and in upstream's push mode the tail
  includes the client's hop (the prefill's answer back, the decode leg out),
  since nothing moves before the decode engine has the request. Streamed: the
  decode worker may hold the KV before the prefill scheduler's finish, so the
  start is the prefill worker's save_kv_layer of the prompt's last layer
  (its ``worker.stream_written`` record's ``last_layer_ns``) when earlier; the
  **last write** row is that record's last write, from the start of its
  NIXL post call (NIXL sends some of the bytes in the call) to the prefill
  worker's check that found it over (the goal: a tail of at most the last
  layer's write plus 1 ms). Beside it: from the last layer's save_kv_layer to
  that post call, and the call's own time. (Before 2026-12-07 the last write
  was timed from the call's return.) A last write posted while an earlier one
  was in flight carries no notification (``notif_alone`` in the record): it
  ends at the check that found every write over and sent the notification
  alone (earlier code wrote one block again to carry it, and the row timed
  that write).
* **client TTFT**: from the client's first leg sent to the first token (the
  prefill leg's round trip plus the decode TTFT; streamed, both legs at once:
  the decode TTFT itself).
* **decode TTFT**: from sending the decode leg to its first streamed token.
* **decode CPU per transfer**: the decode server's processes (API server and
  engine core, ``/proc/<pid>/stat`` utime + stime, 10 ms ticks) over a
  repetition's requests of one length, divided by its requests: the transfer,
  the decode leg's HTTP and one token's compute, and whatever the server burns
  while it waits for the next request (an idle spin counts). **prefill CPU per
  transfer**: the same for the prefill server (its prompt's compute included:
  push moves the transfer's work to this side).
* **prefill compute** (kvsm pull only, the context for the rate cap): the
  prefill scheduler's ``blocks_allocated`` to ``prefill_finished``.

The rate cap (``RATE``, 300 Mbit/s): the tiny Llama's KV is 1 KiB per token
(2 layers, K and V, 2 KV heads of 32 float32), moved in blocks of 128 tokens,
so the longest prompt (2,000 tokens, 16 blocks) moves 2 MiB. Its prefill
compute here is about 60 ms (the ``prefill compute`` row: 57-62 ms on one host,
69-112 ms measured on two hosts, 2026-12-06); at 300 Mbit/s kvsm's read of those
2 MiB took 58.8 ms (``reads_posted`` to ``all_reads_done``, about 285 Mbit/s of
payload), the same size as the compute. Without a cap the veth link moves the
bytes in ~2 ms and the transfer vanishes into the engines' step cadence; at
200 Mbit/s it would take ~85 ms, longer than the compute.

Other rows: **handover, decode side**: the part of the tail after the decode
worker first sees the request (kvsm: the decode worker's first event-log record
of it; upstream: its ``start_load_kv`` line) until it holds the KV (the same end
as the tail); **prefill leg**: the client's time from sending the prefill leg to
its answer (the start of the client's hop that the tail spans).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":  # run as a script: the checkout's venv, the checkout and tools/ on the path
    _venv = ROOT / ".venv"
    if (_venv / "bin" / "python").exists() and Path(sys.prefix).resolve() != _venv.resolve():
        os.execv(str(_venv / "bin" / "python"), [str(_venv / "bin" / "python"), str(Path(__file__).resolve()),
                                                 *sys.argv[1:]])
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tools"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from benchlib import Row, Section, Sizes, stream_ttft_ms  # noqa: E402

CONFIGS = ("kvsm pull", "kvsm push", "kvsm stream", "upstream pull", "upstream push")
CONNECTORS = {"kvsm pull": "KVSMConnector", "kvsm push": "KVSMConnector", "kvsm stream": "KVSMConnector",
              "upstream pull": "NixlConnector", "upstream push": "NixlPushConnector"}
MODES = ("pull", "push", "stream")
# The prefill server's max_num_batched_tokens: a long prompt is computed in chunks of this
# many tokens (vLLM's chunked prefill), as on a deployment; the same for every setup.
CHUNK = 256
TOPOLOGIES = ("one host", "two hosts")
MAX_MODEL_LEN = 2048
LENGTHS = (100, 200, 400, 1000, MAX_MODEL_LEN - 48)
QUICK_LENGTHS = (200, MAX_MODEL_LEN - 48)
MAX_TOKENS = 2  # the decode leg's
RATE = "300mbit"  # the two-host KV link's cap (see the module docstring)
LEG_TIMEOUT_S = 90.0
# Most seconds of measuring (after the warm-up) per pair: upstream's stalls here (a
# handshake or a prefill answer waiting seconds, up to its 30 s lease) must not
# cost the other setups their turn. Whole batches only; what was cut is noted.
PAIR_BUDGET_S = 180.0
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
NIXL_LOGGER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
# Upstream's debug lines, each starting with its %(created) time (see _logging_config).
_UP_FINISHED = re.compile(r"request_finished\((cmpl-\S+?)\)")
_UP_LOAD = re.compile(r"start_load_kv(?: \(push\))? for request (cmpl-\S+?) from remote engine")
_UP_RECVD = re.compile(r"get_finished: \d+ requests done sending and (\d+) requests done recving")


def mode_of(config: str) -> str:
    return config.split()[1]


def _rid_of(vllm_id: str) -> str:
    """The X-Request-Id a vLLM request id was made from (``cmpl-<rid>-0-<suffix>``)."""
    return vllm_id.removeprefix("cmpl-").rsplit("-", 2)[0]


# --------------------------------------------------------------------------- one request


@dataclass
class Result:
    rid: str
    length: int
    rep: int
    ttft_ms: float | None = None
    prefill_leg_ms: float | None = None  # the client's: the prefill leg sent -> its answer
    client_ttft_ms: float | None = None  # the client's: its first leg sent -> the first token
    mode: str | None = None  # the prefill answer's transfer_mode
    error: str | None = None
    coordinates: dict[str, Any] = field(default_factory=dict)  # the prefill server's, from its answer


def _post_json(url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=LEG_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Request-Id": rid})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status} {data[:300]!r}")
        out: dict[str, Any] = json.loads(data)
        return out
    finally:
        conn.close()


def _stream_ttft_ms(url: str, body: dict[str, Any], rid: str) -> float:
    return stream_ttft_ms(url, body, LEG_TIMEOUT_S, {"X-Request-Id": rid})


def pd_request(prefill: str, decode: str, model: str, prompt: list[int], res: Result,
               mode: str | None = None, coordinates: dict[str, Any] | None = None) -> Result:
    """The prefill leg, then the decode leg streamed; fills ``res`` (an error in ``res.error``).
    ``mode`` "push" asks for push on the prefill leg (the setup's own mode otherwise);
    "stream" with the prefill server's ``coordinates`` sends both legs at once, as
    kvsm's router does (``kvsm.router_stream``)."""
    if mode == "stream" and coordinates is not None:
        return _stream_request(prefill, decode, model, prompt, res, coordinates)
    base = {"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    prefill_params = {**PREFILL_PARAMS, **({"transfer_mode": mode} if mode else {})}
    try:
        t0 = time.perf_counter()
        out = _post_json(prefill, {**base, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_params},
                         res.rid)
        res.prefill_leg_ms = (time.perf_counter() - t0) * 1e3
        params = out.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"the prefill's answer has no kv_transfer_params: {str(out)[:300]}")
        res.mode = params.get("transfer_mode")
        res.coordinates = coordinates_of(params)
        res.ttft_ms = _stream_ttft_ms(decode, {**base, "max_tokens": MAX_TOKENS, "stream": True,
                                               "kv_transfer_params": params}, res.rid)
        res.client_ttft_ms = res.prefill_leg_ms + res.ttft_ms  # (the client's hop between them: microseconds)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"[:400]
    return res


# What a streamed decode leg needs of its prefill server (learned from its answers).
COORDINATE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                   "kvsm_protocol", "remote_block_size")


def coordinates_of(params: dict[str, Any]) -> dict[str, Any]:
    return {k: params[k] for k in COORDINATE_KEYS if k in params}


def _stream_request(prefill: str, decode: str, model: str, prompt: list[int], res: Result,
                    coordinates: dict[str, Any]) -> Result:
    """Both legs at once with one join key; decode TTFT from sending them."""
    import concurrent.futures as cf
    import uuid

    base = {"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    key = f"kvsm-stream-{uuid.uuid4().hex}"
    prefill_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "stream",
                      "kvsm_stream": key}
    decode_params = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "stream",
                     "kvsm_stream": key, "remote_request_id": key, "remote_block_ids": [[]], **coordinates}
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            leg = pool.submit(_post_json, prefill, {**base, "max_tokens": 1, "stream": False,
                                                    "kv_transfer_params": prefill_params}, res.rid)
            res.ttft_ms = res.client_ttft_ms = _stream_ttft_ms(decode, {
                **base, "max_tokens": MAX_TOKENS, "stream": True, "kv_transfer_params": decode_params}, res.rid)
            out = leg.result(timeout=LEG_TIMEOUT_S)
            res.prefill_leg_ms = (time.perf_counter() - t0) * 1e3  # (at least: joined after the decode's token)
        res.mode = (out.get("kv_transfer_params") or {}).get("transfer_mode")
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"[:400]
    return res


# --------------------------------------------------------------------------- CPU time


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of these processes (``/proc/<pid>/stat``), those still alive."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / _CLK_TCK


# --------------------------------------------------------------------------- the handover tail from the logs


def _jsonl(paths: Sequence[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict):
                        yield rec


def kvsm_times(events: Path) -> dict[str, dict[str, float]]:
    """rid -> {"tail_ms", "prefill_ms"} from kvsm's event logs (what could be had)."""
    end: dict[str, int] = {}  # rid -> prefill scheduler's pin (ns)
    finished: dict[str, int] = {}
    allocated: dict[str, int] = {}
    for r in _jsonl(sorted(events.glob("prefill.scheduler.*.jsonl"))):
        req = r.get("req")
        if not isinstance(req, str) or not req.startswith("cmpl-"):
            continue
        rid = _rid_of(req)
        if r.get("event") == "sched.pinned" and r.get("pinned_ns"):
            end.setdefault(rid, int(r["pinned_ns"]))
        elif r.get("event") == "prefill_finished":
            finished.setdefault(rid, int(r["t_mono_ns"]))
        elif r.get("event") == "blocks_allocated":
            allocated.setdefault(rid, int(r["t_mono_ns"]))
    streamed: dict[str, dict[str, Any]] = {}  # rid -> the prefill worker's worker.stream_written record
    for r in _jsonl(sorted(events.glob("prefill.worker.*.jsonl"))):
        req = r.get("req")
        if r.get("event") == "worker.stream_written" and isinstance(req, str) and req.startswith("cmpl-"):
            streamed.setdefault(_rid_of(req), r)
    done: dict[str, int] = {}
    seen: dict[str, int] = {}  # the decode worker's first record of the request
    posted: dict[str, int] = {}
    read: dict[str, int] = {}
    for r in _jsonl(sorted(events.glob("decode.worker.*.jsonl"))):
        req = r.get("req")
        if not isinstance(req, str) or not req.startswith("cmpl-"):
            continue
        rid = _rid_of(req)
        seen.setdefault(rid, int(r["t_mono_ns"]))
        if r.get("dst") == "done":
            done.setdefault(rid, int(r["t_mono_ns"]))
        if r.get("event") in ("reads_posted", "writes_asked"):  # pull, push
            posted.setdefault(rid, int(r["t_mono_ns"]))
        elif r.get("event") in ("all_reads_done", "writes_landed"):
            read.setdefault(rid, int(r["t_mono_ns"]))
    out: dict[str, dict[str, float]] = {}
    for rid in set(end) | set(finished) | set(done):
        got: dict[str, float] = {}
        start = end.get(rid, finished.get(rid))
        note = streamed.get(rid)
        if note is not None and note.get("last_layer_ns"):
            # Streamed: the KV may be held before the scheduler's finish; the tail starts when
            # the prompt's last layer was done (its save_kv_layer), the last write's time beside it.
            start = min(start or note["last_layer_ns"], note["last_layer_ns"])
            # The last write: from its NIXL post call's start (NIXL sends some of the
            # bytes in the call) to the check that found it over.
            posting = note.get("final_posting_ns") or note.get("final_posted_ns")
            if posting:
                got["last_write_ms"] = (note["done_ns"] - posting) / 1e6
            if note.get("final_posting_ns"):  # (kvsm from 2026-12-07 on)
                got["to_post_ms"] = (note["final_posting_ns"] - note["last_layer_ns"]) / 1e6
                got["post_call_ms"] = (note["final_posted_ns"] - note["final_posting_ns"]) / 1e6
        if start is not None and rid in done:
            got["tail_ms"] = (done[rid] - start) / 1e6
        if rid in done:
            got["decode_side_ms"] = (done[rid] - seen[rid]) / 1e6
        if rid in posted and rid in read:
            got["move_ms"] = (read[rid] - posted[rid]) / 1e6  # reads posted / writes asked -> all landed
        if rid in allocated and rid in finished:
            got["prefill_ms"] = (finished[rid] - allocated[rid]) / 1e6
        out[rid] = got
    return out


def _timed_lines(path: Path) -> Iterator[tuple[float, str]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        with contextlib.suppress(ValueError):
            yield float(head), rest


def upstream_times(prefill_log: Path, decode_log: Path) -> dict[str, dict[str, float]]:
    """rid -> {"tail_ms"} from upstream's debug lines (see the module docstring)."""
    start: dict[str, float] = {}
    for t, line in _timed_lines(prefill_log):
        m = _UP_FINISHED.search(line)
        if m:
            start.setdefault(_rid_of(m.group(1)), t)
    pending: list[str] = []  # decode requests whose load started, oldest first
    seen: dict[str, float] = {}
    done: dict[str, float] = {}
    for t, line in _timed_lines(decode_log):
        m = _UP_LOAD.search(line)
        if m:
            rid = _rid_of(m.group(1))
            pending.append(rid)
            seen.setdefault(rid, t)
            continue
        m = _UP_RECVD.search(line)
        if m:
            for _ in range(int(m.group(1))):
                if pending:
                    done.setdefault(pending.pop(0), t)
    out: dict[str, dict[str, float]] = {}
    for rid, t in done.items():
        out[rid] = {"decode_side_ms": (t - seen[rid]) * 1e3}
        if rid in start:
            out[rid]["tail_ms"] = (t - start[rid]) * 1e3
    return out


_PROTO_HEAD = re.compile(r"\|\s*remote memory (?P<what>read by ucp_get|write by ucp_put)")
_PROTO_ROW = re.compile(r"\|\s*[0-9.]+\S*\s*\|[^|]*\|\s*(?P<tl>[a-z_0-9]+/[A-Za-z0-9_.:]+)")


def rma_transports(server_log: str) -> set[str]:
    """``read tl/device`` and ``write tl/device``: the UCX transports that UCX chose for
    remote reads and writes in this log (``UCX_PROTO_INFO=y``; cf.
    ``kvsm_testing.two_host_pair.read_transports``, which reads only reads)."""
    found: set[str] = set()
    what: str | None = None
    for line in server_log.splitlines():
        head = _PROTO_HEAD.search(line)
        if head:
            what = head.group("what").split()[0]
            continue
        if what is not None:
            row = _PROTO_ROW.search(line)
            if row:
                found.add(f"{what} {row.group('tl')}")
            elif "+---" not in line and "Range" not in line:
                what = None
    return found


def _logging_config(path: Path) -> Path:
    """A vLLM logging config: warnings and up from vLLM, debug lines from the nixl
    package, every line starting with its wall-clock time in seconds."""
    cfg = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"t": {"format": "%(created).6f %(process)d %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"h": {"class": "logging.StreamHandler", "formatter": "t", "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["h"], "level": "WARNING", "propagate": False},
                    NIXL_LOGGER: {"level": "DEBUG"}},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


# --------------------------------------------------------------------------- one pair


@dataclass
class PairRun:
    """What one setup gave on one topology."""

    config: str
    topology: str
    results: list[Result] = field(default_factory=list)
    cpu_ms: dict[int, list[float]] = field(default_factory=dict)  # length -> per repetition (decode server)
    prefill_cpu_ms: dict[int, list[float]] = field(default_factory=dict)  # the same, prefill server
    times: dict[str, dict[str, float]] = field(default_factory=dict)  # rid -> tail_ms, prefill_ms
    error: str | None = None
    transports: list[str] = field(default_factory=list)
    cut: str | None = None  # what the time budget left out

    def ok(self) -> list[Result]:
        return [r for r in self.results if r.error is None]

    def wrong_mode(self) -> list[Result]:
        return [r for r in self.ok() if r.mode != mode_of(self.config)]

    def per_rep(self, length: int, what: str) -> list[float]:
        """One value per repetition: the median of its requests of ``length``."""
        reps: dict[int, list[float]] = {}
        for r in self.ok():
            if r.length != length:
                continue
            value = (getattr(r, what) if what in ("ttft_ms", "prefill_leg_ms", "client_ttft_ms")
                     else self.times.get(r.rid, {}).get(what))
            if value is not None:
                reps.setdefault(r.rep, []).append(value)
        return [statistics.median(v) for _, v in sorted(reps.items())]


def _specs(config: str, workdir: Path, hosts: Any) -> tuple[Any, Any]:
    from kvsm_testing.servers import pd_specs
    from kvsm_testing.two_host_pair import UCX_TCP_ENV

    connector = CONNECTORS[config]
    kvsm = connector == "KVSMConnector"
    extra = {"transfer_mode": "push"} if kvsm and mode_of(config) == "push" else {}
    p_spec, d_spec = pd_specs(connector=connector, event_log_dir=str(workdir / "events") if kvsm else None,
                              extra_config=extra)
    log_config = None if kvsm else _logging_config(workdir / "logging.json")
    for spec, host in ((p_spec, None if hosts is None else hosts.prefill),
                       (d_spec, None if hosts is None else hosts.decode)):
        spec.max_model_len = MAX_MODEL_LEN
        spec.extra_args = (*spec.extra_args, "--shutdown-timeout", "10")  # the workers close their logs
        if spec is p_spec:
            spec.extra_args = (*spec.extra_args, "--max-num-batched-tokens", str(CHUNK))
        if host is not None:
            spec.netns = host.netns
            spec.bind_host = "0.0.0.0"
            spec.url_host = host.client_addr
            spec.side_channel_host = host.kv_addr
            spec.env = dict(UCX_TCP_ENV)
        if not kvsm:  # servers.py sets these for "NixlConnector" only; the same for its push sibling
            spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.side_channel_host
            spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
            spec.env["VLLM_LOGGING_CONFIG_PATH"] = str(log_config)
    return p_spec, d_spec


def run_pair(config: str, topology: str, hosts: Any, model: str, workdir: Path, lengths: Sequence[int],
             repeat: int, per_rep: int, rng: random.Random, progress: bool = True,
             budget_s: float = PAIR_BUDGET_S) -> PairRun:
    from kvsm_testing.servers import VLLMServer, running_pair, server_pids

    run = PairRun(config, topology)
    workdir.mkdir(parents=True, exist_ok=True)
    p_spec, d_spec = _specs(config, workdir, hosts)
    prefill, decode = VLLMServer(p_spec, model, workdir), VLLMServer(d_spec, model, workdir)
    tag = re.sub(r"[^a-z0-9]+", "", (config + topology).lower())
    counter = iter(range(1_000_000))
    coordinates: dict[str, Any] = {}  # streamed: the prefill server's side channel, as a router learns it

    def one(n: int, rep: int) -> Result:
        res = Result(f"bp{tag}{next(counter)}", n, rep)
        mode = mode_of(config) if mode_of(config) == "stream" else None
        if mode == "stream" and not coordinates:
            mode = "push"  # the first request goes sequentially (kvsm's router does the same)
        pd_request(prefill.url, decode.url, model, [rng.randrange(10, 1100) for _ in range(n)], res, mode,
                   coordinates or None)
        if mode_of(config) == "stream" and res.coordinates:
            coordinates.update(res.coordinates)
        return res

    t0 = time.monotonic()
    try:
        with running_pair(prefill, decode, ready_timeout=600):
            for n in (200, 200, *lengths):  # the first handshake, both engines' first steps, every length once
                warm = one(n, -1)
                if warm.error is not None and progress:
                    print(f"  [{topology}, {config}] warm-up error: {warm.error}", file=sys.stderr, flush=True)
            pids, p_pids = server_pids(decode), server_pids(prefill)
            deadline = time.monotonic() + budget_s
            batches = [(rep, n) for rep in range(repeat) for n in (lengths if rep % 2 == 0 else lengths[::-1])]
            for i, (rep, n) in enumerate(batches):
                if time.monotonic() > deadline:
                    run.cut = (f"stopped by the {budget_s:.0f} s budget after {i} of {len(batches)} batches "
                               f"({per_rep} requests each)")
                    break
                c0, p0 = cpu_seconds(pids), cpu_seconds(p_pids)
                batch = [one(n, rep) for _ in range(per_rep)]
                c1, p1 = cpu_seconds(pids), cpu_seconds(p_pids)
                run.results += batch
                done = sum(r.error is None for r in batch)
                if done:
                    run.cpu_ms.setdefault(n, []).append((c1 - c0) * 1e3 / done)
                    run.prefill_cpu_ms.setdefault(n, []).append((p1 - p0) * 1e3 / done)
    except Exception as e:  # noqa: BLE001 - one setup that cannot run must not cost the others
        run.error = f"{type(e).__name__}: {e}"[:600]
        tail = (prefill.tail(1500) + "\n" + decode.tail(1500)).strip()
        if tail:
            run.error += f" (server logs' tails: ...{tail[-1200:]})"
    if CONNECTORS[config] == "KVSMConnector":
        run.times = kvsm_times(workdir / "events")
    else:
        run.times = upstream_times(prefill.log_path, decode.log_path)
    if hosts is not None:
        run.transports = sorted(rma_transports(decode.tail(10_000_000)) | rma_transports(prefill.tail(10_000_000)))
    if progress:
        errs = sum(r.error is not None for r in run.results)
        print(f"  [{topology}, {config}] {len(run.results)} requests, {errs} errors, "
              f"{len(run.wrong_mode())} wrong mode, {sum('tail_ms' in v for v in run.times.values())} tails, "
              f"{time.monotonic() - t0:.0f} s{'; ' + run.error[:200] if run.error else ''}",
              file=sys.stderr, flush=True)
    return run


# --------------------------------------------------------------------------- the section


def _two_hosts_unavailable() -> str | None:
    from kvsm_testing.netns import netns_unavailable_reason

    return netns_unavailable_reason()


def bench_push(sizes: Sizes, repeat: int, tmp: Path, *, configs: Sequence[str] = CONFIGS,
               topologies: Sequence[str] = TOPOLOGIES, rate: str = RATE,
               lengths: Sequence[int] | None = None, budget_s: float = PAIR_BUDGET_S) -> Section:
    from kvsm_testing import build_tiny_model

    sec = Section(11, "push", "push and streamed push against pull: the handover tail, decode TTFT and decode CPU "
                  "by prompt length, one host and two hosts")
    quick = sizes.e2e_requests < 50
    if quick:
        repeat = 1
    lengths = tuple(lengths or (QUICK_LENGTHS if quick else LENGTHS))
    per_rep = max(2, min(5, sizes.e2e_requests // 10))
    model = str(build_tiny_model())
    rng = random.Random(20261206)
    runs: dict[tuple[str, str], PairRun] = {}
    for topology in topologies:
        hosts_cm: Any = contextlib.nullcontext(None)
        if topology == "two hosts":
            reason = _two_hosts_unavailable()
            if reason is not None:
                sec.notes.append(f"two hosts: not run ({reason})")
                continue
            from kvsm_testing.netns import TwoHosts

            hosts_cm = TwoHosts()
        with hosts_cm as hosts:
            if hosts is not None:
                hosts.rate_limit(rate)
            for config in configs:
                workdir = tmp / "push" / re.sub(r"\W+", "_", f"{topology}_{config}")
                runs[topology, config] = run_pair(config, topology, hosts, model, workdir, lengths, repeat,
                                                  per_rep, rng, budget_s=budget_s)
    _rows(sec, runs, lengths, configs, topologies)
    sec.notes.append(f"{per_rep} requests per length and repetition, one at a time, {repeat} repetition(s); "
                     f"decode leg max_tokens {MAX_TOKENS}; max_model_len {MAX_MODEL_LEN}; each pair measured "
                     f"after its own warm-up, the pairs one after the other (the spread is within a pair: "
                     f"fresh pairs differ too)")
    if any(t == "two hosts" for t, _ in runs):
        sec.notes.append(f"two hosts: the KV link capped at {rate} both ways (tc tbf), UCX on TCP only (what UCX "
                         f"chose: {', '.join(sorted({t for r in runs.values() for t in r.transports})) or '?'})")
    sec.notes.append("handover tail: kvsm from its event logs (prefill scheduler's pin -> decode worker's "
                     "`done`, CLOCK_MONOTONIC); upstream from vLLM's nixl debug lines (prefill scheduler's "
                     "request_finished -> the decode worker's next `done recving` after its start_load_kv, "
                     "wall clock, µs); decode side: from the decode worker's first sight of the request (kvsm: "
                     "first event-log record; upstream: start_load_kv) to the same end; prefill leg: the client's "
                     "round trip of the prefill leg; CPU: each server's utime+stime (all its processes) per "
                     "request, 10 ms ticks")
    sec.extra = {
        "lengths": list(lengths), "per_repetition": per_rep, "repeat": repeat, "rate": rate,
        "runs": {f"{t}/{c}": {"error": r.error, "cut": r.cut, "cpu_ms": {str(k): v for k, v in r.cpu_ms.items()},
                              "prefill_cpu_ms": {str(k): v for k, v in r.prefill_cpu_ms.items()},
                              "transports": r.transports,
                              "requests": [{**r.times.get(x.rid, {}), **dataclasses.asdict(x)} for x in r.results]}
                 for (t, c), r in runs.items()},
    }
    return sec


def _rows(sec: Section, runs: dict[tuple[str, str], PairRun], lengths: Sequence[int], configs: Sequence[str],
          topologies: Sequence[str]) -> None:
    def failed(*runs_: PairRun | None) -> frozenset[str]:
        out = set()
        for r in runs_:
            if r is not None and (r.error is not None or r.wrong_mode() or not r.ok()):
                out.add("kvsm" if r.config.startswith("kvsm") else "upstream")
        return frozenset(out)

    for topology in topologies:
        if not any(t == topology for t, _ in runs):
            continue
        for mode in MODES:
            k, u = runs.get((topology, f"kvsm {mode}")), runs.get((topology, f"upstream {mode}"))
            if k is None and u is None:
                continue
            bad = failed(k, u)
            for n in lengths:
                def vals(r: PairRun | None, what: str, n: int = n) -> list[float] | None:
                    if r is None:
                        return None
                    if what == "cpu":
                        return r.cpu_ms.get(n, [])
                    if what == "prefill_cpu":
                        return r.prefill_cpu_ms.get(n, [])
                    return r.per_rep(n, what)

                label = f"{topology}, {mode}, {n} tokens"
                streamed = (("last_write_ms", "last write", "ms"),
                            ("to_post_ms", "last layer to its write's post", "ms"),
                            ("post_call_ms", "last write's post call", "ms"))
                rows = (("tail_ms", "handover tail", "ms"), *(streamed if mode == "stream" else ()),
                        ("decode_side_ms", "handover, decode side", "ms"),
                        ("prefill_leg_ms", "prefill leg", "ms"), ("ttft_ms", "decode TTFT", "ms"),
                        ("client_ttft_ms", "client TTFT", "ms"))
                for what, measure, unit in (*rows,
                                            ("cpu", "decode CPU per transfer", "ms"),
                                            ("prefill_cpu", "prefill CPU per transfer", "ms")):
                    kv = vals(k, what) if k is not None else []
                    sec.rows.append(Row(f"{label}: {measure}", unit, kv or [], vals(u, what) if u else None,
                                        failed=bad))
        kp = runs.get((topology, "kvsm pull"))
        if kp is not None:
            for n in lengths:
                sec.rows.append(Row(f"{topology}, {n} tokens: prefill compute (kvsm prefill scheduler)", "ms",
                                    kp.per_rep(n, "prefill_ms")))
    for (topology, config), r in runs.items():
        errs = [x for x in r.results if x.error is not None]
        if r.error is not None:
            line = f"{topology}, {config}: did not run: {r.error}"
            (sec.failures if config.startswith("kvsm") else sec.notes).append(line)
        if r.cut:
            sec.notes.append(f"{topology}, {config}: {r.cut}")
        if errs:
            sec.notes.append(f"{topology}, {config}: {len(errs)} of {len(r.results)} requests failed, "
                             f"first: {errs[0].error}")
        wrong = r.wrong_mode()
        if wrong:
            sec.notes.append(f"{topology}, {config}: {len(wrong)} of {len(r.ok())} prefill answers said "
                             f"transfer_mode {sorted({str(x.mode) for x in wrong})}, not {mode_of(config)!r}: "
                             f"FAILED, its numbers are not that mode's")
        missing = sum(1 for x in r.ok() if "tail_ms" not in r.times.get(x.rid, {}))
        if missing and r.ok():
            sec.notes.append(f"{topology}, {config}: no handover tail found in the logs for {missing} of "
                             f"{len(r.ok())} requests")
    for topology in topologies:
        for side, mode in (("kvsm", "push"), ("kvsm", "stream"), ("upstream", "push")):
            pull, push = runs.get((topology, f"{side} pull")), runs.get((topology, f"{side} {mode}"))
            if pull is None or push is None or pull.error or push.error:
                continue
            parts = []
            for n in lengths:
                a, b = pull.per_rep(n, "tail_ms"), push.per_rep(n, "tail_ms")
                if a and b:
                    parts.append(f"{n}: {statistics.median(b) - statistics.median(a):+.1f}")
            if parts:
                sec.notes.append(f"{topology}, {side}: {mode} minus pull handover tail, ms by prompt length "
                                 f"(negative: {mode} hands over sooner): {', '.join(parts)}")
        stream = runs.get((topology, "kvsm stream"))
        if stream is not None and not stream.error:
            parts = []
            for n in lengths:
                tails, writes = stream.per_rep(n, "tail_ms"), stream.per_rep(n, "last_write_ms")
                if tails and writes:
                    over = statistics.median(tails) - statistics.median(writes)
                    parts.append(f"{n}: {over:+.2f} ms ({'within' if over <= 1.0 else 'OVER'} 1 ms)")
            if parts:
                sec.notes.append(f"{topology}, kvsm stream: handover tail minus its last write, by prompt length "
                                 f"(the goal: at most the last write + 1 ms): {', '.join(parts)}")
    if any(r.failed for r in sec.rows):
        sec.notes.append("FAILED cells: the pair did not run, no request got through, or the prefill's answers "
                         "did not echo the mode the row names")


# --------------------------------------------------------------------------- standalone


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    from benchlib import render_section

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, two lengths, 2 requests each")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--topology", choices=("one", "two", "both"), default="both")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, of: {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--lengths", default=None, help="comma-separated prompt lengths (default: by --quick)")
    ap.add_argument("--rate", default=RATE, help=f"the two-host KV link's cap (default {RATE})")
    ap.add_argument("--pair-budget", type=float, default=PAIR_BUDGET_S,
                    help=f"most seconds of measuring per pair (default {PAIR_BUDGET_S:.0f})")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it (logs)")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}")
    topologies = {"one": ("one host",), "two": ("two hosts",), "both": TOPOLOGIES}[args.topology]
    sizes = Sizes((1,), 1, 1, 1, 1, 1, 1, e2e_requests=20 if args.quick else 50)
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    with contextlib.ExitStack() as stack:
        tmp = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsm-bench-push-")))
        t0 = time.perf_counter()
        sec = bench_push(sizes, args.repeat, tmp, configs=configs, topologies=topologies, rate=args.rate,
                         lengths=lengths, budget_s=args.pair_budget)
        sec.seconds = time.perf_counter() - t0
    print(render_section(sec), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"sections": {"push": sec.to_json()}}, indent=1, default=str))
    return 1 if sec.failures else 0


if __name__ == "__main__":
    sys.exit(main())
