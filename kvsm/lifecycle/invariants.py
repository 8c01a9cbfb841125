"""Invariants over lifecycles, shared by the live runtime, the simulation and replay.

Each check reports ``InvariantViolation`` values instead of raising, so a
caller can list every problem rather than stop at the first one.

* ``BlockLedger`` follows block ownership through transition effects: a
  block is *held* from the effect that takes it until the effect that hands
  it back. A receiving request holds its blocks exclusively (reads write
  into them); a sending request's pin is shared, since vLLM's prefix cache
  lets several finished prefills pin the same block at once. Handing back a
  block that is not held is a double free; taking a block that another
  request holds (exclusively, or at all for an exclusive take) is reuse while
  held (what serving a read from an expired, reused block looks like); a
  block still held when its request is terminal was never freed. Which
  effects take, share or hand back blocks is the table's to say
  (``BLOCK_HOLDING_EFFECTS``, ``SHARED_HOLDING_EFFECTS``,
  ``BLOCK_RELEASING_EFFECTS``); nothing here names an effect.
* ``not_terminal`` names machines that ended a log (or a simulation)
  mid-lifecycle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvsm.lifecycle.table import BLOCK_HOLDING_EFFECTS, BLOCK_RELEASING_EFFECTS, LIFECYCLES, SHARED_HOLDING_EFFECTS


@dataclass(frozen=True)
class InvariantViolation:
    """One broken invariant, with enough context to find it in the logs.

    ``where`` is what the caller passed to say where it happened: a dict of
    context (the simulation), or the log record itself (replay)."""

    kind: str
    req: str | None
    detail: str
    where: Any = field(default_factory=dict)

    def __str__(self) -> str:
        who = f" request {self.req!r}" if self.req else ""
        return f"{self.kind}:{who} {self.detail}"


# effects -> what they do to the request's blocks, in order: (takes?, shared?)
# per block effect (filled as met: a lifecycle has a few dozen effect tuples).
_BLOCK_OPS: dict[tuple[str, ...], tuple[tuple[bool, bool], ...]] = {}


def block_ops(effects: Iterable[str]) -> tuple[tuple[bool, bool], ...]:
    """What ``effects`` do to a request's blocks, in order: ``(holds, shared)``
    per effect that takes (``holds``) or hands back (not ``holds``) blocks."""
    key = effects if type(effects) is tuple else tuple(effects)
    ops = _BLOCK_OPS.get(key)
    if ops is None:
        ops = _BLOCK_OPS[key] = tuple(
            (e in BLOCK_HOLDING_EFFECTS, e in SHARED_HOLDING_EFFECTS) for e in key
            if e in BLOCK_HOLDING_EFFECTS or e in BLOCK_RELEASING_EFFECTS)
    return ops


class BlockLedger:
    """Who holds which block of one block pool (one engine process).

    On replay's path (about one call per two records of a log): violations are
    built only when one happens, and ``where`` is kept as it was given.
    """

    __slots__ = ("_held_by", "_holders", "pool", "violations")

    def __init__(self, pool: str = "") -> None:
        self.pool = pool
        self._holders: dict[int, dict[str, bool]] = {}  # block -> {request: shared?}
        self._held_by: dict[str, set[int]] = {}
        self.violations: list[InvariantViolation] = []

    def held(self, req: str | None = None) -> set[int]:
        """The blocks ``req`` holds (None: every held block)."""
        if req is None:
            return set(self._holders)
        return set(self._held_by.get(req, ()))

    def hold(self, req: str, blocks: Iterable[int], where: Any = None, *, shared: bool = False) -> None:
        holders = self._holders
        mine = self._held_by.get(req)
        if mine is None:
            mine = set()
        clashes: dict[int, list[str]] | None = None
        for b in blocks:
            h = holders.get(b)
            if h is None:
                holders[b] = {req: shared}
                mine.add(b)
                continue
            others = [o for o, s in h.items() if o != req and not (shared and s)]
            if others:
                if clashes is None:
                    clashes = {}
                clashes[b] = others
                continue
            h[req] = shared
            mine.add(b)
        if mine:
            self._held_by[req] = mine
        if clashes:
            owners = sorted({o for os in clashes.values() for o in os})
            self.violations.append(InvariantViolation(
                "block_reused_while_held", req,
                f"blocks {sorted(clashes)} of pool {self.pool!r} taken while other requests still hold them "
                f"({', '.join(owners)})", {} if where is None else where))

    def release(self, req: str, blocks: Iterable[int], where: Any = None) -> None:
        mine = self._held_by.get(req)
        not_held = []
        for b in blocks:
            if mine is None or b not in mine:
                not_held.append(b)
                continue
            mine.discard(b)
            h = self._holders[b]
            del h[req]
            if not h:
                del self._holders[b]
        if not_held:
            self.violations.append(InvariantViolation(
                "block_freed_twice", req,
                f"blocks {sorted(not_held)} of pool {self.pool!r} handed back but not held by this request "
                "(freed before, or never taken)", {} if where is None else where))
        if mine is not None and not mine:
            del self._held_by[req]

    def apply_effects(self, req: str, effects: Iterable[str], blocks: Iterable[int], where: Any = None) -> None:
        """Feed one transition's effects; ``blocks`` are the request's block ids."""
        ops = _BLOCK_OPS.get(effects) if type(effects) is tuple else None
        if ops is None:
            ops = block_ops(effects)
        if not ops:
            return
        if type(blocks) is not tuple:
            blocks = tuple(blocks)
        for holds, shared in ops:
            if holds:
                self.hold(req, blocks, where, shared=shared)
            else:
                self.release(req, blocks, where)

    def finish(self, req: str, final_state: str, where: Any = None) -> None:
        """A request reached ``final_state`` (terminal): it must hold nothing."""
        left = self._held_by.pop(req, None)
        if not left:
            return
        for b in left:
            h = self._holders.get(b)
            if h is not None:
                h.pop(req, None)
                if not h:
                    del self._holders[b]
        self.violations.append(InvariantViolation(
            "blocks_never_freed", req,
            f"ended {final_state!r} still holding blocks {sorted(left)} of pool {self.pool!r}",
            {} if where is None else where))


def not_terminal(lifecycle: str, states: dict[str, str]) -> list[InvariantViolation]:
    """Requests of ``lifecycle`` whose state (req -> state) is not terminal."""
    terminal = LIFECYCLES[lifecycle].terminal
    return [
        InvariantViolation("not_terminal_at_end", req, f"{lifecycle} request left in state {state!r}")
        for req, state in sorted(states.items())
        if state not in terminal
    ]
