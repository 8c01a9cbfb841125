"""A clean stop on every exit of the process: the end of the script, SIGTERM,
Ctrl-C, as well as vLLM's own engine shutdown.

Why: an offline script (``LLM(...)``, ``generate``, end of file) never calls
the connector's ``shutdown`` itself, and a process killed by SIGTERM under
Python's default disposition runs no exit handler at all; either way the event
log ended without its clean-stop record and replay read a normal exit as a
crash. So ``stop_on_exit`` registers the stop with the event logs' exit handler
(``kvsm.eventlog.exit``: it runs before the logs close, whatever order
``atexit`` picks), and where SIGTERM still has Python's default disposition it
makes SIGTERM raise ``SystemExit(143)`` in the main thread instead: the
interpreter unwinds (locks are released, ``finally`` blocks run) and exits
through the same handler. Where vLLM installed its own SIGTERM handler (its
engine-core and worker processes, ``vllm serve``), that handler leads to
vLLM's engine shutdown, which calls the connector's ``shutdown``: it is left
alone. ``kill -9`` runs nothing, and replay still reads it as a crash.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

from kvsm.eventlog import exit as log_exit

__all__ = ["SIGTERM_EXIT_CODE", "on_stop_requested", "stop_on_exit"]

log = logging.getLogger(__name__)

# What a shell reports for a process ended by SIGTERM (128 + 15).
SIGTERM_EXIT_CODE: Final = 128 + signal.SIGTERM

_lock = threading.Lock()
_registered = 0
_installed = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Exit through the interpreter's normal path, so the stop hooks run."""
    if log_exit.exiting():
        return  # already on the way out: let the stop finish
    raise SystemExit(SIGTERM_EXIT_CODE)


def _install_sigterm() -> None:
    """Our handler, only where SIGTERM would kill without any exit handler (its
    default disposition) and only from the main thread (Python's rule)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # vLLM's (or the application's): it leads to a shutdown of its own
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed = True
    except (ValueError, OSError) as e:  # pragma: no cover - e.g. an embedded interpreter
        log.debug("kvsm: no SIGTERM handler installed: %s", e)


def _uninstall_sigterm() -> None:
    """Back to the default once nothing is left to stop (if the handler is still ours)."""
    global _installed
    if not _installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed = False
    except (ValueError, OSError):  # pragma: no cover
        pass


def stop_on_exit(stop: Callable[[], Any]) -> Callable[[], None]:
    """Run ``stop`` (once) when the process exits by any path that runs Python's
    exit handlers, and make SIGTERM one of those paths. Returns the call that
    cancels it (made by ``stop`` itself when it ran some other way: a shutdown
    from vLLM). ``stop`` must be idempotent and bound its own waits."""
    global _registered
    unregister = log_exit.on_exit(stop)
    with _lock:
        _registered += 1
    _install_sigterm()
    done = False

    def cancel() -> None:
        nonlocal done
        global _registered
        with _lock:
            if done:
                return
            done = True
            _registered -= 1
            last = _registered == 0
        unregister()
        if last:
            _uninstall_sigterm()

    return cancel


def on_stop_requested(notice: Callable[[], None], owner: str | None = None) -> Callable[[], None]:
    """Call ``notice`` when the process is asked to stop by a handler of its own.

    Why: vLLM's engine core handles SIGTERM/SIGINT by draining, stepping while
    it has work, and a finished prefill whose blocks are pinned for a decode
    engine is work until it is read or its lease ends; its parent kills it when
    the wait is over, and the log then reads as a crash. ``notice`` lets the
    connector close its pins in time. Each Python-level handler installed for
    SIGTERM and SIGINT (vLLM's) is wrapped: ``notice`` (which must only set a
    flag: it runs in a signal handler), then the handler. Where the disposition is
    the default or ours (``stop_on_exit``'s path: the process exits at once), or
    off the main thread, nothing is wrapped; with ``owner``, only a handler
    defined in that module is (the connector names vLLM's engine core: an
    application's own handler, which may not stop the process, is left alone).
    Returns the call that unwraps (a wrapper replaced since by someone else is
    left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    wrapped: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(signum)
            if not callable(previous) or previous is _on_sigterm or previous is signal.default_int_handler:
                continue
            if owner is not None and getattr(previous, "__module__", None) != owner:
                continue

            def handler(num: int, frame: FrameType | None, previous: Any = previous) -> None:
                try:
                    notice()
                finally:
                    previous(num, frame)

            signal.signal(signum, handler)
            wrapped[signum] = (handler, previous)
        except (ValueError, OSError) as e:  # pragma: no cover - e.g. an embedded interpreter
            log.debug("kvsm: no stop notice on signal %s: %s", signum, e)

    def unwrap() -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, (handler, previous) in wrapped.items():
            try:
                if signal.getsignal(signum) is handler:
                    signal.signal(signum, previous)
            except (ValueError, OSError):  # pragma: no cover
                pass
        wrapped.clear()

    return unwrap
