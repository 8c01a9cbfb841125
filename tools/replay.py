#!/usr/bin/env python3
"""CLI for kvsm.replay: merge, check and show kvsm event logs.

    python tools/replay.py prefill.jsonl decode-*.jsonl --request ID --trace trace.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsm.replay import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
