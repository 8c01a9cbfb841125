"""An offline prefill -> decode pair: two vLLM engines in two processes.

Each engine runs in its own interpreter (vLLM keeps per-process global
state) as ``python -m kvsm_testing.pd_pair --role prefill|decode ...`` and
takes JSON commands on stdin, one per line, answering each with one line
``KVSM-RESULT {json}`` on stdout (vLLM's own log lines go around it). The
engines run single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): engine
core, worker and kvsm's loop thread all live in that one process, and each is
pinned to its own core when the machine has two.

Commands::

    {"op": "generate", "prompts": [...], "max_tokens": N, "params": [dict|null, ...]}
        -> {"outputs": [{"token_ids", "kv_transfer_params", "num_cached_tokens", "finish_reason"}]}
    {"op": "corrupt", "block_ids": [...]}     overwrite those KV blocks with noise (prefill side)
    {"op": "state"}                           kvsm's worker and scheduler state, free blocks
    {"op": "digest", "block_ids": [[...], ...]}
        -> {"digests": [[sha256, ...], ...]}  per KV cache group, each block's bytes in that group's layers
    {"op": "watch_arrivals"}                  from now on, digest each request's blocks when the
                                              worker reports its transfer done (before any step uses them)
    {"op": "arrivals"}                        -> {"arrivals": {req_id: [[sha256, ...], ...]}}
    {"op": "quit"}                            kvsm's halves shut down explicitly, then os._exit(0)
    {"op": "end"}                             the script just ends: nothing is shut down by hand, the
                                              interpreter exits normally (an offline script's end)

SIGTERM while it waits for a command ends it the way it ends an offline
script that gets one (kvsm's handler: exit status 143 through the exit hooks).

``PDEngine`` is the parent's handle on one such process.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsm_testing.pythonpath import child_pythonpath

MARKER = "KVSM-RESULT "


def kvsm_transfer_config(role: str, *, port: int, log_dir: str | None, engine_id: str,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``kv_transfer_config`` dict loading KVSMConnector on this machine (``extra``'s
    ``kv_load_failure_policy``, vLLM's key, goes beside kvsm's)."""
    cfg: dict[str, Any] = {"side_channel_host": "127.0.0.1", "side_channel_port": port}
    if log_dir:
        cfg["event_log_dir"] = log_dir
    cfg.update(extra or {})
    policy = cfg.pop("kv_load_failure_policy", None)
    return {
        "kv_connector": "KVSMConnector",
        "kv_connector_module_path": "kvsm.connector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_buffer_device": "cpu",
        **({"kv_load_failure_policy": policy} if policy else {}),
        "kv_connector_extra_config": cfg,
    }


# ----------------------------------------------------------------- the child


