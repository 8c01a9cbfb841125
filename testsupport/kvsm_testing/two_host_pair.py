"""A prefill server and a decode server on two hosts (``kvsm_testing.netns``),
the router beside the decode server, UCX on TCP over the KV network only.

``UCX_TLS=tcp`` leaves UCX no shared-memory or cross-memory-attach transport
(the two namespaces share one kernel, so ``posix``/``cma`` would otherwise
carry the bytes without touching the network), and ``UCX_NET_DEVICES=kv0``
pins it to the KV link. ``UCX_PROTO_INFO=y`` makes UCX print, in the server's
log, which transport each protocol chose; ``read_transports`` reads that back
so a test can show the reads really crossed ``tcp/kv0``.

The same harness runs kvsm and upstream ``NixlConnector`` (``connector=``),
with the same model, core binding, engine settings and load-failure policy.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvsm_testing.netns import KV_IF, TwoHosts
from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs, stop_pair

__all__ = ["UCX_TCP_ENV", "TwoHostPair", "read_transports"]

UCX_TCP_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": KV_IF, "UCX_PROTO_INFO": "y"}

_PROTO_HEAD = re.compile(r"\|\s*(?P<what>remote memory read by ucp_get\S*|remote memory write by ucp_put\S*)")
_PROTO_ROW = re.compile(r"\|\s*[0-9.]+\S*\s*\|[^|]*\|\s*(?P<tl>[a-z_0-9]+/[A-Za-z0-9_.:]+)")


def read_transports(server_log: str) -> set[str]:
    """The UCX transports (``tl/device``) that UCX chose for RMA reads in this log."""
    found: set[str] = set()
    in_read = False
    for line in server_log.splitlines():
        head = _PROTO_HEAD.search(line)
        if head:
            in_read = head.group("what").startswith("remote memory read")
            continue
        if in_read:
            row = _PROTO_ROW.search(line)
            if row:
                found.add(row.group("tl"))
            elif "+---" not in line and "Range" not in line:
                in_read = False
    return found


class TwoHostPair:
    """Both servers, in their hosts, and the router; ``close`` always cleans up
    (servers, router, namespaces)."""

    def __init__(self, hosts: TwoHosts, model: str, workdir: Path, *, connector: str = "KVSMConnector",
                 extra_config: dict[str, Any] | None = None, kv_load_failure_policy: str = "recompute",
                 router_timeout_s: float = 60.0, log_stats: bool = True, prefill_tp: int = 1) -> None:
        self.hosts = hosts
        self.model = model
        self.workdir = workdir
        self.logs = workdir / "logs"
        p_spec, d_spec = pd_specs(connector=connector, event_log_dir=str(self.logs), extra_config=extra_config)
        for spec, host in ((p_spec, hosts.prefill), (d_spec, hosts.decode)):
            spec.netns = host.netns
            spec.bind_host = "0.0.0.0"
            spec.url_host = host.client_addr
            spec.side_channel_host = host.kv_addr
            spec.env = dict(UCX_TCP_ENV)
            spec.log_stats = log_stats
            spec.extra_args = (*spec.extra_args, "--shutdown-timeout", "10")
        d_spec.kv_load_failure_policy = kv_load_failure_policy
        if prefill_tp > 1:  # a worker process per rank, one per core (vLLM-CPU needs the binding)
            p_spec.own_session = d_spec.own_session = False  # one session: see kvsm_testing.servers
            p_spec.cpu = None
            p_spec.extra_args = (*p_spec.extra_args, "--tensor-parallel-size", str(prefill_tp))
            p_spec.env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % 2) for r in range(prefill_tp))
        self.prefill = VLLMServer(p_spec, model, workdir)
        self.decode = VLLMServer(d_spec, model, workdir)
        self.router = RouterProcess([f"http://{hosts.prefill.front_addr}:{p_spec.port}"],
                                    [f"http://127.0.0.1:{d_spec.port}"], workdir, timeout_s=router_timeout_s,
                                    netns=hosts.decode.netns, bind_host="0.0.0.0",
                                    url_host=hosts.decode.client_addr, own_session=prefill_tp == 1)

    def start(self, ready_timeout: float = 600.0) -> TwoHostPair:
        try:
            for server in (self.prefill, self.decode):
                server.start()
            for server in (self.prefill, self.decode):
                server.wait_ready(timeout=ready_timeout)
            self.router.start()
        except BaseException:
            self.close()
            raise
        return self

    def complete(self, prompt: list[int], max_tokens: int, *, rid: str | None = None,
                 timeout: float = 120.0) -> tuple[float, dict[str, Any]]:
        """One completion through the router: (seconds it took, the answer or
        ``{"error": ...}`` for an HTTP error)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        headers = {"Content-Type": "application/json", **({"X-Request-Id": rid} if rid else {})}
        req = urllib.request.Request(self.router.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out: dict[str, Any] = json.loads(r.read())
        except urllib.error.HTTPError as e:
            out = {"error": f"HTTP {e.code}: {e.read()[:300]!r}"}
        except (urllib.error.URLError, OSError) as e:
            out = {"error": f"{type(e).__name__}: {e}"}
        return time.monotonic() - t0, out

    def close(self) -> None:
        stop_pair(self.prefill, self.decode, self.router, timeout=20)

    def __enter__(self) -> TwoHostPair:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
