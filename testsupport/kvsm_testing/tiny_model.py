"""Tiny random-weight models, built locally, for tests that run vLLM.

There is no network here (and none in CI) except package registries, so the
tests never download a model: :func:`build_tiny_model` makes one on the spot.
``build_tiny_model(cache_dir, seed=..., kind=...)`` builds one of
:data:`KINDS`: ``"llama"`` (the default, and what every caller without
``kind`` gets, unchanged), ``"gemma2"`` (sliding-window + full attention),
``"deepseek_v2"`` (MLA), ``"qwen3_next"`` (gated-delta-net linear attention,
i.e. a Mamba-style state, + full attention), ``"qwen3"`` (dense, bfloat16) and
``"gemma3"`` (three sliding-window layers to one global one) and ``"llama4"``
(three chunked local attention layers to one global one, MoE). :func:`vllm_args` gives the
``vllm.LLM`` arguments a kind needs on the CPU backend (dtype, block size,
attention backend); pass them to :func:`kvsm_testing.engine.make_llm`.

Recipe (Llama)
--------------
* ``LlamaConfig``: hidden 128, 2 layers, 4 attention heads, 2 KV heads (head
  size 32: the CPU attention backend accepts only head sizes from a fixed list,
  32..512), MLP 256, ``max_position_embeddings`` 4096, float32.
* A byte-level BPE tokenizer trained with ``tokenizers`` on the fixed corpus
  below (vocabulary ~1.2k: a small vocabulary keeps the CPU engine fast), with
  ``<s>`` prepended to every encoding, ``</s>`` as EOS, ``<pad>``, ``<unk>``
  and role tokens ``<|system|>``/``<|user|>``/``<|assistant|>`` for a small
  chat template (so chat-completion tests can use it too). Byte-level means any
  text tokenizes, and decoding never fails. Every kind has this tokenizer.
* Random weights from a seeded ``torch.Generator`` (not transformers' own
  init, so the weights depend only on the recipe and the seed).

Why the weights are not the usual ``std=0.02``
----------------------------------------------
With transformers' default init (normal, std 0.02, hidden 128) the logits have
a spread of about ``sqrt(128) * 0.02 = 0.23``: almost uniform. Greedy decoding
then follows tiny differences, and attention scores are ~0, so every position
attends almost uniformly to the whole context. Such a model says little when a
test compares a decode engine's output with a reference: a wrong KV cache
(another request's blocks, zeros, a shifted block) may well still pick the same
argmax. The recipe instead scales each matrix by its fan-in
(``std = gain / sqrt(fan_in)``) so that activations keep their size from layer
to layer, with gains chosen so that:

* attention is sharp (``q``/``k`` gain 2.0: score spread of several units, so
  which keys are in the cache matters, not just their mean);
* the residual stream is carried by the layers, not only by the token
  embedding (embeddings std 1.0, ``o_proj``/``down_proj`` gain 1.0);
* the logits are peaked (``lm_head`` gain 4.0: logit spread ~4, top-1/top-2
  gaps far above float32 noise, so greedy outputs are stable across batch
  shapes and runs, yet they change when the context's KV changes).

``tests/test_tiny_model.py`` checks the consequences through vLLM, for every
kind: different prompts give different greedy continuations, continuations are
not one repeated token, changing one token at the start of a long prompt (i.e.
one position of the KV cache) changes the continuation, and noise in the cached
KV (for each KV cache group) changes it.

The other kinds follow the same rules (fan-in scaling, score spread ~4, logit
spread 4-8); what each needed on top is below. The layouts quoted are vLLM
0.32's CPU backend with ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB of KV cache), as
measured by the tests.

Gemma2 (``kind="gemma2"``)
--------------------------
4 layers alternating sliding-window (128) and full attention, 4 heads, 2 KV
heads, head size 32, MLP 256 (GELU-tanh), float32. Under vLLM's hybrid KV cache
manager: two KV cache groups, ``SlidingWindowSpec`` (layers 0, 2) and
``FullAttentionSpec`` (layers 1, 3), both block 128, whose per-layer tensors
overlay the same memory (layer 0 and layer 1 share one tensor, 2 and 3 the
next; a block belongs to one group at a time).

* vLLM always ties Gemma2's ``lm_head`` to the embedding, and Gemma scales the
  embedding by ``sqrt(hidden)``. With every ``(1 + w)`` RMSNorm at ``w = 0``
  the residual stream is mostly the current token's own embedding, so the
  tied logits favour that token: greedy output repeats one token (measured:
  BOS gave the same token 32 times, a long prompt 2 distinct of 32). The fix
  is that the layers carry the stream: ``post_attention_layernorm`` and
  ``post_feedforward_layernorm`` at ``w = 3`` (each sub-layer adds RMS 4)
  against an embedding of RMS 1 (std ``1/sqrt(128)``, times ``sqrt(128)``).
  At ``w = 2`` runs of 4-7 equal tokens remained.
* Tied logits are ``final_norm(h) . embedding``: their spread is the final
  norm's scale, so ``model.norm`` at ``w = 7`` (logit std ~7.5; the final
  soft-capping at 30 compresses only the largest logits).
* ``query_pre_attn_scalar`` 32 (= head size; the default 256 would flatten the
  scores 2.8x) with ``q``/``k`` gain 2: score spread ~4, below
  ``attn_logit_softcapping`` 50, which stays (and so stays exercised).
* Long prompts must be longer than the window (the tests use 336 tokens) for
  the full-attention group to be the only one that sees the start.

DeepSeek-V2 (``kind="deepseek_v2"``)
------------------------------------
2 layers, 4 heads, MLA with ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64
(the CPU MLA kernels support only a latent of 576; rank 64 + rope 32 is
refused), ``qk_nope_head_dim`` = ``v_head_dim`` = 32, 2 routed experts but
``first_k_dense_replace`` 2, so both layers are dense MLPs; float32. One
``MLAAttentionSpec`` group (one 576-wide latent per token and layer, no
heads), block 16, no prefix caching (vLLM turns it off for CPU MLA).

* The Llama gains work as they are (``q_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj`` gain 2: score spread ~4 over the 96-wide q/k heads).
* RoPE is given as YaRN with factor 1, which is plain RoPE (same frequencies,
  mscale 1) but makes vLLM use ``DeepseekScalingRotaryEmbedding``. With the
  ``default`` type vLLM uses ``RotaryEmbedding``, whose CPU kernel
  (``ops.rotary_embedding``) mis-rotates the 3-D ``[tokens, heads, 64]`` view
  MLA hands it (it rotates the first rows of 64 as if each were a token):
  prompt log-probs then differed from transformers' from position 1 on. Now
  vLLM, transformers and a hand-written reference agree.
* :func:`vllm_args` selects ``attention_backend="CPU_MLA"``: on an x86 CPU
  with AMX vLLM would pick ``AMX_MLA``, which refuses float32 weights, and in
  bfloat16 uses block 128 with prefix caching on: another layout on another
  machine.

Qwen3-Next (``kind="qwen3_next"``)
----------------------------------
4 layers alternating gated-delta-net linear attention (4 value / 2 key heads
of 128) and full attention (4 heads, 2 KV heads, head size 32, output gate,
partial RoPE), MoE of 2 experts (top-1) + a shared expert; bfloat16 (vLLM's
CPU GDN kernels need it). Two groups: ``MambaSpec`` (layers 0, 2: a conv
state ``[3, 1024]`` bf16 and an SSM state ``[4, 128, 128]`` per request, in one
padded page) and ``FullAttentionSpec`` (layers 1, 3), both with one block size
(vLLM sizes the attention block so that its page equals the Mamba page): 1152
where vLLM keeps the SSM state in float32 (a CPU with AVX-512 BF16, its
accelerated GDN), 640 where it stays bfloat16. The groups overlay the same
memory like Gemma2's.

* Its ``(1 + w)`` RMSNorms stay at ``w = 0``, except ``q_norm``/``k_norm``
  at ``w = 1``: q and k are RMS-normalized per head, so the projection gains
  do not set the score spread; a scale of 2 on each gives ~4.
* ``A_log`` is fixed per value head to ``log([0.001, 0.01, 0.1, 1])``: per
  token the state decays by ``exp(-A * softplus(a + 1))``, from ~0.999 to
  ~0.3, so some heads remember a long prompt and some only the last tokens
  (transformers draws A uniform in [0.01, 16]: mostly heads that forget at
  once). ``dt_bias`` 1, the gated output norm (scale ``w``) 1.
* bfloat16 rounding depends on the batch's shape: in a batch a prompt may
  flip a near-tie, a dozen or so tokens in, that it does not flip alone
  (measured: token 16 of the 336-token prompt). Greedy outputs are deterministic for the
  same batch; compare a decode engine with a reference run of the same shape.

Caching
-------
The model is built once into ``<cache_dir>/tiny-<kind>-<hash>`` (``tiny-llama``,
``tiny-gemma2``, ``tiny-deepseek-v2``, ``tiny-qwen3-next``) where the hash
covers the recipe (corpus, config, gains, seed, format version, and the kind
for the new kinds: the Llama hash is what it was before there were kinds); a
recipe change builds a new directory. The default cache dir is
``$KVSM_CACHE_DIR`` or ``~/.cache/kvsm``. Building goes into a temporary
sibling directory which is then renamed into place; ``rename`` of a directory
onto an existing non-empty one fails, so when two processes race, one wins and
the other discards its copy and uses the winner's. Building takes 4-7 s here
(mostly importing torch/transformers; ~0.2 s per further kind in the same
process); a cached call takes ~0.1 ms and imports neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvsm_testing.tiny_families import DIR_PREFIX as FAMILY_DIR_PREFIX
from kvsm_testing.tiny_families import VLLM_ARGS as FAMILY_VLLM_ARGS
from kvsm_testing.tiny_families import family_recipes
from kvsm_testing.tiny_hybrid import ATTENTION_GAINS, MLP_GAINS, SMALL_ATTENTION, hybrid_recipes
from kvsm_testing.tiny_hybrid import DIR_PREFIX as HYBRID_DIR_PREFIX
from kvsm_testing.tiny_hybrid import VLLM_ARGS as HYBRID_VLLM_ARGS

__all__ = [
    "KINDS",
    "RECIPE",
    "RECIPES",
    "build_tiny_model",
    "default_cache_dir",
    "model_dir_for",
    "model_dtype",
    "vllm_args",
]

# Bump when the way the recipe is turned into files changes (not its values:
# those are hashed anyway).
_FORMAT_VERSION = 1

_CORPUS = """\
The prefill engine computes the key and value cache for every prompt token, then the decode engine pulls those blocks and keeps generating.
A request moves from new to awaiting blocks, then to pending handshake, remote known, transferring and finally done.
When the remote peer is dead or the read times out, the request fails and its blocks are reported invalid so the scheduler can recompute them.
An abort may arrive at any moment; blocks that a posted read may still write must never be freed before the reads are quiesced.
On the sending side the blocks stay pinned while a lease is armed; a heartbeat extends the lease, and an expired lease frees the blocks.
Every input that changes state is an event with a sequence number, a monotonic clock, a wall clock and the transition it caused.
The replay tool merges the logs of several processes, folds the events into machines and reports the first divergence it finds.
One loop thread per process owns every socket and every transfer, runs every timer and turns every outcome into an event.
Quick brown foxes jump over lazy dogs while seven wizards quietly judge the boxing match in the old town square.
She sells sea shells by the sea shore, and the shells she sells are surely seashells from the northern islands.
Mountains rise above the valley, rivers wind through forests of pine and birch, and the morning fog lifts slowly over the lake.
The library opens at nine in the morning and closes at six in the evening, except on public holidays and during winter storms.
Numbers: zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty hundred thousand million.
Colours: red orange yellow green blue indigo violet black white grey silver golden purple brown crimson scarlet turquoise.
Animals: cat dog horse cow sheep goat rabbit mouse eagle falcon sparrow salmon trout whale dolphin octopus spider beetle.
Food: bread butter cheese apples pears plums cherries grapes lemons oranges rice beans soup salad pasta pizza chocolate coffee tea.
Weather: sunny cloudy rainy windy snowy stormy foggy humid freezing warm cold mild thunder lightning drizzle hail breeze.
Verbs: run walk talk think write read speak listen build break fix send receive allocate release transfer compute schedule.
def main(argv): return run(parse_args(argv)) if argv else print("usage: tool [options] file ...")
for i in range(10): total += values[i] * weights[i] - offsets[i] // 2
{"request_id": "abc-123", "kv_transfer_params": {"do_remote_decode": true, "remote_block_ids": [1, 2, 3]}}
Kernel, tensor, matrix, vector, scalar, gradient, optimizer, attention, embedding, tokenizer, sampler, logits, softmax.
Once upon a time a curious engineer opened a terminal, typed a long command and waited patiently for the answer to appear.
Yesterday the committee approved the budget; tomorrow they will discuss the schedule, the staffing plan and the new building.
Please remember to water the plants, feed the cat, lock the back door and switch off the lights before you leave the house.
"""

_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

RECIPE: dict[str, Any] = {
    "format_version": _FORMAT_VERSION,
    "corpus_sha256": hashlib.sha256(_CORPUS.encode()).hexdigest(),
    "special_tokens": _SPECIAL_TOKENS,
    "chat_template": _CHAT_TEMPLATE,
    "bpe_vocab_size": 1280,
    "config": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # std = gain / sqrt(fan_in) for linear layers; embeddings: std = embed_std.
    "init": {
        "embed_std": 1.0,
        "q_proj": 2.0,
        "k_proj": 2.0,
        "v_proj": 1.0,
        "o_proj": 1.0,
        "gate_proj": 1.0,
        "up_proj": 1.0,
        "down_proj": 1.0,
        "lm_head": 4.0,
    },
}
"""The Llama recipe (``kind="llama"``; kept under this name for old callers)."""

# The tokenizer part of every recipe (the same tokenizer for every kind).
_TOKENIZER_RECIPE = {
    k: RECIPE[k] for k in ("format_version", "corpus_sha256", "special_tokens", "chat_template", "bpe_vocab_size")
}

RECIPES: dict[str, dict[str, Any]] = {
    "llama": RECIPE,
    **hybrid_recipes(_TOKENIZER_RECIPE),  # kvsm_testing.tiny_hybrid
}

# More architecture families (kvsm_testing.tiny_families), on the same rules.
RECIPES.update(family_recipes(_TOKENIZER_RECIPE, SMALL_ATTENTION, ATTENTION_GAINS, MLP_GAINS))

KINDS: tuple[str, ...] = tuple(RECIPES)
"""The model kinds :func:`build_tiny_model` can build."""

# The directory name's prefix per kind.
_DIR_PREFIX = {
    "llama": "tiny-llama",
    **HYBRID_DIR_PREFIX,
    **FAMILY_DIR_PREFIX,
}


def default_cache_dir() -> Path:
    """``$KVSM_CACHE_DIR`` or ``~/.cache/kvsm``."""
    env = os.environ.get("KVSM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvsm"


def _recipe(kind: str) -> dict[str, Any]:
    try:
        return RECIPES[kind]
    except KeyError:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {', '.join(KINDS)}") from None


def _recipe_blob(kind: str, seed: int) -> dict[str, Any]:
    # Llama's blob (and so its hash and directory) is what it was before there
    # were other kinds.
    if kind == "llama":
        return {"recipe": RECIPE, "seed": seed}
    return {"kind": kind, "recipe": _recipe(kind), "seed": seed}


def _recipe_hash(seed: int, kind: str = "llama") -> str:
    blob = json.dumps(_recipe_blob(kind, seed), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_dir_for(cache_dir: Path | None = None, *, seed: int = 0, kind: str = "llama") -> Path:
    """Where :func:`build_tiny_model` puts (or has put) the model."""
    _recipe(kind)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return base / f"{_DIR_PREFIX[kind]}-{_recipe_hash(seed, kind)}"


def model_dtype(kind: str = "llama") -> str:
    """The dtype the model is saved in and is to be run in (``"float32"``, or
    ``"bfloat16"`` for ``qwen3_next``: vLLM's CPU GDN kernels need BF16)."""
    return str(_recipe(kind).get("dtype", "float32"))


# What vLLM needs beyond the model directory (not part of the recipe hash).
_VLLM_ARGS: dict[str, dict[str, Any]] = {
    "llama": {"dtype": "float32"},
    **HYBRID_VLLM_ARGS,
    **FAMILY_VLLM_ARGS,
}


def vllm_args(kind: str = "llama") -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (or :func:`kvsm_testing.engine.make_llm`)
    that the model of ``kind`` needs on vLLM's CPU backend (a fresh dict)."""
    _recipe(kind)
    return dict(_VLLM_ARGS[kind])


_COMPLETE_MARKER = "kvsm-tiny-model.json"


def build_tiny_model(cache_dir: Path | None = None, *, seed: int = 0, kind: str = "llama") -> Path:
    """Build (once) the tiny model of ``kind`` (one of :data:`KINDS`) and
    return its directory.

    Safe to call from several processes at once; a cached complete build is
    returned without importing torch or transformers.
    """
    final = model_dir_for(cache_dir, seed=seed, kind=kind)
    if (final / _COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        if kind == "llama":
            _build_into(tmp, seed)
        else:
            _build_kind_into(tmp, seed, kind)
        (tmp / _COMPLETE_MARKER).write_text(
            json.dumps(_recipe_blob(kind, seed), indent=1, sort_keys=True)
        )
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost a race (the winner's directory exists and is non-empty), or
            # a stale incomplete directory is in the way.
            if (final / _COMPLETE_MARKER).is_file():
                return final
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _train_tokenizer(out_dir: Path):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["bpe_vocab_size"],
        min_frequency=1,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=RECIPE["config"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = _CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _init_weights(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    gains = RECIPE["init"]
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            if "norm" in name:
                param.fill_(1.0)
            elif leaf == "embed_tokens":
                param.copy_(torch.randn(param.shape, generator=gen) * gains["embed_std"])
            elif leaf in gains and param.dim() == 2:
                std = gains[leaf] / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            elif name.endswith(".bias"):
                param.zero_()
            else:  # pragma: no cover - a new parameter kind: fail loudly
                raise RuntimeError(f"tiny model recipe does not know {name}")


def _build_into(out_dir: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_tok = _train_tokenizer(out_dir)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **RECIPE["config"],
    )
    cfg.dtype = "float32"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    _init_weights(model, seed)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_generation_config(out_dir, hf_tok)


def _save_generation_config(out_dir: Path, hf_tok) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        do_sample=False,
    ).save_pretrained(out_dir)


def _init_rule(rules: dict[str, Any], name: str) -> Any:
    parts = name.split(".")
    leaf_at = len(parts) - 2 if parts[-1] == "weight" else len(parts) - 1
    leaf, parent = parts[leaf_at], parts[leaf_at - 1] if leaf_at else ""
    for key in (f"{parent}.{leaf}", leaf):
        if key in rules:
            return rules[key]
    raise RuntimeError(f"tiny model recipe does not know {name}")


def _init_kind_weights(model, seed: int, rules: dict[str, Any]) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            rule = _init_rule(rules, name)
            if isinstance(rule, (int, float)):
                std = rule / param.shape[-1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            elif "std" in rule:
                param.copy_(torch.randn(param.shape, generator=gen) * rule["std"])
            elif "fill" in rule:
                param.fill_(rule["fill"])
            else:
                param.copy_(torch.tensor(rule["values"], dtype=torch.float64).reshape(param.shape))


def _build_kind_into(out_dir: Path, seed: int, kind: str) -> None:
    import torch
    import transformers

    recipe = _recipe(kind)
    arch = recipe["architecture"]
    config_cls = getattr(transformers, recipe.get("config_class", arch.replace("ForCausalLM", "Config")))
    model_cls = getattr(transformers, arch)
    hf_tok = _train_tokenizer(out_dir)
    cfg = config_cls(
        vocab_size=len(hf_tok),
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        **recipe["config"],
    )
    dtype = getattr(torch, recipe["dtype"])
    cfg.dtype = recipe["dtype"]
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    _init_kind_weights(model, seed, recipe["init"])
    model = model.to(dtype).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_generation_config(out_dir, hf_tok)


if __name__ == "__main__":  # pragma: no cover
    import sys

    # python -m kvsm_testing.tiny_model [CACHE_DIR [KIND]]
    print(
        build_tiny_model(
            Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else None,
            kind=sys.argv[2] if len(sys.argv) > 2 else "llama",
        )
    )
