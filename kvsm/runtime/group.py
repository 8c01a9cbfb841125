"""Several driven event loops on one virtual clock, run from one thread.

``DrivenLoops.loop_options()`` is what to pass where a component builds its
own ``EventLoop`` (``WorkerHalf(..., loop_options=...)``): each loop made with
it is ``mode="driven"`` on the group's zmq context and joins the group, so
the driver never needs a handle on a component's loop. The driver then runs
``run_until_idle`` (every loop until none has work: a message one loop sends
over inproc is readable by another at once, so this settles everything that
can happen at this instant) and moves the clock to ``next_deadline_ns`` (the
earliest timer of any loop) only when nothing can run. Same inputs, same run.
"""

from __future__ import annotations

from typing import Any, Protocol

import zmq

from kvsm.lifecycle.clock import Clock, VirtualClock

MAX_ROUNDS = 100_000


class DrivenLoop(Protocol):
    """What the group drives of a ``kvsm.runtime.loop.EventLoop`` (a protocol, so
    that the group and the loop do not import each other)."""

    name: str

    @property
    def clock(self) -> Clock: ...

    @property
    def driven_running(self) -> bool: ...

    def run_once(self) -> int: ...

    def has_work_due(self) -> bool: ...

    def next_deadline_ns(self) -> int | None: ...

    def stop(self, timeout: float = ...) -> bool: ...


class DrivenLoops:
    """The driven loops of one simulation, their clock and their zmq context."""

    def __init__(self, clock: VirtualClock, context: zmq.Context | None = None) -> None:
        self.clock = clock
        self.context = context if context is not None else zmq.Context()
        self.loops: list[DrivenLoop] = []
        # Loops that do not run for now (a process cut off by a partition: its
        # sockets stay open, what is sent to it waits, its timers do not fire).
        self.frozen: set[int] = set()

    def loop_options(self) -> dict[str, Any]:
        """EventLoop keyword arguments for a loop of this group (clock passed apart)."""
        return {"mode": "driven", "context": self.context, "group": self}

    def add(self, loop: DrivenLoop) -> None:
        """Called by EventLoop's constructor for a loop made with ``group=self``."""
        if loop.clock is not self.clock:
            raise ValueError(f"loop {loop.name!r} is not on the group's clock")
        self.loops.append(loop)

    def run_until_idle(self, max_rounds: int = MAX_ROUNDS, *, after_jump: bool = False) -> int:
        """Run the started loops round-robin, one ``run_once`` each per round, until
        a whole round finds no work (then no message is in flight between them and
        nothing is due); returns the work done.

        ``after_jump``: the loops were idle, then only the clock moved and posts
        were made (nobody wrote to their sockets), so the first round runs only
        the loops with a timer due or a post queued: the others cannot have work.
        """
        total = 0
        first = after_jump
        for _ in range(max_rounds):
            work = 0
            for loop in self.loops:
                if loop.driven_running and id(loop) not in self.frozen and (not first or loop.has_work_due()):
                    work += loop.run_once()
            first = False
            if not work:
                return total
            total += work
        raise RuntimeError(f"driven loops still busy after {max_rounds} rounds (a reader that never drains, "
                           "or callables that re-post themselves?)")

    def next_deadline_ns(self) -> int | None:
        """The earliest timer of any running loop, or None."""
        deadlines = [d for loop in self.loops if loop.driven_running and id(loop) not in self.frozen
                     if (d := loop.next_deadline_ns()) is not None]
        return min(deadlines) if deadlines else None

    def close(self) -> None:
        """Stop every loop (closing its sockets) and destroy the context."""
        for loop in self.loops:
            loop.stop()
        self.context.destroy(linger=0)
