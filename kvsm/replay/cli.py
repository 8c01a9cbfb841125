"""The ``kvsm-replay`` command line (also ``tools/replay.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kvsm.replay
from kvsm.replay.fold import analyse
from kvsm.replay.render import chrome_trace, render_text, timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvsm-replay", description=(kvsm.replay.__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit status: 0 clean, 1 violations found, 2 unreadable input")
    parser.add_argument("logs", nargs="+", help="JSONL event logs (files or directories)")
    parser.add_argument("--request", "-r", help="show this request's timeline across processes")
    parser.add_argument("--trace", type=Path, help="write a Perfetto/Chrome trace JSON here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--limit", type=int, default=50, help="rows of requests and violations to print")
    args = parser.parse_args(argv)

    report = analyse(args.logs)
    if args.trace is not None:
        args.trace.parent.mkdir(parents=True, exist_ok=True)
        args.trace.write_text(json.dumps(chrome_trace(report)))
    if args.json:
        out = report.to_json()
        if args.request is not None:
            out["timeline"] = timeline(report, args.request)
        print(json.dumps(out, indent=1, default=str))
    else:
        print(render_text(report, args.request, args.limit))
        if args.trace is not None:
            print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
