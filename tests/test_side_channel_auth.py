"""The shared pair of real API servers runs with the deployment's CURVE keys
(conftest's ``llama_servers``); here, as a stranger on the same host would, and
as an operator rotating keys would (issue 31).

* The pair says it is keyed (``vllm:kvsm_side_channel_authenticated`` 1) and
  serves (every other test on these servers compares outputs against a single
  engine and replays the logs clean).
* A stranger gets nothing from the prefill side channel: kvsm's own client
  without keys or with another deployment's, a raw ZMQ DEALER, a CURVE client
  that knows the server's public key but holds a key of its own, raw TCP. Its
  tries are counted in the metrics and logged.
* The keys rotate across the running pair (next beside current, next made
  current, the old one removed) while requests flow through the router: none
  fails, each output equals the single-engine one, and a peer holding only the
  rotated-out key is refused afterwards.
* The side-channel fuzzer, holding a deployment key, storms the authenticated
  socket while requests flow: every message is answered as the protocol says.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import pytest
import zmq
import zmq.auth

from conftest import LlamaServers
from kvsm.handshake import CompatInfo, HandshakeClient, HandshakeError
from kvsm.handshake.keys import KeyPair, SideChannelKeys, load_keys
from kvsm_testing.fuzz import SideChannelFuzzer
from kvsm_testing.reliability import read_records, wait_until

pytestmark = pytest.mark.slow

STRANGER_COMPAT = CompatInfo(model="x", dtype="float32", num_layers=1, num_kv_heads=1, head_size=8,
                             block_size=16, kv_layout="NHD")


def _side_channel(servers: LlamaServers) -> tuple[str, int]:
    spec = servers.prefill.spec
    return spec.side_channel_host, spec.side_channel_port


def _metric(server: Any, name: str, **labels: str) -> float:
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = 8) -> str:
    import json
    import urllib.request
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


def _kvsm_client_fetch(address: str, keys: SideChannelKeys | None) -> object:
    """What kvsm's own client gets from ``address`` with these keys."""
    ctx = zmq.Context()
    client = HandshakeClient(STRANGER_COMPAT, "stranger/tp0", context=ctx, keys=keys)
    try:
        rid = client.fetch_metadata(address, 0, claims=["any"], deadline_ns=time.monotonic_ns() + 5 * 10**9)
        end = time.monotonic() + 6
        while time.monotonic() < end:
            poller = zmq.Poller()
            for sock in client.sockets():
                poller.register(sock, zmq.POLLIN)
            results = [r for sock, _ in poller.poll(20) for r in client.on_readable(sock)]
            results += client.expire(time.monotonic_ns()) + client.poll_results()
            for r in results:
                if r.request_id == rid:
                    return r.outcome
        raise AssertionError("kvsm's client got no result at all")
    finally:
        client.close()
        ctx.term()


def _nothing_on(sock: zmq.Socket, send: bytes, wait_s: float = 1.5) -> bool:
    sock.send(send)
    return sock.poll(int(wait_s * 1000)) == 0


def test_the_keyed_pair_says_so_at_start_and_in_its_metrics(llama_servers: LlamaServers) -> None:
    for server in (llama_servers.prefill, llama_servers.decode):
        assert _metric(server, "vllm:kvsm_side_channel_authenticated") == 1.0, server.spec.name
        assert "no side_channel_keys" not in server.tail(200_000)
    records = read_records(sorted(llama_servers.events.glob("*.worker.*.jsonl")))
    keyed = {r["engine_id"] for r in records if r.get("event") == "worker.keys"}
    assert keyed == {"prefill", "decode"}, keyed


