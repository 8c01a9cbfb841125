#!/usr/bin/env python3
"""Where a decode worker's CPU per transfer goes: section 2's steady run, sampled.

    python tools/profile_worker.py [--connector kvsm|upstream-np] [--inflight 16] [--steps 400]

Starts one pair of section 2's processes (``tools/bench_nixl_peer.py``: a
decode worker reading from a prefill worker over real NIXL), warms it, then
runs ``--steps`` steps with ``--inflight`` transfers in flight while ``py-spy``
samples every thread of the decode process (``pip install py-spy``; it is not a
dependency of kvsm). Prints the share of samples per function (self and
inclusive, idle waits left out) and the decode CPU per transfer of the run, and
writes the collapsed stacks beside them (``--out``) for a flame graph.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and (ROOT / ".venv").exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
    os.execv(str(ROOT / ".venv/bin/python"), [str(ROOT / ".venv/bin/python"), __file__, *sys.argv[1:]])
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

# ruff: noqa: E402
from bench_nixl import BLOCKS_PER_TRANSFER, FORWARD_S, LEASE_S, Geometry, Peer
from benchlib import Sizes

from kvsm_testing.ports import free_port

# Frames that are a thread waiting, not working.
_IDLE = ("poll (zmq", "wait (threading", "_wait_for_tstate_lock", "select (", "sleep", "recv (", "readline")


def _pair(name: str, geometry: Geometry, log_dir: Path) -> tuple[Peer, Peer]:
    kind = name.split("-")[0]
    common = {"connector": kind, "block_size": geometry.block_size, "num_blocks": geometry.num_blocks,
              "side_port": free_port(), "pin_port": free_port(), "lease_s": LEASE_S,
              "progress_thread": name != "upstream-np",
              "event_log_dir": str(log_dir / "kvsm-events") if kind == "kvsm" else None}
    prefill = Peer(f"{name}-prefill", {"role": f"{kind}-prefill", "engine_id": f"prof-{name}-prefill", **common},
                   log_dir)
    decode = Peer(f"{name}-decode", {"role": f"{kind}-decode", "engine_id": f"prof-{name}-decode",
                                     "remote_engine": f"prof-{name}-prefill",
                                     "remote_num_blocks": geometry.num_blocks, **common}, log_dir)
    for p in (prefill, decode):
        p.ready(timeout=300)
    return decode, prefill


def _summarise(collapsed: Path, top: int) -> list[str]:
    """Self and inclusive sample shares per function, idle frames dropped."""
    self_n: collections.Counter[str] = collections.Counter()
    incl_n: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or any(m in frames[-1] for m in _IDLE):
            continue
        n = int(count)
        total += n
        self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    out = [f"{total} busy samples"]
    out += ["self:"] + [f"  {100 * n / total:5.1f}%  {f}" for f, n in self_n.most_common(top)]
    out += ["inclusive:"] + [f"  {100 * n / total:5.1f}%  {f}" for f, n in incl_n.most_common(top)
                             if not f.startswith(("process ", "thread "))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", default="kvsm", choices=("kvsm", "upstream-np", "upstream"))
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=Path("profile-worker.txt"))
    ap.add_argument("--logs", type=Path, default=None, help="keep kvsm's event logs of the run in this directory")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return 2
    geometry = Geometry.for_sizes(Sizes((1,), 1, 1, 1, 1, 1, 1, worker_inflight=(args.inflight,)))
    with tempfile.TemporaryDirectory(prefix="kvsm-profile-") as tmp:
        decode, prefill = _pair(args.connector, geometry, Path(tmp))
        try:
            decode.call("steady", timeout=300.0, run="warm", inflight=4, steps=5, warm_steps=0, forward_s=FORWARD_S,
                        bpr=BLOCKS_PER_TRANSFER, timeout_s=240.0)
            prefill.call("quiesce", timeout=60.0, within=30.0)
            raw = Path(tmp) / "stacks.txt"
            sampler = subprocess.Popen([spy, "record", "--pid", str(decode.proc.pid), "--rate", str(args.rate),
                                        "--format", "raw", "--output", str(raw), "--threads", "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attached
            r = decode.call("steady", timeout=600.0, run="profiled", inflight=args.inflight, steps=args.steps,
                            warm_steps=2, forward_s=FORWARD_S, bpr=BLOCKS_PER_TRANSFER, timeout_s=540.0)
            sampler.send_signal(2)
            _, err = sampler.communicate(timeout=60)
            prefill.call("quiesce", timeout=60.0, within=30.0)
        finally:
            for p in (decode, prefill):
                p.close()
        if not raw.exists():
            print(f"py-spy wrote nothing: {err.decode()[-2000:]}", file=sys.stderr)
            return 1
        shutil.copy(raw, args.out)
        if args.logs is not None and (Path(tmp) / "kvsm-events").exists():
            shutil.copytree(Path(tmp) / "kvsm-events", args.logs, dirs_exist_ok=True)
    per_transfer_us = r["cpu_s"] / max(1, r["done"]) * 1e6
    print(f"{args.connector}: {r['done']} transfers in {r['steps']} steps, decode process CPU per transfer "
          f"{per_transfer_us:.0f} µs (all threads, sampler attached: higher than unprofiled)")
    print("\n".join(_summarise(args.out, args.top)))
    print(f"collapsed stacks: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
