"""The receiving side's lifecycle (``recv``): one machine per request a decode
worker reads remote KV for, from the scheduler's match to the blocks handed
back to vLLM."""

from __future__ import annotations

from typing import Any

from kvsm.lifecycle.spec import LifecycleSpec
from kvsm.lifecycle.spec import each as _each

RECV_STATES = [
    "new",
    "awaiting_blocks",
    "pending_handshake",
    "reading_unclaimed",
    "read_unclaimed",
    "remote_known",
    "transferring",
    "being_written",
    "stopping_writes",
    "aborting_writes",
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
    # Push mode (transfer_mode "push"): the claims as for a read, then the prefill
    # workers are asked to write into our blocks; no read goes out early.
    {"trigger": "allocated", "source": "awaiting_blocks", "dest": "pending_handshake", "prepare": "hold_blocks",
     "conditions": "is_push", "after": ["take_blocks", "arm_handshake_timer", "start_handshake"]},
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
     "conditions": ["all_claims_granted", "is_push"], "after": ["cancel_handshake_timer", "ask_writes"]},
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
    {"trigger": "error", "source": ["remote_known", "transferring", "failing", "aborting", "being_written",
                                    "stopping_writes", "aborting_writes"], "dest": "=",
     "conditions": "answers_a_claim"},
    # Push mode. The writes asked, every prefill worker's landing (its NIXL
    # notification rides on its write) delivers the blocks. Any failure or abort
    # first waits until no write can land any more (each landed, failed or was
    # refused, its writer is gone, or the deadline every write is bound by
    # passed): only then do the blocks go back to vLLM. Each prefill worker not
    # through is told at once, so it stops writing (a stream would go on to its
    # end) and says when nothing of its writes is in flight any more.
    {"trigger": "writes_asked", "source": "remote_known", "dest": "being_written", "after": "arm_transfer_timer"},
    {"trigger": "writes_landed", "source": "being_written", "dest": "done",
     "after": ["deliver_blocks", "cancel_timers"]},
    *_each(_FAILURES, source="being_written", dest="stopping_writes", prepare="note_failure",
           after=["notify_abandon", "stop_writes"]),
    {"trigger": "abort", "source": "being_written", "dest": "aborting_writes",
     "after": ["notify_abandon", "stop_writes"]},
    {"trigger": "abort", "source": "stopping_writes", "dest": "aborting_writes"},
    *_each(_FAILURES, source=["stopping_writes", "aborting_writes"], dest="="),
    # Every write settled without all landing, or the deadline passed: it failed.
    # Every prefill worker not through yet (its ask refused or late, its write never
    # posted) is told, so it unpins now rather than at its lease's end.
    {"trigger": "writes_stopped", "source": "being_written", "dest": "failed", "prepare": "note_failure",
     "after": ["notify_abandon", "report_invalid", "cancel_timers"]},
    *_each(["writes_stopped", "writes_landed"], source="stopping_writes", dest="failed",
           after=["notify_abandon", "report_invalid", "cancel_timers"]),
    *_each(["writes_stopped", "writes_landed"], source="aborting_writes", dest="aborted",
           after=["notify_abandon", "release_blocks", "cancel_timers"]),
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

_RECV_LATER = ["remote_known", "transferring", "failing", "aborting", "being_written", "stopping_writes",
               "aborting_writes"]
_RECV_ENDS = ["done", "failed", "aborted", "closed_at_shutdown"]
RECV_STALE: list[dict[str, Any]] = [
    {"trigger": "handshake_ok", "source": _RECV_LATER,
     "why": "an answer to a second claim: the first one moved the request on"},
    {"trigger": "abort", "source": ["aborting", "aborting_writes"], "why": "aborted twice"},
    {"trigger": ["abort", "handshake_ok", "timeout", "peer_dead", "error", "internal_error", "reads_quiesced",
                 "all_reads_done", "writes_landed", "writes_stopped"],
     "source": _RECV_ENDS, "why": "the request ended (and vLLM was told) before this input arrived"},
]


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
