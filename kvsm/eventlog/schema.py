"""Event-log schema v1: the fields of every record, and how outcomes map to them.

One JSON object per line. Every record carries the *header* fields; what
follows depends on ``kind``:

``create``       a request's machine was created: ``lifecycle``, ``req``,
                 ``dst`` (the entry state), ``blocks``.
``transition``   an input moved a machine: ``lifecycle``, ``req``, ``event``
                 (the trigger), ``src``, ``dst``, ``input`` (the event's own
                 fields, enough to rebuild it), ``effects``, ``blocks`` (the
                 request's block ids when an effect holds or releases them).
``violation``    an input that was not legal: as a transition, plus
                 ``violation`` (its name); ``dst`` equals ``src``.
``log``          a diagnostic line from structlog (``event`` is its message).
``log_overflow`` the in-memory buffer was full: ``dropped`` records were lost
                 (they got no ``seq``, so ``seq`` stays gap-free).
``log_start``    first record of a process's log.

``seq`` is per process and gap-free: a gap in a file means lost lines.
"""

from __future__ import annotations

from typing import Any, Final

from kvsm.lifecycle.machine import Outcome
from kvsm.lifecycle.table import BLOCK_HOLDING_EFFECTS, BLOCK_RELEASING_EFFECTS

SCHEMA_VERSION: Final = 1

HEADER_FIELDS: Final = (
    "schema",
    "seq",
    "t_mono_ns",
    "t_wall_ns",
    "pid",
    "role",
    "engine_id",
    "rank",
    "kind",
    "req",
    "event",
    "src",
    "dst",
)

KINDS: Final = frozenset({"create", "transition", "violation", "log", "log_overflow", "log_start"})

_BLOCK_EFFECTS = BLOCK_HOLDING_EFFECTS | BLOCK_RELEASING_EFFECTS


def outcome_fields(outcome: Outcome) -> dict[str, Any]:
    """The kind-specific fields of a lifecycle outcome (the header is added by the log).

    On the hot path of every transition: plain dict building, no copies.
    """
    trigger = outcome.trigger
    effects = outcome.effects
    if trigger == "create":
        kind = "create"
    elif outcome.violation:
        kind = "violation"
    else:
        kind = "transition"
    fields: dict[str, Any] = {
        "kind": kind,
        "lifecycle": outcome.lifecycle,
        "req": outcome.req,
        "event": trigger,
        "src": outcome.src,
        "dst": outcome.dst,
    }
    if outcome.event is not None:
        fields["input"] = outcome.event.inputs()
    if effects:
        fields["effects"] = effects
        if not _BLOCK_EFFECTS.isdisjoint(effects):
            fields["blocks"] = outcome.block_ids
    if outcome.violation:
        fields["violation"] = outcome.violation
    if outcome.stale:
        fields["stale"] = outcome.stale
    if kind == "create":
        fields["blocks"] = outcome.block_ids
    return fields
