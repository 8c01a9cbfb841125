"""A worker-side pin channel in its own process (as a TP > 1 worker has it), for
tests/test_pin_channel.py and tools/bench_pins.py: ``python tests/pin_peer.py '{}'``.

Prints ``{"ready", "endpoint", "token", "pid", "dir"}``, then answers
``{"op": "received"}`` with every pin its loop accepted so far (and the
channel's stats), and ``{"op": "quit"}`` by closing the channel.
"""

from __future__ import annotations

import json
import os
import sys

from kvsm_testing.pins import PinWorker


def main() -> int:
    worker = PinWorker("pin-peer")
    endpoint = worker.server.endpoint
    print(json.dumps({"ready": True, "endpoint": endpoint, "token": worker.server.token.hex(), "pid": os.getpid(),
                      "dir": os.path.dirname(endpoint.removeprefix("ipc://"))}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "received":
            got = worker.loop.call(lambda: list(worker.got), timeout=10.0)
            received = [{"req": p.req, "ok": p.ok, "block_ids": list(p.block_ids), "reason": p.reason,
                         "pinned_ns": p.pinned_ns, "via": via, "received_ns": at} for p, via, at in got]
            print(json.dumps({"ok": True, "received": received, "stats": worker.stats()}), flush=True)
        elif cmd["op"] == "quit":
            worker.close()
            print(json.dumps({"ok": True}), flush=True)
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
