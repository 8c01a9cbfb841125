"""A tiny random-weight Llama model, built locally, for tests that run vLLM.

There is no network here (and none in CI) except package registries, so the
tests never download a model: :func:`build_tiny_model` makes one on the spot.

Recipe
------
* ``LlamaConfig``: hidden 128, 2 layers, 4 attention heads, 2 KV heads (head
  size 32: the CPU attention backend accepts only head sizes from a fixed list,
  32..512), MLP 256, ``max_position_embeddings`` 4096, float32.
* A byte-level BPE tokenizer trained with ``tokenizers`` on the fixed corpus
  below (vocabulary ~1.2k: a small vocabulary keeps the CPU engine fast), with
  ``<s>`` prepended to every encoding, ``</s>`` as EOS, ``<pad>``, ``<unk>``
  and role tokens ``<|system|>``/``<|user|>``/``<|assistant|>`` for a small
  chat template (so chat-completion tests can use it too). Byte-level means any
  text tokenizes, and decoding never fails.
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

``tests/test_tiny_model.py`` checks the consequences through vLLM: different
prompts give different greedy continuations, continuations are not one repeated
token, and changing one token at the start of a long prompt (i.e. one position
of the KV cache) changes the continuation.

Caching
-------
The model is built once into ``<cache_dir>/tiny-llama-<hash>`` where the hash
covers the recipe (corpus, config, gains, seed, format version); a recipe
change builds a new directory. The default cache dir is ``$KVSM_CACHE_DIR`` or
``~/.cache/kvsm``. Building goes into a temporary sibling directory which is
then renamed into place; ``rename`` of a directory onto an existing non-empty
one fails, so when two processes race, one wins and the other discards its
copy and uses the winner's. Building takes 4-7 s here (mostly importing
torch/transformers); a cached call takes ~0.1 ms and imports neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "RECIPE",
    "build_tiny_model",
    "default_cache_dir",
    "model_dir_for",
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


def default_cache_dir() -> Path:
    """``$KVSM_CACHE_DIR`` or ``~/.cache/kvsm``."""
    env = os.environ.get("KVSM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvsm"


def _recipe_hash(seed: int) -> str:
    blob = json.dumps({"recipe": RECIPE, "seed": seed}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_dir_for(cache_dir: Path | None = None, *, seed: int = 0) -> Path:
    """Where :func:`build_tiny_model` puts (or has put) the model."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return base / f"tiny-llama-{_recipe_hash(seed)}"


_COMPLETE_MARKER = "kvsm-tiny-model.json"


def build_tiny_model(cache_dir: Path | None = None, *, seed: int = 0) -> Path:
    """Build (once) the tiny model and return its directory.

    Safe to call from several processes at once; a cached complete build is
    returned without importing torch or transformers.
    """
    final = model_dir_for(cache_dir, seed=seed)
    if (final / _COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _build_into(tmp, seed)
        (tmp / _COMPLETE_MARKER).write_text(
            json.dumps({"recipe": RECIPE, "seed": seed}, indent=1, sort_keys=True)
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
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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
    GenerationConfig(
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        do_sample=False,
    ).save_pretrained(out_dir)


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(build_tiny_model(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
