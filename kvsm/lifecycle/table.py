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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsm.lifecycle.data import PeerMachine, RequestMachine
from kvsm.lifecycle.folds import LEASE_MARGIN_NS, PREPARE  # noqa: F401 - LEASE_MARGIN_NS: its old home

# --- effects: what a transition asks the I/O layer to do --------------------

EFFECTS: Mapping[str, str] = {
    # receiving side
    "take_blocks": "the allocated local blocks are ours to write until reported back",
    "post_reads": "post NIXL READs of the remote blocks into the local blocks",
    "post_early_reads": ("post the reads right after the request's claims leave (later in the same loop turn), "
                         "without waiting for their answers (each read's notification is held by the prefill "
                         "side until its claim); a request that ended meanwhile posts none"),
    "send_notif": "tell the prefill side over the side channel that its blocks are not needed (nothing to read)",
    "deliver_blocks": "report finished_recving: the local blocks hold the remote KV",
    "report_invalid": "report the local blocks through get_block_ids_with_load_errors",
    "count_late_reads": "count reads that completed too late in their claim's lease (metrics, log)",
    "count_failure": "count a claim's refusal as the request's failure, by its kind (metrics)",
    "release_blocks": "report finished_recving for an aborted request: blocks go back",
    "notify_abandon": "tell the prefill side we will never read, so it can unpin",
    "release_reads": "release the request's settled NIXL transfer handles",
    "cancel_reads": ("release what can be released of the reads in flight, and watch the rest until they settle "
                     "(the request's claims are over too: no retry)"),
    # sending side
    "pin_blocks": "keep the request's blocks out of the free pool (delay the free)",
    "free_blocks": "report finished_sending: the blocks may be reused",
    "count_expired_lease": "count a lease that expired unread (metrics, rate-limited warning)",
    "arm_lease": "start the lease timer for the pinned blocks",
    "extend_lease": "move the lease deadline (a heartbeat came)",
    "cancel_lease": "stop the lease timer",
    "arm_abandon_timer": "forget an early abandon after a lease if its prefill never finishes here",
    "cancel_abandon_timer": "stop the early abandon's timer",
    "start_handshake": "ask the prefill side for its agent (if not known yet) and claim the request's blocks",
    "arm_handshake_timer": "start the handshake timeout",
    "cancel_handshake_timer": "stop the handshake timeout and the claims' retries (the handshake is over)",
    "arm_transfer_timer": "start the transfer timeout",
    "cancel_timers": "stop the request's timers",
    # peers
    "drop_agent": ("remove the peer's NIXL agent (every read from it settles, none can write afterwards) and close "
                   "its side-channel socket (the next contact connects afresh)"),
    "fail_waiting": "fail every request that depends on the peer",
    "arm_backoff_timer": "end the back-off at the machine's dead_until_ns",
    "cancel_backoff_timer": "stop the back-off timer",
}

# Effects that hand blocks back to their pool; the block ledger counts them.
BLOCK_RELEASING_EFFECTS = frozenset({"deliver_blocks", "report_invalid", "release_blocks", "free_blocks"})
# Effects that take blocks out of the pool for this request.
BLOCK_HOLDING_EFFECTS = frozenset({"take_blocks", "pin_blocks"})
# Holds that others may share: a pin only keeps blocks from being freed (the
# prefix cache lets several finished prefills pin one block); a take is for
# writing and is exclusive.
SHARED_HOLDING_EFFECTS = frozenset({"pin_blocks"})


# --- conditions: pure predicates over the request's data --------------------


def _all_reads_in(m: RequestMachine, ev: Any) -> bool:
    return m.reads_seen >= m.reads_expected


def _all_claims_granted(m: RequestMachine, ev: Any) -> bool:
    return m.claims_granted == (1 << m.claims_needed) - 1


def _within_lease(m: RequestMachine, ev: Any) -> bool:
    return m.late_ns <= 0


def _claims_outstanding(m: RequestMachine, ev: Any) -> bool:
    return not _all_claims_granted(m, ev)


def _reads_early(m: RequestMachine, ev: Any) -> bool:
    return bool(ev.early)


def _peer_gone(m: RequestMachine, ev: Any) -> bool:
    return bool(ev.peer_gone)


