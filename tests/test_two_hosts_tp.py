"""An abort, and a ``kill -9`` of one prefill rank, while the decode side's reads
from both ranks are in flight, on real engines across two hosts.

A TP 2 prefill server on one host (``kvsm_testing.netns``), a TP 1 decode server
on the other (2 -> 1: the decode worker reads one KV head from each prefill
rank, two NIXL reads), UCX on TCP over the KV link, capped at 1 Mbit/s so that a
400-token prompt's reads take about four seconds. Once the decode worker has
posted both reads (its ``reads_posted`` record), either the client hangs up (the
router closes the decode leg, and vLLM aborts the request) or prefill rank 1's
worker process is killed.

After the abort:

* the decode request ends ``aborted`` through ``aborting``: its blocks go back to
  vLLM only once neither read can still write into them;
* both prefill ranks let the request go at once (each is told by the decode
  worker), not at the end of their lease;
* the decode engine holds nothing, and the next prompt through the router (its
  blocks may be the aborted request's) equals the decode engine alone;
* both engines' logs replay clean.

After the kill:

* the client still gets the right answer: the decode engine recomputes the
  prompt (``kv_load_failure_policy: recompute``), equal to the decode engine
  computing it alone;
* the request fails from ``transferring`` through ``failing``: the blocks go
  back to vLLM only once no read, rank 0's included, can still write into them;
* the decode engine holds nothing afterwards and serves on;
* the decode engine's logs replay clean and name the cause.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import require, require_netns

require("vllm")
require("nixl")

from kvsm.replay import analyse
from kvsm_testing import build_tiny_model
from kvsm_testing.netns import TwoHosts
from kvsm_testing.reliability import live_kvsm_requests, read_records, replay_when_settled, send_machines, wait_until
from kvsm_testing.two_host_pair import TwoHostPair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_netns()

KVSM_CONFIG = {"kv_lease_duration": 10.0, "handshake_timeout": 5, "stall_timeout": 2,
               "peer_backoff": 1, "peer_backoff_max": 4}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHostPair]:
    model = str(build_tiny_model())
    hosts = TwoHosts()
    try:
        p = TwoHostPair(hosts, model, tmp_path_factory.mktemp("tp2h"), extra_config=KVSM_CONFIG, prefill_tp=2)
        try:
            yield p.start()
        finally:
            p.close()
    finally:
        hosts.close()


def _alone(pair: TwoHostPair, prompt: list[int], salt: str) -> str:
    """The decode engine computing ``prompt`` by itself (a salt keeps it off any cached block)."""
    out = pair.decode.post("/v1/completions", {"model": pair.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                               "temperature": 0, "ignore_eos": True, "cache_salt": salt})
    text: str = out["choices"][0]["text"]
    return text


def _recv(pair: TwoHostPair, rid: str) -> list[dict[str, Any]]:
    return [r for r in read_records(sorted(pair.logs.glob("decode.worker.*.jsonl")))
            if r.get("lifecycle") == "recv" and rid in (r.get("req") or "")]


def _send(pair: TwoHostPair, rid: str) -> dict[int, list[dict[str, Any]]]:
    """Each prefill rank's send-lifecycle records of ``rid`` (a log per rank)."""
    return {recs[0]["rank"]: recs for f in sorted(pair.logs.glob("prefill.worker.*.jsonl"))
            for recs in send_machines(read_records([f]), rid).values()}


def _warm(pair: TwoHostPair) -> None:
    """One request through the router (once per module): both prefill ranks' agents known."""
    if _recv(pair, "warm"):
        return
    took, out = pair.complete(list(range(20, 420)), MAX_TOKENS, rid="warm")
    assert "error" not in out, out
    assert any(r.get("dst") == "done" for r in wait_until(lambda: _recv(pair, "warm") or None, 10, "warm-up")), \
        _recv(pair, "warm")


def _reads_posted(pair: TwoHostPair, rid: str) -> list[dict[str, Any]]:
    return wait_until(lambda: [r for r in _recv(pair, rid) if r.get("event") == "reads_posted"] or None,
                      20, f"the decode worker's reads_posted for {rid}")


