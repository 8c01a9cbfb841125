"""Routers' prefill/decode contracts, replayed against kvsm's real scheduler half.

Each router below is transcribed from its source: what it sends to the
prefill engine, and what it forwards from the prefill engine's answer to the
decode engine. The engines are vLLM's real ``Scheduler`` with kvsm
(``kvsm_testing.scheduler``, no model, no worker); between them the prefill
answer goes through JSON, as it does over HTTP (and Dynamo's request plane).
The tests check that kvsm's prefill side accepts exactly what each router
sends and pins the blocks, that what it returns carries everything upstream's
pull-mode ``NixlConnector`` returns (``transfer_mode: "pull"`` included), and
that the decode side, given exactly what the router forwards, reads those
blocks from that engine.

Sources of the contracts (as stored in the public index this was written from):

* vLLM's toy proxy, ``vllm-project/vllm``
  ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``:
  ``send_request_to_service`` sends the client's body with ``kv_transfer_params
  = {do_remote_decode: true, do_remote_prefill: false, remote_engine_id,
  remote_block_ids, remote_host, remote_port: null}``, ``stream: false``,
  ``max_tokens: 1`` (and ``max_completion_tokens: 1`` where present), without
  ``stream_options``, ``min_tokens``, ``min_completion_tokens``;
  ``_handle_completions`` sends the client's own body to the decode engine,
  with the prefill response's ``kv_transfer_params`` only when they are truthy.
* llm-d's routing sidecar, ``llm-d/llm-d-router``
  ``pkg/sidecar/proxy/connector_nixlv2.go`` (``handleNIXLV2``, READ mode) with
  ``pkg/common/request/tokens.go`` (``CapSingleToken``); before that
  ``llm-d/llm-d-routing-sidecar`` ``internal/proxy/connector_nixlv2.go``
  (``runNIXLProtocolV2``): the same six-key ``kv_transfer_params``, every token
  limit set to 1, ``min_tokens`` removed, ``stream: false``; the decode leg is
  the client's body with ``kv_transfer_params`` set to the prefill response's
  value, whatever it is (``null`` when it is missing).
* NVIDIA Dynamo, ``ai-dynamo/dynamo`` ``components/src/dynamo/vllm/``:
  ``kv_connector_protocols.py`` (``NixlConnectorProtocol``: the same six keys
  for the prefill request, the engine's ``RequestOutput.kv_transfer_params``
  verbatim for the decode; ``make_kv_connector_protocol`` looks the engine's
  ``kv_transfer_config.kv_connector`` up in ``KV_CONNECTOR_PROTOCOLS`` and
  raises "Unsupported kv_connector" for a name it lacks), ``handlers.py``
  (``PrefillWorkerHandler._generate_token_mode``: ``max_tokens = min_tokens =
  1``) and ``llm_engine.py`` (``VllmLLMEngine.generate``, the unified backend:
  the decode request gets ``prefill_result["disaggregated_params"]
  ["kv_transfer_params"]`` and fails without it). Dynamo runs kvsm under the
  name it accepts: ``kv_connector "NixlConnector"`` loaded from
  ``kv_connector_module_path "kvsm.plugin"``.
* vLLM's push-mode proxy, ``vllm-project/vllm``
  ``examples/disaggregated/disaggregated_serving/disagg_proxy_pushconnector_demo.py``
  (``PushProxy._build_decode_kv_params``): the decode engine gets the prefill
  engine's coordinates from the command line and no ``remote_block_ids``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.replay import analyse
from kvsm.vllm.connector import KVSMConnector
from kvsm.vllm.metadata import KVSMConnectorMetadata
from kvsm_testing.scheduler import SchedulerHarness, make_scheduler

PREFILL_HOST, PREFILL_PORT = "10.1.2.3", 23456
PROMPT_TOKENS, BLOCK_SIZE = 40, 16  # 3 blocks, the last one partial
CLIENT_MAX_TOKENS = 4

# What all three pull-mode routers put in the prefill request (the same six keys).
NIXL_PULL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}

# What an operator puts in --kv-transfer-config to run kvsm under Dynamo: the only
# name Dynamo's make_kv_connector_protocol accepts that kvsm can answer to.
DYNAMO_KVSM_CONFIG = {"kv_connector": "NixlConnector", "kv_connector_module_path": "kvsm.plugin"}

# A client's request, with the fields the routers rewrite for the prefill leg.
CLIENT_BODY: dict[str, Any] = {"model": "m", "prompt": "p", "max_tokens": CLIENT_MAX_TOKENS, "min_tokens": 2,
                               "stream": True, "stream_options": {"include_usage": True}}


# ------------------------------------------------------------ the routers


def _toy_proxy_prefill(client: dict[str, Any]) -> dict[str, Any]:
    body = dict(client, kv_transfer_params=dict(NIXL_PULL_PREFILL_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(key, None)
    return body


def _toy_proxy_decode(client: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    body = dict(client)
    kv = prefill_response.get("kv_transfer_params", {})
    if kv:
        body["kv_transfer_params"] = kv
    return body


def _llm_d_prefill(client: dict[str, Any]) -> dict[str, Any]:
    body = dict(client, kv_transfer_params=dict(NIXL_PULL_PREFILL_PARAMS), stream=False, max_tokens=1,
                max_completion_tokens=1)
    body.pop("min_tokens", None)
    body.pop("stream_options", None)
    return body


def _llm_d_decode(client: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    return dict(client, kv_transfer_params=prefill_response.get("kv_transfer_params"))


def _dynamo_prefill(client: dict[str, Any]) -> dict[str, Any]:
    return dict(client, kv_transfer_params=dict(NIXL_PULL_PREFILL_PARAMS), max_tokens=1, min_tokens=1)


def _dynamo_decode(client: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    kv = prefill_response.get("kv_transfer_params")
    disaggregated_params = {"kv_transfer_params": kv} if kv is not None else None
    kv_params = (disaggregated_params or {}).get("kv_transfer_params")
    if kv_params is None:
        raise ValueError("decode worker received prefill_result without kv_transfer_params")
    return dict(client, kv_transfer_params=kv_params)


@dataclass(frozen=True)
class Router:
    name: str
    prefill: Callable[[dict[str, Any]], dict[str, Any]]
    decode: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]
    # The engines' kv_transfer_config as the router's documentation runs them.
    kv_connector: str = "KVSMConnector"
    kv_connector_module_path: str | None = "kvsm.connector"


TOY_PROXY = Router("vllm-toy-proxy", _toy_proxy_prefill, _toy_proxy_decode)
LLM_D = Router("llm-d-sidecar-nixlv2", _llm_d_prefill, _llm_d_decode)
DYNAMO = Router("dynamo", _dynamo_prefill, _dynamo_decode, **DYNAMO_KVSM_CONFIG)
ROUTERS = (TOY_PROXY, LLM_D, DYNAMO)


# ------------------------------------------------------------ helpers


@pytest.fixture(autouse=True)
def _restore_conv_state_layout() -> Iterator[None]:
    """vLLM's CPU platform sets VLLM_SSM_CONV_STATE_LAYOUT once per process from
    the first config it sees (DS for a connector named NixlConnector); leave it
    as it was for the tests after these."""
    key = "VLLM_SSM_CONV_STATE_LAYOUT"
    before = os.environ.get(key)
    yield
    if before is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = before


def engine(router: Router, kv_role: str, engine_id: str, port: int, tmp_path: Path | None = None) -> SchedulerHarness:
    extra: dict[str, Any] = {"side_channel_host": PREFILL_HOST, "side_channel_port": port}
    if tmp_path is not None:
        extra["event_log_dir"] = str(tmp_path / "logs")
    return make_scheduler(kv_role=kv_role, kv_connector=router.kv_connector,
                          kv_connector_module_path=router.kv_connector_module_path, block_size=BLOCK_SIZE,
                          extra_config=extra, engine_id=engine_id)


def submit(h: SchedulerHarness, prompt: list[int], body: dict[str, Any], request_id: str) -> None:
    """What vLLM's OpenAI server makes of a request body: the prompt, max_tokens,
    and body["kv_transfer_params"] in SamplingParams.extra_args."""
    h.add_request(prompt, kv_transfer_params=body.get("kv_transfer_params"), max_tokens=body["max_tokens"],
                  request_id=request_id)


def http(value: Any) -> Any:
    """One hop through JSON, as a response body travels (tuples become lists)."""
    return json.loads(json.dumps(value))


def meta_of(step: Any) -> KVSMConnectorMetadata:
    meta = step.connector_metadata
    assert isinstance(meta, KVSMConnectorMetadata), type(meta)
    return meta


def drained(h: SchedulerHarness) -> None:
    counts = h.connector.scheduler_half.pending_counts()
    assert all(v == 0 for v in counts.values()), counts


def log_events(tmp_path: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for f in (tmp_path / "logs").glob("*.scheduler.*.jsonl"):
        out += [r for r in map(json.loads, f.read_text().splitlines()) if r["event"] == event]
    return out


def replays_clean(tmp_path: Path) -> None:
    """The closed engines' scheduler logs replay clean: each request's ``sched``
    machine took the steps the table declares."""
    report = analyse(sorted((tmp_path / "logs").glob("*.scheduler.*.jsonl")))
    assert report.machines and not report.findings, [str(f) for f in report.findings]


# ------------------------------------------------------------ the contracts


@pytest.mark.parametrize("roles", [("kv_producer", "kv_consumer"), ("kv_both", "kv_both")], ids=["p-d", "both"])
@pytest.mark.parametrize("router", ROUTERS, ids=[r.name for r in ROUTERS])
def test_a_request_goes_through_the_router_and_reads_the_prefill_blocks(router: Router, roles: tuple[str, str],
                                                                        tmp_path: Path) -> None:
    p_role, d_role = roles
    with engine(router, p_role, "prefill-e", PREFILL_PORT, tmp_path / "p") as p, \
            engine(router, d_role, "decode-e", PREFILL_PORT + 1, tmp_path / "d") as d:
        assert type(p.connector) is type(d.connector) is KVSMConnector  # also under Dynamo's spelling
        p_free0, d_free0 = p.free_blocks(), d.free_blocks()
        prompt = p.make_prompt(PROMPT_TOKENS)

        # Prefill leg: accepted as sent, pinned, finished after the one token.
        prefill_body = router.prefill(CLIENT_BODY)
        assert prefill_body["max_tokens"] == 1
        submit(p, prompt, prefill_body, "p-1")
        s = p.step()
        assert [x.req for x in meta_of(s).send_start] == ["p-1"]
        out = s.finished["p-1"]
        params = out.kv_transfer_params
        assert params is not None, "the prefill engine returned no kv_transfer_params"
        held = [list(g) for g in p.block_ids("p-1")]
        assert len(held[0]) == 3 and p.free_blocks() == p_free0 - 3  # pinned past the finish
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["transfer_mode"] == "pull"
        assert (params["remote_engine_id"], params["remote_request_id"]) == ("prefill-e", "p-1")
        assert (params["remote_host"], params["remote_port"]) == (PREFILL_HOST, PREFILL_PORT)
        assert (params["tp_size"], params["pp_size"], params["remote_num_tokens"]) == (1, 1, PROMPT_TOKENS)
        assert [list(g) for g in params["remote_block_ids"]] == held
        assert not log_events(tmp_path / "p", "sched.params_ignored")

        # Decode leg: exactly what the router forwards from the answer's JSON.
        response = http({"kv_transfer_params": params})
        decode_body = router.decode(CLIENT_BODY, response)
        forwarded = decode_body["kv_transfer_params"]
        assert forwarded == response["kv_transfer_params"]  # verbatim, vLLM's own extras included
        assert {"transfer_mode", "remote_prefill_cached_tokens"} <= set(forwarded)
        assert decode_body["max_tokens"] == CLIENT_MAX_TOKENS
        submit(d, prompt, decode_body, "d-1")
        s = d.step()
        (start,) = meta_of(s).recv_start
        assert (start.req, start.remote_engine, start.remote_req) == ("d-1", "prefill-e", "p-1")
        assert (start.remote_host, start.remote_port, start.remote_tp_size) == (PREFILL_HOST, PREFILL_PORT, 1)
        assert list(start.remote_block_ids) == held[0]
        assert list(start.local_block_ids) == list(d.block_ids("d-1")[0])
        assert start.num_tokens == PROMPT_TOKENS and start.awaited
        assert d.request("d-1").status.name == "WAITING_FOR_REMOTE_KVS" and s.scheduled == {}
        assert not log_events(tmp_path / "d", "sched.params_ignored")

        # The read lands; decode generates; the prefill side's blocks come back.
        d.step(finished_recving={"d-1"})
        results = d.run_until_idle()
        done = {rid: o for r in results for rid, o in r.finished.items()}
        assert done["d-1"].kv_transfer_params is None  # a decode's finish hands nothing on
        assert p.step().finished == {}  # the pin goes to the worker with this step
        p.step(finished_sending={"p-1"})
        assert (p.free_blocks(), d.free_blocks()) == (p_free0, d_free0)
        drained(p)
        drained(d)


@pytest.mark.parametrize("router", [TOY_PROXY, LLM_D], ids=["vllm-toy-proxy", "llm-d-sidecar-nixlv2"])
def test_a_prefill_without_params_leaves_the_decode_to_run_locally(router: Router) -> None:
    """A prefill engine that cannot produce (kv_consumer, misconfigured) answers
    without kv_transfer_params: the toy proxy then forwards the client's body
    as it came, llm-d forwards ``null``; either way the decode engine prefills
    the prompt itself, and nothing is pinned anywhere."""
    with engine(router, "kv_consumer", "prefill-e", PREFILL_PORT) as p, \
            engine(router, "kv_consumer", "decode-e", PREFILL_PORT + 1) as d:
        free0 = p.free_blocks()
        prompt = p.make_prompt(PROMPT_TOKENS)
        submit(p, prompt, router.prefill(CLIENT_BODY), "p-1")
        out = p.step().finished["p-1"]
        assert out.kv_transfer_params is None
        assert p.free_blocks() == free0  # freed at once: nothing pinned
        decode_body = router.decode(CLIENT_BODY, http({"kv_transfer_params": out.kv_transfer_params}))
        assert decode_body.get("kv_transfer_params") is None
        submit(d, prompt, decode_body, "d-1")
        s = d.step()
        assert not meta_of(s).recv_start and s.scheduled == {"d-1": PROMPT_TOKENS}
        d.run_until_idle()
        drained(p)
        drained(d)


def test_dynamo_gets_no_params_from_a_prefill_engine_that_cannot_produce() -> None:
    """kvsm under Dynamo's name (``DYNAMO_KVSM_CONFIG``) on a prefill engine that
    cannot produce (kv_consumer) answers Dynamo's prefill request without
    kv_transfer_params and pins nothing. Unlike the toy proxy and llm-d, Dynamo
    does not run such a request locally: ``VllmLLMEngine.generate``
    (``components/src/dynamo/vllm/llm_engine.py``) fails the decode leg when
    ``prefill_result["disaggregated_params"]["kv_transfer_params"]`` is missing
    (``_dynamo_decode``, transcribed)."""
    with engine(DYNAMO, "kv_consumer", "prefill-e", PREFILL_PORT) as p:
        assert type(p.connector) is KVSMConnector
        free0 = p.free_blocks()
        prefill_body = DYNAMO.prefill(CLIENT_BODY)
        assert prefill_body["max_tokens"] == prefill_body["min_tokens"] == 1
        submit(p, p.make_prompt(PROMPT_TOKENS), prefill_body, "p-1")
        s = p.step()
        assert not meta_of(s).send_start
        out = s.finished["p-1"]
        assert out.kv_transfer_params is None
        assert p.free_blocks() == free0  # freed at once: nothing pinned
        drained(p)
    with pytest.raises(ValueError, match="without kv_transfer_params"):
        DYNAMO.decode(CLIENT_BODY, http({"kv_transfer_params": out.kv_transfer_params}))


def test_push_mode_proxy_params_run_the_decode_locally_and_say_why(tmp_path: Path) -> None:
    """vLLM's push-mode proxy gives the decode engine the prefill engine's
    coordinates and no block ids (its D registers blocks for P to write into).
    kvsm only reads: the request runs locally, and the log says why."""
    push_params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "prefill-engine-001",
                   "remote_host": PREFILL_HOST, "remote_port": PREFILL_PORT, "tp_size": 1, "pp_size": 1,
                   "remote_request_id": "3f1c"}
    with engine(TOY_PROXY, "kv_consumer", "decode-e", PREFILL_PORT + 1, tmp_path) as d:
        free0 = d.free_blocks()
        submit(d, d.make_prompt(PROMPT_TOKENS), {"max_tokens": 2, "kv_transfer_params": push_params}, "d-push")
        s = d.step()
        assert not meta_of(s).recv_start and s.scheduled == {"d-push": PROMPT_TOKENS}
        d.run_until_idle()
        assert d.free_blocks() == free0
        drained(d)
    (ignored,) = log_events(tmp_path, "sched.params_ignored")
    assert ignored["req"] == "d-push" and "remote_block_ids" in ignored["reason"]
    replays_clean(tmp_path)


@pytest.mark.parametrize("mode", ["push", "WRITE"])
def test_params_of_a_producer_that_is_not_pull_run_the_decode_locally_and_say_why(mode: str,
                                                                                   tmp_path: Path) -> None:
    """Pull-shaped params (block ids included) from a producer whose
    transfer_mode is not "pull" (NixlPushConnector's prefill answer, forwarded
    by a pull router) are not read as if they were: the request runs locally
    and the log names the mode. Without the key (an older producer) they are."""
    with engine(TOY_PROXY, "kv_consumer", "decode-e", PREFILL_PORT + 1, tmp_path) as d:
        base = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                "remote_engine_id": "prefill-e", "remote_request_id": "p-1", "remote_host": PREFILL_HOST,
                "remote_port": PREFILL_PORT, "tp_size": 1, "remote_num_tokens": PROMPT_TOKENS}
        submit(d, d.make_prompt(PROMPT_TOKENS), {"max_tokens": 2, "kv_transfer_params": {**base,
                                                                                         "transfer_mode": mode}},
               "d-mode")
        submit(d, d.make_prompt(PROMPT_TOKENS), {"max_tokens": 2, "kv_transfer_params": base}, "d-old")
        s = d.step()
        assert [r.req for r in meta_of(s).recv_start] == ["d-old"]
        assert "d-mode" in s.scheduled
        d.step(finished_recving={"d-old"})
        d.run_until_idle()
        drained(d)
    (ignored,) = log_events(tmp_path, "sched.params_ignored")
    assert ignored["req"] == "d-mode" and f"transfer_mode {mode!r}" in ignored["reason"]
    replays_clean(tmp_path)


# ------------------------------------------------------------ Dynamo's connector name
#
# Dynamo's ``make_kv_connector_protocol`` (``components/src/dynamo/vllm/
# kv_connector_protocols.py``) looks the engine's ``kv_transfer_config.kv_connector``
# up in ``KV_CONNECTOR_PROTOCOLS`` ("NixlConnector", "NeuronNixlConnector",
# "MooncakeConnector", "LMCacheMPConnector" in the stored versions) and raises
# "Unsupported kv_connector" for any other name, "KVSMConnector" included; a
# ``MultiConnector`` or ``PdConnector`` is taken for its one child named in that
# table. So kvsm runs under Dynamo only as ``DYNAMO_KVSM_CONFIG``, alone or as that
# child. The tests below check what kvsm and vLLM make of that spelling; the router
# tests above (``dynamo``) run a request through it.


def multi_connector_engine(kv_role: str, engine_id: str, port: int) -> SchedulerHarness:
    """An engine whose kv_connector is vLLM's MultiConnector with kvsm, spelled as
    for Dynamo, as its one child."""
    child = {**DYNAMO_KVSM_CONFIG, "kv_role": kv_role,
             "kv_connector_extra_config": {"side_channel_host": PREFILL_HOST, "side_channel_port": port}}
    return make_scheduler(kv_role=kv_role, kv_connector="MultiConnector", kv_connector_module_path=None,
                          block_size=BLOCK_SIZE, extra_config={"connectors": [child]}, engine_id=engine_id)


def test_dynamo_spelling_inside_vllms_multi_connector_runs_kvsm() -> None:
    """The Dynamo spelling as a MultiConnector's child (e.g. beside an offloading
    connector): vLLM's real MultiConnector builds kvsm for it, Dynamo's prefill
    request goes through it, and the params it returns (kvsm's, through the
    wrapper) are read by a decode engine that runs kvsm under the plain Dynamo
    spelling."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorMetadata,
    )


    with multi_connector_engine("kv_both", "prefill-e", PREFILL_PORT) as p, \
            engine(DYNAMO, "kv_both", "decode-e", PREFILL_PORT + 1) as d:
        assert isinstance(p.connector, MultiConnector)
        (child,) = p.connector._connectors
        assert type(child) is KVSMConnector and type(d.connector) is KVSMConnector
        p_free0 = p.free_blocks()
        prompt = p.make_prompt(PROMPT_TOKENS)
        submit(p, prompt, DYNAMO.prefill(CLIENT_BODY), "p-1")
        s = p.step()
        wrapped = s.connector_metadata
        assert isinstance(wrapped, MultiKVConnectorMetadata)
        (meta,) = wrapped.metadata
        assert isinstance(meta, KVSMConnectorMetadata) and [x.req for x in meta.send_start] == ["p-1"]
        params = s.finished["p-1"].kv_transfer_params
        assert params is not None, "the MultiConnector returned no kv_transfer_params"
        held = [list(g) for g in p.block_ids("p-1")]
        assert len(held[0]) == 3 and p.free_blocks() == p_free0 - 3
        assert params["transfer_mode"] == "pull" and "kvsm_protocol" in params  # kvsm's answer, not upstream's
        assert (params["remote_engine_id"], params["remote_request_id"]) == ("prefill-e", "p-1")
        assert (params["remote_host"], params["remote_port"]) == (PREFILL_HOST, PREFILL_PORT)
        assert [list(g) for g in params["remote_block_ids"]] == held

        submit(d, prompt, DYNAMO.decode(CLIENT_BODY, http({"kv_transfer_params": params})), "d-1")
        (start,) = meta_of(d.step()).recv_start
        assert (start.req, start.remote_engine, start.remote_req) == ("d-1", "prefill-e", "p-1")
        assert list(start.remote_block_ids) == held[0]
        d.step(finished_recving={"d-1"})
        d.run_until_idle()
        p.step()
        p.step(finished_sending={"p-1"})
        assert p.free_blocks() == p_free0
        pending = child.scheduler_half.pending_counts()
        assert all(v == 0 for v in pending.values()), pending
        drained(d)


