#!/usr/bin/env python3
"""Write the sample event logs under tests/data/ from the simulation.

The simulation runs the real prefill and decode workers (``kvsm_testing.sim``); their
logs are ``prefill-0.worker.rank0.jsonl`` and ``decode-0.worker.rank0.jsonl``.

* ``sample-clean/``: a prefill and a decode worker log of a run with every
  survivable fault mixed in (timeouts, aborts, expired leases, errors): the
  replay must find no violation and exit 0.
* ``sample-violations/``: the same kind of run with planted faults the replay
  must report (exit 1):
  - a line removed from the middle of the decode log (``seq_gap``),
  - an illegal transition recorded by the runtime (a read notification after
    the lease expired, ``read_after_lease_expiry``),
  - the log of the decode engine cut off while a request is mid-transfer
    (``not_terminal_at_end``),
  - a transition record whose destination was edited (``divergence``).

    python tools/make_sample_logs.py [--out tests/data]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsm.eventlog import EventLog
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import VirtualClock
from kvsm.lifecycle.machine import LifecycleTracker
from kvsm.lifecycle.table import RECV, SEND
from kvsm_testing.sim import Faults, SimConfig, run_simulation

CLEAN_SEED = 7
VIOLATIONS_SEED = 11
PREFILL_LOG = "prefill-0.worker.rank0.jsonl"
DECODE_LOG = "decode-0.worker.rank0.jsonl"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def make_clean(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result = run_simulation(SimConfig(seed=CLEAN_SEED, num_requests=40, faults=Faults.mixed(0.08), log_dir=out))
    if result.violations or result.illegal_events:
        raise SystemExit(f"the clean sample run found problems: {result.violations} {result.illegal_events}")


def make_violations(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_simulation(SimConfig(seed=VIOLATIONS_SEED, num_requests=30, faults=Faults.mixed(0.05),
                                 log_dir=Path(tmp)))
        decode = _lines(Path(tmp) / DECODE_LOG)
        prefill = _lines(Path(tmp) / PREFILL_LOG)

    # 1. A lost line in the middle of the decode log.
    del decode[len(decode) // 2]
    # 2. A divergence: a recorded transition whose destination does not follow
    #    from its input (someone edited the log, or the table changed).
    for i, line in enumerate(prefill):
        rec = orjson.loads(line)
        if rec["kind"] == "transition" and rec["event"] == "finished_ok":
            rec["dst"] = "released"
            prefill[i] = orjson.dumps(rec) + b"\n"
            break
    (out / DECODE_LOG).write_bytes(b"".join(decode))
    (out / PREFILL_LOG).write_bytes(b"".join(prefill))

    # 3. + 4. A second decode engine whose process logged a read notification
    #    after a lease expired and then died while a request was mid-transfer
    #    (no worker.shutdown record: the process did not stop cleanly).
    clock = VirtualClock(start_ns=5_000_000)
    path = out / "decode-1.worker.rank0.jsonl"
    path.unlink(missing_ok=True)
    log = EventLog(path, role="worker", engine_id="decode-1", rank=0, clock=clock)
    send = LifecycleTracker(SEND, clock, listener=log.record_outcome)
    recv = LifecycleTracker(RECV, clock, listener=log.record_outcome)
    send.create("p-late")
    send.apply(ev.FinishedOk(req="p-late", block_ids=(3, 4), expected_reads=1, lease_ns=1_000_000))
    clock.advance(1_000_000)
    send.apply(ev.LeaseExpired(req="p-late"))
    clock.advance(10_000)
    send.apply(ev.ReadNotif(req="p-late", reader="decode-0"))  # illegal: read after lease expiry
    recv.create("d-cut")
    for event in (ev.Matched(req="d-cut", num_tokens=40, remote_engine="prefill-0", remote_req="p-cut",
                             remote_blocks=1),
                  ev.Allocated(req="d-cut", block_ids=(9,), num_external_tokens=40),
                  ev.HandshakeOk(req="d-cut", remote_engine="prefill-0"),
                  ev.ReadsPosted(req="d-cut", num_blocks=1, num_descs=1)):
        clock.advance(100_000)
        recv.apply(event)
    log.close()  # the process "dies" here: d-cut never finishes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "data")
    args = parser.parse_args(argv)
    for name, make in (("sample-clean", make_clean), ("sample-violations", make_violations)):
        target = args.out / name
        shutil.rmtree(target, ignore_errors=True)
        make(target)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
