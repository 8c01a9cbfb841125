#!/usr/bin/env python3
"""CLI for kvsm.replay: merge, check and show kvsm event logs.

    python tools/replay.py prefill.jsonl decode-*.jsonl --request ID --trace trace.json

Run with any Python: when kvsm's dependencies are not importable here but the
checkout's .venv exists (bash tools/dev.sh setup), it re-runs itself there.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The checkout only as a fallback: an installed kvsm (a wheel) is the one replayed with.
sys.path.append(str(ROOT))

try:
    from kvsm.replay import main
except ModuleNotFoundError:
    venv_python = ROOT / ".venv" / "bin" / "python"
    if venv_python.exists() and Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        os.execv(str(venv_python), [str(venv_python), __file__, *sys.argv[1:]])
    raise

if __name__ == "__main__":
    sys.exit(main())
