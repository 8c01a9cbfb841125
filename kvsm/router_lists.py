"""A completions request with a list of prompts: which requests name several, and
the answers to one prompt each merged as vLLM answers the list.

``kvsm.router`` sends a non-streamed list as one prefill/decode pair per prompt
(vLLM's prefill response carries the first prompt's ``kv_transfer_params``
only) and answers with the merge. Stdlib only: part of ``kvsm.router``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["merge_completions", "prompt_list"]


def prompt_list(path: str, body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completions request that names several (texts, or lists of
    token ids); None for one prompt (a list of ints is one tokenized prompt)."""
    prompt = body.get("prompt")
    if not path.endswith("/v1/completions") or not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def merge_completions(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several one-prompt completions as vLLM answers a list of prompts: the choices
    in prompt order (prompt i's sample j at index i * n + j), the usage summed."""
    merged = {k: v for k, v in answers[0].items() if k != "kv_transfer_params"}
    choices: list[dict[str, Any]] = []
    for i, answer in enumerate(answers):
        own = sorted(answer["choices"], key=lambda c: c.get("index", 0))
        choices += [{**c, "index": i * len(own) + j} for j, c in enumerate(own)]
    merged["choices"] = choices
    usages: list[dict[str, Any]] = [u for u in (a.get("usage") for a in answers) if isinstance(u, dict)]
    if len(usages) == len(answers):
        summed: dict[str, Any] = dict.fromkeys(usages[0])  # details that do not add up: none
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            summed[key] = sum(int(u.get(key) or 0) for u in usages)
        merged["usage"] = summed
    return merged
