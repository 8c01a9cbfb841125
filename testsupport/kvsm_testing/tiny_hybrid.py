"""Recipes of the tiny hybrid, MLA and bfloat16 models (Gemma 2 and 3, DeepSeek-V2,
Qwen3-Next, Qwen3, Llama 4), on the rules of :mod:`kvsm_testing.tiny_model`,
which builds them (and holds the Llama recipe and the tokenizer's).

Each kind is what vLLM's hybrid KV cache manager or MLA serves: sliding-window
and full attention (``gemma2``, ``gemma3``), chunked local attention
(``llama4``), a gated-delta-net state beside attention (``qwen3_next``), a
latent cache (``deepseek_v2``), and a dense bfloat16 model (``qwen3``).
"""

from __future__ import annotations

import math
from typing import Any

# How a recipe's "init" reads (kvsm_testing.tiny_model applies it): it maps a parameter to its rule, looked up by
# "<parent>.<leaf>" first, then "<leaf>" (leaf: the module name for a
# ``.weight``, else the parameter's own name; parent: the module above it):
#   a number g: normal, std = g / sqrt(fan_in), fan_in = the last dimension
#               (in-features; for a depthwise conv, the kernel width);
#   {"std": s}: normal, std = s;     {"fill": v}: every element = v;
#   {"values": [...]}: exactly these values.
# What the small attention models below share: their sizes, and the gains of
# their projections (sharp attention, as the Llama recipe explains).
SMALL_ATTENTION = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 32, "max_position_embeddings": 4096}
ATTENTION_GAINS = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 1.0, "o_proj": 1.0}
MLP_GAINS = {"gate_proj": 1.0, "up_proj": 1.0, "down_proj": 1.0}
# Gemma's RMSNorm scales by (1 + w): "fill" is w, not the scale.
GEMMA_INIT = {"embed_tokens": {"std": 128**-0.5}, **ATTENTION_GAINS, **MLP_GAINS,
              "input_layernorm": {"fill": 0.0}, "pre_feedforward_layernorm": {"fill": 0.0},
              "post_attention_layernorm": {"fill": 3.0}, "post_feedforward_layernorm": {"fill": 3.0},
              "model.norm": {"fill": 7.0}}


