"""The one declaration of every request lifecycle kvsm runs.

Nothing else in kvsm may change a request's state. Each lifecycle is a list
of states and a list of transitions written in the ``transitions`` library's
vocabulary (``trigger``, ``source``, ``dest``, ``prepare``, ``conditions``,
``after``), so the same declaration:

* drives the runtime, compiled by ``LifecycleSpec`` into a dict lookup
  (``transitions`` costs ~14 us a trigger and O(n) per added model, too
  much for the hot path; see docs/design.md),
* builds a real ``transitions.Machine`` (``LifecycleSpec.machine``) that the
  tests run side by side with the compiled table and that
  ``tools/statecharts.py`` renders with its mermaid engine,
* and is what replay re-applies recorded inputs to.

Callback names have fixed meanings:

``prepare``
    folds the event's inputs into the request's data before conditions are
    checked (functions in ``PREPARE``).
``conditions``
    pure predicates over the request's data (functions in ``CONDITIONS``).
``after``
    *effects*: what the I/O layer must now do (free blocks, arm a timer...).
    The core never performs them; it returns their names (``EFFECTS``).

Rules for a (state, trigger) pair are tried in order, like ``transitions``
does; the last one must be unconditional, so a legal event always moves
the machine somewhere (possibly to the same state) and never silently does
nothing.

This module gathers them and keeps the public names: each lifecycle is
declared in a module of its own (``recv.py``, ``send.py``, ``peer.py``,
``sched.py``), ``spec.py`` compiles and checks a declaration, and
``vocabulary.py`` holds the names a declaration may use (``PREPARE``,
``CONDITIONS``, ``EFFECTS``, the scheduler's merged in). They import one way
(callbacks, vocabulary, spec, declarations, this module), so a new lifecycle
is one new module and one line in ``LIFECYCLES``.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvsm.lifecycle import sched as _sched
from kvsm.lifecycle.folds import LEASE_MARGIN_NS  # noqa: F401 - its old home
from kvsm.lifecycle.peer import (  # noqa: F401 - re-exported: the table's public names
    PEER,
    PEER_FETCH_STATES,
    PEER_READABLE_STATES,
    PEER_STALE,
    PEER_STATES,
    PEER_TRANSITIONS,
    PEER_UNREACHABLE_STATES,
)
from kvsm.lifecycle.recv import RECV, RECV_STALE, RECV_STATES, RECV_TRANSITIONS  # noqa: F401
from kvsm.lifecycle.send import (  # noqa: F401
    ANSWER_OK,
    ANSWER_UNKNOWN,
    CLAIM_ANSWERS,
    SEND,
    SEND_EARLY_WAITING,
    SEND_NEW_AFTER_END,
    SEND_STALE,
    SEND_STATES,
    SEND_TRANSITIONS,
)
from kvsm.lifecycle.spec import LifecycleDeclarationError, LifecycleSpec, Rule, names_of  # noqa: F401
from kvsm.lifecycle.vocabulary import (  # noqa: F401
    BLOCK_HOLDING_EFFECTS,
    BLOCK_RELEASING_EFFECTS,
    CONDITIONS,
    EFFECTS,
    MAX_EARLY_INPUTS,
    PREPARE,
    SHARED_HOLDING_EFFECTS,
)

# The scheduler half's lifecycle: declared in kvsm/lifecycle/sched.py with its own
# callbacks and effects (merged into vocabulary.py's registry); compiled here.
SCHED = LifecycleSpec(**_sched.SCHED_DECLARATION)

LIFECYCLES: Mapping[str, LifecycleSpec] = {RECV.name: RECV, SEND.name: SEND, PEER.name: PEER, SCHED.name: SCHED}
