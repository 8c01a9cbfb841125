"""The router's choice of backends: round robin, or prefix affinity with a load guard.

Turn k+1 of a conversation is turn k's prompt, turn k's answer and the new
message, so its prompt starts with turn k's. The engines that computed turn k
hold its blocks in their prefix caches; sending turn k+1 there saves computing
them again. With ``kvsm.router --prefix-affinity`` each generate request goes,
for each role (prefill, decode), to the backend whose prefix index holds the
longest prefix of its prompt in blocks (llm-d's prefix-cache scorer is the
model). The decode index is the one ``kvsm.router_decider`` keeps for the
threshold (every prompt the router sent to a decode backend); the prefill
index remembers every prompt a prefill backend computed for the router.

Ties between backends holding the same longest prefix, and prompts no backend
holds any block of (a conversation's first turn), go round robin, as do
prompts whose token ids the router does not know; the round robin turns only
on those choices, so unrelated conversations spread as they did without
affinity. A load guard keeps affinity from piling requests onto one backend: a
preferred backend with more requests in flight from this router than the
limit (``--affinity-max-inflight``; by default twice the least loaded
backend's count plus 4) gives way to the least loaded backend.

The choice costs one pass of chain hashes over the prompt's blocks (made once
per request and shared with the threshold) and one set lookup per backend per
block: fine for a handful of backends. Off, it is the round robin it replaces.

Stdlib only, and no kvsm package but the router's decider: part of ``kvsm.router``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from kvsm.router_decider import Decider, Decision, PrefixIndex, block_hashes

__all__ = ["ROLES", "Balancer", "Choice"]

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Choice:
    """One backend chosen for one role, and why (the log line and ``/metrics`` say both)."""

    role: str
    url: str
    reason: str  # off | no_tokens | miss | prefix | tie | overloaded | hold
    blocks: int = 0  # leading blocks of the prompt the chosen backend's index holds

    def field(self) -> str:
        return f"{self.role}:{self.reason}:{self.blocks}"


class Balancer:
    """Per role: the backends, their round robin, their prefix index and requests in flight."""

    REASONS = ("off", "no_tokens", "miss", "prefix", "tie", "overloaded", "hold")

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], decode_index: PrefixIndex, *,
                 on: bool = False, max_inflight: int | None = None) -> None:
        """``decode_index``: the decider's; the prefill index gets its block size and capacity."""
        if max_inflight is not None and max_inflight < 0:
            raise ValueError("the affinity's in-flight limit is a number of requests, 0 or more")
        self.on, self.max_inflight = on, max_inflight
        self.urls = {"prefill": list(prefill_urls), "decode": list(decode_urls)}
        self._cycles = {role: itertools.cycle(urls) for role, urls in self.urls.items()}
        self._tokenizers = itertools.cycle(self.urls["decode"])  # /tokenize, asked before a choice
        self.indexes = {"prefill": PrefixIndex(decode_index.block_size, decode_index.capacity),
                        "decode": decode_index}
        self.inflight = {role: dict.fromkeys(urls, 0) for role, urls in self.urls.items()}
        self.counts: dict[tuple[str, str], int] = {}

    # -- choosing -------------------------------------------------------------------------

    async def route(self, decider: Decider, model: str, countable: bool,
                    tokens_on: Callable[[str], Awaitable[tuple[list[int] | None, str | None]]],
                    want_tokens: bool = False) -> tuple[Choice, Decision, list[int] | None, list[int] | None]:
        """One prompt's decode backend, P/D or that backend alone (``decider``), the prompt's
        block hashes and its token ids (None: unknown). ``tokens_on(url)`` counts the prompt's tokens (a
        decode backend's ``/tokenize`` for text): with affinity before the choice, on the next
        decode backend in turn; without it on the backend chosen, as the threshold alone did.
        ``want_tokens``: count them even with neither on (the router's hold reuse matches them)."""
        if not countable or not (decider.on or self.on or want_tokens):
            return self.pick("decode", None), decider.pd("off" if countable else "streamed_list"), None, None
        choice = None if self.on else self.pick("decode", None)
        tokens, note = await tokens_on(choice.url if choice else next(self._tokenizers))
        hashes = None if tokens is None else block_hashes(model, tokens, self.indexes["decode"].block_size)
        choice = choice or self.pick("decode", hashes)
        if not decider.on:
            return choice, decider.pd("off"), hashes, tokens
        if tokens is None or hashes is None:
            return choice, decider.pd("tokenize_failed", note), hashes, tokens
        return choice, decider.decide(choice.url, model, tokens, hashes), hashes, tokens

    def pick(self, role: str, hashes: Sequence[int] | None) -> Choice:
        """The backend for a prompt (its ``block_hashes``; None: token ids unknown)."""
        if not self.on:
            return self._count(Choice(role, next(self._cycles[role]), "off"))
        if hashes is None:
            return self._count(Choice(role, next(self._cycles[role]), "no_tokens"))
        index = self.indexes[role]
        scores = {url: index.matched_blocks(url, hashes, touch=False) for url in self.urls[role]}
        best = max(scores.values())
        if best == 0:
            return self._count(Choice(role, next(self._cycles[role]), "miss"))
        held = [url for url, n in scores.items() if n == best]
        url = held[0] if len(held) == 1 else self._round_robin(role, held)
        load = self.inflight[role]
        least = min(load.values())
        limit = 2 * least + 4 if self.max_inflight is None else self.max_inflight
        if load[url] > limit and load[url] > least:
            url = self._round_robin(role, [u for u, n in load.items() if n == least])
            return self._count(Choice(role, url, "overloaded", scores[url]))
        return self._count(Choice(role, url, "tie" if len(held) > 1 else "prefix", best))

    def replace(self, choice: Choice, url: str, reason: str) -> Choice:
        """``url`` in place of a choice made (counted as ``reason``, the choice made uncounted):
        the router's hold reuse sends a decode leg to the backend holding its conversation."""
        self.counts[(choice.role, choice.reason)] -= 1
        return self._count(Choice(choice.role, url, reason, choice.blocks if url == choice.url else 0))

    def _round_robin(self, role: str, among: Sequence[str]) -> str:
        """The next of ``among`` in the role's round robin."""
        cycle = self._cycles[role]
        for _ in range(len(self.urls[role])):
            url = next(cycle)
            if url in among:
                return url
        return among[0]

    def _count(self, choice: Choice) -> Choice:
        key = (choice.role, choice.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        return choice

    # -- what the router tells it -----------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, choice: Choice) -> Iterator[None]:
        """A request in flight on the chosen backend, from its choice to its end."""
        self.inflight[choice.role][choice.url] += 1
        try:
            yield
        finally:
            self.inflight[choice.role][choice.url] -= 1

    def record(self, choice: Choice, hashes: Sequence[int]) -> None:
        """The chosen backend computed the prompt: its engine now caches the blocks.
        The decode index always (the threshold reads it too); the prefill index when on."""
        if choice.role == "decode" or self.on:
            self.indexes[choice.role].add(choice.url, hashes)

    # -- /metrics ------------------------------------------------------------------------------

    def prometheus(self) -> str:
        """The counts and the requests in flight, in Prometheus' text format."""
        lines = ["# HELP kvsm_router_affinity_total Backend choices by role and why: off (round robin, affinity "
                 "off), no_tokens (round robin, token ids unknown), miss (round robin, no backend holds a block of "
                 "the prompt), prefix (the longest prefix's holder), tie (round robin among the holders of the "
                 "longest prefix), overloaded (the least loaded backend, the preferred one over the limit), hold "
                 "(the decode backend holding the conversation's blocks, --reuse-holds).",
                 "# TYPE kvsm_router_affinity_total counter"]
        lines += [f'kvsm_router_affinity_total{{role="{role}",reason="{r}"}} {self.counts.get((role, r), 0)}'
                  for role in ROLES for r in self.REASONS]
        lines += ["# HELP kvsm_router_inflight_requests Requests this router has in flight on each backend.",
                  "# TYPE kvsm_router_inflight_requests gauge"]
        lines += [f'kvsm_router_inflight_requests{{role="{role}",backend="{url}"}} {n}'
                  for role in ROLES for url, n in self.inflight[role].items()]
        lines += ["# HELP kvsm_router_prefix_affinity Whether the router chooses backends by prefix (1) or round "
                  "robin (0).", "# TYPE kvsm_router_prefix_affinity gauge",
                  f"kvsm_router_prefix_affinity {int(self.on)}"]
        return "\n".join(lines) + "\n"