def test_the_alias_loads_kvsm_and_leaves_upstreams_nixl_connector_alone() -> None:
    """Dynamo's spelling resolves to kvsm in vLLM's real ``KVConnectorFactory``:
    ``kvsm.plugin.NixlConnector`` is KVSMConnector for a config that names the
    module; vLLM's registry keeps upstream's NixlConnector for every other one,
    however often the plugin registers."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as UpstreamNixl

    import kvsm.vllm.plugin

    kvsm.vllm.plugin.register()
    kvsm.vllm.plugin.register()
    alias = KVTransferConfig(kv_role="kv_both", **DYNAMO_KVSM_CONFIG)
    assert KVConnectorFactory.get_connector_class(alias) is KVSMConnector
    assert KVConnectorFactory.supports_hma_config(alias)  # KVSMConnector's SupportsHMA, not upstream's answer
    plain = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(plain) is UpstreamNixl
    assert KVConnectorFactory.get_connector_class_by_name("NixlConnector") is UpstreamNixl
    assert KVConnectorFactory.get_connector_class_by_name("KVSMConnector") is KVSMConnector
    assert alias.has_connector("NixlConnector")  # vLLM's name-keyed NIXL settings apply to it
    assert kvsm.vllm.plugin.NixlConnector is KVSMConnector
    with pytest.raises(AttributeError, match="NixlPushConnector"):
        _ = kvsm.vllm.plugin.NixlPushConnector