def test_a_stranger_gets_nothing_from_the_prefill_side_channel(llama_servers: LlamaServers,
                                                                tmp_path: Any) -> None:
    host, port = _side_channel(llama_servers)
    address = f"tcp://{host}:{port}"
    prefill = llama_servers.prefill
    before_unauth = _metric(prefill, "vllm:kvsm_side_channel_messages_total", outcome="unauthenticated")
    before_failed = _metric(prefill, "vllm:kvsm_side_channel_messages_total", outcome="handshake_failed")
    deployment = load_keys(str(llama_servers.keys))

    # kvsm's own client: without keys; with another deployment's; with a key of its
    # own and the server's public key (public knowledge).
    no_keys = _kvsm_client_fetch(address, None)
    assert isinstance(no_keys, HandshakeError) and no_keys.code == "handshake_failed", no_keys
    zmq.auth.create_certificates(str(tmp_path), "current")
    other = load_keys(str(tmp_path))
    assert isinstance(got := _kvsm_client_fetch(address, other), HandshakeError) and got.code == "unauthenticated"
    knows_public = SideChannelKeys(other.directory, (KeyPair("current", deployment.own.public, other.own.secret),), "")
    # (its secret does not match that public key: CurveZMQ's vouch fails, the server drops it)
    got = _kvsm_client_fetch(address, knows_public)
    assert isinstance(got, HandshakeError) and got.code == "unauthenticated", got

    ctx = zmq.Context()
    try:
        # A raw DEALER, no CURVE, sending a well-formed metadata request.
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(address)
        assert _nothing_on(plain, b"\x82\xa4type\xacmetadata_req\xa5nonce\x01")
        # A CURVE client with its own key pair, naming the server's public key.
        own_pub, own_sec = zmq.curve_keypair()
        curve = ctx.socket(zmq.DEALER)
        curve.setsockopt(zmq.LINGER, 0)
        curve.curve_publickey, curve.curve_secretkey, curve.curve_serverkey = own_pub, own_sec, deployment.own.public
        curve.connect(address)
        assert _nothing_on(curve, b"\x82\xa4type\xacmetadata_req\xa5nonce\x01")
        plain.close()
        curve.close()
    finally:
        ctx.term()
    # Raw TCP: a ZMTP greeting with the NULL mechanism, then a frame; only libzmq's
    # own 64-byte greeting ever comes back.
    with socket.create_connection((host, port), timeout=3) as tcp:
        tcp.sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 48 + b"\x00\x05READY")
        tcp.settimeout(1.5)
        received = b""
        try:
            while chunk := tcp.recv(4096):
                received += chunk
        except (TimeoutError, ConnectionResetError):  # silence, or the server closing on us
            pass
    assert len(received) <= 64 and b"compat" not in received and b"agent" not in received, received

    # Counted (published with the prefill engine's next step) and logged.
    _complete(llama_servers.router.url, llama_servers.model, [random.randrange(10, 1000) for _ in range(40)])

    def counted() -> bool:
        unauth = _metric(prefill, "vllm:kvsm_side_channel_messages_total", outcome="unauthenticated")
        failed = _metric(prefill, "vllm:kvsm_side_channel_messages_total", outcome="handshake_failed")
        return unauth - before_unauth >= 1 and failed - before_failed >= 3
    if not counted():  # one more step publishes what the loop counted after the last one
        _complete(llama_servers.router.url, llama_servers.model, [random.randrange(10, 1000) for _ in range(40)])
    wait_until(lambda: counted() or None, 10, "the stranger's tries in the prefill server's metrics")
    assert "unauthenticated connection(s) so far" in prefill.tail(500_000)


def test_keys_rotate_across_the_running_pair_without_failing_a_request(llama_servers: LlamaServers) -> None:
    d = llama_servers.keys
    old = load_keys(str(d))
    rng = random.Random(31)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randrange(20, 200))] for _ in range(6)]
    reference = [_complete(llama_servers.prefill.url, llama_servers.model, p) for p in prompts]
    outcomes: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            k = i % len(prompts)
            try:
                text = _complete(llama_servers.router.url, llama_servers.model, prompts[k])
                outcomes.append("ok" if text == reference[k] else f"wrong output for prompt {k}")
            except Exception as e:  # noqa: BLE001 - every failure is the finding
                outcomes.append(f"failed: {e}")
            i += 1

    def engines_use(describe: str) -> None:
        def seen() -> bool | None:
            records = read_records(sorted(llama_servers.events.glob("*.worker.*.jsonl")))
            last = {r["engine_id"]: r["keys"] for r in records if r.get("event") == "worker.keys"}
            return (set(last) == {"prefill", "decode"} and all(v.endswith(describe) for v in last.values())) or None
        wait_until(seen, 15, f"both engines to reload their keys ({describe})")

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)
        zmq.auth.create_certificates(str(d), "next")
        step1 = load_keys(str(d))
        engines_use(f"accepting {step1.own}, {step1.pairs[1]}")
        time.sleep(1.0)
        os.rename(d / "current.key_secret", d / "previous.key_secret")
        os.rename(d / "next.key_secret", d / "current.key_secret")
        step2 = load_keys(str(d))
        assert step2.own.public != old.own.public
        engines_use(f"accepting {step2.own}, {step2.pairs[1]}")
        time.sleep(1.0)
        os.remove(d / "previous.key_secret")
        step3 = load_keys(str(d))
        engines_use(f"accepting {step3.own}")
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join(timeout=90)
    assert outcomes and set(outcomes) == {"ok"}, [o for o in outcomes if o != "ok"][:5]
    assert len(outcomes) >= 10, outcomes

    # A peer holding only the rotated-out key is refused now.
    host, port = _side_channel(llama_servers)
    got = _kvsm_client_fetch(f"tcp://{host}:{port}", old)
    assert isinstance(got, HandshakeError) and got.code == "unauthenticated", got
    assert _complete(llama_servers.router.url, llama_servers.model, prompts[0]) == reference[0]


def test_a_fuzz_storm_holding_a_deployment_key_is_answered_by_the_rules(llama_servers: LlamaServers) -> None:
    host, port = _side_channel(llama_servers)
    keys = load_keys(str(llama_servers.keys))
    fuzzer = SideChannelFuzzer(host, port, seed=31, reply_timeout_s=20,
                               curve=(keys.own.public, keys.own.secret, keys.own.public))
    rng = random.Random(5)
    prompt = [rng.randrange(10, 1000) for _ in range(64)]
    reference = _complete(llama_servers.prefill.url, llama_servers.model, prompt)
    report = fuzzer.storm(3000, hold_open=6, big_frames=2, over_limit_frames=1, claimed_64mib=2, deadline_s=90)
    assert not report.mismatches, report.mismatches[:5]
    assert report.unanswered == 0 and report.messages >= 3000, report.summary()
    assert sum(report.answered.values()) == report.delivered and report.answered["served"] > 0, report.summary()
    assert _complete(llama_servers.router.url, llama_servers.model, prompt) == reference
