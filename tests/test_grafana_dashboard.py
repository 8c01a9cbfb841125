"""The Grafana dashboard (``deploy/grafana/kvsm-dashboard.json``): its structure,
and every panel's PromQL evaluated against a real Prometheus (Debian's
``prometheus``, installed by ``tools/dev.sh setup``) that scrapes a real
prefill and decode server while requests flow, a failing one among them:
each query must return data. Grafana itself is not in the package registries
reachable here, so the dashboard is not rendered.

Grafana's own variables are replaced before a query is sent: ``$__rate_interval``
by 1 min (at least four scrapes of 1 s, as Grafana's rule asks) and ``$__range``
by 5 min.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require, require_all

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "kvsm-dashboard.json"
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "5m"}
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def kvsm_metric_names() -> set[str]:
    """The ``vllm:kvsm_*`` metrics kvsm registers, with the series names Prometheus
    derives from them (counters' ``_total``, histograms' ``_bucket/_sum/_count``)."""
    source = (REPO / "kvsm" / "vllm" / "stats.py").read_text()
    names = set()
    for name in re.findall(r'"(vllm:kvsm_\w+)"', source):
        names |= {name, name + "_total", name + "_bucket", name + "_sum", name + "_count"}
    return names


def problems(d: dict[str, Any]) -> list[str]:
    """What keeps ``d`` from being an importable kvsm dashboard: a datasource
    input every panel and target uses, unique ids and refIds, panels on
    Grafana's 24-column grid without overlaps, and only metrics kvsm exports."""
    out: list[str] = []
    if not (d.get("schemaVersion", 0) >= 36 and d.get("uid") and d.get("title")):
        out.append("schemaVersion, uid or title")
    inputs = [i for i in d.get("__inputs", []) if i.get("type") == "datasource" and i.get("pluginId") == "prometheus"]
    if len(inputs) != 1:
        return [*out, "not exactly one Prometheus datasource input"]
    ds = {"type": "prometheus", "uid": "${" + inputs[0]["name"] + "}"}
    ids = [p.get("id") for p in d["panels"]]
    if len(ids) != len(set(ids)):
        out.append(f"panel ids repeat: {ids}")
    cells: set[tuple[int, int]] = set()
    known = kvsm_metric_names()
    for p in d["panels"]:
        title = p.get("title", "?")
        if p.get("type") not in PANEL_TYPES or p.get("datasource") != ds:
            out.append(f"{title}: type or datasource")
        g = p.get("gridPos", {})
        if not (all(isinstance(g.get(k), int) and g[k] >= 0 for k in "xywh") and g["x"] + g["w"] <= 24):
            out.append(f"{title}: gridPos {g}")
            continue
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        if mine & cells:
            out.append(f"{title}: overlaps another panel")
        cells |= mine
        refs = [t.get("refId") for t in p.get("targets", [])]
        if not refs or len(refs) != len(set(refs)):
            out.append(f"{title}: refIds {refs}")
        for t in p.get("targets", []):
            used = set(re.findall(r"vllm:kvsm_\w+", t.get("expr", "")))
            if t.get("datasource") != ds or not used or not used <= known:
                out.append(f"{title}: target {t.get('refId')} (metrics not exported: {sorted(used - known)})")
    return out


def test_the_dashboard_is_well_formed() -> None:
    d = load()
    assert problems(d) == []
    # The panels: transfer time and bytes, failures by kind, leases,
    # handshake latency, requests per lifecycle state.
    text = " ".join(e for _, e in exprs(d))
    for needed in ("kvsm_transfer_time_seconds", "kvsm_transfer_bytes", "kvsm_failures_total",
                   "kvsm_leases_expired", "kvsm_handshake_time_seconds", "kvsm_requests"):
        assert needed in text, needed
    assert "by (kind)" in text and "by (lifecycle, state)" in text


