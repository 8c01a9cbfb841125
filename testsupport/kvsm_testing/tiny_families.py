"""Recipes of tiny models of more architecture families, for the offline pairs.

Each is what an operator serves often enough that a KV connector must carry
it, reduced to the tiny-model rules of :mod:`kvsm_testing.tiny_model` (its
tokenizer, fan-in-scaled weights with sharp attention and peaked logits):

* ``qwen2``: Llama's layout with biases on q/k/v (Qwen2, Qwen2.5).
* ``mistral``: every layer sliding-window (128 tokens): one KV cache group
  of ``SlidingWindowSpec``, whose blocks before the window are null.
* ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``, head size 96 (another
  row length for the attention kernel's token layout).
* ``gpt2``: learned absolute positions, multi-head attention (as many KV
  heads as query heads), ``Conv1D`` weights, tied embeddings.
* ``opt``: learned positions with OPT's offset of 2, biases everywhere,
  ReLU MLP, tied embeddings. Token embeddings small (std 0.25) beside a
  strong attention output: with tied embeddings and embeddings of std 0.5,
  the residual stream was mostly the input token's own embedding and the
  model mostly repeated the prompt's last token whatever its KV cache held
  (a corrupted transfer went unnoticed in CI).

``Conv1D`` weights (GPT-2) are ``[in, out]``: the fan-in rule of the other
kinds (``gain / sqrt(shape[-1])``) would scale them by their fan-out, so
their stds are written out.
"""

from __future__ import annotations

from typing import Any

FAMILIES: tuple[str, ...] = ("qwen2", "mistral", "phi3", "gpt2", "opt")

DIR_PREFIX = {kind: f"tiny-{kind}" for kind in FAMILIES}
VLLM_ARGS: dict[str, dict[str, Any]] = {kind: {"dtype": "float32"} for kind in FAMILIES}

_NORMS = {"input_layernorm": {"fill": 1.0}, "post_attention_layernorm": {"fill": 1.0}, "norm": {"fill": 1.0}}


def family_recipes(tokenizer: dict[str, Any], attention: dict[str, Any], attention_gains: dict[str, float],
                   mlp_gains: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The families' recipes, built on the tiny-model module's shared parts."""
    hidden = int(attention["hidden_size"])
    llama_like = {"embed_tokens": {"std": 1.0}, **attention_gains, **mlp_gains, "lm_head": 4.0, **_NORMS}
    return {
        "qwen2": {
            **tokenizer, "architecture": "Qwen2ForCausalLM", "dtype": "float32",
            "config": {**{k: v for k, v in attention.items() if k != "head_dim"}, "num_hidden_layers": 2,
                       "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False},
            "init": {**llama_like, "bias": {"std": 0.1}},
        },
        "mistral": {
            **tokenizer, "architecture": "MistralForCausalLM", "dtype": "float32",
            "config": {**attention, "num_hidden_layers": 2, "sliding_window": 128, "rms_norm_eps": 1e-5,
                       "rope_theta": 10000.0, "tie_word_embeddings": False},
            "init": llama_like,
        },
        "phi3": {
            **tokenizer, "architecture": "Phi3ForCausalLM", "dtype": "float32",
            "config": {"hidden_size": 384, "intermediate_size": 256, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 4096,
                       "original_max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                       "tie_word_embeddings": False},
            "init": {"embed_tokens": {"std": 1.0}, "qkv_proj": 2.0, "o_proj": 1.0, "gate_up_proj": 1.0,
                     "down_proj": 1.0, "lm_head": 4.0, **_NORMS},
        },
        "gpt2": {
            **tokenizer, "architecture": "GPT2LMHeadModel", "config_class": "GPT2Config", "dtype": "float32",
            "config": {"n_embd": hidden, "n_layer": 2, "n_head": 4, "n_inner": 2 * hidden, "n_positions": 4096,
                       "activation_function": "gelu_new", "tie_word_embeddings": True},
            "init": {"wte": {"std": 0.5}, "wpe": {"std": 0.5}, "attn.c_attn": {"std": 2.0 / hidden ** 0.5},
                     "attn.c_proj": {"std": 1.0 / hidden ** 0.5}, "mlp.c_fc": {"std": 1.0 / hidden ** 0.5},
                     "mlp.c_proj": {"std": 1.0 / (2 * hidden) ** 0.5}, "ln_1": {"fill": 1.0}, "ln_2": {"fill": 1.0},
                     "ln_f": {"fill": 1.0}, "bias": {"fill": 0.0}},
        },
        "opt": {
            **tokenizer, "architecture": "OPTForCausalLM", "dtype": "float32",
            "config": {"hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 2 * hidden,
                       "max_position_embeddings": 4096, "word_embed_proj_dim": hidden, "do_layer_norm_before": True,
                       "activation_function": "relu", "tie_word_embeddings": True},
            "init": {"embed_tokens": {"std": 0.25}, "embed_positions": {"std": 0.5}, "q_proj": 2.0, "k_proj": 2.0,
                     "v_proj": 1.0, "out_proj": 2.0, "fc1": 1.0, "fc2": 1.0, "self_attn_layer_norm": {"fill": 1.0},
                     "final_layer_norm": {"fill": 1.0}, "bias": {"fill": 0.0}},
        },
    }
