"""The event logs' process-wide hooks: a forked child's fresh start, and the
order of the last things a process does at interpreter exit.

Why the order matters: a clean stop's last record (the worker's
``worker.shutdown``) is what tells replay a normal exit from a crash, so it
must reach the file before the logs close. ``atexit`` runs handlers
last-registered-first, and vLLM's teardown (weakref finalizers that end in
the connector's ``shutdown``) registers whenever vLLM first makes one, so on
its own the logs could close first and the record be dropped. So there is
one ``atexit`` handler here: it first runs the stop hooks (``on_exit``: the
connector's shutdown, newest first), then closes every live log. A shutdown
vLLM runs before or after it finds the work already done (it is idempotent).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["LIVE_LOGS", "close_all_at_exit", "exiting", "on_exit", "run_stop_hooks"]

log = logging.getLogger(__name__)

# How long the logs get to flush at exit (each), after the stop hooks ran.
CLOSE_TIMEOUT_S = 2.0
# How long the stop hooks get at exit, all together (a worker's own stop waits
# 10 s at most for its loop, 10 s for the thread and 5 s for its log).
STOP_TIMEOUT_S = 30.0


# Every live log, so fork and interpreter exit can reach them without keeping
# them alive (kvsm.eventlog.log.EventLog adds itself, and leaves when closed).
LIVE_LOGS: weakref.WeakSet[Any] = weakref.WeakSet()

# id -> (pid that registered it, hook). A forked child runs none of its parent's.
_hooks: dict[int, tuple[int, Callable[[], object]]] = {}
_ids = itertools.count()
_lock = threading.Lock()
_exiting = False


def on_exit(fn: Callable[[], object]) -> Callable[[], None]:
    """Run ``fn`` at interpreter exit before the logs close (newest first; its
    errors are logged, never raised). Returns the call that unregisters it. ``fn``
    must bound its own waits: exit waits for it."""
    key = next(_ids)
    with _lock:
        _hooks[key] = (os.getpid(), fn)

    def unregister() -> None:
        with _lock:
            _hooks.pop(key, None)

    return unregister


def exiting() -> bool:
    """The exit handler has begun (a signal arriving now need not start another exit)."""
    return _exiting


def run_stop_hooks(timeout: float | None = None) -> bool:
    """Run (and forget) this process's stop hooks, newest first, on a helper
    thread given ``timeout`` seconds in all (``STOP_TIMEOUT_S``): a hook stuck
    on something unbounded must not hang the exit. False if they overran."""
    pid = os.getpid()
    with _lock:
        todo = [fn for _key, (owner, fn) in sorted(_hooks.items(), reverse=True) if owner == pid]
        _hooks.clear()
    if not todo:
        return True

    def run() -> None:
        for fn in todo:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - never fail interpreter exit
                log.warning("kvsm: a stop hook failed at exit: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=run, name="kvsm-stop", daemon=True)
    thread.start()
    thread.join(STOP_TIMEOUT_S if timeout is None else timeout)
    if thread.is_alive():
        log.warning("kvsm: the stop hooks did not finish within %.0f s; exiting without them",
                    STOP_TIMEOUT_S if timeout is None else timeout)
        return False
    return True


def close_all_at_exit() -> None:
    """The stop hooks first (their last records go to open logs), then the logs."""
    global _exiting
    _exiting = True
    run_stop_hooks()
    for event_log in list(LIVE_LOGS):
        try:
            event_log.close(timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - never fail interpreter exit
            pass


def _after_fork_in_child() -> None:
    for event_log in list(LIVE_LOGS):
        event_log._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(close_all_at_exit)
