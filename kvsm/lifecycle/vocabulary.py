"""The names a lifecycle declaration may use: its ``prepare`` callbacks, its
conditions and its effects.

One registry for every lifecycle (RECV, SEND and PEER here; the scheduler
half's from ``sched.py``, merged in below), because the compiled step
(``machine.py``), the declarations' validation (``spec.py``) and the log
reader all look a name up in one place. It sits below the declarations and
above the callbacks, so the core's modules import one way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvsm.lifecycle import sched as _sched
from kvsm.lifecycle.data import PeerMachine, RequestMachine
from kvsm.lifecycle.folds import PREPARE as _PREPARE

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
    "ask_writes": ("push mode: ask every prefill worker over the side channel to write its blocks into ours, "
                   "with our agent and a deadline after which it writes nothing"),
    "stop_writes": ("push mode, giving up: wait until no write can land any more (each landed, failed or was "
                    "refused, its writer is gone, or the deadline passed); the table hears it as writes_stopped"),
    # sending side
    "post_write": "push mode: post the NIXL WRITE of the pinned blocks into the asking decode rank's blocks",
    "cancel_writes": "push mode: stop the request's writes (before its blocks are freed): those in flight finish, "
                     "but one carrying its landed notification is cancelled",
    "abandon_writes": "push mode: stop the writes of decode ranks that gave up; those in flight finish (the ranks "
                      "will not use the bytes)",
    "count_write": "count a write that completed, or failed (metrics, log)",
    "count_served": ("count a request whose blocks its decode ranks read (the last read's notification, or "
                     "one held until its claim or the prefill's finish)"),
    "pass_abandon": ("streamed push: the early abandon a join key's machine held goes to the prefill request "
                     "the key names (its finish then frees its blocks)"),
    "restart_stream": ("streamed push, the prefill preempted (vLLM freed its blocks): what it computes again "
                       "is written from its new blocks; the tokens written before stay (the same KV)"),
    "rewrite_unsure_streams": ("streamed push, the prefill preempted: each decode rank whose write was still "
                               "reading the freed blocks (the bytes may be another request's) is written again "
                               "whole from the new blocks, nothing of it posted before those writes are over"),
    "fail_notified_streams": ("streamed push, the prefill preempted: each decode rank whose write in question "
                              "carried the landed notification is told its write failed, and gives the "
                              "request up rather than use the bytes"),
    "start_stream": ("streamed push: write what is computed of the request already, then each layer as its "
                     "forward pass is done, the last write carrying the notification"),
    "pin_blocks": "keep the request's blocks out of the free pool (delay the free)",
    "free_blocks": "report finished_sending: the blocks may be reused",
    "count_expired_lease": "count a lease that expired unread (metrics, rate-limited warning)",
    "count_hold_ended": "count a hold for a next turn that ended unread (expired, or released under its budget)",
    "arm_lease": "start the lease timer for the pinned blocks",
    "extend_lease": "move the lease deadline (a heartbeat came)",
    "cancel_lease": "stop the lease timer",
    "arm_abandon_timer": "forget an early abandon after a lease if its prefill never finishes here",
    "cancel_abandon_timer": "stop the early abandon's timer",
    "count_refused_abandon": ("count and warn of an early abandon refused (MAX_EARLY_INPUTS wait already): "
                              "its blocks wait for their lease"),
    "count_refused_read": ("count and warn of an early read notification refused (MAX_EARLY_INPUTS wait "
                           "already): its blocks wait for their lease"),
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


# At most this many early inputs (abandons and read notifications for a prefill
# this worker has not heard finish) may wait as send machines: a bound on what
# peers can make a prefill worker hold (each waits at most a lease).
MAX_EARLY_INPUTS = 4096


def _early_inputs_full(m: RequestMachine, ev: Any) -> bool:
    """The bound is reached: ``early_waiting`` (the early inputs already waiting
    when this one came, recorded with it) is the worker's count, the refusal the
    table's, so replay re-checks it."""
    return bool(ev.early_waiting >= MAX_EARLY_INPUTS)


def _unclaimed(m: RequestMachine, ev: Any) -> bool:
    """No decode rank claimed it: nobody may be reading it."""
    return not m.claimants


def _is_hold(m: RequestMachine, ev: Any) -> bool:
    return m.hold


def _is_push(m: RequestMachine, ev: Any) -> bool:
    return m.push


def _writes_unsure(m: RequestMachine, ev: Any) -> bool:
    """Some decode rank's write was still reading the blocks vLLM freed."""
    return bool(ev.unsure)


def _notified_unsure(m: RequestMachine, ev: Any) -> bool:
    """... and one of those writes carried the landed notification."""
    return bool(ev.notified)


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
    "early_inputs_full": _early_inputs_full,
    "outdated": _outdated,
    "unclaimed": _unclaimed,
    "is_hold": _is_hold,
    "is_push": _is_push,
    "writes_unsure": _writes_unsure,
    "notified_unsure": _notified_unsure,
}


# The scheduler half's callbacks and effects join the others: one lookup each.
PREPARE: dict[str, Callable[[Any, Any, int], None]] = {**_PREPARE, **_sched.SCHED_PREPARE}
CONDITIONS = {**CONDITIONS, **_sched.SCHED_CONDITIONS}
EFFECTS = {**EFFECTS, **_sched.SCHED_EFFECTS}