def corrupt_blocks(worker: Any, block_ids: list[int], seed: int) -> int:
    """Overwrite ``block_ids`` of every layer of ``worker``'s KV cache with noise of
    the data's own scale (runs inside each vLLM worker: ``LLM.collective_rpc``)."""
    import torch

    ids = torch.tensor(block_ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    for layer in runner.kv_caches:
        # A Mamba layer's cache is a tuple of state views (conv, ssm).
        for t in layer if isinstance(layer, (list, tuple)) else (layer,):
            scale = float(t[ids].float().std()) or 1.0
            t[ids] = (torch.randn((len(ids), *t.shape[1:]), generator=gen) * scale).to(t.dtype)
    return len(block_ids)


def group_digests(runner: Any, kv_cache_config: Any, block_ids: Sequence[Sequence[int]]) -> list[list[str]]:
    """sha256 of each block's bytes in every layer of its KV cache group (every
    state view of a Mamba layer), group by group: what lets a test show that a
    block arrived byte for byte. Block 0 is vLLM's null block: digested as ''."""
    import hashlib

    ctx = runner.compilation_config.static_forward_context
    out = []
    for group, ids in zip(kv_cache_config.kv_cache_groups, block_ids, strict=True):
        views = []
        for name in group.layer_names:
            cache = ctx[name].kv_cache
            cache = cache[0] if isinstance(cache, list) and cache and isinstance(cache[0], (list, tuple)) else cache
            views += list(cache) if isinstance(cache, (list, tuple)) else [cache]
        digests = []
        for b in ids:
            if b == 0:
                digests.append("")
                continue
            h = hashlib.sha256()
            for t in views:
                h.update(t[b].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
            digests.append(h.hexdigest())
        out.append(digests)
    return out


def _serve(args: argparse.Namespace) -> int:
    from kvsm_testing.engine import apply_engine_env

    apply_engine_env()
    ncpu = os.cpu_count()
    if args.cpu is not None and hasattr(os, "sched_setaffinity") and ncpu and ncpu > 1:
        os.sched_setaffinity(0, {args.cpu % ncpu})
    from kvsm_testing.engine import make_llm

    extra = json.loads(args.extra) if args.extra else None
    kv = kvsm_transfer_config(args.kv_role, port=args.port, log_dir=args.log_dir, engine_id=args.engine_id,
                              extra=extra)
    llm_kwargs = json.loads(args.llm_kwargs) if args.llm_kwargs else {}
    llm = make_llm(args.model, kv_transfer_config=kv, **{"max_model_len": args.max_model_len, **llm_kwargs})
    engine = llm.llm_engine

    def connector_halves() -> tuple[Any, Any, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        worker = get_kv_transfer_group().worker_half if has_kv_transfer_group() else None
        core = getattr(engine, "engine_core", None)
        core = getattr(core, "engine_core", core)
        sched = getattr(getattr(core, "scheduler", None), "connector", None)
        return worker, getattr(sched, "scheduler_half", None), core

    def reply(obj: Any) -> None:
        sys.stdout.write(MARKER + json.dumps(obj) + "\n")
        sys.stdout.flush()

    arrivals: dict[str, list[list[str]]] = {}
    reply({"ready": True, "pid": os.getpid()})
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                params = cmd.get("params") or [None] * len(cmd["prompts"])
                from kvsm_testing.engine import _as_prompts, greedy_params

                sps = [greedy_params(cmd["max_tokens"], kv_transfer_params=p) for p in params]
                outs = llm.generate(_as_prompts(cmd["prompts"], cmd.get("cache_salt")), sps, use_tqdm=False)
                reply({"outputs": [{
                    "token_ids": list(o.outputs[0].token_ids),
                    "kv_transfer_params": _jsonable(o.kv_transfer_params),
                    "num_cached_tokens": int(o.num_cached_tokens or 0),
                    "finish_reason": o.outputs[0].finish_reason,
                } for o in outs]})
            elif op == "corrupt":
                # On every worker (a tensor parallel engine's run in processes of their own).
                llm.collective_rpc(corrupt_blocks, args=(list(cmd["block_ids"]), int(cmd.get("seed", 0))))
                reply({"corrupted": cmd["block_ids"]})
            elif op == "state":  # (a tensor parallel engine's workers are elsewhere: worker None)
                worker, sched, core = connector_halves()
                pool = core.scheduler.kv_cache_manager.block_pool
                reply({"worker": worker.debug_state() if worker else None,
                       "stats": worker.stats.totals() if worker else None,
                       "scheduler": sched.pending_counts() if sched else None,
                       "free_blocks": pool.get_num_free_blocks(),
                       "requests": len(core.scheduler.requests)})
            elif op == "digest":
                _, _, core = connector_halves()
                reply({"digests": group_digests(_runner(core), core.scheduler.kv_cache_config, cmd["block_ids"])})
            elif op == "watch_arrivals":
                _watch_arrivals(connector_halves()[2], arrivals)
                reply({"watching": True})
            elif op == "arrivals":
                reply({"arrivals": arrivals})
            elif op == "quit":
                reply({"bye": True})
                break
            elif op == "end":
                reply({"bye": True})
                return 0  # the interpreter exits as at a script's end: vLLM's and kvsm's exit hooks
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - report it to the parent, keep serving
            import traceback

            reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    try:
        worker, _, _ = connector_halves()
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        get_kv_transfer_group().shutdown()
        sched = getattr(getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None),
                                "scheduler", None), "connector", None)
        if sched is not None:
            sched.shutdown()
    finally:
        os._exit(0)  # vLLM's atexit teardown of a single-process engine can hang; logs are closed


def _runner(core: Any) -> Any:
    """This process's model runner (a single-process engine: the executor's one worker)."""
    worker = core.model_executor.driver_worker
    return getattr(worker, "model_runner", None) or worker.worker.model_runner


def _watch_arrivals(core: Any, arrivals: dict[str, list[list[str]]]) -> None:
    """Wrap the worker half's result call (vLLM calls it at the end of each step,
    before the next step computes on what arrived) to digest each arrived request's
    blocks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if getattr(connector, "_kvsm_digesting", False):
        return
    connector._kvsm_digesting = True
    take = connector.get_transfer_results
    runner = _runner(core)

    def digesting(finished_req_ids: set[str]) -> Any:
        results = take(finished_req_ids)
        for req in results.finished_recving or ():
            ids = core.scheduler.kv_cache_manager.get_block_ids(req)
            arrivals[req] = group_digests(runner, core.scheduler.kv_cache_config, ids)
        return results

    connector.get_transfer_results = digesting


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ----------------------------------------------------------------- the parent


class PDEngine:
    """One engine process of the pair, driven over its stdin/stdout."""

    def __init__(self, name: str, kv_role: str, *, model: str | os.PathLike[str], port: int, engine_id: str,
                 log_dir: str | os.PathLike[str] | None, workdir: str | os.PathLike[str], cpu: int | None = None,
                 extra: dict[str, Any] | None = None, max_model_len: int = 512, start_timeout: float = 240.0,
                 llm_kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 wait: bool = True) -> None:
        """Start the engine process; ``wait``: until it is ready (else call
        :meth:`wait_ready`, or :func:`started` for several engines started at once)."""
        self.name = name
        self.start_timeout = start_timeout
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = workdir / f"{name}.stderr.log"
        from kvsm_testing.engine import engine_env

        environ = dict(os.environ)
        environ.update(engine_env())
        environ.update(env or {})  # e.g. VLLM_CPU_OMP_THREADS_BIND for a tensor parallel engine
        env = environ
        # The kvsm and kvsm_testing this process imported, whatever the child's cwd.
        env["PYTHONPATH"] = child_pythonpath(env.get("PYTHONPATH"))
        cmd = [sys.executable, "-m", "kvsm_testing.pd_pair", "--kv-role", kv_role, "--model", str(model),
               "--port", str(port), "--engine-id", engine_id, "--max-model-len", str(max_model_len)]
        if log_dir is not None:
            cmd += ["--log-dir", str(log_dir)]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        if extra:
            cmd += ["--extra", json.dumps(extra)]
        if llm_kwargs:
            cmd += ["--llm-kwargs", json.dumps(llm_kwargs)]
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(workdir), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._other: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"pd-{name}-stdout")
        self._reader.start()
        self.info: dict[str, Any] | None = self._wait_reply(start_timeout) if wait else None

    def wait_ready(self) -> PDEngine:
        """Wait (up to the start timeout) for the engine started with ``wait=False``."""
        if self.info is None:
            self.info = self._wait_reply(self.start_timeout)
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARKER):
                self._lines.put(line[len(MARKER):])
            else:
                self._other.append(line)
                del self._other[:-200]
        self._lines.put(None)

    def _wait_reply(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no answer within {timeout} s\n{self.tail()}") from None
        if line is None:
            raise RuntimeError(f"{self.name}: the engine process exited (rc={self.proc.poll()})\n{self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def request(self, cmd: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout)

    def generate(self, prompts: Sequence[Any], max_tokens: int, params: Sequence[dict | None] | None = None,
                 timeout: float = 120.0, cache_salt: str | None = None) -> list[dict[str, Any]]:
        """Greedy outputs; ``cache_salt`` computes the prompts apart from the prefix
        cache's other entries (a reference on an engine of the pair)."""
        return self.request({"op": "generate", "prompts": list(prompts), "max_tokens": max_tokens,
                             "params": list(params) if params is not None else None,
                             "cache_salt": cache_salt}, timeout)["outputs"]

    def prefill_params(self, prompts: Sequence[Any]) -> list[dict[str, Any]]:
        """A prefill engine's ``kv_transfer_params`` for ``prompts`` (one token
        generated each), as a router forwards them. Nothing steps this engine
        afterwards, as for a user's: its worker must have the blocks pinned."""
        outs = self.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
        params = []
        for o in outs:
            p = dict(o["kv_transfer_params"])
            # Else the decode engine reports the prefill side's cache hits as its own.
            p.pop("remote_prefill_cached_tokens", None)
            params.append(p)
        return params

    def tail(self) -> str:
        try:
            err = self.stderr_path.read_text(errors="replace")[-6000:]
        except OSError:
            err = ""
        return "".join(self._other[-40:]) + err

    def end(self, timeout: float = 60.0) -> int:
        """End the process as an offline script ends (no shutdown by hand); its exit status."""
        self.request({"op": "end"}, timeout=timeout)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        """Its exit status once it has exited (killed if it has not within ``timeout``)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(f"{self.name}: still running {timeout} s after it was told to end\n"
                               f"{self.tail()}") from None

    def close(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            try:
                self.request({"op": "quit"}, timeout=timeout)
            except (RuntimeError, TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        return self.proc.returncode


def started(*engines: PDEngine) -> tuple[PDEngine, ...]:
    """Engines constructed with ``wait=False``, once all are ready: they start side
    by side (an engine's start is mostly one core's Python imports, and a pair's
    engines are pinned to a core each). If one fails, all are closed."""
    try:
        return tuple(engine.wait_ready() for engine in engines)
    except BaseException:
        for engine in engines:
            engine.close()
        raise


def stream_pairs(prefill: PDEngine, decode: PDEngine, prompts: list[list[int]], max_tokens: int,
                 coordinates: dict[str, Any], *, groups: int = 1, decode_first_s: float = 0.0,
                 cache_salt: str | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """Both legs of each prompt, as kvsm's router sends a streamed pair (one join key
    in both; ``coordinates``: the prefill engine's, as its answers would give them):
    the decode legs ``decode_first_s`` ahead (a busy prefill engine), the prefill legs
    computing one token. The join keys and the decode outputs."""
    import time
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    from kvsm.handoff.facts import STREAM_KEY

    keys = [f"kvsm-stream-{uuid.uuid4().hex}" for _ in prompts]
    prefill_legs = [{"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "stream",
                     STREAM_KEY: k} for k in keys]
    decode_legs = [{"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "stream",
                    STREAM_KEY: k, "remote_request_id": k, "remote_block_ids": [[] for _ in range(groups)],
                    **coordinates} for k in keys]
    with ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(decode.generate, prompts, max_tokens, decode_legs, cache_salt=cache_salt)
        time.sleep(decode_first_s)
        prefill.generate(prompts, 1, prefill_legs)
        return keys, decoded.result(timeout=120)


def replay_stopped_pair(prefill: PDEngine, decode: PDEngine, logs: Path) -> Any:
    """Once neither engine's worker holds a live machine, stop both (their event logs
    are flushed and closed) and replay every log in ``logs``: the report, checked to
    have no findings."""
    from kvsm.replay import analyse
    from kvsm_testing.reliability import wait_until

    def settled() -> bool:
        return (prefill.request({"op": "state"})["worker"]["send"] == {}
                and decode.request({"op": "state"})["worker"]["recv"] == {})

    wait_until(settled, 10, "no live machine on either side")
    prefill.close()
    decode.close()
    report = analyse(sorted(logs.glob("*.jsonl")))
    assert not report.findings, [str(f) for f in report.findings]
    return report


def engine_records(logs: Path, engine_id: str) -> list[dict[str, Any]]:
    """Every record of engine ``engine_id``'s event logs in ``logs`` (as flushed so far)."""
    return [json.loads(line) for f in logs.glob(f"{engine_id}.*.jsonl")
            for line in f.read_text().splitlines() if line.strip()]


