"""Test infrastructure: a tiny locally built model and helpers to run vLLM
offline on the CPU with it. Importing this package imports neither torch nor
vLLM; the functions import them when called."""

from kvsm_testing.engine import (
    engine_env,
    generate_greedy,
    greedy,
    greedy_params,
    kv_cache_tensors,
    make_llm,
    run_engine_subprocess,
    run_reference_subprocess,
    run_single_engine_reference,
    wait_engine_subprocess,
)
from kvsm_testing.tiny_model import build_tiny_model, default_cache_dir, model_dir_for

__all__ = [
    "build_tiny_model",
    "default_cache_dir",
    "engine_env",
    "generate_greedy",
    "greedy",
    "greedy_params",
    "kv_cache_tensors",
    "make_llm",
    "model_dir_for",
    "run_engine_subprocess",
    "run_reference_subprocess",
    "run_single_engine_reference",
    "wait_engine_subprocess",
]
