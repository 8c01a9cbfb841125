"""A worker's pin channel on a real loop in this process, for tests and benchmarks.

What a TP 1 engine's worker has: a ``PinChannelServer`` on an ``EventLoop``,
its socket watched by the loop, recording every pin it accepts (request,
path, when). ``channel()`` is what the worker would publish to its
scheduler through vLLM (``KVSMWorkerChannel``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvsm.handoff.facts import SendFinish
from kvsm.handoff.pins import PinChannelServer, PinTarget
from kvsm.runtime.loop import EventLoop

__all__ = ["PinWorker"]


class PinWorker:
    """A pin channel on its own loop; ``got`` holds (finish, via, received_ns)."""

    def __init__(self, name: str = "pin-worker") -> None:
        self.loop = EventLoop(name).start()
        self.got: list[tuple[SendFinish, str, int]] = []
        self.arrived = threading.Event()

        def on_pins(pins: list[SendFinish], via: str) -> None:
            now = time.monotonic_ns()
            self.got += [(p, via, now) for p in pins]
            self.arrived.set()

        def open_server() -> PinChannelServer:
            server = PinChannelServer(self.loop.context, on_pins, lambda fn, label: self.loop.post(fn, label=label))
            for sock in server.sockets():
                self.loop.add_reader(sock, server.on_readable, label="pin channel")
            return server

        self.server: PinChannelServer = self.loop.call(open_server, timeout=10.0)
        self._closed = False

    def target(self, tp_rank: int = 0) -> PinTarget:
        return self.server.target(tp_rank)

    def channel(self, tp_rank: int = 0) -> Any:
        """The ``KVSMWorkerChannel`` a worker publishes (imports vLLM)."""
        from kvsm.vllm.connector import KVSMWorkerChannel

        return KVSMWorkerChannel(self.target(tp_rank))

    def stats(self) -> dict[str, int]:
        return self.loop.call(self.server.stats, timeout=5.0)

    def stats_when(self, want: dict[str, int], timeout: float = 10.0) -> dict[str, int]:
        """The server's stats once they equal ``want`` (or at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats == want or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def close() -> None:
            for sock in self.server.sockets():
                self.loop.remove_reader(sock)
            self.server.close()
        self.loop.call(close, timeout=10.0)
        self.loop.stop()
