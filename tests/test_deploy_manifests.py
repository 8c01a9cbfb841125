"""The Kubernetes manifests under ``deploy/k8s``: valid objects, and a kvsm set-up that holds together.

No cluster is involved. Every document is validated offline:

- core kinds against the Kubernetes JSON schemas that ``kubernetes-validate``
  bundles (strict mode: an unknown field is an error), for the oldest Kubernetes
  version the manifests need (1.29: native sidecars, ``restartPolicy: Always`` on an
  init container) and the newest the package bundles;
- gateway-api-inference-extension's ``InferencePool`` (a custom resource no
  Kubernetes schema knows) against ``INFERENCE_POOL_SCHEMA`` below, written from
  that project's v1 CRD (``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml``).
  A kind that neither knows fails the test: nothing is skipped silently.

Then kvsm's own reading of them: every vLLM container's ``--kv-transfer-config``
parses, names ``KVSMConnector`` and goes through ``KVSMConfig.from_vllm`` (the
connector's real config parser); a producer declares its side-channel port
(``side_channel_port`` + data-parallel index 0) and takes the advertised host from
the pod IP; every engine's ``side_channel_keys`` (the deployment's CURVE keys) is
the path of a read-only, owner-only mount of a Secret, mounted whole (no ``subPath``,
which a Secret's update never reaches), the same Secret for every engine of the file,
and the real parser loads a key pair put there; the router's arguments parse with
``kvsm.router``'s real CLI and point at Services of the same file; Service and probe ports exist in the pods; llm-d's
sidecar, InferencePool and EPP configuration agree with the vLLM ports. Each check
also has a negative case: a broken copy that must be rejected.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
import zmq.auth
from kubernetes_validate.utils import latest_version

from kvsm import router as kvsm_router
from kvsm.config import EXTRA_KEYS, KVSMConfig
from kvsm.vllm.config import kvsm_config as parse_config

MANIFEST_DIR = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
MANIFESTS = sorted(MANIFEST_DIR.glob("*.yaml"))
K8S_VERSIONS = ("1.29", latest_version())

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SIDE_CHANNEL_PORT_NAME = "kvsm-side"
KEYS_ENV = "KVSM_SIDE_CHANNEL_KEYS"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")

_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
# InferencePool, inference.networking.k8s.io/v1: the spec of the v1 CRD (fields,
# types, bounds and required keys as the CRD declares them; CEL rules left out),
# closed to unknown fields as the API server prunes them.
INFERENCE_POOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}}},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts"],
            "additionalProperties": False,
            "properties": {
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "selector": {
                    "type": "object", "required": ["matchLabels"], "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                                   "additionalProperties": _LABEL_VALUE}},
                },
                "targetPorts": {
                    "type": "array", "minItems": 1, "maxItems": 8,
                    "items": {"type": "object", "required": ["number"], "additionalProperties": False,
                              "properties": {"number": _PORT}},
                },
                "endpointPickerRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {"type": "object", "required": ["number"], "additionalProperties": False,
                                 "properties": {"number": _PORT}},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
CUSTOM_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_SCHEMA}


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def validate(doc: dict[str, Any], version: str) -> None:
    """Raise (jsonschema.ValidationError or kubernetes_validate's errors) unless ``doc`` is valid."""
    custom = CUSTOM_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if custom is not None:
        jsonschema.Draft202012Validator(custom).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


# -- reading pods -----------------------------------------------------------------------


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every workload in ``docs``."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in WORKLOAD_KINDS]


def all_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def argv(container: dict[str, Any]) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one wins), else None."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def is_vllm(container: dict[str, Any]) -> bool:
    return VLLM_MODULE in argv(container)


def is_kvsm_router(container: dict[str, Any]) -> bool:
    args = argv(container)
    return any(a == "-m" and args[i + 1:i + 2] == ["kvsm.router"] for i, a in enumerate(args))