def test_an_abort_mid_read_lets_every_prefill_rank_go(pair: TwoHostPair) -> None:
    _warm(pair)
    victim = [(i * 7) % 1000 + 10 for i in range(400)]
    follow = [(i * 11) % 1000 + 10 for i in range(300)]
    reference = _alone(pair, victim, "abort-reference")
    follow_reference = _alone(pair, follow, "abort-follow")
    pair.hosts.rate_limit("1mbit")
    host, port = pair.router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        body = {"model": pair.model, "prompt": victim, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "X-Request-Id": "aborted"})
        posted = _reads_posted(pair, "aborted")
        assert len(posted) == 1, posted
    finally:
        if conn.sock is not None:
            conn.sock.close()  # the client hangs up with both reads in flight
        conn.close()
    hung_up = time.monotonic()

    # The request is aborted from its transfer, and its blocks wait for both reads to settle.
    recs = wait_until(lambda: (r := _recv(pair, "aborted")) and r[-1].get("dst") == "aborted" and r, 30,
                      "the aborted request's machine aborted")
    pair.hosts.heal()
    steps = [(r["event"], r.get("src"), r["dst"]) for r in recs if r.get("kind") == "transition"]
    assert any(src in ("transferring", "reading_unclaimed") and dst == "aborting" for _, src, dst in steps), steps
    assert steps[-1][1] == "aborting", steps
    matched = next(r for r in recs if r.get("event") == "matched")
    assert matched["input"]["sources"] == 2, matched

    # Both prefill ranks let it go, told by the decode worker, well within their 10 s lease.
    sends = wait_until(lambda: (s := _send(pair, "aborted")) and len(s) == 2
                       and all(v[-1]["dst"] == "released" for v in s.values()) and s, 30,
                       "both prefill ranks released the aborted request")
    for rank, machine in sends.items():
        assert machine[-1]["event"] != "lease_expired", (rank, machine[-1])
    assert time.monotonic() - hung_up < 25

    # Nothing is held on either engine, and the next prompts are right: another one, whose
    # blocks may be the aborted request's, and the aborted prompt itself (nothing half read
    # was kept for its prefix).
    for server in (pair.prefill, pair.decode):
        assert not {k: v for k, v in live_kvsm_requests(server.metrics()).items()
                    if k.startswith(("recv:", "send:"))}, server
    took, out = pair.complete(follow, MAX_TOKENS, rid="after-abort")
    assert "error" not in out, out
    assert out["choices"][0]["text"] == follow_reference
    took, out = pair.complete(victim, MAX_TOKENS, rid="again-after-abort")
    assert "error" not in out, out
    assert out["choices"][0]["text"] == reference
    report = replay_when_settled(lambda: sorted(pair.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings][:10]


def test_kill_9_of_one_prefill_rank_mid_read(pair: TwoHostPair) -> None:
    _warm(pair)
    victim = list(range(500, 900))
    reference = _alone(pair, victim, "reference")
    follow = list(range(1000, 1100))
    follow_reference = _alone(pair, follow, "before")
    pair.hosts.rate_limit("1mbit")
    answer: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answer.update(zip(("took", "out"), pair.complete(
        victim, MAX_TOKENS, rid="victim"))), daemon=True)
    thread.start()
    posted = _reads_posted(pair, "victim")
    assert len(posted) == 1, posted
    (rank1,) = sorted(pair.logs.glob("prefill.worker.rank1.*.jsonl"))
    os.kill(int(rank1.name.split(".")[-2]), signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(60)
    pair.hosts.heal()
    assert not thread.is_alive(), "no answer within 60 s"
    assert "error" not in answer["out"], answer
    assert answer["out"]["choices"][0]["text"] == reference  # recomputed by the decode engine
    assert time.monotonic() - killed_at < 15

    recs = wait_until(lambda: (r := _recv(pair, "victim")) and r[-1].get("dst") == "failed" and r, 15,
                      "the victim's machine failed")
    steps = [(r["event"], r.get("src"), r["dst"]) for r in recs if r.get("kind") == "transition"]
    # Both reads were in flight (one request, two prefill ranks: one reads_posted with two sources);
    # the failure came while transferring, and the blocks went back only from failing, once no
    # read could still write.
    # (or reading_unclaimed: reads that went out right behind claims not yet answered)
    assert any(src in ("transferring", "reading_unclaimed") and dst == "failing" for _, src, dst in steps), steps
    assert steps[-1][1] == "failing", steps
    matched = next(r for r in recs if r.get("event") == "matched")
    assert matched["input"]["sources"] == 2, matched

    # The decode engine holds nothing and serves on (the prefill engine died with its rank).
    assert not {k: v for k, v in live_kvsm_requests(pair.decode.metrics()).items()
                if k.startswith(("recv:", "send:"))}
    assert _alone(pair, follow, "after") == follow_reference

    pair.close()
    report = analyse(sorted(pair.logs.glob("decode.*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings][:10]
    (cause,) = [c for c in report.causes if c.lifecycle == "recv" and "victim" in c.req]
    assert cause.line, cause
