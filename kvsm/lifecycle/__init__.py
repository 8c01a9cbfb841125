"""The sans-I/O core: lifecycles, events, the tracker, invariants, timers.

Nothing under this package imports vLLM, NIXL, ZMQ or torch (a test enforces
it), so it can be read, tested and replayed on its own.
"""

from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock, SystemClock, VirtualClock
from kvsm.lifecycle.events import EVENT_TYPES, Event, event_from_record
from kvsm.lifecycle.machine import (
    IllegalEventPolicy,
    IllegalTransition,
    LifecycleTracker,
    Outcome,
    RequestMachine,
)
from kvsm.lifecycle.table import EFFECTS, LIFECYCLES, RECV, SEND, LifecycleSpec

__all__ = [
    "Clock",
    "EFFECTS",
    "EVENT_TYPES",
    "Event",
    "IllegalEventPolicy",
    "IllegalTransition",
    "LIFECYCLES",
    "LifecycleSpec",
    "LifecycleTracker",
    "Outcome",
    "RECV",
    "RequestMachine",
    "SEND",
    "SYSTEM_CLOCK",
    "SystemClock",
    "VirtualClock",
    "event_from_record",
]
