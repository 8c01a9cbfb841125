"""Helpers for reliability tests on real vLLM API servers: engines killed with
``kill -9`` and restarted on the same ports, their event logs told apart per
incarnation, clients that hang up mid-stream, and metric reads.

A :class:`Node` is one role (prefill or decode) across restarts: the same
``ServerSpec`` (HTTP port, side-channel port, engine id) each time, a new
process (and so new event-log files, named by pid) each time. Tests check the
files of the incarnation they care about: a killed one's log ends abruptly,
its successor's starts clean.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvsm.lifecycle.table import LIFECYCLES
from kvsm_testing.servers import ServerSpec, VLLMServer

__all__ = ["Node", "StreamOutcome", "live_kvsm_requests", "metric", "post_json", "read_records",
           "recv_machines", "stream_completion", "wait_until"]

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def stop_process(pid: int, timeout: float = 2.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (``T`` in
    /proc): ``kill`` returns before a busy machine has stopped them all, and a
    thread still running may yet answer what the test sends next."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool | None:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            with contextlib.suppress(OSError):
                states.append(stat.read_text().rpartition(")")[2].split()[0])
        return bool(states) and all(s in ("T", "t") for s in states) or None

    wait_until(stopped, timeout, f"every thread of process {pid} stopped", interval=0.001)


def replay_when_settled(files: Callable[[], Iterable[Path]], timeout: float = 5.0) -> Any:
    """``kvsm.replay.analyse`` of ``files()`` once it finds nothing, or after
    ``timeout`` s (the caller asserts on what it found). A request's last records
    reach the file up to a writer batch after the client has its answer (the
    scheduler half ends its machine in the step that returns the output), so a
    live server's logs are read again until they settle."""
    from kvsm.replay import analyse

    deadline = time.monotonic() + timeout
    while True:
        report = analyse(list(files()))
        if not report.findings or time.monotonic() > deadline:
            return report
        time.sleep(0.05)


# -- event logs ----------------------------------------------------------------------------


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every record of these JSONL logs; a torn last line (the process was killed
    mid-write) is skipped, as is the line a live writer has not finished yet."""
    out: list[dict[str, Any]] = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            rec["_file"] = str(path)
            out.append(rec)
    return out


def machines(records: Iterable[dict[str, Any]], lifecycle: str, rid: str) -> dict[str, list[dict[str, Any]]]:
    """The ``lifecycle`` records (create, transitions) of each engine request whose id contains ``rid``."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("lifecycle") == lifecycle and r["kind"] in ("create", "transition") and rid in (r.get("req") or ""):
            out.setdefault(r["req"], []).append(r)
    return out


def recv_machines(records: Iterable[dict[str, Any]], rid: str) -> dict[str, list[dict[str, Any]]]:
    """The recv-lifecycle records of each engine request whose id contains ``rid``."""
    return machines(records, "recv", rid)


def send_machines(records: Iterable[dict[str, Any]], rid: str) -> dict[str, list[dict[str, Any]]]:
    """The send-lifecycle records of each engine request whose id contains ``rid``."""
    return machines(records, "send", rid)


def is_terminal(lifecycle: str, recs: list[dict[str, Any]]) -> bool:
    return bool(recs) and recs[-1].get("dst") in LIFECYCLES[lifecycle].terminal