def _answers_a_claim(m: RequestMachine, ev: Any) -> bool:
    return bool(ev.claim)


def _outdated(m: PeerMachine, ev: Any) -> bool:
    """Sent before the last news about the peer: part of an outage already
    handled, or older than an answer."""
    return 0 < ev.sent_ns < m.news_ns


CONDITIONS: Mapping[str, Callable[[Any, Any], bool]] = {
    "all_reads_in": _all_reads_in,
    "all_claims_granted": _all_claims_granted,
    "claims_outstanding": _claims_outstanding,
    "reads_early": _reads_early,
    "within_lease": _within_lease,
    "peer_gone": _peer_gone,
    "answers_a_claim": _answers_a_claim,
    "outdated": _outdated,
}


# --- the declarations -------------------------------------------------------


def _each(triggers: Sequence[str], **rest: Any) -> list[dict[str, Any]]:
    """One ``transitions`` dict per trigger (the library takes one trigger each)."""
    return [{"trigger": t, **rest} for t in triggers]


RECV_STATES = [
    "new",
    "awaiting_blocks",
    "pending_handshake",
    "reading_unclaimed",
    "read_unclaimed",
    "remote_known",
    "transferring",
    "failing",
    "aborting",
    "done",
    "failed",
    "aborted",
    "closed_at_shutdown",
]

_FAILURES = ["error", "timeout", "peer_dead", "internal_error"]
# Failures that say nothing about posted reads (they may still write).
_INTERRUPTS = ["timeout", "peer_dead", "internal_error"]


