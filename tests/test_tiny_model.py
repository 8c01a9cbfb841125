"""The tiny test models and the offline CPU engine helpers.

Builds the models into a temporary cache, then runs vLLM in fresh interpreters
(one engine per process) on a 1-token prompt, a short prompt and a prompt of a
few hundred tokens, and checks what later P/D tests rely on: greedy outputs are
deterministic across processes, differ between prompts, are not degenerate,
and depend on the KV cache (garbage in the cached blocks changes them). The
Llama model goes through ``kvsm_testing.engine``'s probe; the other kinds
(Gemma2, DeepSeek-V2, Qwen3-Next) through the probe at the end of this file,
which also reports (and the tests check) their KV cache groups and tensors.

Skipped only when vLLM is not installed at all (and failed even then where
everything must be installed: ``conftest.require``); a vLLM that is installed
but broken fails the test.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from conftest import require

require("vllm")

from kvsm_testing.tiny_model import build_tiny_model, model_dir_for

MAX_TOKENS = 32
BLOCK_SIZE = 128


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("kvsm-cache"))


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> tuple[list, list[int]]:
    """Prompts (a token-id list of just BOS, a short text, a long text) and
    their lengths in tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    short = "The decode engine pulls the blocks and keeps generating."
    long = " ".join(
        [
            "Once upon a time a curious engineer opened a terminal and waited.",
            "Mountains rise above the valley, rivers wind through forests of pine.",
            "Every input that changes state is an event with a sequence number.",
        ]
        * 8
    )
    n_short, n_long = len(tok(short).input_ids), len(tok(long).input_ids)
    assert 5 < n_short < BLOCK_SIZE, n_short
    # Several blocks, and room for the generated tokens within max_model_len.
    assert 2 * BLOCK_SIZE < n_long <= 512 - MAX_TOKENS, n_long
    return [[tok.bos_token_id], short, long], [1, n_short, n_long]


