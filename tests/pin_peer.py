"""A worker-side pin channel in its own process (as a TP > 1 worker has it), for
tests/test_pin_channel.py: ``python tests/pin_peer.py '{}'``.

Prints ``{"ready", "endpoint", "token", "pid", "dir"}``, then answers
``{"op": "received"}`` with every pin its loop accepted so far (and the
channel's stats), and ``{"op": "quit"}`` by closing the channel.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from kvsm.loop import EventLoop
from kvsm.facts import SendFinish
from kvsm.pin_channel import PinChannelServer


def main() -> int:
    loop = EventLoop("pin-peer").start()
    received: list[dict[str, Any]] = []

    def on_pins(pins: list[SendFinish], via: str) -> None:
        now = time.monotonic_ns()
        received.extend({"req": p.req, "ok": p.ok, "block_ids": list(p.block_ids), "reason": p.reason,
                         "pinned_ns": p.pinned_ns, "via": via, "received_ns": now} for p in pins)

    def open_server() -> PinChannelServer:
        server = PinChannelServer(loop.context, on_pins, lambda fn, label: loop.post(fn, label=label))
        for sock in server.sockets():
            loop.add_reader(sock, server.on_readable, label="pin channel")
        return server

    server = loop.call(open_server, timeout=10.0)
    print(json.dumps({"ready": True, "endpoint": server.endpoint, "token": server.token.hex(), "pid": os.getpid(),
                      "dir": os.path.dirname(server.endpoint.removeprefix("ipc://"))}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "received":
            got = loop.call(lambda: (list(received), server.stats()), timeout=10.0)
            print(json.dumps({"ok": True, "received": got[0], "stats": got[1]}), flush=True)
        elif cmd["op"] == "quit":
            def close() -> None:
                for sock in server.sockets():
                    loop.remove_reader(sock)
                server.close()
            loop.call(close, timeout=10.0)
            loop.stop()
            print(json.dumps({"ok": True}), flush=True)
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