def ports(container: dict[str, Any]) -> dict[str, int]:
    """Container port name (or its number as text) -> number."""
    out: dict[str, int] = {}
    for p in container.get("ports", []):
        out[str(p["containerPort"])] = p["containerPort"]
        if "name" in p:
            out[p["name"]] = p["containerPort"]
    return out


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- kvsm's checks: each returns the problems it found (an empty list: none) ------------------


@functools.cache
def key_directory() -> str:
    """A directory holding a fresh key pair, as a mounted Secret holds the deployment's
    (``current.key_secret``): what the parser reads in place of the mount path."""
    path = tempfile.mkdtemp(prefix="kvsm-manifest-keys-")
    atexit.register(shutil.rmtree, path, True)
    zmq.auth.create_certificates(path, "current")
    return path


def keys_path(container: dict[str, Any]) -> str | None:
    """Where the engine is told its side-channel keys are: ``side_channel_keys``, else the env fallback."""
    raw = flag(argv(container), "--kv-transfer-config")
    extra = (json.loads(raw).get("kv_connector_extra_config") or {}) if raw else {}
    return extra.get("side_channel_keys") or env_of(container).get(KEYS_ENV, {}).get("value")


def keys_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str | None, str | None]:
    """(the Secret mounted at ``path``, None) if ``path`` is a usable key mount, else (None, what is wrong)."""
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == path.rstrip("/")]
    if not mounts:
        return None, f"side_channel_keys {path} is no volume mount of the container"
    mount = mounts[0]
    if mount.get("subPath") or mount.get("subPathExpr"):
        return None, f"side_channel_keys {path} is a subPath mount: a Secret's update (a key rotation) never reaches it"
    if not mount.get("readOnly"):
        return None, f"side_channel_keys {path} is not mounted readOnly"
    volume = next((v for v in pod["spec"].get("volumes", []) if v["name"] == mount["name"]), {})
    secret = volume.get("secret")
    if secret is None or not secret.get("secretName"):
        return None, f"side_channel_keys {path}: volume {mount['name']} is not a Secret volume"
    mode = secret.get("defaultMode", 0o644)
    if mode & 0o077:
        return None, f"side_channel_keys {path}: defaultMode {mode:#o} lets other users read the secret keys"
    if secret.get("optional"):
        return None, f"side_channel_keys {path}: the Secret is optional, so a pod could start without its keys"
    items = secret.get("items")
    if items is not None and not any(i.get("path") == "current.key_secret" for i in items):
        return None, f"side_channel_keys {path}: the Secret's items put no current.key_secret there"
    return secret["secretName"], None


def kvsm_config(container: dict[str, Any], pod_ip: str = "10.0.0.7") -> tuple[dict[str, Any], KVSMConfig]:
    """The container's --kv-transfer-config, and what kvsm's config parser makes of it
    (the pod's env as the engine would see it, with status.podIP as ``pod_ip``, and
    a fresh key pair where the side-channel keys' Secret would be mounted)."""
    args = argv(container)
    raw = flag(args, "--kv-transfer-config")
    assert raw is not None, f"{container['name']}: no --kv-transfer-config"
    kvt = json.loads(raw)
    env: dict[str, str] = {}
    for name, e in env_of(container).items():
        if "value" in e:
            env[name] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[name] = pod_ip
    extra = dict(kvt.get("kv_connector_extra_config") or {})
    if extra.get("side_channel_keys"):
        extra["side_channel_keys"] = key_directory()
    if env.get(KEYS_ENV):
        env[KEYS_ENV] = key_directory()
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra, kv_role=kvt.get("kv_role"),
            kv_buffer_device=kvt.get("kv_buffer_device", "cpu"), engine_id="manifest-check",
            kv_load_failure_policy=kvt.get("kv_load_failure_policy", "fail")),
        parallel_config=SimpleNamespace(
            data_parallel_index=0, tensor_parallel_size=int(flag(args, "--tensor-parallel-size") or 1),
            pipeline_parallel_size=1, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 8, use_mla=False),
    )
    return kvt, parse_config(vllm_config, env=env)