def hybrid_recipes(tokenizer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The recipes by kind, each with ``tokenizer``'s fields (the tokenizer part
    of every recipe)."""
    return {
        "gemma2": {
            **tokenizer,
            "architecture": "Gemma2ForCausalLM",
            "dtype": "float32",
            "config": {
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "sliding_window": 128,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "hidden_activation": "gelu_pytorch_tanh",
                "query_pre_attn_scalar": 32,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "tie_word_embeddings": True,
            },
            "init": GEMMA_INIT,
        },
        "deepseek_v2": {
            **tokenizer,
            "architecture": "DeepseekV2ForCausalLM",
            "dtype": "float32",
            "config": {
                "hidden_size": 128,
                "intermediate_size": 256,
                "moe_intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "q_lora_rank": None,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
                "n_routed_experts": 2,
                "n_shared_experts": 1,
                "num_experts_per_tok": 1,
                "first_k_dense_replace": 2,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                # YaRN with factor 1 is plain RoPE (same frequencies, mscale 1),
                # but makes vLLM use DeepseekScalingRotaryEmbedding: the default
                # RotaryEmbedding's CPU kernel mis-rotates MLA's 3-D q (see above).
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 1.0,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                },
                "tie_word_embeddings": False,
            },
            "init": {
                "embed_tokens": {"std": 1.0},
                "q_proj": 2.0,
                "kv_a_proj_with_mqa": 2.0,
                "kv_b_proj": 2.0,
                "o_proj": 1.0,
                "gate_proj": 1.0,
                "up_proj": 1.0,
                "down_proj": 1.0,
                "lm_head": 4.0,
                "kv_a_layernorm": {"fill": 1.0},
                "input_layernorm": {"fill": 1.0},
                "post_attention_layernorm": {"fill": 1.0},
                "norm": {"fill": 1.0},
            },
        },
        "qwen3_next": {
            **tokenizer,
            "architecture": "Qwen3NextForCausalLM",
            "dtype": "bfloat16",
            "config": {
                "hidden_size": 128,
                "intermediate_size": 256,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_conv_kernel_dim": 4,
                "num_experts": 2,
                "num_experts_per_tok": 1,
                "full_attention_interval": 2,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
            },
            # Qwen3Next's RMSNorm scales by (1 + w) ("fill" is w), except the gated
            # norm of the linear-attention output (linear_attn.norm), which scales
            # by w.
            "init": {
                "embed_tokens": {"std": 1.0},
                "q_proj": 1.0,
                "k_proj": 1.0,
                "v_proj": 1.0,
                "o_proj": 1.0,
                "q_norm": {"fill": 1.0},
                "k_norm": {"fill": 1.0},
                "in_proj_qkvz": 1.0,
                "in_proj_ba": 1.0,
                "conv1d": 1.0,
                "out_proj": 1.0,
                "linear_attn.norm": {"fill": 1.0},
                "A_log": {"values": [math.log(a) for a in (0.001, 0.01, 0.1, 1.0)]},
                "dt_bias": {"fill": 1.0},
                "mlp.gate": 1.0,
                "experts.gate_up_proj": 1.0,
                "experts.down_proj": 1.0,
                "gate_proj": 1.0,
                "up_proj": 1.0,
                "down_proj": 1.0,
                "shared_expert_gate": 1.0,
                "lm_head": 4.0,
                "input_layernorm": {"fill": 0.0},
                "post_attention_layernorm": {"fill": 0.0},
                "norm": {"fill": 0.0},
            },
        },
        # A dense model as most operators serve it: bfloat16, Qwen3's q/k norms.
        "qwen3": {
            **tokenizer,
            "architecture": "Qwen3ForCausalLM",
            "dtype": "bfloat16",
            "config": {
                **SMALL_ATTENTION,
                "num_hidden_layers": 2,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
            },
            "init": {
                "embed_tokens": {"std": 1.0},
                **ATTENTION_GAINS,
                "q_norm": {"fill": 3.0},
                "k_norm": {"fill": 3.0},
                **MLP_GAINS,
                "lm_head": 4.0,
                "input_layernorm": {"fill": 1.0},
                "post_attention_layernorm": {"fill": 1.0},
                "norm": {"fill": 1.0},
            },
        },
        # Gemma 3 (text): three sliding-window layers to one global one, each kind
        # with its own rotary base; vLLM makes four KV cache groups of one layer.
        "gemma3": {
            **tokenizer,
            "architecture": "Gemma3ForCausalLM",
            "config_class": "Gemma3TextConfig",
            "dtype": "float32",
            "config": {
                **SMALL_ATTENTION,
                "num_hidden_layers": 4,
                "sliding_window": 128,
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 32,
                "hidden_activation": "gelu_pytorch_tanh",
                "tie_word_embeddings": True,
            },
            "init": {**GEMMA_INIT, "q_norm": {"fill": 2.0}, "k_norm": {"fill": 2.0}},
        },
        # Llama 4 (text): three chunked local attention layers (chunks of 128 tokens)
        # to one global one without rotary embedding, mixture-of-experts MLPs.
        "llama4": {
            **tokenizer,
            "architecture": "Llama4ForCausalLM",
            "config_class": "Llama4TextConfig",
            "dtype": "float32",
            "config": {
                **SMALL_ATTENTION,
                "intermediate_size_mlp": 256,
                "num_hidden_layers": 4,
                "attention_chunk_size": 128,
                "layer_types": ["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"],
                "no_rope_layers": [1, 1, 1, 0],
                "num_local_experts": 2,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
                "use_qk_norm": False,
                "attn_temperature_tuning": False,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
            },
            "init": {
                "embed_tokens": {"std": 1.0},
                **ATTENTION_GAINS,
                **MLP_GAINS,
                "router": 1.0,
                "gate_up_proj": 1.0,
                "lm_head": 4.0,
                "input_layernorm": {"fill": 1.0},
                "post_attention_layernorm": {"fill": 1.0},
                "norm": {"fill": 1.0},
            },
        },
    }


# The model directory's name prefix per kind.
DIR_PREFIX = {
    "gemma2": "tiny-gemma2",
    "deepseek_v2": "tiny-deepseek-v2",
    "qwen3_next": "tiny-qwen3-next",
    "qwen3": "tiny-qwen3",
    "gemma3": "tiny-gemma3",
    "llama4": "tiny-llama4",
}

# What vLLM needs beyond the model directory (not part of the recipe hash).
VLLM_ARGS: dict[str, dict[str, Any]] = {
    "gemma2": {"dtype": "float32"},
    # The reference CPU MLA backend, float32, block 16. Without it an x86 CPU
    # with AMX picks AMX_MLA, which needs bfloat16 weights, keeps prefix
    # caching on, and so behaves differently from a CPU without AMX.
    "deepseek_v2": {"dtype": "float32", "block_size": None, "attention_backend": "CPU_MLA"},
    # block_size None: vLLM sizes the attention block (1152, or 640 on a CPU without
    # AVX-512 BF16) so that an attention page is as large as a Mamba state page.
    "qwen3_next": {"dtype": "bfloat16", "block_size": None},
    "qwen3": {"dtype": "bfloat16"},
    "gemma3": {"dtype": "float32"},
    "llama4": {"dtype": "float32"},
}
