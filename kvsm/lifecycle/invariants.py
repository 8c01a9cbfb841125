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
  block still held when its request is terminal was never freed.
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
    """One broken invariant, with enough context to find it in the logs."""

    kind: str
    req: str | None
    detail: str
    where: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        who = f" request {self.req!r}" if self.req else ""
        return f"{self.kind}:{who} {self.detail}"


class BlockLedger:
    """Who holds which block of one block pool (one engine process)."""

    def __init__(self, pool: str = "") -> None:
        self.pool = pool
        # block -> {request: shared?}
        self._holders: dict[int, dict[str, bool]] = {}
        self._held_by: dict[str, set[int]] = {}
        self.violations: list[InvariantViolation] = []

    def held(self, req: str | None = None) -> set[int]:
        if req is None:
            return set(self._holders)
        return set(self._held_by.get(req, ()))

    def hold(self, req: str, blocks: Iterable[int], where: dict[str, Any] | None = None, *,
             shared: bool = False) -> None:
        mine = self._held_by.setdefault(req, set())
        clashes: dict[int, list[str]] = {}
        for b in blocks:
            holders = self._holders.setdefault(b, {})
            others = [r for r, s in holders.items() if r != req and not (shared and s)]
            if others:
                clashes[b] = others
                if not holders:
                    del self._holders[b]
                continue
            holders[req] = shared
            mine.add(b)
        if not mine:
            self._held_by.pop(req, None)
        if clashes:
            owners = sorted({r for rs in clashes.values() for r in rs})
            self.violations.append(InvariantViolation(
                "block_reused_while_held", req,
                f"blocks {sorted(clashes)} of pool {self.pool!r} taken while other requests still hold them "
                f"({', '.join(owners)})", where or {}))

    def release(self, req: str, blocks: Iterable[int], where: dict[str, Any] | None = None) -> None:
        mine = self._held_by.get(req, set())
        not_held = []
        for b in blocks:
            if b not in mine:
                not_held.append(b)
                continue
            mine.discard(b)
            holders = self._holders[b]
            del holders[req]
            if not holders:
                del self._holders[b]
        if not_held:
            self.violations.append(InvariantViolation(
                "block_freed_twice", req,
                f"blocks {sorted(not_held)} of pool {self.pool!r} handed back but not held by this request "
                "(freed before, or never taken)", where or {}))
        if not mine:
            self._held_by.pop(req, None)

    def apply_effects(self, req: str, effects: Iterable[str], blocks: Iterable[int],
                      where: dict[str, Any] | None = None) -> None:
        """Feed one transition's effects; ``blocks`` are the request's block ids."""
        blocks = tuple(blocks)
        for effect in effects:
            if effect in BLOCK_HOLDING_EFFECTS:
                self.hold(req, blocks, where, shared=effect in SHARED_HOLDING_EFFECTS)
            elif effect in BLOCK_RELEASING_EFFECTS:
                self.release(req, blocks, where)

    def finish(self, req: str, final_state: str, where: dict[str, Any] | None = None) -> None:
        """A request reached ``final_state`` (terminal): it must hold nothing."""
        left = self._held_by.pop(req, set())
        for b in left:
            holders = self._holders.get(b)
            if holders is not None:
                holders.pop(req, None)
                if not holders:
                    del self._holders[b]
        if left:
            self.violations.append(InvariantViolation(
                "blocks_never_freed", req,
                f"ended {final_state!r} still holding blocks {sorted(left)} of pool {self.pool!r}",
                where or {}))


def not_terminal(lifecycle: str, states: dict[str, str]) -> list[InvariantViolation]:
    """Requests of ``lifecycle`` whose state (req -> state) is not terminal."""
    terminal = LIFECYCLES[lifecycle].terminal
    return [
        InvariantViolation("not_terminal_at_end", req, f"{lifecycle} request left in state {state!r}")
        for req, state in sorted(states.items())
        if state not in terminal
    ]
