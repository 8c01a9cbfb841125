"""Network faults between two hosts, kvsm against upstream ``NixlConnector``:
every scenario of ``kvsm_testing.net_faults`` on a fresh two-host pair per
connector (network namespaces, UCX on TCP over the KV link), one markdown
table of what each request saw. Needs root (network namespaces) and nftables.

    python tools/net_faults.py [--only partition_during_reads,...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsm_testing import build_tiny_model
from kvsm_testing.net_faults import SCENARIOS, ScenarioResult, run_scenario
from kvsm_testing.netns import TwoHosts
from kvsm_testing.two_host_pair import TwoHostPair

KVSM_CONFIG = {"handshake_timeout": 5, "stall_timeout": 2, "peer_backoff": 2, "peer_backoff_max": 4}
# (Back-off as tests/test_two_hosts.py, which says why 2 s.)
# The handshake scenario needs a peer no request has reached yet: it goes first.
ORDER = ["partition_during_handshake", "partition_during_reads", "partition_after_reads", "drop_decode_to_prefill",
         "drop_prefill_to_decode", "link_flapping", "bandwidth_cap"]


def run_connector(connector: str, names: list[str], workdir: Path) -> list[ScenarioResult]:
    model = str(build_tiny_model())
    with TwoHosts() as hosts, TwoHostPair(hosts, model, workdir / connector, connector=connector,
                                          extra_config=KVSM_CONFIG if connector == "KVSMConnector" else None) as pair:
        pair.start()
        out = []
        for seed, name in enumerate(names):
            result = run_scenario(name, hosts, pair, connector, seed=seed)
            print(result.line(), flush=True)
            out.append(result)
        return out


def cell(result: ScenarioResult, phase: str) -> str:
    outs = result.of(phase)
    if not outs:
        return "-"
    secs = [o.seconds for o in outs]
    wrong = sum(not o.right for o in outs)
    text = f"{len(outs)} req: max {max(secs):.2f} s, median {statistics.median(secs):.2f} s"
    return text + (f", **{wrong} wrong/errors**" if wrong else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated scenarios (default: all)")
    parser.add_argument("--json", default="", help="write every request's outcome here")
    args = parser.parse_args()
    names = [n for n in ORDER if not args.only or n in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(SCENARIOS) - {""}
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {sorted(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="kvsm-netfaults-") as tmp:
        results = {c: run_connector(c, names, Path(tmp)) for c in ("KVSMConnector", "NixlConnector")}
    print("\n| scenario | kvsm: during the fault | kvsm: after the heal | upstream: during the fault "
          "| upstream: after the heal |\n| --- | --- | --- | --- | --- |")
    for i, name in enumerate(names):
        k, u = results["KVSMConnector"][i], results["NixlConnector"][i]
        print(f"| {name} | {cell(k, 'fault')} | {cell(k, 'heal')} | {cell(u, 'fault')} | {cell(u, 'heal')} |")
    for connector, rs in results.items():
        for r in rs:
            for phase, figures in r.extra.items():
                if not isinstance(figures, dict):
                    continue
                print(f"{r.name} [{connector}] {phase}: " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()))
    if args.json:
        rows = {c: [{"name": r.name, "outcomes": [vars(o) for o in r.outcomes], "extra": r.extra} for r in rs]
                for c, rs in results.items()}
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
