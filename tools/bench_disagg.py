"""Section 9 of tools/bench.py: selective disaggregation, P/D against the decode engine alone.

One pair of real vLLM API servers (the tiny Llama, KVSMConnector, prefill on
core 0, decode on core 1) and two ``kvsm.router`` processes in front of them:
one that sends every request by prefill and transfer (``--disagg-threshold
0``), one that sends every request to the decode engine alone (a threshold
above any prompt). One streamed request at a time, a fresh random prompt of
token ids each (nothing in any prefix cache), ``max_tokens`` 4: the time from
sending it to the first token's event, by prompt length, the two paths
alternating request by request (the order rotates each repetition). Each
repetition's value is the median of its requests; the rows give the median
over the repetitions and their spread. Also the decode engine's ``/tokenize``
round trip, what the router adds to a text prompt when the threshold is on.

What ``--disagg-threshold``'s default is chosen from (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from pathlib import Path

from benchlib import Row, Section, Sizes, stream_ttft_ms

LENGTHS = (16, 32, 64, 128, 256, 400)
PATHS = ("pd", "local")
MAX_TOKENS = 4
# A router whose threshold no prompt reaches (max_model_len is 512): every request goes alone.
ALWAYS_LOCAL = 1_000_000


def _ttft_ms(url: str, model: str, prompt: list[int], timeout_s: float = 120.0) -> float:
    """Send one streamed request; ms until its first event with a token."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    return stream_ttft_ms(url, body, timeout_s)


def _tokenize_ms(url: str, model: str, text: str) -> float:
    req = urllib.request.Request(url + "/tokenize", data=json.dumps({"model": model, "prompt": text}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    return (time.perf_counter() - t0) * 1e3


def bench_disagg(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    from kvsm_testing import build_tiny_model
    from kvsm_testing.servers import RouterProcess, VLLMServer, pd_specs, running_pair

    sec = Section(9, "disagg", "selective disaggregation: TTFT by P/D against the decode engine alone")
    per_rep = max(2, sizes.e2e_requests // 5)  # requests per length, path and repetition
    rng = random.Random(20261206)
    model = str(build_tiny_model())
    workdir = tmp / "disagg"
    p_spec, d_spec = pd_specs()
    prefill, decode = VLLMServer(p_spec, model, workdir), VLLMServer(d_spec, model, workdir)
    routers = {"pd": RouterProcess([prefill.url], [decode.url], workdir, disagg_threshold=0),
               "local": RouterProcess([prefill.url], [decode.url], workdir, disagg_threshold=ALWAYS_LOCAL)}
    values: dict[tuple[int, str], list[float]] = {(n, p): [] for n in LENGTHS for p in PATHS}
    raw: dict[str, list[float]] = {}
    tokenize: list[float] = []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, 1100) for _ in range(n)]

    with running_pair(prefill, decode, ready_timeout=600):
        for r in routers.values():
            r.start()
        try:
            for _ in range(3):  # the first handshake, both engines' first steps
                for path in PATHS:
                    _ttft_ms(routers[path].url, model, prompt(64))
            for rep in range(repeat):
                for n in LENGTHS:
                    got: dict[str, list[float]] = {p: [] for p in PATHS}
                    order = PATHS if rep % 2 == 0 else PATHS[::-1]
                    for _ in range(per_rep):
                        for path in order:
                            got[path].append(_ttft_ms(routers[path].url, model, prompt(n)))
                    for path in PATHS:
                        values[n, path].append(statistics.median(got[path]))
                        raw.setdefault(f"{n}:{path}", []).extend(got[path])
                text = " ".join(rng.choice(("blocks", "engine", "decode", "prefill", "cache")) for _ in range(60))
                tokenize.append(statistics.median(_tokenize_ms(decode.url, model, text) for _ in range(per_rep)))
        finally:
            for r in routers.values():
                r.stop()

    for n in LENGTHS:
        sec.rows.append(Row(f"TTFT, {n}-token prompt, P/D", "ms", values[n, "pd"]))
        sec.rows.append(Row(f"TTFT, {n}-token prompt, decode engine alone", "ms", values[n, "local"]))
    sec.rows.append(Row("decode engine's /tokenize, 60-word text", "ms", tokenize))
    medians = {key: statistics.median(v) for key, v in values.items()}
    saved = ", ".join(f"{n}: {medians[n, 'pd'] - medians[n, 'local']:+.1f}" for n in LENGTHS)
    pd_wins = [n for n in LENGTHS if medians[n, "pd"] < medians[n, "local"]]
    sec.notes.append(f"P/D minus alone, ms by prompt length (positive: alone is faster): {saved}")
    sec.notes.append(f"shortest length where P/D is faster: {pd_wins[0] if pd_wins else 'none measured'}; "
                     f"{per_rep} requests per length, path and repetition")
    sec.extra = {"lengths": list(LENGTHS), "per_repetition": per_rep, "requests_ms": raw}
    return sec

