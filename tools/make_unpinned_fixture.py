"""Reproduce the offline failure of pins that wait for an engine step, and keep its logs.

Before the pin channel (``kvsm.handoff.pins``), a prefill engine told its worker
that a finished request was pinned only with its next engine step. Offline,
after ``generate`` returned, nothing stepped it again, and every decode
request failed at its handshake timeout with its claims answered "unknown".
``KVSM_PIN_VIA_STEP=1`` brings that path back; this script runs the offline
pair with it and writes the event logs to ``tests/data/unpinned-offline/``,
the fixture replay's cause line is tested on::

    .venv/bin/python tools/make_unpinned_fixture.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "tests" / "data" / "unpinned-offline"))
    args = parser.parse_args(argv)
    from kvsm.scheduler.half import PIN_VIA_STEP_ENV
    from kvsm_testing import build_tiny_model
    from kvsm_testing.pd_pair import PDEngine
    from kvsm_testing.ports import free_port_run

    os.environ[PIN_VIA_STEP_ENV] = "1"  # the engines inherit it: the old path
    model = build_tiny_model()
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs"
        base = free_port_run(4)
        extra = {"handshake_timeout": 1.0}
        prefill = PDEngine("prefill", "kv_producer", model=model, port=base, engine_id="prefill-0", log_dir=logs,
                           workdir=tmp, cpu=0, extra=extra)
        decode = PDEngine("decode", "kv_consumer", model=model, port=base + 2, engine_id="decode-0", log_dir=logs,
                          workdir=tmp, cpu=1, extra=extra)
        try:
            prompts = [[17], list(range(20, 320))]
            outs = prefill.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
            params = [dict(o["kv_transfer_params"]) for o in outs]
            decode.generate(prompts, 4, params)
        finally:
            prefill.close()
            decode.close()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for f in sorted(logs.glob("*.jsonl")):
            # Stable names: the pid in each file name changes every run.
            name = ".".join(p for p in f.name.split(".") if not p.isdigit())
            shutil.copy(f, out / name)
    print(f"wrote {sorted(p.name for p in out.iterdir())} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
