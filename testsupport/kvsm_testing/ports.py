"""Free TCP ports for tests, picked *outside* the kernel's ephemeral range.

Binding port 0 and closing again hands back a port from the ephemeral range
(32768-60999 on Linux), which is exactly where the kernel also places every
outgoing connection and every ``bind(0)`` listener (UCX opens several per NIXL
agent). A port chosen that way and bound a second later by the process under
test is taken in the meantime often enough to fail CI ("Address already in
use"). Ports below the ephemeral range are only ever taken by someone asking
for them by number, so a random one that binds now stays free.

Ports handed out are remembered for the life of the process so that two calls
never return the same one, even when the first has not been bound yet.
"""

from __future__ import annotations

import os
import random
import socket
import threading

__all__ = ["free_port", "free_port_run", "free_ports"]

HOST = "127.0.0.1"
_LOW, _HIGH = 20000, 32000  # below Linux's default ip_local_port_range (32768-60999)

_lock = threading.Lock()
_given: set[int] = set()
_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _candidates() -> range:
    lo, _ = _ephemeral_range()
    high = min(_HIGH, lo - 1)
    low = min(_LOW, high - 2000)
    return range(max(1024, low), high)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port_run(n: int = 1) -> int:
    """The first of ``n`` consecutive ports that are all free now and never handed out before.

    Raises RuntimeError naming the range searched when none is found after many tries.
    """
    if n < 1:
        raise ValueError(f"free_port_run needs n >= 1, got {n}")
    span = _candidates()
    with _lock:
        for _ in range(500):
            base = _rng.randrange(span.start, span.stop - n)
            run = range(base, base + n)
            if any(p in _given for p in run):
                continue
            if all(_bindable(p) for p in run):
                _given.update(run)
                return base
    raise RuntimeError(f"no run of {n} free ports in {span.start}-{span.stop - 1} after 500 tries")


def free_port() -> int:
    """One port that is free now, outside the ephemeral range, never handed out before in this process."""
    return free_port_run(1)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (not necessarily consecutive), sorted."""
    return sorted(free_port() for _ in range(n))