# -- metrics -------------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples (optionally those with these labels)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def live_kvsm_requests(text: str) -> dict[str, float]:
    """``vllm:kvsm_requests`` samples in a non-terminal state with a non-zero count."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kvsm_requests{"):
            continue
        labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.rindex("}")].split(","))
        lifecycle, state = labels["lifecycle"].strip('"'), labels["state"].strip('"')
        value = float(line.rsplit(" ", 1)[1])
        if value and state not in LIFECYCLES[lifecycle].terminal:
            out[f"{lifecycle}:{state}"] = out.get(f"{lifecycle}:{state}", 0) + value
    return out


# -- servers across restarts ---------------------------------------------------------------


class Node:
    """One role's API server across kill -9 and restarts on the same ports."""

    def __init__(self, spec: ServerSpec, model: str, workdir: Path, log_dir: Path) -> None:
        self.spec = spec
        self.model = model
        self.workdir = workdir
        self.log_dir = log_dir
        self.server: VLLMServer | None = None
        self.incarnation = 0
        self.files: list[Path] = []  # the current incarnation's event logs
        self.past_files: list[list[Path]] = []  # earlier incarnations' event logs, oldest first
        self.started_at = 0.0  # time.monotonic() when the current incarnation was started
        self.ready_at = 0.0  # time.monotonic() when /health first answered
        self._known: set[Path] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def alive(self) -> bool:
        return self.server is not None and self.server.proc is not None and self.server.proc.poll() is None

    def _logs(self) -> set[Path]:
        return set(self.log_dir.glob(f"{self.spec.engine_id or self.spec.name}.*.jsonl"))

    def start(self) -> None:
        """A new process on the same ports (its server log gets the incarnation's number)."""
        if self.server is not None:
            self.past_files.append(self.files)
        self.incarnation += 1
        self._known = self._logs()
        self.files = []
        self.server = VLLMServer(self.spec, self.model, self.workdir)
        self.server.log_path = self.workdir / f"{self.spec.name}.{self.incarnation}.server.log"
        self.started_at = time.monotonic()
        self.server.start()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until /health answers and this incarnation's worker has opened its event log."""
        assert self.server is not None
        self.server.wait_ready(timeout=timeout)
        self.ready_at = time.monotonic()
        wait_until(lambda: [p for p in self._logs() - self._known if ".worker." in p.name], 30,
                   f"{self.spec.name}'s worker event log")
        self.files = sorted(self._logs() - self._known)

    def restart(self, timeout: float = 300.0) -> float:
        """Start again and wait; the seconds it took."""
        t0 = time.monotonic()
        self.start()
        self.wait_ready(timeout)
        return time.monotonic() - t0

    def kill(self) -> None:
        """kill -9 the API server, its engine core and everything they started."""
        if self.server is not None:
            self.server.kill()
            self.server.stop()  # closes the server log; nothing is left to signal

    def stop(self) -> None:
        """A clean stop (SIGTERM, then SIGKILL for stragglers)."""
        if self.server is not None:
            self.server.stop()

    def records(self, *, worker_only: bool = False) -> list[dict[str, Any]]:
        """The current incarnation's event-log records (re-found: the scheduler's log may start late)."""
        if self.server is not None and not self.files:
            self.files = sorted(self._logs() - self._known)
        elif self.server is not None:
            self.files = sorted(set(self.files) | (self._logs() - self._known))
        files = [p for p in self.files if ".worker." in p.name] if worker_only else self.files
        return read_records(files)

    def notes(self, event: str) -> list[dict[str, Any]]:
        """This incarnation's diagnostic ``log`` records named ``event``."""
        return [r for r in self.records() if r["kind"] == "log" and r["event"] == event]

    def metrics(self) -> str:
        assert self.server is not None
        return self.server.metrics()

    def post(self, body: dict[str, Any], rid: str | None = None, timeout: float = 120.0) -> dict[str, Any]:
        status, out, _, _ = post_json(self.url + "/v1/completions", body, {"X-Request-Id": rid} if rid else None,
                                      timeout=timeout)
        assert status == 200, f"{self.spec.name} answered {status}: {out}"
        return out


# -- HTTP clients ----------------------------------------------------------------------------


def post_json(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout: float = 120.0) -> tuple[int, dict[str, Any], dict[str, str], float]:
    """POST JSON; (status, JSON body, headers, seconds), HTTP errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"raw": raw.decode(errors="replace")}
        return e.code, payload, dict(e.headers), time.monotonic() - t0


@dataclass
class StreamOutcome:
    """What a streaming client saw before it finished or hung up."""

    rid: str
    status: int | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # read up to ``data: [DONE]``
    left: str = ""  # "" (stayed to the end), "before_headers", "after_headers", "after_N_chunks"

    @property
    def text(self) -> str:
        return "".join(c["choices"][0].get("text") or "" for c in self.chunks if c.get("choices"))


def stream_completion(base: str, body: dict[str, Any], rid: str, *, leave_after_chunks: int | None = None,
                      leave_before_headers_s: float | None = None, timeout: float = 120.0) -> StreamOutcome:
    """Stream ``/v1/completions`` through ``base``; hang up (close the socket)
    ``leave_before_headers_s`` after sending (the router is still prefilling),
    or after ``leave_after_chunks`` chunks (0: right after the headers)."""
    host, port = base.removeprefix("http://").split(":")
    out = StreamOutcome(rid)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json", "X-Request-Id": rid})
        if leave_before_headers_s is not None:
            time.sleep(leave_before_headers_s)
            out.left = "before_headers"
            return out
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            out.chunks.append(json.loads(resp.read() or b"{}"))
            return out
        if leave_after_chunks == 0:
            out.left = "after_headers"
            return out
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                out.done = True
                break
            out.chunks.append(json.loads(payload))
            if leave_after_chunks is not None and len(out.chunks) >= leave_after_chunks:
                out.left = f"after_{len(out.chunks)}_chunks"
                break
        return out
    finally:
        with contextlib.suppress(OSError):
            if conn.sock is not None:
                conn.sock.close()  # a hang-up, not a polite drain
        conn.close()
