"""Streamed push, prefill side of the scheduler: what each step computes of each
streamed request (``StreamStep``), for the workers that write it layer by layer.

vLLM's scheduler output says which requests a step computes and how many
tokens; their blocks come as lists for new requests and as additions for
running ones (a whole new list for one resumed after preemption), one list per
KV cache group. The request itself says how many tokens were computed before
the step (vLLM moves its count on only after ``build_connector_meta``). No vLLM
import: the objects are read by attribute.

A sliding window or chunked local attention group's blocks before what the
prompt's last token attends to are never read on the decode side (its vLLM
gives them the null block), and the prefill side's vLLM may free them
mid-prompt (``remove_skipped_blocks`` at each scheduling, for the tokens its
``get_num_skipped_tokens(computed)`` says: before ``computed - window + 1``,
before ``computed // chunk * chunk``), when a write from them could still be in
flight. So those positions go as ``UNWRITTEN`` (``GroupReach``). The blocks
from there on are never freed before the finish, since the scheduling of the
prompt's last step has computed ``prompt - 1`` tokens at most.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsm.handoff.facts import STREAM_KEY, STREAM_MODE, UNWRITTEN, StreamPreempted, StreamStep

# A join key is an id like a request's: printable, bounded.
MAX_KEY_LENGTH = 256


@dataclass(frozen=True)
class GroupReach:
    """How far back one KV cache group's attention reads: a sliding window's
    tokens, a chunked local attention's chunk (both 0: every token, as full
    attention and MLA)."""

    window: int = 0
    chunk: int = 0

    def first_read(self, prompt: int) -> int:
        """The first token the prompt's last one attends to (vLLM's skipped tokens
        once ``prompt - 1`` are computed)."""
        if self.window:
            return max(0, prompt - self.window)
        if self.chunk:
            return (prompt - 1) // self.chunk * self.chunk
        return 0


@dataclass
class _Stream:
    key: str
    request: Any  # vLLM's Request (num_computed_tokens, num_prompt_tokens)
    blocks: list[list[int]] = field(default_factory=list)  # per KV cache group, by position


class StreamSteps:
    """The streamed prefill requests of one engine, from their arrival to their finish.

    ``reach``: per KV cache group, how far back it reads; ``block_size``: the
    groups' one."""

    def __init__(self, reach: tuple[GroupReach, ...] = (GroupReach(),), block_size: int = 16) -> None:
        self._streams: dict[str, _Stream] = {}
        self._reach = reach
        self._block_size = block_size

    def __len__(self) -> int:
        return len(self._streams)

    @staticmethod
    def wanted(params: Mapping[str, Any]) -> bool:
        """A prefill leg of a streamed pair (its join key is a printable id)."""
        key = params.get(STREAM_KEY)
        return (params.get("transfer_mode") == STREAM_MODE and isinstance(key, str)
                and 0 < len(key) <= MAX_KEY_LENGTH and key.isprintable())

    def add(self, request: Any, params: Mapping[str, Any]) -> None:
        self._streams[request.request_id] = _Stream(str(params[STREAM_KEY]), request)

    def key_of(self, req: str) -> str:
        s = self._streams.get(req)
        return s.key if s is not None else ""

    def discard(self, req: str) -> None:
        self._streams.pop(req, None)

    def preempted(self, out: Any, now_ns: int) -> list[StreamPreempted]:
        """The streamed requests vLLM preempted in this step's scheduling (it freed
        their blocks; ``out.preempted_req_ids``), with the time, no earlier than the
        free and before any later step could compute into those blocks."""
        ids = getattr(out, "preempted_req_ids", None) or ()
        return [StreamPreempted(req=req, at_ns=now_ns) for req in ids if req in self._streams]

    def steps(self, out: Any) -> list[StreamStep]:
        """This step's part of each streamed request's prompt (``out``: vLLM's SchedulerOutput)."""
        scheduled: Mapping[str, int] = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            s = self._streams.get(new.req_id)
            if s is not None:
                s.blocks = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for req, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            s = self._streams.get(req)
            if s is not None and ids is not None:
                s.blocks = ([list(g) for g in ids] if req in resumed or not s.blocks
                            else [have + list(g) for have, g in zip(s.blocks, ids, strict=True)])
        facts = []
        for req, s in self._streams.items():
            n = scheduled.get(req, 0)
            start, prompt = int(s.request.num_computed_tokens), int(s.request.num_prompt_tokens)
            if n <= 0 or start >= prompt:
                continue
            end = min(prompt, start + n)
            facts.append(StreamStep(req=req, block_ids=self._written(s.blocks, prompt), start=start, end=end,
                                    last=end >= prompt))
        return facts

    def _written(self, blocks: list[list[int]], prompt: int) -> tuple[tuple[int, ...], ...]:
        """Each group's blocks by position, ``UNWRITTEN`` before what it reads (see the module doc)."""
        out = []
        for ids, reach in zip(blocks, self._reach, strict=True):
            first = reach.first_read(prompt) // self._block_size
            out.append((UNWRITTEN,) * min(first, len(ids)) + tuple(ids[first:]))
        return tuple(out)
