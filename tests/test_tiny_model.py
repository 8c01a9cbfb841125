"""The tiny test model and the offline CPU engine helpers.

Builds the model into a temporary cache, then runs vLLM in fresh interpreters
(one engine per process) on a 1-token prompt, a short prompt and a prompt of a
few hundred tokens, and checks what later P/D tests rely on: greedy outputs are
deterministic across processes, differ between prompts, are not degenerate,
and depend on the KV cache (garbage in the cached blocks changes them).

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

from kvsm.testing.tiny_model import build_tiny_model, model_dir_for

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
    from kvsm.testing.engine import run_engine_subprocess, wait_engine_subprocess

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