def check_vllm_containers(docs: list[dict[str, Any]]) -> list[str]:
    problems = []
    secrets: dict[str, str] = {}  # engine -> the Secret its keys come from
    for workload, pod in pod_specs(docs):
        for c in all_containers(pod):
            if not is_vllm(c):
                continue
            where = f"{workload['metadata']['name']}/{c['name']}"
            try:
                kvt, cfg = kvsm_config(c)
            except (AssertionError, ValueError) as e:  # json.JSONDecodeError is a ValueError
                problems.append(f"{where}: {e}")
                continue
            if kvt.get("kv_connector") != "KVSMConnector":
                problems.append(f"{where}: kv_connector is {kvt.get('kv_connector')!r}, not KVSMConnector")
            keys = keys_path(c)
            if keys is None:
                problems.append(f"{where}: no side_channel_keys: its side channel would answer any host "
                                "that reaches it (docs/security.md)")
            else:
                secret, wrong = keys_secret(pod, c, keys)
                if wrong is not None:
                    problems.append(f"{where}: {wrong}")
                else:
                    secrets[where] = str(secret)
            unknown = sorted(set(kvt.get("kv_connector_extra_config") or {}) - set(EXTRA_KEYS))
            if unknown:
                problems.append(f"{where}: kv_connector_extra_config keys kvsm does not know: {unknown}")
            dp = int(flag(argv(c), "--data-parallel-size") or 1)
            declared = ports(c)
            side = declared.get(SIDE_CHANNEL_PORT_NAME)
            if cfg.produces:
                # Data-parallel engine i listens on side_channel_port + i; engine 0 is cfg's.
                base = cfg.side_channel_port  # + data_parallel_index 0
                want = {base + i for i in range(dp)}
                have = {p for name, p in declared.items() if name.startswith(SIDE_CHANNEL_PORT_NAME)}
                if side != base or have != want:
                    problems.append(f"{where}: side-channel container ports {sorted(have)} (named "
                                    f"{SIDE_CHANNEL_PORT_NAME}*), kvsm listens on {sorted(want)}")
                host = env_of(c).get("VLLM_NIXL_SIDE_CHANNEL_HOST", {})
                from_pod_ip = host.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"
                if cfg.side_channel_host != "10.0.0.7" or not from_pod_ip:
                    problems.append(f"{where}: the advertised side-channel host is {cfg.side_channel_host!r}, "
                                    "not the pod IP (VLLM_NIXL_SIDE_CHANNEL_HOST from status.podIP)")
            elif side is not None:
                problems.append(f"{where}: kv_role {cfg.kv_role} binds no side channel, yet declares port {side}")
            http = flag(argv(c), "--port")
            if http is None or int(http) not in declared.values():
                problems.append(f"{where}: vLLM's --port {http} is not a container port")
    if len(set(secrets.values())) > 1:
        problems.append(f"the engines' keys come from different Secrets, so they would not trust each other: "
                        f"{secrets}")
    return problems


