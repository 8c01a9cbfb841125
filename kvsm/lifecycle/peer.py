"""The peer lifecycle (``peer``): one machine per prefill worker a decode
worker talks to, for as long as the process lives."""

from __future__ import annotations

from typing import Any

from kvsm.lifecycle.data import PeerMachine
from kvsm.lifecycle.spec import LifecycleSpec

PEER_STATES = ["unconnected", "alive", "stale", "dead", "probing", "closed"]
_PEER_LIVE = ["unconnected", "alive", "stale", "probing"]

PEER_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "agent_added", "source": ["unconnected", "stale", "probing"], "dest": "alive",
     "prepare": "take_agent"},
    # A claim sent before the death, answered after it: alive after all.
    {"trigger": "agent_added", "source": "dead", "dest": "alive", "prepare": "take_agent",
     "after": "cancel_backoff_timer"},
    {"trigger": "answered", "source": _PEER_LIVE, "dest": "=", "prepare": "note_answer"},
    {"trigger": "answered", "source": "dead", "dest": "probing", "prepare": "note_answer",
     "after": "cancel_backoff_timer"},
    # A timeout of a message sent before the last news tells nothing new.
    {"trigger": "died", "source": _PEER_LIVE, "dest": "=", "conditions": "outdated"},
    {"trigger": "died", "source": _PEER_LIVE, "dest": "dead", "prepare": "note_death",
     "after": ["drop_agent", "fail_waiting", "arm_backoff_timer"]},
    {"trigger": "read_failed", "source": ["alive", "stale"], "dest": "stale", "prepare": "note_read_failed"},
    # Reads from it stalled: a liveness probe is out (one at a time); its answer
    # or its silence (answered, died) ends it.
    {"trigger": "probe_sent", "source": ["alive", "stale"], "dest": "=", "prepare": "note_probe"},
    {"trigger": "backoff_over", "source": "dead", "dest": "probing", "prepare": "end_backoff"},
    {"trigger": "closed", "source": [*_PEER_LIVE, "dead"], "dest": "closed", "after": "cancel_backoff_timer"},
]

PEER_STALE: list[dict[str, Any]] = [
    {"trigger": "died", "source": "dead", "why": "already known dead: one outage, one back-off step"},
    {"trigger": "read_failed", "source": ["unconnected", "dead", "probing"],
     "why": "its agent is gone already: the next claim fetches it anyway"},
    {"trigger": "probe_sent", "source": ["unconnected", "dead", "probing"],
     "why": "no read goes to it: nothing to probe"},
]

# What each peer state lets a decode worker do: claims to a peer in FETCH_STATES
# ask for its metadata too; a peer in UNREACHABLE_STATES gets no messages and
# fails new requests at once. The transitions fold this into the machine's data
# (``needs_metadata``, ``agent_readable``, ``unreachable``), which is what the
# worker reads; tests/test_lifecycle.py checks the folds agree with these sets.
PEER_FETCH_STATES = frozenset({"unconnected", "stale", "probing", "dead"})
# Reads may be posted to the machine's agent only in these (after a death it
# was removed from the transport).
PEER_READABLE_STATES = frozenset({"alive", "stale"})
PEER_UNREACHABLE_STATES = frozenset({"dead"})


PEER = LifecycleSpec(
    name="peer",
    states=tuple(PEER_STATES),
    initial="unconnected",
    terminal=frozenset({"closed"}),
    transitions=tuple(PEER_TRANSITIONS),
    entry_states=frozenset({"unconnected"}),
    stale_inputs=tuple(PEER_STALE),
    machine_cls=PeerMachine,
    lives_with_process=True,
)
