"""Streamed push (transfer_mode "stream") as the simulation's prefill engine plays it.

The router sends both legs of a streamed request at once, with one join key:
the decode engine matches the whole prompt and allocates its blocks before
the prefill engine computed any of it (``DecodeEngine.arrive_stream``). The
prefill engine computes the prompt in one or more steps (chunked prefill), and
each step is a forward pass on virtual time, layer by layer, as vLLM's model
thread runs it: it computes a layer's part of the step's tokens into the
request's blocks, then calls the worker's ``layer_saved`` (``save_kv_layer``),
and once every layer is done ``step_over`` (``wait_for_save``) and ``submit``
(``start_load_kv``). A step's facts say what it computes of each streamed
request (``StreamStep``); its first ``layer_saved`` hands them over.

Where the bytes are: each block's bytes are split evenly into one slice per
layer (``InMemoryAgent``'s layers), and each slice into one run per token
position of the block (``token_span``). A layer of a step computes exactly the
runs of the step's tokens, so a block holds what the prefill computed only in
the runs of the tokens computed so far: what a write reads before its layer
is computed is what the block held before (another request's bytes, or
zeros), and the decode side's check of every prompt token (``check_streamed``)
sees it.

Either engine's prefix cache may hold a prompt's first blocks (``PREFIX_HIT``):
the prefill's first step starts past them, or the decode leg asks only for the
blocks after them (``first_position``). ``SimConfig.stream_reorder`` lets a
request's layer writes land out of the order they were posted.

``SimConfig.stream_preempt`` has vLLM preempt a request between two of its
steps: its blocks go back to the pool at once (the next request may take
them; a layer write still in flight from them lands poisoned bytes, as an
RDMA read after the free may: ``InMemoryAgent.freed``), the step's facts say
so (``StreamPreempted``), and a later step computes it again from its first
token into new blocks.

``ForwardPasses.compute_after_save`` plants an engine bug (for tests that
show the check can fail): each layer is computed only after ``layer_saved``
told the worker it was, once the worker's loop ran.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsm.handoff.facts import SendStart, StepFacts, StreamPreempted, StreamStep
from kvsm_testing.sim.config import MS


class PrefillEngine(Protocol):
    """What the forward passes use of the prefill engine (``kvsm_testing.sim.engines``,
    which imports this module: named here by what it has, not imported)."""

    sim: Any
    block_tokens: int
    blocks: dict[str, tuple[int, ...]]
    pool: Any
    agent: Any
    facts: StepFacts
    worker: Any

    def finish(self, i: int, status: str) -> None: ...
    def take_facts(self) -> StepFacts: ...

# How long one layer of a forward pass takes (virtual ns): a step's layers are
# done over about the wire's latency, so writes posted as they are done overlap.
LAYER_NS = (20_000, 150_000)
# Between two steps of the engine; from a request's last step to its finish (the
# scheduler's output processing, a busy engine's next steps): before or after its
# last write is over, both orders happen.
STEP_GAP_NS = (0, 100_000)
FINISH_NS = (0, 4 * MS)
# How far apart the router's two legs reach their engines (either may be first).
LEG_SPREAD_NS = 600_000
# The chance that an engine's prefix cache holds some of a streamed prompt's first
# blocks: the prefill's first step starts past them (they are written from the
# cache), or the decode engine asks only for the blocks after them.
PREFIX_HIT = 0.2


def stream_block(req_index: int, block_index: int, size: int) -> bytes:
    """What the prefill engine computes for one block of a streamed request: bytes
    that differ from block to block and request to request almost everywhere (a
    stale byte in any token's run tells)."""
    return hashlib.shake_128(struct.pack("<II", req_index, block_index)).digest(size)


def token_span(block_bytes: int, layers: int, layer: int, first: int, end: int, block_tokens: int) -> tuple[int, int]:
    """The byte run (from, to) within a block of tokens ``first`` to ``end`` (of
    the block's ``block_tokens``) in layer ``layer``'s slice."""
    size = block_bytes // layers
    base = layer * size
    return base + first * size // block_tokens, base + end * size // block_tokens


def check_streamed(got: bytes, want: bytes, layers: int, tokens: int, block_tokens: int) -> int | None:
    """The first layer in which a delivered block's first ``tokens`` tokens differ
    from what the prefill computed (None: every one is as computed)."""
    for layer in range(layers):
        lo, hi = token_span(len(want), layers, layer, 0, tokens, block_tokens)
        if got[lo:hi] != want[lo:hi]:
            return layer
    return None


@dataclass
class Streamed:
    """One streamed prefill request on the prefill engine."""

    index: int
    num_blocks: int
    num_tokens: int
    ends: list[int]  # where each of its steps ends (tokens); the last is num_tokens
    abort_in_ns: int | None = None  # the client goes away that long after it started
    error_after: int = 0  # it ends by error after that many steps (0: it does not)
    preempt_after: int = 0  # vLLM preempts it after that many steps (0: it does not)
    preempted: bool = False
    blocks: tuple[int, ...] = ()
    done: int = 0  # tokens every layer holds
    steps: int = 0  # steps over
    abort_pending: bool = False  # aborted during a forward pass that computes it
    finished: bool = False  # request_finished came (a finish on its way does nothing then)

    @property
    def req(self) -> str:
        return f"p-{self.index}"

    @property
    def key(self) -> str:
        return f"s-{self.index}"


@dataclass
class _Pass:
    """One forward pass: the step's facts and the streamed requests it computes."""

    facts: StepFacts
    reqs: list[Streamed]
    layer_ns: int
    late: list[Callable[[], None]] = field(default_factory=list)  # compute_after_save only


class ForwardPasses:
    """The prefill engine's steps that compute streamed requests."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine
        self.sim = engine.sim
        self.live: dict[str, Streamed] = {}  # started, not computed to their end
        self.current: _Pass | None = None
        self.compute_after_save = False  # a planted engine bug (see the module's doc)
        self.steps_of: dict[str, int] = {}  # how many steps computed each streamed request
        self._armed = False

    def busy(self) -> bool:
        return bool(self.live) or self.current is not None or self._armed

    # -- a request --------------------------------------------------------------------------

    def arrive(self, i: int) -> None:
        """The router sends both legs now: the decode leg goes its way, the prefill
        request starts computing a little before or after it arrives."""
        sim, cfg = self.sim, self.sim.config
        f, rng, size = cfg.faults, sim.rng, self.engine.block_tokens
        n = rng.randint(1, cfg.max_blocks_per_request)
        tokens = n * size - rng.randrange(size)
        cached = rng.randint(1, n - 1) * size if n > 1 and sim.chance(PREFIX_HIT) else 0
        steps = rng.randint(1, min(cfg.stream_max_steps, tokens - cached))
        s = Streamed(i, n, tokens, [*sorted(rng.sample(range(cached + 1, tokens), steps - 1)), tokens], done=cached)
        if sim.chance(f.prefill_abort):  # while it computes, or computed and not finished yet
            s.abort_in_ns = rng.randint(0, (steps + 3) * MS)
        elif sim.chance(f.prefill_abnormal):
            s.error_after = rng.randint(1, steps)
        if steps > 1 and sim.chance(cfg.stream_preempt):
            s.preempt_after = rng.randint(1, steps - 1)
        sim.route_stream(i, n, tokens)
        sim.at(rng.randint(0, LEG_SPREAD_NS), functools.partial(self._start, s))

    def _start(self, s: Streamed) -> None:
        """vLLM schedules it: its blocks, and the facts' SendStart with its join key."""
        engine = self.engine
        s.blocks = engine.blocks[s.req] = engine.pool.allocate(s.req, s.num_blocks)
        for j in range(s.done // engine.block_tokens):  # a prefix cache hit: computed before, every layer
            engine.agent.write_block(s.blocks[j], stream_block(s.index, j, engine.agent.block_bytes))
        engine.facts.send_start.append(SendStart(s.req, stream=s.key))
        self.live[s.req] = s
        if s.abort_in_ns is not None:
            self.sim.at(s.abort_in_ns, functools.partial(self._abort, s))
        self._kick()

    def _abort(self, s: Streamed) -> None:
        """The client went away: vLLM finishes it between steps (at the end of a
        forward pass that computes it), unless it finished already."""
        if self.current is not None and s in self.current.reqs:
            s.abort_pending = True
            return
        self.live.pop(s.req, None)
        self._finish(s, "FINISHED_ABORTED")

    def _finish(self, s: Streamed, status: str) -> None:
        if not s.finished:
            s.finished = True
            self.engine.finish(s.index, status)

    # -- the engine's steps ----------------------------------------------------------------

    def _kick(self) -> None:
        if self.current is None and not self._armed and self.live:
            self._armed = True
            self.sim.at(self.sim.rng.randint(*STEP_GAP_NS), self._begin)

    def _begin(self) -> None:
        """A step computes the next part of every streamed request (one batch)."""
        self._armed = False
        if self.current is not None or not self.live:
            return
        size = self.engine.block_tokens
        facts = self.engine.take_facts()
        reqs = [s for s in self.live.values() if self._schedule(s, facts)]
        if not reqs:  # (every one preempted now: the facts go with no forward pass)
            assert self.engine.worker is not None
            self.engine.worker.submit(facts)
            self._kick()
            return
        for s in reqs:
            end = s.ends[s.steps]
            blocks = tuple(s.blocks[:-(-end // size)])
            facts.stream_steps.append(StreamStep(req=s.req, block_ids=(blocks,), start=s.done, end=end,
                                                 last=end == s.num_tokens))
        self.current = _Pass(facts, reqs, self.sim.rng.randint(*LAYER_NS))
        self.sim.at(self.current.layer_ns, functools.partial(self._layer, 0))

    def _schedule(self, s: Streamed, facts: StepFacts) -> bool:
        """vLLM's scheduling of ``s`` for this step: True, it is computed. Preempted
        now, its blocks go back to the pool at once; resumed, it gets new ones and
        is computed again from its first token."""
        engine = self.engine
        if s.preempt_after and s.steps == s.preempt_after and not s.preempted:
            s.preempted = True
            engine.pool.free(s.req, s.blocks)
            engine.agent.freed(s.blocks)  # (a write still reading them carries bytes no longer its)
            s.blocks = engine.blocks[s.req] = ()
            facts.stream_preempted.append(StreamPreempted(s.req, at_ns=self.sim.clock.monotonic_ns()))
            return False
        if not s.blocks:
            s.blocks = engine.blocks[s.req] = engine.pool.allocate(s.req, s.num_blocks)
            s.done = 0
        return True

    def _layer(self, layer: int) -> None:
        """The forward pass is done with ``layer``: its KV of the step's tokens is in
        the blocks, and the worker hears of it (save_kv_layer)."""
        p, engine = self.current, self.engine
        assert p is not None and engine.worker is not None
        names = engine.agent.layers() or ()
        self._run_late(p)
        compute = functools.partial(self._compute, p.reqs, layer)
        if self.compute_after_save:
            engine.worker.layer_saved(names[layer], p.facts)
            p.late.append(compute)
        else:
            compute()
            engine.worker.layer_saved(names[layer], p.facts)
        nxt = functools.partial(self._layer, layer + 1) if layer + 1 < len(names) else self._end
        self.sim.at(p.layer_ns, nxt)

    @staticmethod
    def _run_late(p: _Pass) -> None:
        for fn in p.late:
            fn()
        p.late.clear()

    def _compute(self, reqs: list[Streamed], layer: int) -> None:
        """Layer ``layer``'s bytes of each request's tokens this step computes."""
        agent, size = self.engine.agent, self.engine.block_tokens
        block_bytes, layers = agent.block_bytes, len(agent.layers() or ())
        for s in reqs:
            start, end = s.done, s.ends[s.steps]
            for j in range(start // size, (end - 1) // size + 1):
                first, last = max(start, j * size) - j * size, min(end, (j + 1) * size) - j * size
                lo, hi = token_span(block_bytes, layers, layer, first, last, size)
                at = s.blocks[j] * block_bytes
                agent.memory[at + lo:at + hi] = stream_block(s.index, j, block_bytes)[lo:hi]

    def _end(self) -> None:
        """The forward pass is over (wait_for_save, then start_load_kv); the
        scheduler sees what the step computed: requests computed to their end
        finish, aborts and errors that waited for the step take effect."""
        p, engine, rng = self.current, self.engine, self.sim.rng
        assert p is not None and engine.worker is not None
        self._run_late(p)
        engine.worker.step_over()
        engine.worker.submit(p.facts)
        self.current = None
        for s in p.reqs:
            s.done = s.ends[s.steps]
            s.steps += 1
            self.steps_of[s.req] = s.steps
            if s.abort_pending:
                del self.live[s.req]
                self._finish(s, "FINISHED_ABORTED")
            elif s.steps == s.error_after:
                del self.live[s.req]
                self._finish(s, "FINISHED_ERROR")
            elif s.done == s.num_tokens:
                del self.live[s.req]
                self.sim.at(rng.randint(*FINISH_NS), functools.partial(self._finish, s, "FINISHED_STOPPED"))
        self._kick()