def test_model_files_and_tokenizer(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.max_position_embeddings >= 2048
    assert cfg.vocab_size == len(tok)
    assert 1000 <= len(tok) <= 2048
    ids = tok("hello world").input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n") and "hi" in chat


def test_build_is_cached_deterministic_and_race_safe(model_dir: Path, tmp_path: Path) -> None:
    # A second call finds the complete build.
    assert build_tiny_model(model_dir.parent) == model_dir
    # Two builders racing on an empty cache: both get the same complete
    # directory, no temporary directory is left behind, and the files are
    # identical to the first build (weights depend only on recipe + seed).
    barrier = threading.Barrier(2)
    results: list[Path | BaseException] = []

    def build() -> None:
        barrier.wait()
        try:
            results.append(build_tiny_model(tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [model_dir_for(tmp_path)] * 2, results
    assert [p.name for p in tmp_path.iterdir()] == [model_dir.name]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(tmp_path / model_dir.name / name) == _sha(model_dir / name), name
    # Another seed is another model.
    assert model_dir_for(tmp_path, seed=1) != model_dir_for(tmp_path)


@pytest.mark.slow  # two vLLM engines in processes of their own
def test_engine_outputs_are_deterministic_distinct_and_depend_on_kv(
    model_dir: Path, prompts: tuple[list, list[int]], tmp_path: Path
) -> None:
    prompts, lengths = prompts
    from kvsm_testing.engine import run_engine_subprocess, wait_engine_subprocess

    # Two fresh interpreters side by side: a plain reference run, and a probe
    # that also reruns the prompts with prefix-cache hits and with garbage KV.
    ref_proc = run_engine_subprocess(
        "reference", model_dir, prompts, MAX_TOKENS, workdir=tmp_path / "ref"
    )
    probe_proc = run_engine_subprocess(
        "probe", model_dir, prompts, MAX_TOKENS, workdir=tmp_path / "probe"
    )
    ref = wait_engine_subprocess(ref_proc)
    probe = wait_engine_subprocess(probe_proc)
    print("reference timings:", ref["timings"], "probe timings:", probe["timings"])

    outputs = ref["outputs"]
    assert [len(o) for o in outputs] == [MAX_TOKENS] * len(prompts)
    # Deterministic across processes and across calls in one engine.
    assert probe["outputs"] == outputs
    assert probe["outputs_again"] == outputs
    # Different prompts, different continuations; none degenerate.
    assert len({tuple(o) for o in outputs}) == len(outputs)
    for out in outputs:
        assert len(set(out)) >= MAX_TOKENS // 4, out

    # The CPU backend's block layout and the prefix cache, as P/D tests expect.
    assert probe["block_size"] == BLOCK_SIZE
    for shape in probe["kv_cache_shapes"]:
        assert shape[1:] == [2, BLOCK_SIZE, 2 * 32], shape
    assert probe["num_cached_tokens"] == [0, 0, 0]
    # Rerun: full blocks of the prompt come from the prefix cache (the last
    # prompt token is always recomputed); the short prompts have no full block.
    cached = probe["num_cached_tokens_again"]
    assert cached == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in lengths], (cached, lengths)
    assert cached[2] >= 2 * BLOCK_SIZE

    # Garbage in the cached blocks changes the output of the prompt that
    # reused them, and only that one; restoring the blocks restores it.
    perturbed = probe["outputs_perturbed"]
    assert probe["num_cached_tokens_perturbed"] == cached
    assert perturbed[0] == outputs[0] and perturbed[1] == outputs[1]
    assert perturbed[2] != outputs[2]
    assert probe["outputs_restored"] == outputs
    assert probe["outputs_after_reset"] == outputs
    assert probe["num_cached_tokens_after_reset"] == [0, 0, 0]


# ---------------------------------------------------------------------------
# The other model kinds (Gemma2: sliding window + full attention; DeepSeek-V2:
# MLA; Qwen3-Next: gated-delta-net linear attention (Mamba-style state) + full
# attention). One fresh interpreter per kind runs this file as a script (the
# probe below) with one engine; the tests check what it reports.
# ---------------------------------------------------------------------------

NEW_KINDS = ("gemma2", "deepseek_v2", "qwen3_next", "qwen3", "gemma3", "llama4")
# kvsm_testing.tiny_families: built and laid out as checked here; their outputs'
# dependence on the KV cache is checked in transformers here and by the offline
# pairs (test_pd_models.py: a corrupted and a swapped transfer change them), not
# by the probe below, whose one-token change at the start of a long prompt a
# sliding window cannot see.
FAMILIES = ("qwen2", "mistral", "phi3", "gpt2", "opt")


def _gdn_block_size() -> int:
    """Qwen3-Next's block: vLLM sizes the attention block so that an attention page
    is as large as a Mamba state page. On a CPU with AVX-512 BF16 (vLLM's
    accelerated GDN) it keeps the SSM state in float32 (``platforms/cpu.py``);
    without, in the model's bfloat16, and the page is smaller (seen: 640)."""
    import torch

    return 1152 if torch.cpu._is_avx512_bf16_supported() else 640


GDN_BLOCK = _gdn_block_size()
# What each kind's KV cache looks like to the connector on vLLM 0.32's CPU
# backend: (spec class, block size, layers) per KV cache group.
EXPECTED_GROUPS = {
    "gemma2": [
        ("SlidingWindowSpec", 128, [0, 2]),
        ("FullAttentionSpec", 128, [1, 3]),
    ],
    "deepseek_v2": [("MLAAttentionSpec", 16, [0, 1])],
    "qwen3_next": [
        ("MambaSpec", GDN_BLOCK, [0, 2]),
        ("FullAttentionSpec", GDN_BLOCK, [1, 3]),
    ],
    "qwen3": [("FullAttentionSpec", 128, [0, 1])],
    # Three sliding-window layers to one global one: vLLM makes groups of equal
    # size, one layer each here, all four overlaid on one buffer.
    "gemma3": [
        ("SlidingWindowSpec", 128, [0]),
        ("SlidingWindowSpec", 128, [1]),
        ("SlidingWindowSpec", 128, [2]),
        ("FullAttentionSpec", 128, [3]),
    ],
    # Llama 4: three chunked local attention layers (chunks of 128) to one global.
    "llama4": [
        ("ChunkedLocalAttentionSpec", 128, [0]),
        ("ChunkedLocalAttentionSpec", 128, [1]),
        ("ChunkedLocalAttentionSpec", 128, [2]),
        ("FullAttentionSpec", 128, [3]),
    ],
}

LONG_TEXT = " ".join(
    [
        "Once upon a time a curious engineer opened a terminal and waited.",
        "Mountains rise above the valley, rivers wind through forests of pine.",
        "Every input that changes state is an event with a sequence number.",
    ]
    * 8
)


def _probe_prompts(model_dir: str) -> dict[str, list[int]]:
    """BOS alone, a short prompt, a long one (longer than Gemma2's sliding
    window of 128, several blocks of 128) and the long one with its first
    token after BOS changed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    long = tok(LONG_TEXT).input_ids
    long_mod = list(long)
    long_mod[1] = (long[1] + 7) % len(tok)
    return {
        "bos": [tok.bos_token_id],
        "short": tok("The decode engine pulls the blocks and keeps generating.").input_ids,
        "long": long,
        "long_mod": long_mod,
    }


def _describe(t) -> dict:
    if not hasattr(t, "data_ptr"):  # a Mamba layer: (conv state, SSM state)
        return {"parts": [_describe(x) for x in t]}
    return {
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "stride": list(t.stride()),
        "data_ptr": t.data_ptr(),
        "storage_ptr": t.untyped_storage().data_ptr(),
        "storage_nbytes": t.untyped_storage().nbytes(),
    }


def _probe_engine(kind: str, model_dir: str, out: str) -> None:
    """Runs in a fresh interpreter (``python tests/test_tiny_model.py probe
    KIND MODEL_DIR OUT``): greedy outputs of a batch, the same again, each
    prompt alone, and the long prompt decoded after its cached KV (every block
    of one KV cache group, or only its first block) was overwritten with noise
    right after prefill. Writes the results and the engine's KV cache layout as
    JSON to OUT."""
    import json
    import time

    import torch

    from kvsm_testing.engine import _shutdown, generate_greedy, greedy_params, make_llm
    from kvsm_testing.tiny_model import vllm_args

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    prompts = _probe_prompts(model_dir)
    names = list(prompts)
    llm = make_llm(model_dir, max_model_len=1024, **vllm_args(kind))
    timings["engine_start_s"] = round(time.perf_counter() - t0, 3)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    scheduler = core.scheduler
    kv_config = scheduler.kv_cache_config
    runner = engine.model_executor.driver_worker.worker.model_runner
    forward_context = runner.compilation_config.static_forward_context
    result: dict = {"kind": kind, "prompt_lengths": {n: len(p) for n, p in prompts.items()}}
    try:
        t0 = time.perf_counter()

        def run(names_: list[str]) -> tuple[list[list[int]], list[int]]:
            outs = generate_greedy(llm, [prompts[n] for n in names_], MAX_TOKENS)
            return [list(o.outputs[0].token_ids) for o in outs], [
                int(o.num_cached_tokens or 0) for o in outs
            ]

        result["outputs"], result["num_cached_tokens"] = run(names)
        timings["generate_s"] = round(time.perf_counter() - t0, 3)
        result["outputs_again"], result["num_cached_tokens_again"] = run(names)
        result["outputs_alone"] = [run([n])[0][0] for n in names]

        def layer_kv(layer: str) -> list[torch.Tensor]:
            kv = forward_context[layer].kv_cache
            return [kv] if isinstance(kv, torch.Tensor) else list(kv)

        def decode_long(perturb=None) -> tuple[list[int], list[list[int]]]:
            """The long prompt through the step API; ``perturb(block_ids)``
            runs once, after the step that finished its prefill."""
            req = engine.add_request("probe-long", {"prompt_token_ids": prompts["long"]}, greedy_params(MAX_TOKENS))
            tokens: list[int] = []
            block_ids: list[list[int]] = []
            while engine.has_unfinished_requests():
                for o in engine.step():
                    tokens = list(o.outputs[0].token_ids)
                if perturb is not None and tokens and not block_ids:
                    block_ids = [list(b) for b in scheduler.kv_cache_manager.get_block_ids(req)]
                    perturb(block_ids)
            llm.reset_prefix_cache()  # never reuse perturbed blocks
            return tokens, block_ids

        gen = torch.Generator().manual_seed(0)

        def noise(group: int, first_block_only: bool):
            def perturb(block_ids: list[list[int]]) -> None:
                ids = [b for b in block_ids[group] if b != 0]  # 0: the null block
                ids = ids[:1] if first_block_only else ids
                for layer in kv_config.kv_cache_groups[group].layer_names:
                    for t in layer_kv(layer):
                        old = t[ids].float()
                        scale = float(old.std()) or 1.0
                        t[ids] = (torch.randn(old.shape, generator=gen) * scale).to(t.dtype)

            return perturb

        result["outputs_step_api"], block_ids = decode_long(lambda ids: None)
        result["long_block_ids"] = block_ids
        perturbed = []
        for g in range(len(kv_config.kv_cache_groups)):
            for first_only in (False, True):
                tokens, _ = decode_long(noise(g, first_only))
                perturbed.append({"group": g, "first_block_only": first_only, "outputs": tokens})
        result["outputs_perturbed"] = perturbed
        result["outputs_after_perturbation"] = run(["long"])[0][0]

        # The KV cache layout: vLLM's config and, per layer, the tensor the
        # model reads (what KVConnectorBase_V1.register_kv_caches gets for an
        # attention layer; for a Mamba layer it gets the raw int8 page view
        # these two state views are carved from).
        result["num_blocks"] = kv_config.num_blocks
        result["enable_prefix_caching"] = bool(engine.vllm_config.cache_config.enable_prefix_caching)
        result["groups"] = [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "layer_names": list(g.layer_names),
            }
            for g in kv_config.kv_cache_groups
        ]
        result["kv_cache_tensors"] = [
            {"size": t.size, "layers": list(t.layers), "layer_stride": t.layer_stride, "block_stride": t.block_stride}
            for t in kv_config.kv_cache_tensors
        ]
        result["layer_tensors"] = {
            layer: _describe(forward_context[layer].kv_cache)
            for g in kv_config.kv_cache_groups
            for layer in g.layer_names
        }
        result["timings"] = timings
    finally:
        _shutdown(llm)
    Path(out).write_text(json.dumps(result))


@pytest.fixture(scope="module")
def kind_dirs(model_dir: Path) -> dict[str, Path]:
    """Every new kind, built into the same cache as the Llama model."""
    return {kind: build_tiny_model(model_dir.parent, kind=kind) for kind in (*NEW_KINDS, *FAMILIES)}


def test_kinds_are_built_cached_and_apart(model_dir: Path, kind_dirs: dict[str, Path]) -> None:
    from transformers import AutoConfig

    from kvsm_testing.tiny_model import KINDS, model_dtype, vllm_args

    assert KINDS == ("llama", *NEW_KINDS, *FAMILIES)
    # The Llama API and directory are what they were: kind="llama" is the default.
    assert model_dir_for(model_dir.parent, kind="llama") == model_dir
    assert model_dir.name.startswith("tiny-llama-")
    dirs = {model_dir, *kind_dirs.values()}
    assert len(dirs) == len(KINDS) and {d.parent for d in dirs} == {model_dir.parent}
    for kind, path in kind_dirs.items():
        assert build_tiny_model(model_dir.parent, kind=kind) == path  # cached
        assert model_dir_for(model_dir.parent, kind=kind) == path
        assert model_dir_for(model_dir.parent, kind=kind, seed=1) != path
        # One tokenizer for every kind.
        assert _sha(path / "tokenizer.json") == _sha(model_dir / "tokenizer.json")
        cfg = AutoConfig.from_pretrained(str(path))
        assert cfg.model_type == {"gemma3": "gemma3_text", "llama4": "llama4_text"}.get(kind, kind)
        # (Phi-3: four heads of 96, another head size for the attention kernel)
        assert cfg.hidden_size == (384 if kind == "phi3" else 128) and cfg.max_position_embeddings >= 2048
        assert str(cfg.dtype).removeprefix("torch.") == model_dtype(kind) == vllm_args(kind)["dtype"]
    assert model_dtype("qwen3_next") == "bfloat16"
    assert AutoConfig.from_pretrained(str(kind_dirs["gemma2"])).layer_types == [
        "sliding_attention", "full_attention"
    ] * 2  # fmt: skip
    assert AutoConfig.from_pretrained(str(kind_dirs["gemma3"])).layer_types == [
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"
    ]  # fmt: skip
    assert model_dtype("qwen3") == "bfloat16"
    assert AutoConfig.from_pretrained(str(kind_dirs["qwen3_next"])).layer_types == [
        "linear_attention", "full_attention"
    ] * 2  # fmt: skip
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        model_dir_for(model_dir.parent, kind="gpt3")


def _greedy(model, prompt: list[int], n: int, corrupt: bool) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (transformers, one token a step on
    the cache); ``corrupt``: noise of the data's own scale in the prompt's
    cache first, as ``pd_pair.corrupt_blocks`` writes into transferred blocks."""
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        cache = model(torch.tensor([prompt[:-1]]), use_cache=True).past_key_values
        if corrupt:
            for layer in cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    setattr(layer, name, torch.randn(t.shape, generator=gen) * t.std())
        out, last = [], prompt[-1]
        for _ in range(n):
            step = model(torch.tensor([[last]]), past_key_values=cache, use_cache=True)
            cache, last = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(last)
    return out


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_outputs_are_not_degenerate_and_depend_on_kv(kind: str, kind_dirs: dict[str, Path]) -> None:
    """Each family's greedy output varies, and noise in its cache changes it for
    every prompt: what the offline pairs' corrupted-transfer test relies on
    (the OPT model once only repeated the prompt's last token, whatever its cache
    held, and that test failed in CI). Checked with transformers, in process."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(kind_dirs[kind]), dtype=torch.float32).eval()
    rng = random.Random(kind)
    for _ in range(4):
        prompt = [rng.randrange(10, 1100) for _ in range(200)]
        clean = _greedy(model, prompt, 10, corrupt=False)
        assert len(set(clean)) >= 3, (kind, clean)
        assert clean != [prompt[-1]] * 10, (kind, clean)
        assert _greedy(model, prompt, 10, corrupt=True) != clean, (kind, prompt[-3:], clean)


def _run_probe(kind: str, path: Path, workdir: Path) -> dict:
    import json
    import os
    import subprocess
    import sys
    import time

    from kvsm_testing.engine import engine_env

    workdir.mkdir(parents=True, exist_ok=True)
    out, log = workdir / "probe.json", workdir / "probe.log"
    env = {**os.environ, **engine_env()}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    t0 = time.perf_counter()
    with open(log, "w") as log_file:
        rc = subprocess.run(
            [sys.executable, __file__, "probe", kind, str(path), str(out)],
            env=env, cwd=workdir, stdout=log_file, stderr=subprocess.STDOUT, timeout=600, check=False,
        ).returncode  # fmt: skip
    if rc != 0 or not out.exists():
        raise RuntimeError(f"probe of {kind} failed (rc={rc}):\n{log.read_text(errors='replace')[-8000:]}")
    result = json.loads(out.read_text())
    print(kind, "probe:", round(time.perf_counter() - t0, 1), "s;", result["timings"])
    return result


# What vLLM makes of each kind's KV cache: layout facts that the offline pairs
# (test_pd_models.py) rely on and show in CI through their outputs, bytes and
# corrupted transfers; re-checked with -m extended, e.g. after a vLLM upgrade.
@pytest.mark.slow  # one vLLM engine in a process of its own, per kind
@pytest.mark.extended
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_kind_outputs_are_distinct_and_depend_on_kv(
    kind: str, kind_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from kvsm_testing.tiny_model import model_dtype

    probe = _run_probe(kind, kind_dirs[kind], tmp_path)
    names = list(probe["prompt_lengths"])
    assert names == ["bos", "short", "long", "long_mod"]
    outputs = dict(zip(names, probe["outputs"]))
    assert [len(o) for o in outputs.values()] == [MAX_TOKENS] * len(names)
    # Deterministic; different prompts (the long ones differ in one token, at
    # the start) give different continuations; none degenerate.
    assert probe["outputs_again"] == probe["outputs"]
    assert len({tuple(o) for o in outputs.values()}) == len(names)
    for out in outputs.values():
        assert len(set(out)) >= MAX_TOKENS // 4, out
    alone = dict(zip(names, probe["outputs_alone"]))
    if model_dtype(kind) == "float32":
        # A batch gives what each prompt gives alone.
        assert alone == outputs
    else:
        # bfloat16: rounding depends on the batch's shape, and a near-tie can
        # flip a later token (qwen3_next: token 16 of the long prompt); each
        # prompt alone is still deterministic and distinct.
        assert len({tuple(o) for o in alone.values()}) == len(names)
    assert probe["outputs_step_api"] == alone["long"]

    # Noise in a KV cache group's blocks right after prefill: the first token
    # (sampled before) is kept, the rest changes, for every group (sliding
    # window and full attention, MLA latent, Mamba state). For full attention
    # and MLA, noise in only the first block (the prompt's start) is enough.
    groups = probe["groups"]
    specs = [g["spec"] for g in groups]
    for p in probe["outputs_perturbed"]:
        out, spec = p["outputs"], specs[p["group"]]
        if p["first_block_only"] and spec not in ("FullAttentionSpec", "MLAAttentionSpec"):
            continue
        assert out[0] == alone["long"][0], p
        assert out[1:] != alone["long"][1:], p
    assert probe["outputs_after_perturbation"] == alone["long"]

    # The KV cache layout (vLLM 0.32, CPU backend; see tiny_model's docstring).
    assert [
        (g["spec"], g["block_size"], sorted(int(n.split(".")[2]) for n in g["layer_names"]))
        for g in groups
    ] == EXPECTED_GROUPS[kind]
    tensors = probe["layer_tensors"]
    parts = [t for layer in tensors.values() for t in layer.get("parts", [layer])]
    assert len({t["storage_ptr"] for t in parts}) == 1  # one allocation
    for group in groups:
        ptrs = [_first_ptr(tensors[n]) for n in group["layer_names"]]
        assert len(set(ptrs)) == len(ptrs)  # a group's layers apart...
    for overlaid in zip(*(g["layer_names"] for g in groups)) if len(groups) > 1 else ():
        assert len({_first_ptr(tensors[n]) for n in overlaid}) == 1  # ...groups overlaid
    cached = dict(zip(names, probe["num_cached_tokens_again"]))
    if kind in ("gemma2", "gemma3", "qwen3", "llama4"):
        # Every group hits: the two full blocks of 128 (the last prompt token is
        # always recomputed).
        assert cached["long"] == cached["long_mod"] == 2 * BLOCK_SIZE
    elif kind == "deepseek_v2":
        assert not probe["enable_prefix_caching"]  # vLLM's CPU MLA: no prefix caching
        assert set(cached.values()) == {0}
    else:
        assert set(cached.values()) == {0}  # blocks of GDN_BLOCK (640 or 1152) > any prompt here


def _first_ptr(layer: dict) -> int:
    return (layer["parts"][0] if "parts" in layer else layer)["data_ptr"]


if __name__ == "__main__":  # the probe's fresh interpreter
    import sys

    if sys.argv[1:2] != ["probe"] or len(sys.argv) != 5:
        sys.exit("usage: python tests/test_tiny_model.py probe KIND MODEL_DIR OUT")
    _probe_engine(*sys.argv[2:5])
