#!/usr/bin/env python3
"""Where does a decode request's time to first token go?

Starts a prefill and a decode API server with KVSMConnector (event logs on,
each pinned to its own core, as the demo and the benchmarks run them) and
plays the router's part itself, so that every timestamp is on one clock
(CLOCK_MONOTONIC, which the event logs also use): the prefill leg
(``do_remote_decode``, ``max_tokens=1``), then the decode leg, streamed,
timed from its start to its first chunk. ``--rounds`` rounds of
``--concurrency`` requests at once. Then it lines each decode leg up with the
decode worker's event log (when the worker first saw the request, when the
claim was granted, when the reads were done) and the prefill worker's (when
it answered the claim), and prints p50 / p90 / p99 / max of each part:

* arrival until the decode worker sees the request: vLLM's API server and
  scheduler, up to the step whose metadata carries it;
* the claim: decode worker to the prefill worker's answer, and back;
* the NIXL read, from its post's return (a large read copies inside the post)
  to its completion; a read posted right behind its claim (early reads)
  overlaps the claim, so these two parts do not add up;
* done (every claim granted and every read complete) until the first token:
  reported at the end of a step, then scheduled and computed in the next one.

    python tools/ttft_breakdown.py [--rounds 3] [--concurrency 50] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvsm_testing import build_tiny_model  # noqa: E402
from kvsm_testing.servers import VLLMServer, pd_specs, running_pair  # noqa: E402

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
MAX_TOKENS = 16


@dataclass
class Leg:
    """One request's decode leg, on the monotonic clock (ns)."""

    rid: str
    start_ns: int
    first_chunk_ns: int


def _post(url: str, body: dict[str, Any], rid: str) -> bytes:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def _one(prefill: str, decode: str, model: str, prompt: list[int], rid: str) -> Leg:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    out = json.loads(_post(prefill, {**body, "kv_transfer_params": PREFILL_PARAMS, "max_tokens": 1,
                                     "stream": False}, rid))
    decode_body = {**body, "kv_transfer_params": out["kv_transfer_params"], "stream": True}
    req = urllib.request.Request(decode + "/v1/completions", data=json.dumps(decode_body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    start = time.monotonic_ns()
    with urllib.request.urlopen(req, timeout=120) as r:
        first = 0
        for line in r:
            if line.startswith(b"data: ") and not first:
                first = time.monotonic_ns()
        r.read()
    return Leg(rid, start, first)


def _transitions(paths: list[Path]) -> dict[str, dict[str, int]]:
    """The request id vLLM was given (``cmpl-<rid>-0-<suffix>``) -> event -> t_mono_ns."""
    out: dict[str, dict[str, int]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            req = r.get("req")
            if r["kind"] in ("create", "transition") and isinstance(req, str) and req.startswith("cmpl-"):
                out.setdefault(req[len("cmpl-"):].rsplit("-", 2)[0], {}).setdefault(r["event"], r["t_mono_ns"])
    return out


def _row(name: str, values: list[float]) -> str:
    v = sorted(values)
    if not v:
        return f"| {name} | - | - | - | - |"

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(p * len(v)))]

    return f"| {name} | {statistics.median(v):.1f} | {q(0.9):.1f} | {q(0.99):.1f} | {v[-1]:.1f} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvsm-ttft-"))
    events = work / "events"
    model = str(build_tiny_model())
    p_spec, d_spec = pd_specs(event_log_dir=str(events))
    for spec in (p_spec, d_spec):
        spec.extra_args = ("--shutdown-timeout", "10")  # the workers close their logs
    prefill, decode = VLLMServer(p_spec, model, work), VLLMServer(d_spec, model, work)
    rng = random.Random(7)
    legs: list[Leg] = []
    with running_pair(prefill, decode):
        for i in range(5):  # warm-up: first handshake, first reads
            _one(prefill.url, decode.url, model, [rng.randrange(10, 1100) for _ in range(200)], f"warm{i}")
        for rnd in range(args.rounds):
            prompts = [[rng.randrange(10, 1100) for _ in range(rng.randrange(20, 400))]
                       for _ in range(args.concurrency)]
            with ThreadPoolExecutor(args.concurrency) as pool:
                legs += pool.map(lambda ip, rnd=rnd: _one(prefill.url, decode.url, model, ip[1], f"r{rnd}q{ip[0]}"),
                                 enumerate(prompts))
    dec = _transitions(sorted(events.glob("decode.worker.*.jsonl")))
    pre = _transitions(sorted(events.glob("prefill.worker.*.jsonl")))
    parts: dict[str, list[float]] = {k: [] for k in ("ttft", "arrive", "claim_out", "claim_back", "read", "after")}
    for leg in legs:
        d, p = dec.get(leg.rid, {}), pre.get(leg.rid, {})
        if not {"create", "handshake_ok", "reads_posted", "all_reads_done"} <= d.keys() or "heartbeat" not in p:
            continue  # nothing read (a full prefix hit) or a failed request: not in the breakdown
        ms = 1e-6
        done = max(d["handshake_ok"], d["all_reads_done"])  # its move to `done`: whichever came last
        parts["ttft"].append((leg.first_chunk_ns - leg.start_ns) * ms)
        parts["arrive"].append((d["create"] - leg.start_ns) * ms)
        parts["claim_out"].append((p["heartbeat"] - d["create"]) * ms)
        parts["claim_back"].append((d["handshake_ok"] - p["heartbeat"]) * ms)
        parts["read"].append((d["all_reads_done"] - d["reads_posted"]) * ms)
        parts["after"].append((leg.first_chunk_ns - done) * ms)
    print(f"{len(parts['ttft'])} of {len(legs)} decode legs, {args.rounds} rounds of {args.concurrency} at once; "
          f"logs in {events}\n")
    print("| part of decode TTFT (ms) | p50 | p90 | p99 | max |\n| --- | ---: | ---: | ---: | ---: |")
    for key, name in (("ttft", "decode TTFT (leg start to first chunk)"),
                      ("arrive", "until the decode worker sees the request"),
                      ("claim_out", "claim: until the prefill worker answers it"),
                      ("claim_back", "claim: the answer back to the decode worker"),
                      ("read", "NIXL read (posted to done)"),
                      ("after", "granted and read until the first token")):
        print(_row(name, parts[key]))
    return 0 if parts["ttft"] else 1


if __name__ == "__main__":
    sys.exit(main())
