"""A helper process driven by JSON lines, for tests and benchmarks that put one
side of a transfer in another process (``tests/worker_peer.py``,
``tools/bench_nixl_peer.py``).

The child is ``python SCRIPT SPEC_JSON``: it prints one hello line when ready,
then answers each command line on its stdin with one line on its stdout; its
stderr goes to a file, whose tail every failure message carries. A reader
thread queues the stdout lines, so that every wait for a reply has a deadline
even when the child hangs or dies.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["PeerProcess"]


class PeerProcess:
    """One child process speaking JSON lines: spawn now, ``ready()`` later (so
    several start at once). ``error`` is what a silent, dead or failing peer
    raises (tests keep ``AssertionError``; a tool raises its own)."""

    error: type[Exception] = AssertionError

    def __init__(self, label: str, script: Path, spec: dict[str, Any], log_dir: Path, *, root: Path,
                 env: dict[str, str] | None = None, start_new_session: bool = False) -> None:
        self.label = label
        self.err_path = log_dir / f"peer-{label}.stderr"
        self._err = open(self.err_path, "wb")  # noqa: SIM115 - closed in close_stderr()
        # ``root`` on the path: the child imports kvsm from this checkout.
        full_env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, str(script), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, env=full_env, cwd=root, text=True,
                                     bufsize=1, start_new_session=start_new_session)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"peer-{label}-stdout", daemon=True).start()
        self.pid = self.proc.pid
        self.hello: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, chars: int = 3000) -> str:
        self._err.flush()
        return self.err_path.read_text(errors="replace")[-chars:]

    def next_reply(self, timeout: float, what: str) -> dict[str, Any]:
        """The child's next line; ``error`` if none comes within ``timeout`` s or it exited."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise self.error(f"peer {self.label}: no reply to {what} within {timeout:g} s; "
                             f"stderr:\n{self.stderr_tail()}") from None
        if line is None:
            raise self.error(f"peer {self.label} exited ({self.proc.poll()}) during {what}; "
                             f"stderr:\n{self.stderr_tail()}")
        return json.loads(line)

    def ready(self, timeout: float = 60.0) -> PeerProcess:
        """Wait for the hello line (``{"ready": true, ...}``)."""
        self.hello = self.next_reply(timeout, "start-up")
        if not self.hello.get("ready"):
            raise self.error(f"peer {self.label} failed to start: {self.hello}; stderr:\n{self.stderr_tail()}")
        return self

    def send(self, op: str, **kw: Any) -> None:
        """Write one command line (no reply awaited)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        """Send a command and return its reply; ``error`` unless the reply says ``ok``."""
        self.send(op, **kw)
        reply = self.next_reply(timeout, op)
        if not reply.get("ok"):
            raise self.error(f"peer {self.label}: {op} failed: {reply}; stderr:\n{self.stderr_tail()}")
        return reply

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to ``quit`` (a command it must know) and wait for it; kill it if
        it does not answer or exit within ``timeout`` s each. Never leaves it running."""
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout)
                self.proc.wait(timeout=timeout)
            except (self.error, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.close_stderr()

    def close_stderr(self) -> None:
        self._err.close()