def check_router(docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """kvsm.router's arguments parse with its real CLI, and its backends are Services here."""
    problems = []
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for workload, pod in pod_specs(docs):
        for c in all_containers(pod):
            if not is_kvsm_router(c):
                continue
            where = f"{workload['metadata']['name']}/{c['name']}"
            seen: dict[str, Any] = {}
            monkeypatch.setattr(kvsm_router, "create_app",
                                lambda p, d, t, seen=seen, **kw: seen.update(prefill=p, decode=d, timeout=t))
            monkeypatch.setattr(kvsm_router.web, "run_app", lambda app, seen=seen, **kw: seen.update(kw))
            monkeypatch.setattr(kvsm_router.logging, "basicConfig", lambda **kw: None)
            args = c.get("args", [])
            try:
                kvsm_router.main(args)
            except SystemExit as e:
                problems.append(f"{where}: kvsm.router rejects {args}: exit {e.code}")
                continue
            if seen.get("port") not in ports(c).values():
                problems.append(f"{where}: the router listens on {seen.get('port')}, not a container port")
            for url in seen["prefill"] + seen["decode"]:
                u = urlsplit(url)
                svc = services.get(u.hostname or "")
                if svc is None or u.port not in {p["port"] for p in svc["spec"]["ports"]}:
                    problems.append(f"{where}: backend {url} is no Service port in this file")
    return problems


def check_services_and_probes(docs: list[dict[str, Any]]) -> list[str]:
    """Each Service selects a pod here with its target ports; probes use declared ports."""
    problems = []
    pods = pod_specs(docs)
    for svc in (d for d in docs if d["kind"] == "Service"):
        name = svc["metadata"]["name"]
        targets = [pod for _, pod in pods if selects(svc["spec"].get("selector", {}), pod["metadata"]["labels"])]
        if not targets:
            problems.append(f"Service {name}: selects no pod in this file")
        for pod in targets:
            declared = {k: v for c in all_containers(pod) for k, v in ports(c).items()}
            for p in svc["spec"]["ports"]:
                if str(p.get("targetPort", p["port"])) not in declared:
                    problems.append(f"Service {name}: targetPort {p.get('targetPort', p['port'])} not in its pods")
    for workload, pod in pods:
        for c in all_containers(pod):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = c.get(probe) or {}
                get = spec.get("httpGet") or spec.get("grpc") or spec.get("tcpSocket")
                if get is not None and str(get["port"]) not in ports(c):
                    problems.append(f"{workload['metadata']['name']}/{c['name']}: {probe} port {get['port']} "
                                    "is not a port of the container")
    return problems


def check_llm_d(docs: list[dict[str, Any]]) -> list[str]:
    """The llm-d pieces agree with the vLLM containers (only where an InferencePool is present)."""
    problems = []
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    for pool in pools:
        target = pool["spec"]["targetPorts"][0]["number"]
        members = [(w, pod) for w, pod in pod_specs(docs)
                   if selects(pool["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])]
        roles = {pod["metadata"]["labels"].get("llm-d.ai/role") for _, pod in members}
        if not {"prefill", "decode"} <= roles:
            problems.append(f"InferencePool {pool['metadata']['name']}: its pods' llm-d.ai/role are {roles}")
        for w, pod in members:
            name = w["metadata"]["name"]
            vllm = [c for c in all_containers(pod) if is_vllm(c)]
            sidecars = [c for c in pod["spec"].get("initContainers", []) if flag(argv(c), "--vllm-port")]
            role = pod["metadata"]["labels"].get("llm-d.ai/role")
            if len(vllm) != 1:
                problems.append(f"{name}: {len(vllm)} vLLM containers")
                continue
            vllm_port = int(flag(argv(vllm[0]), "--port") or 0)
            if role == "prefill" and vllm_port != target:
                # The EPP hands the decode sidecar <prefill pod IP>:<targetPort>.
                problems.append(f"{name}: prefill vLLM on {vllm_port}, the pool targets {target}")
            if role == "decode":
                if len(sidecars) != 1:
                    problems.append(f"{name}: {len(sidecars)} routing sidecars")
                    continue
                s = argv(sidecars[0])
                if sidecars[0].get("restartPolicy") != "Always":
                    problems.append(f"{name}: the routing sidecar is not a native sidecar")
                if int(flag(s, "--vllm-port") or 0) != vllm_port or int(flag(s, "--port") or 0) != target:
                    problems.append(f"{name}: sidecar --port/--vllm-port {flag(s, '--port')}/{flag(s, '--vllm-port')}"
                                    f", pool target {target}, vLLM on {vllm_port}")
                if (flag(s, "--kv-connector") or flag(s, "--connector")) != "nixlv2":
                    problems.append(f"{name}: the sidecar's protocol is not nixlv2 "
                                    "(kvsm speaks its kv_transfer_params)")
        epp = pool["spec"].get("endpointPickerRef", {})
        svc = next((d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == epp.get("name")), None)
        if svc is None or epp.get("port", {}).get("number") not in {p["port"] for p in svc["spec"]["ports"]}:
            problems.append(f"InferencePool {pool['metadata']['name']}: endpointPickerRef {epp} "
                            "is no Service port here")
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        for key, text in cm.get("data", {}).items():
            conf = yaml.safe_load(text)
            if not isinstance(conf, dict) or conf.get("kind") != "EndpointPickerConfig":
                continue
            declared = {p.get("name", p["type"]) for p in conf["plugins"]}
            used = {r["pluginRef"] for prof in conf["schedulingProfiles"] for r in prof["plugins"]}
            for p in conf["plugins"]:
                for ref in (p.get("parameters") or {}).get("deciders", {}).values():
                    used.add(ref)
            if used - declared:
                problems.append(f"ConfigMap {cm['metadata']['name']}/{key}: "
                                f"undeclared plugins {sorted(used - declared)}")
    return problems


# -- tests ------------------------------------------------------------------------------------


def test_manifests_present() -> None:
    assert {p.name for p in MANIFESTS} >= {"1p1d.yaml", "xpyd-llm-d.yaml"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_schema_valid(path: Path, version: str) -> None:
    docs = load(path)
    assert docs
    for doc in docs:
        try:
            validate(doc, version)
        except Exception as e:  # noqa: BLE001 - name the document, whatever the validator raised
            pytest.fail(f"{path.name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}: "
                        f"{type(e).__name__}: {getattr(e, 'message', e)}")


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kvsm_consistent(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = load(path)
    assert any(is_vllm(c) for _, pod in pod_specs(docs) for c in all_containers(pod))
    problems = (check_vllm_containers(docs) + check_router(docs, monkeypatch)
                + check_services_and_probes(docs) + check_llm_d(docs))
    assert problems == []


def _first(docs: list[dict[str, Any]], kind: str, pred: Any = lambda d: True) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and pred(d))


def _vllm(doc: dict[str, Any], role: str) -> dict[str, Any]:
    return next(c for c in all_containers(doc["spec"]["template"])
                if is_vllm(c) and f'"kv_role":"{role}"' in (flag(argv(c), "--kv-transfer-config") or ""))


def _producer(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = _first(docs, "Deployment", lambda d: any(is_vllm(c) and '"kv_producer"' in " ".join(argv(c))
                                                   for c in all_containers(d["spec"]["template"])))
    return doc, _vllm(doc, "kv_producer")


def test_schema_rejects_broken_copies() -> None:
    docs = load(MANIFEST_DIR / "1p1d.yaml")
    version = K8S_VERSIONS[-1]
    deployment, _ = _producer(docs)
    validate(deployment, version)

    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    unknown_field = copy.deepcopy(deployment)
    unknown_field["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    no_image_port = copy.deepcopy(deployment)
    no_image_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    for broken in (wrong_type, unknown_field, no_image_port):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, version)
    # Strict mode is what catches the typo: the lenient schemas let it through.
    kubernetes_validate.validate(unknown_field, version, strict=False)

    pool = _first(load(MANIFEST_DIR / "xpyd-llm-d.yaml"), "InferencePool")
    validate(pool, version)
    for mutate in (lambda p: p["spec"].update(targetPorts=[]),
                   lambda p: p["spec"]["targetPorts"][0].update(number=70000),
                   lambda p: p["spec"].update(extensionRef={"name": "old-field"}),
                   lambda p: p["spec"].pop("selector")):
        broken = copy.deepcopy(pool)
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, version)

    unknown_kind = {"apiVersion": "example.com/v1", "kind": "Gizmo", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(unknown_kind, version)


def test_kvsm_checks_reject_broken_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = load(MANIFEST_DIR / "1p1d.yaml")
    assert check_vllm_containers(docs) == []

    def broken(edit: Any) -> list[str]:
        copy_ = copy.deepcopy(docs)
        edit(copy_)
        return check_vllm_containers(copy_)

    def set_config(d: list[dict[str, Any]], fn: Any) -> None:
        c = _producer(d)[1]
        i = c["args"].index("--kv-transfer-config") + 1
        conf = json.loads(c["args"][i])
        fn(conf)
        c["args"][i] = json.dumps(conf)

    def side_port(d: list[dict[str, Any]]) -> dict[str, Any]:
        return next(p for p in _producer(d)[1]["ports"] if p["name"] == SIDE_CHANNEL_PORT_NAME)

    assert any("side-channel container ports" in p
               for p in broken(lambda d: side_port(d).update(containerPort=5601)))
    assert any("side-channel container ports" in p
               for p in broken(lambda d: set_config(d, lambda c: c["kv_connector_extra_config"].update(
                   side_channel_port=5700))))
    assert any("not KVSMConnector" in p
               for p in broken(lambda d: set_config(d, lambda c: c.update(kv_connector="NixlConnector"))))
    assert any("does not know" in p
               for p in broken(lambda d: set_config(d, lambda c: c["kv_connector_extra_config"].update(
                   lease=30))))
    # kvsm's own parser refuses a heartbeat as long as the lease.
    assert any("heartbeat_interval" in p
               for p in broken(lambda d: set_config(d, lambda c: c["kv_connector_extra_config"].update(
                   heartbeat_interval=30))))
    assert any("not the pod IP" in p
               for p in broken(lambda d: _producer(d)[1]["env"].__setitem__(
                   0, {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "0.0.0.0"})))

    # The side channel's keys: removed, or mounted where they leak or a rotation cannot reach them.
    assert any("no side_channel_keys" in p
               for p in broken(lambda d: set_config(d, lambda c: c["kv_connector_extra_config"].pop(
                   "side_channel_keys"))))

    def keys_mount(d: list[dict[str, Any]]) -> dict[str, Any]:
        c = _producer(d)[1]
        return next(m for m in c["volumeMounts"] if m["mountPath"] == keys_path(c))

    def keys_volume(d: list[dict[str, Any]]) -> dict[str, Any]:
        doc, _ = _producer(d)
        name = keys_mount(d)["name"]
        return next(v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == name)

    assert any("subPath" in p for p in broken(lambda d: keys_mount(d).update(subPath="current.key_secret")))
    assert any("not mounted readOnly" in p for p in broken(lambda d: keys_mount(d).pop("readOnly")))
    assert any("no volume mount" in p
               for p in broken(lambda d: _producer(d)[1]["volumeMounts"].remove(keys_mount(d))))
    assert any("not a Secret volume" in p
               for p in broken(lambda d: keys_volume(d).update(secret=None, emptyDir={})))
    assert any("other users read" in p
               for p in broken(lambda d: keys_volume(d)["secret"].update(defaultMode=0o444)))
    assert any("optional" in p for p in broken(lambda d: keys_volume(d)["secret"].update(optional=True)))
    assert any("different Secrets" in p
               for p in broken(lambda d: keys_volume(d)["secret"].update(secretName="other-keys")))

    router = _first(docs, "Deployment", lambda d: d["metadata"]["name"] == "kvsm-router")
    router["spec"]["template"]["spec"]["containers"][0]["args"][1] = "http://kvsm-prefill:9999"
    assert any("no Service port" in p for p in check_router(docs, monkeypatch))


def test_llm_d_checks_reject_broken_copies() -> None:
    docs = load(MANIFEST_DIR / "xpyd-llm-d.yaml")
    assert check_llm_d(docs) == []
    decode = _first(docs, "Deployment", lambda d: d["metadata"]["labels"].get("llm-d.ai/role") == "decode")
    sidecar = decode["spec"]["template"]["spec"]["initContainers"][0]
    sidecar["args"] = [a.replace("--vllm-port=8200", "--vllm-port=8001") for a in sidecar["args"]]
    cm = _first(docs, "ConfigMap")
    cm["data"]["epp-config.yaml"] = cm["data"]["epp-config.yaml"].replace("- pluginRef: queue-scorer",
                                                                          "- pluginRef: kv-scorer", 1)
    problems = check_llm_d(docs)
    assert any("--vllm-port" in p for p in problems)
    assert any("undeclared plugins ['kv-scorer']" in p for p in problems)
