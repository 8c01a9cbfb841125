"""Route structlog diagnostics into the event log as ``kind="log"`` records.

Why: one file per process, one ``seq`` and one pair of clocks for both the
lifecycle records and the free-text diagnostics around them, so replay can
show them on the same timeline. The forwarding processor hands the event dict
to ``EventLog.emit`` (cheap: no rendering on the caller's thread) and raises
``structlog.DropEvent`` so structlog itself prints nothing.

Caveat: ``structlog.configure`` is process-global. After
``configure_structlog(log)`` every ``structlog.get_logger()`` in the process
(not only kvsm's) writes into ``log``; other libraries that rely on structlog's
default console output lose it. Pass ``processors`` to run your own steps
first, or call ``structlog.reset_defaults()`` to undo.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import structlog
from structlog.typing import EventDict
from structlog.typing import Processor as StructlogProcessor

from kvsm.eventlog.log import EventLog
from kvsm.eventlog.schema import HEADER_FIELDS

__all__ = ["EventLogForwarder", "configure_structlog"]

# Header fields a log call may set directly; the others are stamped by the log,
# so a user field with such a name is kept under ``arg_<name>``.
_PASSTHROUGH = frozenset({"req", "src", "dst"})
_RENAMED = frozenset(HEADER_FIELDS) - _PASSTHROUGH - {"event"}


class EventLogForwarder:
    """Final structlog processor: ``emit(kind="log", event=message, level=...)``."""

    __slots__ = ("log",)

    def __init__(self, log: EventLog) -> None:
        self.log = log

    def __call__(self, logger: Any, method_name: str, event_dict: EventDict) -> NoReturn:
        ed = event_dict  # structlog hands each call its own fresh dict
        message = ed.pop("event", "")
        if not isinstance(message, str):
            message = str(message)
        level = ed.pop("level", method_name)
        req = ed.pop("req", None)
        src = ed.pop("src", None)
        dst = ed.pop("dst", None)
        if not _RENAMED.isdisjoint(ed):
            ed = {(f"arg_{k}" if k in _RENAMED else k): v for k, v in ed.items()}
        self.log.emit("log", message, None if req is None else str(req), src=src, dst=dst, level=level, **ed)
        raise structlog.DropEvent


def configure_structlog(
    log: EventLog,
    *,
    min_level: int = logging.DEBUG,
    processors: Sequence[StructlogProcessor] = (),
    cache_logger_on_first_use: bool = False,
) -> None:
    """Make ``structlog.get_logger(...).info("msg", req=..., k=v)`` a ``log``
    record in ``log``. Filtering by level happens in the bound logger (free
    for disabled levels); context vars bound with
    ``structlog.contextvars.bind_contextvars`` are merged in."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            *processors,
            EventLogForwarder(log),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=structlog.ReturnLoggerFactory(),
        cache_logger_on_first_use=cache_logger_on_first_use,
    )