RECV_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "matched", "source": "new", "dest": "awaiting_blocks", "prepare": "take_remote"},
    # Every prefill worker it reads from is known and readable: the reads go out
    # right behind the claims, so the claims' round trip overlaps the reads.
    {"trigger": "allocated", "source": "awaiting_blocks", "dest": "reading_unclaimed", "prepare": "hold_blocks",
     "conditions": "reads_early",
     "after": ["take_blocks", "arm_handshake_timer", "start_handshake", "post_early_reads"]},
    {"trigger": "allocated", "source": "awaiting_blocks", "dest": "pending_handshake",
     "prepare": "hold_blocks", "after": ["take_blocks", "arm_handshake_timer", "start_handshake"]},
    # Every prefill rank the request reads from (one, unless the tensor parallel
    # sizes differ) must grant its claim before any read is posted.
    {"trigger": "handshake_ok", "source": "pending_handshake", "dest": "remote_known", "prepare": "note_grant",
     "conditions": "all_claims_granted", "after": ["cancel_handshake_timer", "post_reads"]},
    {"trigger": "handshake_ok", "source": "pending_handshake", "dest": "="},
    {"trigger": "reads_posted", "source": "remote_known", "dest": "transferring", "after": "arm_transfer_timer"},
    # Reads posted before the claims' answers. Once every claim is granted they are
    # an ordinary transfer; reads that completed first wait for the grants, and are
    # served only if they completed inside the lease the claims granted.
    {"trigger": "reads_posted", "source": "reading_unclaimed", "dest": "=", "after": "arm_transfer_timer"},
    {"trigger": "handshake_ok", "source": "reading_unclaimed", "dest": "transferring", "prepare": "note_grant",
     "conditions": "all_claims_granted", "after": "cancel_handshake_timer"},
    {"trigger": "handshake_ok", "source": "reading_unclaimed", "dest": "="},
    {"trigger": "all_reads_done", "source": "reading_unclaimed", "dest": "read_unclaimed",
     "prepare": "note_reads_done"},
    {"trigger": "handshake_ok", "source": "read_unclaimed", "dest": "=", "prepare": "note_grant",
     "conditions": "claims_outstanding"},
    {"trigger": "handshake_ok", "source": "read_unclaimed", "dest": "done", "prepare": "check_lease",
     "conditions": "within_lease", "after": ["cancel_handshake_timer", "release_reads", "deliver_blocks",
                                             "cancel_timers"]},
    {"trigger": "handshake_ok", "source": "read_unclaimed", "dest": "failed", "prepare": "note_late_reads",
     "after": ["count_late_reads", "release_reads", "report_invalid", "cancel_timers"]},
    # Full local prefix hit: nothing to read, but the prefill side must unpin.
    {"trigger": "nothing_to_read", "source": ["remote_known", "reading_unclaimed"], "dest": "done",
     "after": ["send_notif", "deliver_blocks", "cancel_timers"]},
    # The reads carried their notification. They are served only if they
    # completed inside the lease the claim granted: else the prefill side may
    # have reused the blocks while we read them.
    {"trigger": "all_reads_done", "source": "transferring", "dest": "done", "prepare": "check_lease",
     "conditions": "within_lease", "after": ["release_reads", "deliver_blocks", "cancel_timers"]},
    {"trigger": "all_reads_done", "source": "transferring", "dest": "failed", "prepare": "note_late_reads",
     "after": ["count_late_reads", "release_reads", "report_invalid", "cancel_timers"]},
    # Before any read is posted a failure ends the request at once.
    # A claim refused (or its blocks gone) fails the request while its claims are
    # out, counted by its kind; after them it changes nothing (every claim was
    # granted, or the request's own failure is under way, its reads settling).
    {"trigger": "error", "source": "pending_handshake", "dest": "failed", "prepare": "note_failure",
     "conditions": "answers_a_claim", "after": ["count_failure", "notify_abandon", "report_invalid", "cancel_timers"]},
    {"trigger": "error", "source": "reading_unclaimed", "dest": "failing", "prepare": "note_failure",
     "conditions": "answers_a_claim", "after": ["count_failure", "cancel_reads"]},
    {"trigger": "error", "source": "read_unclaimed", "dest": "failed", "prepare": "note_failure",
     "conditions": "answers_a_claim",
     "after": ["count_failure", "notify_abandon", "release_reads", "report_invalid", "cancel_timers"]},
    {"trigger": "error", "source": ["remote_known", "transferring", "failing", "aborting"], "dest": "=",
     "conditions": "answers_a_claim"},
    # Before any read is posted a failure ends the request at once.
    *_each(_FAILURES, source=["new", "awaiting_blocks", "pending_handshake", "remote_known"],
           dest="failed", prepare="note_failure", after=["notify_abandon", "report_invalid", "cancel_timers"]),
    # A transfer that ended in error is over: nothing can write any more.
    {"trigger": "error", "source": "transferring", "dest": "failed", "prepare": "note_failure",
     "conditions": "peer_gone", "after": ["release_reads", "report_invalid", "cancel_timers"]},
    {"trigger": "error", "source": "transferring", "dest": "failed", "prepare": "note_failure",
     "after": ["notify_abandon", "release_reads", "report_invalid", "cancel_timers"]},
    # A timeout or a dead peer does not stop posted reads: wait for quiescence
    # before the blocks go back to vLLM (they could still be written).
    *_each(_INTERRUPTS, source="transferring", dest="failing", prepare="note_failure", after="cancel_reads"),
    # Reads posted before the claims' answers: any failure (a claim refused too)
    # waits for them to settle; once settled, every prefill worker not yet through
    # is told (a read's notification is held there until its claim).
    *_each(_FAILURES, source="reading_unclaimed", dest="failing", prepare="note_failure", after="cancel_reads"),
    *_each(_FAILURES, source="read_unclaimed", dest="failed", prepare="note_failure",
           after=["notify_abandon", "release_reads", "report_invalid", "cancel_timers"]),
    *_each(_INTERRUPTS, source=["failing", "aborting"], dest="=", after="cancel_reads"),
    # Once nothing can write, every prefill worker not yet through is told we will
    # never read (a read that completed after its claim's grant told it itself).
    *_each(["all_reads_done", "reads_quiesced", "error"], source="failing", dest="failed",
           after=["notify_abandon", "release_reads", "report_invalid", "cancel_timers"]),
    # Abort: immediate where no read is posted, via aborting where one is.
    {"trigger": "abort", "source": "new", "dest": "aborted", "after": ["release_blocks", "cancel_timers"]},
    # From awaiting_blocks on the prefill side is known: tell it to unpin now
    # rather than hold the blocks until its lease runs out.
    {"trigger": "abort", "source": ["awaiting_blocks", "pending_handshake", "remote_known"], "dest": "aborted",
     "after": ["notify_abandon", "release_blocks", "cancel_timers"]},
    {"trigger": "abort", "source": ["transferring", "reading_unclaimed"], "dest": "aborting", "after": "cancel_reads"},
    {"trigger": "abort", "source": "read_unclaimed", "dest": "aborted",
     "after": ["notify_abandon", "release_reads", "release_blocks", "cancel_timers"]},
    {"trigger": "abort", "source": "failing", "dest": "aborting"},
    *_each(["all_reads_done", "reads_quiesced", "error"], source="aborting", dest="aborted",
           after=["notify_abandon", "release_reads", "release_blocks", "cancel_timers"]),
    # A clean stop: whatever is live ends here, its blocks going back (the process
    # ends, so no read can land anywhere vLLM would look).
    {"trigger": "shutdown", "source": [s for s in RECV_STATES if s not in ("done", "failed", "aborted",
                                                                            "closed_at_shutdown")],
     "dest": "closed_at_shutdown", "after": ["release_reads", "release_blocks", "cancel_timers"]},
]

