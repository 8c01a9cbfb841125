"""The router's selective disaggregation: which requests skip the prefill engine.

A request whose prompt is mostly in a decode engine's prefix cache already, or
is short, costs the decode engine little to compute itself, while the
prefill/decode path adds a prefill request, a handshake claim and a transfer
before the first token. ``kvsm.router --disagg-threshold N`` sends a request to
its decode backend alone when fewer than ``N`` of its prompt tokens are
*uncached* there (llm-d's prefix-based P/D decider is the model).

What is cached is the router's own estimate, as llm-d's prefix-cache scorer
makes it: every prompt the router sent to a decode backend (by P/D or alone)
is remembered there as a chain of block hashes (each hash covers a block of
``block_size`` token ids and every block before it, and the model's name), in
a bounded set per backend whose least recently used hashes go first. A
prompt's cached prefix is its longest run of leading blocks found in the set.
The engine may have evicted blocks the router still remembers (the estimate
is then low, and the request computes more on the decode engine than
expected), and a block size other than the engines' ``--block-size`` makes the
estimate coarser; neither makes an answer wrong.

Stdlib only: ``kvsm.router`` stands alone, and this is part of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_TOKENIZE_KEYS", "Decider", "Decision", "PrefixIndex", "block_hashes", "tokenize_body"]

# The chat request keys that change what vLLM's /tokenize renders (TokenizeChatRequest's fields).
CHAT_TOKENIZE_KEYS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                      "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")


def block_hashes(model: str, tokens: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of ``tokens``' full blocks: the i-th covers blocks 0..i (and the model)."""
    out: list[int] = []
    h = hash(("kvsm.router", model))
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[start:start + block_size])))
        out.append(h)
    return out


class PrefixIndex:
    """Per backend, the block hashes of the prompts sent there: at most
    ``capacity`` per backend, the least recently used dropped first."""

    def __init__(self, block_size: int = 16, capacity: int = 100_000) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("the prefix index needs a block size and a capacity of at least 1")
        self.block_size, self.capacity = block_size, capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def matched_blocks(self, backend: str, hashes: Sequence[int], touch: bool = True) -> int:
        """How many leading blocks of a prompt (its ``block_hashes``) the backend has seen;
        ``touch`` marks them used (a lookup that only compares backends leaves them be)."""
        seen = self._blocks.get(backend)
        n = 0
        if seen:
            for h in hashes:
                if h not in seen:
                    break
                if touch:
                    seen.move_to_end(h)
                n += 1
        return n

    def cached_tokens(self, backend: str, model: str, tokens: Sequence[int],
                      hashes: Sequence[int] | None = None) -> int:
        """How many leading tokens of ``tokens`` the backend has seen (whole blocks only);
        ``hashes``: their ``block_hashes`` when already made."""
        if hashes is None:
            hashes = block_hashes(model, tokens, self.block_size)
        return self.matched_blocks(backend, hashes) * self.block_size

    def record(self, backend: str, model: str, tokens: Sequence[int]) -> None:
        """Remember that ``tokens`` went to ``backend`` (its engine now caches their blocks)."""
        self.add(backend, block_hashes(model, tokens, self.block_size))

    def add(self, backend: str, hashes: Sequence[int]) -> None:
        """``record`` for a prompt's ``block_hashes`` already made."""
        seen = self._blocks.setdefault(backend, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def size(self, backend: str) -> int:
        return len(self._blocks.get(backend, ()))


@dataclass
class Decision:
    """Where one prompt goes, and why (the router's log line and counters say both)."""

    path: str  # "pd": prefill, then decode with the transfer; "local": the decode engine alone
    reason: str  # off | above_threshold | below_threshold | tokenize_failed | streamed_list
    threshold: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    note: str | None = None  # why the prompt was not counted (a failed /tokenize)

    @property
    def local(self) -> bool:
        return self.path == "local"

    @property
    def uncached(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    def fields(self) -> str:
        uncached = "-" if self.uncached is None else str(self.uncached)
        text = f"disagg={self.path} disagg_reason={self.reason} uncached={uncached} threshold={self.threshold}"
        return f"{text} disagg_note={self.note!r}" if self.note else text


class Decider:
    """The threshold, the prefix index and the counts of each path taken."""

    REASONS = ("off", "above_threshold", "below_threshold", "tokenize_failed", "streamed_list")

    def __init__(self, threshold: int = 0, block_size: int = 16, capacity: int = 100_000) -> None:
        if threshold < 0:
            raise ValueError("the disaggregation threshold is a number of tokens, 0 or more")
        self.threshold = threshold
        self.index = PrefixIndex(block_size, capacity)
        self.counts: dict[tuple[str, str], int] = {}

    @property
    def on(self) -> bool:
        return self.threshold > 0

    def count(self, decision: Decision) -> Decision:
        key = (decision.path, decision.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        return decision

    def pd(self, reason: str, note: str | None = None) -> Decision:
        """P/D without a count of the prompt (off, a failed /tokenize, a streamed list)."""
        return self.count(Decision("pd", reason, self.threshold, note=note))

    def decide(self, backend: str, model: str, tokens: Sequence[int],
               hashes: Sequence[int] | None = None) -> Decision:
        """Local when fewer than ``threshold`` of ``tokens`` are uncached on ``backend``."""
        if not self.on:
            return self.pd("off")
        cached = self.index.cached_tokens(backend, model, tokens, hashes)
        local = len(tokens) - cached < self.threshold
        return self.count(Decision("local" if local else "pd", "below_threshold" if local else "above_threshold",
                                   self.threshold, len(tokens), cached))

    def prometheus(self) -> str:
        """The counts in Prometheus' text format (the router's ``/metrics``)."""
        lines = ["# HELP kvsm_router_disagg_total Prompts by the path the router sent them: pd (prefill, then "
                 "decode with the transfer) or local (the decode engine alone), and why.",
                 "# TYPE kvsm_router_disagg_total counter"]
        for path, reasons in (("pd", ("off", "above_threshold", "tokenize_failed", "streamed_list")),
                              ("local", ("below_threshold",))):
            lines += [f'kvsm_router_disagg_total{{path="{path}",reason="{r}"}} {self.counts.get((path, r), 0)}'
                      for r in reasons]
        lines += ["# HELP kvsm_router_disagg_threshold_tokens Uncached prompt tokens below which a request goes "
                  "to the decode engine alone (0: never).",
                  "# TYPE kvsm_router_disagg_threshold_tokens gauge",
                  f"kvsm_router_disagg_threshold_tokens {self.threshold}"]
        return "\n".join(lines) + "\n"


def tokenize_body(path: str, body: dict[str, Any], prompt: Any) -> list[int] | dict[str, Any] | None:
    """A prompt's token ids when the request gives them, else the body that asks
    vLLM's ``/tokenize`` for them; None for a prompt that cannot be counted."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return {"model": body.get("model"), "messages": messages,
                **{k: body[k] for k in CHAT_TOKENIZE_KEYS if k in body}}
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, str):
        out = {"model": body.get("model"), "prompt": prompt}
        if "add_special_tokens" in body:
            out["add_special_tokens"] = body["add_special_tokens"]
        return out
    return None
