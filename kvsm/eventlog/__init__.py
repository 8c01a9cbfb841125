"""The event log: schema, non-blocking JSONL sink, structlog routing, reader.

Depends only on ``kvsm.lifecycle`` (never on vLLM, NIXL, ZMQ or torch).
"""

from kvsm.eventlog.log import EventLog
from kvsm.eventlog.reader import Problem, ReadResult, iter_log, read_logs
from kvsm.eventlog.schema import HEADER_FIELDS, KINDS, SCHEMA_VERSION, outcome_fields
from kvsm.eventlog.structlog_setup import configure_structlog

__all__ = [
    "EventLog",
    "HEADER_FIELDS",
    "KINDS",
    "Problem",
    "ReadResult",
    "SCHEMA_VERSION",
    "configure_structlog",
    "iter_log",
    "outcome_fields",
    "read_logs",
]