def matched_tokens(logs: Path, engine_id: str, remote_reqs: Sequence[str], timeout: float = 10.0) -> dict[str, int]:
    """remote (prefill) request -> tokens its decode request read remotely, from
    decode engine ``engine_id``'s worker event logs in ``logs``, once they hold
    every one of ``remote_reqs`` (the log's writer flushes every 50 ms)."""
    import orjson

    from kvsm_testing.reliability import wait_until

    def probe() -> dict[str, int] | None:
        out: dict[str, int] = {}
        for f in logs.glob(f"{engine_id}.worker*.jsonl"):
            data = f.read_bytes()
            for line in data[:data.rfind(b"\n") + 1].splitlines():  # whole lines only
                r = orjson.loads(line)
                if r.get("event") == "matched" and r.get("kind") == "transition":
                    out[r["input"]["remote_req"]] = r["input"]["num_tokens"]
        return out if all(q in out for q in remote_reqs) else None

    return wait_until(probe, timeout, f"the decode worker's matched records of {list(remote_reqs)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsm_testing.pd_pair")
    parser.add_argument("--kv-role", required=True, choices=["kv_producer", "kv_consumer", "kv_both"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True, help="side-channel base port")
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--log-dir")
    parser.add_argument("--cpu", type=int, help="pin this process to one core")
    parser.add_argument("--extra", help="JSON: more kv_connector_extra_config")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--llm-kwargs", help="JSON: more vllm.LLM arguments (dtype, block_size, ...)")
    return _serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