_RECV_LATER = ["remote_known", "transferring", "failing", "aborting"]
_RECV_ENDS = ["done", "failed", "aborted", "closed_at_shutdown"]
RECV_STALE: list[dict[str, Any]] = [
    {"trigger": "handshake_ok", "source": _RECV_LATER,
     "why": "an answer to a second claim: the first one moved the request on"},
    {"trigger": "abort", "source": "aborting", "why": "aborted twice"},
    {"trigger": ["abort", "handshake_ok", "timeout", "peer_dead", "error", "internal_error", "reads_quiesced",
                 "all_reads_done"],
     "source": _RECV_ENDS, "why": "the request ended (and vLLM was told) before this input arrived"},
]

SEND_STATES = ["prefilling", "abandoned_early", "read_early", "awaiting_pull", "released", "expired", "forgotten",
               "closed_at_shutdown"]

SEND_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "finished_ok", "source": "prefilling", "dest": "awaiting_pull",
     "prepare": "pin_blocks_data", "after": ["pin_blocks", "arm_lease"]},
    *_each(["abort", "finished_abnormally"], source="prefilling", dest="released"),
    # A claim or heartbeat extends the lease; a read its rank posted before the
    # claim (held, see note_read) counts now.
    {"trigger": "heartbeat", "source": "awaiting_pull", "dest": "released",
     "prepare": ["extend_lease_data", "note_claimant"], "conditions": "all_reads_in",
     "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "heartbeat", "source": "awaiting_pull", "dest": "=", "after": "extend_lease"},
    {"trigger": "read_notif", "source": "awaiting_pull", "dest": "released", "prepare": "note_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "read_notif", "source": "awaiting_pull", "dest": "="},
    # Each decode rank that has business with these blocks is through once (its
    # read's notification or its abandon); the blocks go once all are.
    {"trigger": "remote_abandoned", "source": "awaiting_pull", "dest": "released", "prepare": "count_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "remote_abandoned", "source": "awaiting_pull", "dest": "="},
    {"trigger": "lease_expired", "source": "awaiting_pull", "dest": "expired",
     "after": ["count_expired_lease", "free_blocks"]},
    # The decode side gave up before this worker heard of the prefill's end
    # (its abandon overtook the scheduler's finish): the finish frees at once.
    {"trigger": "remote_abandoned", "source": "prefilling", "dest": "abandoned_early",
     "after": "arm_abandon_timer"},
    {"trigger": "finished_ok", "source": "abandoned_early", "dest": "released", "prepare": "pin_blocks_data",
     "after": ["cancel_abandon_timer", "pin_blocks", "free_blocks"]},
    *_each(["abort", "finished_abnormally"], source="abandoned_early", dest="released",
           after="cancel_abandon_timer"),
    {"trigger": "abandon_expired", "source": "abandoned_early", "dest": "forgotten"},
    # A read's notification before this worker heard of the prefill's end (a read
    # posted at once by a decode worker that knows us): held, like an early
    # abandon, until the finish pins the blocks; it counts once its rank claims.
    {"trigger": "read_notif", "source": "prefilling", "dest": "read_early", "prepare": "note_read",
     "after": "arm_abandon_timer"},
    {"trigger": "read_notif", "source": "read_early", "dest": "=", "prepare": "note_read"},
    {"trigger": "remote_abandoned", "source": "read_early", "dest": "=", "prepare": "count_read"},
    {"trigger": "finished_ok", "source": "read_early", "dest": "released", "prepare": "pin_blocks_data",
     "conditions": "all_reads_in", "after": ["cancel_abandon_timer", "pin_blocks", "free_blocks"]},
    {"trigger": "finished_ok", "source": "read_early", "dest": "awaiting_pull",
     "after": ["cancel_abandon_timer", "pin_blocks", "arm_lease"]},
    *_each(["abort", "finished_abnormally"], source="read_early", dest="released", after="cancel_abandon_timer"),
    {"trigger": "abandon_expired", "source": "read_early", "dest": "forgotten"},
    # A clean stop: pinned blocks are freed (finished_sending, so the block ledger
    # balances); a request not pinned yet holds nothing, its timers stop.
    {"trigger": "shutdown", "source": "awaiting_pull", "dest": "closed_at_shutdown",
     "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "shutdown", "source": "prefilling", "dest": "closed_at_shutdown"},
    {"trigger": "shutdown", "source": ["abandoned_early", "read_early"], "dest": "closed_at_shutdown",
     "after": "cancel_abandon_timer"},
    # A draining engine's time is up: only what is pinned closes (a request still
    # prefilling, or known only by an early input, is pinned by its finish and closed
    # at the next step that says so).
    {"trigger": "drain_over", "source": "awaiting_pull", "dest": "closed_at_shutdown",
     "after": ["cancel_lease", "free_blocks"]},
]

SEND_STALE: list[dict[str, Any]] = [
    {"trigger": ["finished_ok", "finished_abnormally", "abort"], "source": ["awaiting_pull", "released", "expired"],
     "why": "told twice (a direct hand-off that partly failed also goes with the next step)"},
    {"trigger": ["finished_ok", "finished_abnormally", "abort", "remote_abandoned", "read_notif", "heartbeat"],
     "source": "closed_at_shutdown", "why": "the worker was shutting down: it had let the request go"},
    {"trigger": "remote_abandoned", "source": ["abandoned_early", "released", "expired", "forgotten"],
     "why": "nothing is pinned for it (abandoned twice, or released already)"},
    {"trigger": "read_notif", "source": "released",
     "why": "released already (the reader's abandon overtook its read's notification)"},
    {"trigger": "read_notif", "source": "abandoned_early",
     "why": "another reader gave the request up before this worker heard of its finish, which frees it"},
    {"trigger": "read_notif", "source": "forgotten",
     "why": "its prefill never finished here within a lease of an early input: forgotten"},
]

# A finish for a request whose early abandon was forgotten is a new request.
SEND_NEW_AFTER_END = frozenset({"forgotten"})

# How the prefill side answers a claim (or heartbeat) for a request, by the
# state of its send machine after the claim was applied (None: not known here,
# or forgotten). "unknown": ask again (the prefill worker may not have heard of
# the finish yet); "expired": the blocks are gone.
CLAIM_ANSWERS: Mapping[str | None, str] = {
    None: "unknown",
    "prefilling": "unknown",
    "abandoned_early": "unknown",
    "read_early": "unknown",
    "awaiting_pull": "ok",
    "released": "expired",
    "expired": "expired",
    "forgotten": "unknown",
    "closed_at_shutdown": "expired",
}

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


# --- compiling a declaration ------------------------------------------------


def names_of(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """A declaration field (one name, a list of names, or nothing) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled transition for one (source state, trigger) pair."""

    trigger: str
    source: str
    dest: str
    prepare: tuple[str, ...] = ()
    conditions: tuple[str, ...] = ()
    effects: tuple[str, ...] = ()
    # Non-empty: a declared stale input (the text says why it no longer
    # applies): the machine stays where it is and nothing is done.
    stale: str = ""


class LifecycleDeclarationError(ValueError):
    """The declaration itself is inconsistent (caught at import time)."""


@dataclass(frozen=True)
class LifecycleSpec:
    """A named lifecycle: its states, its transitions, and their compiled form."""

    name: str
    states: tuple[str, ...]
    initial: str
    terminal: frozenset[str]
    transitions: tuple[Mapping[str, Any], ...]
    # States a machine may be created in: a process that learns of a request
    # mid-way (a worker seeing the scheduler's metadata) starts there.
    entry_states: frozenset[str] = frozenset()
    # Illegal (state, trigger) pairs that have a specific name in reports.
    named_violations: Mapping[tuple[str, str], str] = field(default_factory=dict)
    # Inputs that may arrive after they stopped mattering (a reply to a claim
    # whose request already failed, a second finish): ``{"trigger", "source",
    # "why"}``. From a live state they are rules that stay and do nothing; from
    # a terminal state they are recorded instead of being a violation.
    stale_inputs: tuple[Mapping[str, Any], ...] = ()
    # The class of the data each machine carries.
    machine_cls: type[RequestMachine] = RequestMachine
    # Machines that last as long as their process (peers): one still live where a
    # log ends (a running or crashed process) is not stuck; a clean stop ends it.
    lives_with_process: bool = False
    # Terminal states after which an input for the same request begins a new
    # machine (``LifecycleTracker.may_begin``): a finish whose early abandon was forgotten.
    new_after_end: frozenset[str] = frozenset()
    rules: Mapping[tuple[str, str], tuple[Rule, ...]] = field(init=False, repr=False)
    stale_after_end: Mapping[tuple[str, str], str] = field(init=False, repr=False)
    triggers: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        rules = _compile(self)
        after_end: dict[tuple[str, str], str] = {}
        for t in self.stale_inputs:
            unknown_keys = set(t) - {"trigger", "source", "why"}
            if unknown_keys or not t.get("why"):
                raise LifecycleDeclarationError(
                    f"{self.name}: a stale input needs exactly trigger, source and why: {t}")
            for trigger in names_of(t["trigger"]):
                for source in names_of(t["source"]):
                    if (source, trigger) in rules:
                        raise LifecycleDeclarationError(
                            f"{self.name}: ({source!r}, {trigger!r}) is declared both as a transition and stale")
                    if source in self.terminal:
                        after_end[(source, trigger)] = t["why"]
                    else:
                        rules[(source, trigger)] = (Rule(trigger, source, source, stale=t["why"]),)
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "stale_after_end", after_end)
        object.__setattr__(self, "triggers", frozenset(t for (_, t) in rules))
        _validate(self)

    def legal_triggers(self, state: str) -> list[str]:
        return sorted(t for (s, t) in self.rules if s == state)

    def machine(self, model: Any = "self", **kwargs: Any) -> Any:
        """A real ``transitions.Machine`` built from this declaration.

        Used by the tests (run side by side with the compiled table) and by the
        statecharts tool (``machine_cls=GraphMachine``). Not used on the hot path.
        """
        from transitions import Machine

        logging.getLogger("transitions").setLevel(logging.WARNING)
        machine_cls = kwargs.pop("machine_cls", Machine)
        initial = kwargs.pop("initial", self.initial)
        # Stale inputs from live states are internal transitions (dest None):
        # legal, and they change nothing.
        stale = [{"trigger": r.trigger, "source": r.source, "dest": None}
                 for rules in self.rules.values() for r in rules if r.stale]
        stale += [{"trigger": trigger, "source": source, "dest": None} for source, trigger in self.stale_after_end]
        return machine_cls(
            model=model,
            states=list(self.states),
            initial=initial,
            transitions=[dict(t) for t in self.transitions] + stale,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            send_event=False,
            **kwargs,
        )


def _compile(spec: LifecycleSpec) -> dict[tuple[str, str], tuple[Rule, ...]]:
    table: dict[tuple[str, str], list[Rule]] = {}
    for t in spec.transitions:
        unknown_keys = set(t) - {"trigger", "source", "dest", "prepare", "conditions", "after"}
        if unknown_keys:
            raise LifecycleDeclarationError(f"{spec.name}: unsupported keys {sorted(unknown_keys)} in {t}")
        for trigger in names_of(t["trigger"]):
            for source in names_of(t["source"]):
                dest = source if t["dest"] == "=" else t["dest"]
                rule = Rule(trigger, source, dest, names_of(t.get("prepare")), names_of(t.get("conditions")),
                            names_of(t.get("after")))
                table.setdefault((source, trigger), []).append(rule)
    return {k: tuple(v) for k, v in table.items()}


def _validate(spec: LifecycleSpec) -> None:
    states = set(spec.states)
    where = f"lifecycle {spec.name!r}"
    if spec.initial not in states:
        raise LifecycleDeclarationError(f"{where}: initial state {spec.initial!r} is not declared")
    for s in spec.terminal | spec.entry_states:
        if s not in states:
            raise LifecycleDeclarationError(f"{where}: state {s!r} is not declared")
    for (source, trigger) in spec.stale_after_end:
        if source not in states:
            raise LifecycleDeclarationError(f"{where}: source {source!r} of stale {trigger!r} is not declared")
    for (source, trigger), rules in spec.rules.items():
        if source not in states:
            raise LifecycleDeclarationError(f"{where}: source {source!r} of {trigger!r} is not declared")
        if source in spec.terminal:
            raise LifecycleDeclarationError(f"{where}: terminal state {source!r} has a transition on {trigger!r}")
        for r in rules:
            if r.dest not in states:
                raise LifecycleDeclarationError(f"{where}: dest {r.dest!r} of {trigger!r} is not declared")
            for name in r.prepare:
                if name not in PREPARE:
                    raise LifecycleDeclarationError(f"{where}: unknown prepare callback {name!r}")
            for name in r.conditions:
                if name not in CONDITIONS:
                    raise LifecycleDeclarationError(f"{where}: unknown condition {name!r}")
            for name in r.effects:
                if name not in EFFECTS:
                    raise LifecycleDeclarationError(f"{where}: unknown effect {name!r}")
        if rules[-1].conditions:
            raise LifecycleDeclarationError(
                f"{where}: the last rule for ({source!r}, {trigger!r}) is conditional; "
                "a legal event must always move the machine")
    reachable = _reachable(spec.initial, spec.rules) | {
        s for e in spec.entry_states for s in _reachable(e, spec.rules)}
    unreachable = states - reachable
    if unreachable:
        raise LifecycleDeclarationError(f"{where}: states never reached: {sorted(unreachable)}")
    for s in states - spec.terminal:
        if not (_reachable(s, spec.rules) & spec.terminal):
            raise LifecycleDeclarationError(f"{where}: no terminal state is reachable from {s!r}")


def _reachable(start: str, rules: Mapping[tuple[str, str], Iterable[Rule]]) -> set[str]:
    seen = {start}
    frontier = [start]
    while frontier:
        s = frontier.pop()
        for (source, _), rs in rules.items():
            if source == s:
                for r in rs:
                    if r.dest not in seen:
                        seen.add(r.dest)
                        frontier.append(r.dest)
    return seen


RECV = LifecycleSpec(
    name="recv",
    states=tuple(RECV_STATES),
    initial="new",
    terminal=frozenset({"done", "failed", "aborted", "closed_at_shutdown"}),
    transitions=tuple(RECV_TRANSITIONS),
    entry_states=frozenset({"new", "pending_handshake"}),
    named_violations={},
    stale_inputs=tuple(RECV_STALE),
)

SEND = LifecycleSpec(
    name="send",
    states=tuple(SEND_STATES),
    initial="prefilling",
    terminal=frozenset({"released", "expired", "forgotten", "closed_at_shutdown"}),
    transitions=tuple(SEND_TRANSITIONS),
    entry_states=frozenset({"prefilling"}),
    named_violations={
        ("expired", "read_notif"): "read_after_lease_expiry",
        ("expired", "heartbeat"): "heartbeat_after_lease_expiry",
    },
    stale_inputs=tuple(SEND_STALE),
    new_after_end=SEND_NEW_AFTER_END,
)

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

# The scheduler half's lifecycle: declared in kvsm/lifecycle/sched.py with its own
# callbacks and effects, which join the tables here; compiled like the others.
from kvsm.lifecycle import sched as _sched  # noqa: E402

PREPARE = {**PREPARE, **_sched.SCHED_PREPARE}
CONDITIONS = {**CONDITIONS, **_sched.SCHED_CONDITIONS}
EFFECTS = {**EFFECTS, **_sched.SCHED_EFFECTS}
SCHED = LifecycleSpec(**_sched.SCHED_DECLARATION)

LIFECYCLES: Mapping[str, LifecycleSpec] = {RECV.name: RECV, SEND.name: SEND, PEER.name: PEER, SCHED.name: SCHED}