def test_a_broken_dashboard_is_caught() -> None:
    """The check can fail: an unknown metric, an overlapping panel, a panel off
    the grid, a repeated id."""
    for breaks in (lambda d: d["panels"][0]["targets"][0].update(expr="rate(vllm:kvsm_no_such_total[5m])"),
                   lambda d: d["panels"][1]["gridPos"].update(x=0, y=0),
                   lambda d: d["panels"][0]["gridPos"].update(x=20),
                   lambda d: d["panels"][1].update(id=d["panels"][0]["id"])):
        d = load()
        breaks(d)
        assert problems(d), "a broken dashboard passed the check"


# -- against a real Prometheus ------------------------------------------------------------


def _prometheus_or_reason() -> str | None:
    return None if shutil.which("prometheus") else "Debian's prometheus is not installed (tools/dev.sh setup)"


class Prometheus:
    def __init__(self, workdir: Path, targets: list[str]) -> None:
        from kvsm_testing.ports import free_port

        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": targets}]}],
        }))
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (REPO / self.log.name).read_text()[-2000:]
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(s.get("value") and s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in result)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    reason = _prometheus_or_reason()
    if reason is not None:
        if require_all():
            pytest.fail(f"{reason}, and KVSM_REQUIRE_ALL or CI is set", pytrace=False)
        pytest.skip(reason)
    require("vllm")
    from kvsm_testing import build_tiny_model
    from kvsm_testing.servers import VLLMServer, free_port, pd_specs, running_pair

    tmp = tmp_path_factory.mktemp("grafana")
    model = str(build_tiny_model())
    p_spec, d_spec = pd_specs(event_log_dir=str(tmp / "logs"))
    for spec in (p_spec, d_spec):
        spec.log_stats = True
    d_spec.kv_load_failure_policy = "recompute"
    prefill, decode = VLLMServer(p_spec, model, tmp), VLLMServer(d_spec, model, tmp)
    with running_pair(prefill, decode):
        prom = Prometheus(tmp, [f"127.0.0.1:{p_spec.port}", f"127.0.0.1:{d_spec.port}"])
        try:
            prom.wait_ready()
            # Both targets scraped before any request, the second time after the first had
            # been seen: rates then see the requests as increases over a sample before them.
            deadline = time.monotonic() + 30
            while len([x for x in prom.query("up == 1")]) < 2:
                assert time.monotonic() < deadline, "prometheus never scraped both servers"
                time.sleep(0.5)
            seen = time.time()
            while not all(float(x["value"][1]) > seen for x in prom.query("timestamp(up)") or [{"value": [0, 0]}]):
                assert time.monotonic() < deadline, "prometheus did not scrape both servers again"
                time.sleep(0.2)
            body = {"model": model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            for i in range(6):  # P/D requests, as a router sends them
                prompt = list(range(20 + i, 300 + i))
                kv = prefill.post("/v1/completions", {**body, "prompt": prompt, "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}})
                decode.post("/v1/completions", {**body, "prompt": prompt,
                                                "kv_transfer_params": kv["kv_transfer_params"]})
            # One failing: its params name a prefill engine whose port nothing listens on.
            kv = prefill.post("/v1/completions", {**body, "prompt": list(range(500, 700)), "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
            dead = {**kv["kv_transfer_params"], "remote_port": free_port(), "remote_engine_id": "gone"}
            decode.post("/v1/completions", {**body, "prompt": list(range(500, 700)), "kv_transfer_params": dead})
            yield prom
        finally:
            prom.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_panel_returns_data_from_a_real_prometheus(scraped: Prometheus) -> None:
    """Both servers scraped every second while requests flowed (one of them
    failing): every panel's query, Grafana's variables substituted, returns at
    least one sample that is a number."""
    pending = dict.fromkeys(exprs(load()))
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        for title, expr in list(pending):
            query = expr
            for var, value in GRAFANA_VARS.items():
                query = query.replace(var, value)
            if _has_data(scraped.query(query)):
                pending.pop((title, expr))
        time.sleep(1)
    assert not pending, f"panels without data: {list(pending)}"
    # The failing request is there by its kind.
    kinds = {s["metric"].get("kind") for s in scraped.query("sum by (kind) (vllm:kvsm_failures_total)")}
    assert kinds & {"peer_refused", "peer_dead", "handshake_timeout"}, kinds
