"""The sending side's lifecycle (``send``): one machine per request a prefill
worker pins blocks for, from its prefill to the blocks freed, and how its state
answers a decode worker's claim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvsm.lifecycle.spec import LifecycleSpec
from kvsm.lifecycle.spec import each as _each

SEND_STATES = ["prefilling", "streaming", "streamed", "abandoned_early", "read_early", "awaiting_pull", "writing",
               "releasing", "released",
               "expired", "hold_expired", "forgotten", "refused_early", "closed_at_shutdown"]

# States of the early inputs that wait for their prefill's finish: their number
# (``ReadNotif``/``RemoteAbandoned.early_waiting``) is what ``early_inputs_full``
# bounds.
SEND_EARLY_WAITING = ("abandoned_early", "read_early")

SEND_TRANSITIONS: list[dict[str, Any]] = [
    {"trigger": "finished_ok", "source": "prefilling", "dest": "awaiting_pull",
     "prepare": "pin_blocks_data", "after": ["pin_blocks", "arm_lease"]},
    *_each(["abort", "finished_abnormally"], source="prefilling", dest="released"),
    # A claim or heartbeat extends the lease; a read its rank posted before the
    # claim (held, see note_read) counts now.
    {"trigger": "heartbeat", "source": "awaiting_pull", "dest": "released",
     "prepare": ["extend_lease_data", "note_claimant"], "conditions": "all_reads_in",
     "after": ["cancel_lease", "count_served", "free_blocks"]},
    {"trigger": "heartbeat", "source": "awaiting_pull", "dest": "=", "after": "extend_lease"},
    {"trigger": "read_notif", "source": "awaiting_pull", "dest": "released", "prepare": "note_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "count_served", "free_blocks"]},
    {"trigger": "read_notif", "source": "awaiting_pull", "dest": "="},
    # Each decode rank that has business with these blocks is through once (its
    # read's notification or its abandon); the blocks go once all are.
    {"trigger": "remote_abandoned", "source": "awaiting_pull", "dest": "released", "prepare": "count_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "remote_abandoned", "source": "awaiting_pull", "dest": "="},
    # Push mode: a decode rank asks for the pinned blocks to be written into its own.
    # The lease keeps running (heartbeats extend it) and bounds the writes: each is
    # also cancelled at the deadline its decode rank set. Each decode rank is through
    # once its write is over (or its abandon came); the blocks go once all are.
    {"trigger": "write_asked", "source": "awaiting_pull", "dest": "writing", "prepare": "note_writer",
     "after": "post_write"},
    {"trigger": "write_asked", "source": "writing", "dest": "=", "prepare": "note_writer", "after": "post_write"},
    {"trigger": "write_done", "source": "writing", "dest": "released", "prepare": "count_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "count_write", "free_blocks"]},
    {"trigger": "write_done", "source": "writing", "dest": "=", "after": "count_write"},
    {"trigger": "heartbeat", "source": "writing", "dest": "=", "prepare": "extend_lease_data", "after": "extend_lease"},
    {"trigger": "remote_abandoned", "source": "writing", "dest": "released", "prepare": "count_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "abandon_writes", "free_blocks"]},
    {"trigger": "remote_abandoned", "source": "writing", "dest": "="},
    {"trigger": "lease_expired", "source": "writing", "dest": "expired",
     "after": ["cancel_writes", "count_expired_lease", "free_blocks"]},
    *_each(["shutdown", "drain_over"], source="writing", dest="closed_at_shutdown",
           after=["cancel_lease", "cancel_writes", "free_blocks"]),
    # Streamed push: a decode rank claims the request by its join key and asks for
    # each layer to be written as it is computed, before the prefill finishes. The
    # finish pins the blocks until the last write is over (then as push mode's
    # writing); a stream over before the finish frees them at the finish.
    {"trigger": "stream_claimed", "source": ["prefilling", "streaming", "streamed"], "dest": "=",
     "prepare": "note_claimant"},
    {"trigger": "stream_claimed", "source": ["awaiting_pull", "writing"], "dest": "=",
     "prepare": ["extend_lease_data", "note_claimant"], "after": "extend_lease"},
    {"trigger": "stream_asked", "source": "prefilling", "dest": "streaming", "prepare": "note_writer",
     "after": "start_stream"},
    {"trigger": "stream_asked", "source": "streaming", "dest": "=", "prepare": "note_writer", "after": "start_stream"},
    # (the prefill finished before the ask: what is pinned is written at once)
    *_each(["stream_asked"], source=["awaiting_pull", "writing"], dest="writing", prepare="note_writer",
           after="start_stream"),
    {"trigger": "write_done", "source": "streaming", "dest": "streamed", "prepare": "count_read",
     "conditions": "all_reads_in", "after": "count_write"},
    {"trigger": "write_done", "source": "streaming", "dest": "=", "prepare": "count_read", "after": "count_write"},
    {"trigger": "finished_ok", "source": "streaming", "dest": "writing", "prepare": "pin_blocks_data",
     "after": ["pin_blocks", "arm_lease"]},
    {"trigger": "finished_ok", "source": "streamed", "dest": "released", "prepare": "pin_blocks_data",
     "after": ["pin_blocks", "free_blocks"]},
    *_each(["abort", "finished_abnormally"], source="streaming", dest="released", after="cancel_writes"),
    *_each(["abort", "finished_abnormally"], source="streamed", dest="released"),
    {"trigger": "remote_abandoned", "source": "streaming", "dest": "abandoned_early",
     "after": ["abandon_writes", "arm_abandon_timer"]},
    {"trigger": "shutdown", "source": "streaming", "dest": "closed_at_shutdown", "after": "cancel_writes"},
    # vLLM preempted the prefill and freed its blocks: it is computed again into new
    # ones. A write still reading the old ones may carry another request's bytes:
    # those ranks are written again whole, from the new blocks, once such writes are
    # over; one told by that write's notification may hold them as its KV: it fails.
    {"trigger": "stream_preempted", "source": "streaming", "dest": "=", "conditions": "notified_unsure",
     "after": ["fail_notified_streams", "rewrite_unsure_streams", "restart_stream"]},
    {"trigger": "stream_preempted", "source": "streaming", "dest": "=", "conditions": "writes_unsure",
     "after": ["rewrite_unsure_streams", "restart_stream"]},
    {"trigger": "stream_preempted", "source": ["prefilling", "streaming", "abandoned_early"], "dest": "=",
     "after": "restart_stream"},
    # The decode side gave up by the join key before this worker knew it (an early
    # abandon named by the key): once the key names a request here, that request
    # hears the abandon, so that its finish frees its blocks.
    {"trigger": "stream_joined", "source": "abandoned_early", "dest": "forgotten",
     "after": ["cancel_abandon_timer", "pass_abandon"]},
    {"trigger": "shutdown", "source": "streamed", "dest": "closed_at_shutdown"},
    # A decode engine's hold for a next turn ends unread at its time to live: the
    # conversation did not come back (no warning: that is what holds are for).
    {"trigger": "lease_expired", "source": "awaiting_pull", "dest": "hold_expired", "conditions": "is_hold",
     "after": ["count_hold_ended", "free_blocks"]},
    {"trigger": "lease_expired", "source": "awaiting_pull", "dest": "expired",
     "after": ["count_expired_lease", "free_blocks"]},
    # The decode engine's holds went over their budget: one nobody claimed goes at
    # once; a claimed one is not extended any more and goes once its read is in, or
    # when a read its last claim allowed can no longer come (never while one may).
    {"trigger": "release_asked", "source": "awaiting_pull", "dest": "released", "conditions": "unclaimed",
     "after": ["cancel_lease", "count_hold_ended", "free_blocks"]},
    {"trigger": "release_asked", "source": "awaiting_pull", "dest": "releasing", "prepare": "end_lease_soon",
     "after": "arm_lease"},
    {"trigger": "read_notif", "source": "releasing", "dest": "released", "prepare": "note_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "count_served", "free_blocks"]},
    {"trigger": "read_notif", "source": "releasing", "dest": "=", "prepare": "note_read"},
    {"trigger": "remote_abandoned", "source": "releasing", "dest": "released", "prepare": "count_read",
     "conditions": "all_reads_in", "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "remote_abandoned", "source": "releasing", "dest": "="},
    {"trigger": "lease_expired", "source": "releasing", "dest": "hold_expired",
     "after": ["count_hold_ended", "free_blocks"]},
    # The decode side gave up before this worker heard of the prefill's end
    # (its abandon overtook the scheduler's finish): the finish frees at once.
    # Early inputs wait in machines, at most MAX_EARLY_INPUTS of them (a bound on
    # what peers can make us hold): beyond it one is refused, visibly, and its
    # blocks wait for their lease once the finish pins them.
    {"trigger": "remote_abandoned", "source": "prefilling", "dest": "refused_early",
     "conditions": "early_inputs_full", "after": "count_refused_abandon"},
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
    {"trigger": "read_notif", "source": "prefilling", "dest": "refused_early",
     "conditions": "early_inputs_full", "after": "count_refused_read"},
    {"trigger": "read_notif", "source": "prefilling", "dest": "read_early", "prepare": "note_read",
     "after": "arm_abandon_timer"},
    {"trigger": "read_notif", "source": "read_early", "dest": "=", "prepare": "note_read"},
    {"trigger": "remote_abandoned", "source": "read_early", "dest": "=", "prepare": "count_read"},
    {"trigger": "finished_ok", "source": "read_early", "dest": "released", "prepare": "pin_blocks_data",
     "conditions": "all_reads_in", "after": ["cancel_abandon_timer", "pin_blocks", "count_served", "free_blocks"]},
    {"trigger": "finished_ok", "source": "read_early", "dest": "awaiting_pull",
     "after": ["cancel_abandon_timer", "pin_blocks", "arm_lease"]},
    *_each(["abort", "finished_abnormally"], source="read_early", dest="released", after="cancel_abandon_timer"),
    {"trigger": "abandon_expired", "source": "read_early", "dest": "forgotten"},
    # A clean stop: pinned blocks are freed (finished_sending, so the block ledger
    # balances); a request not pinned yet holds nothing, its timers stop.
    {"trigger": "shutdown", "source": ["awaiting_pull", "releasing"], "dest": "closed_at_shutdown",
     "after": ["cancel_lease", "free_blocks"]},
    {"trigger": "shutdown", "source": "prefilling", "dest": "closed_at_shutdown"},
    {"trigger": "shutdown", "source": ["abandoned_early", "read_early"], "dest": "closed_at_shutdown",
     "after": "cancel_abandon_timer"},
    # A draining engine's time is up: only what is pinned closes (a request still
    # prefilling, or known only by an early input, is pinned by its finish and closed
    # at the next step that says so).
    {"trigger": "drain_over", "source": ["awaiting_pull", "releasing"], "dest": "closed_at_shutdown",
     "after": ["cancel_lease", "free_blocks"]},
]

SEND_STALE: list[dict[str, Any]] = [
    {"trigger": ["stream_claimed", "stream_asked"], "source": ["abandoned_early", "read_early", "releasing"],
     "why": "not a streamed request here any more (given up, or a hold being released): answered unknown"},
    {"trigger": "stream_asked", "source": "streamed", "why": "written already: the ask is answered unknown"},
    {"trigger": "stream_joined", "source": ["prefilling", "streaming", "streamed", "read_early", "awaiting_pull",
                                            "writing", "releasing"],
     "why": "a machine of the key's name that holds no early abandon: nothing to pass on"},
    {"trigger": ["heartbeat", "read_notif", "write_asked"], "source": ["streaming", "streamed"],
     "why": "a streamed request is claimed by its join key and written layer by layer, not read"},
    {"trigger": "remote_abandoned", "source": "streamed",
     "why": "every write is over: the finish frees the blocks"},
    {"trigger": "stream_preempted", "source": "streamed",
     "why": "every write was over before the preemption: nothing of it is in question"},
    {"trigger": "write_asked", "source": ["prefilling", "abandoned_early", "read_early", "releasing"],
     "why": "not pinned for a reader here (the finish has not come, or a hold is being released): the ask is "
            "answered unknown and nothing is written"},
    {"trigger": ["finished_ok", "finished_abnormally", "abort", "read_notif", "release_asked"], "source": "writing",
     "why": "the blocks are being written to their decode engine (push mode): told twice, or not a reader's input"},
    # A claim (or heartbeat) is an input of every live machine: granted by a
    # heartbeat transition (awaiting_pull), answered "unknown" by these (the decode
    # worker asks again), so the log holds each answer of a live request.
    {"trigger": "heartbeat", "source": ["prefilling", "abandoned_early", "read_early"],
     "why": "the finish has not come here yet: the claim is answered unknown and asked again"},
    {"trigger": ["finished_ok", "finished_abnormally", "abort"],
     "source": ["awaiting_pull", "releasing", "released", "expired", "hold_expired"],
     "why": "told twice (a direct hand-off that partly failed also goes with the next step)"},
    {"trigger": "heartbeat", "source": "releasing",
     "why": "the hold is being released (over its budget): no claim extends it; the claim is answered unknown"},
    {"trigger": "release_asked", "source": ["releasing", "released", "expired", "hold_expired", "closed_at_shutdown"],
     "why": "the hold ended already, or is ending (read, expired, released before)"},
    {"trigger": "remote_abandoned", "source": "hold_expired", "why": "nothing is held for it any more"},
    {"trigger": ["finished_ok", "finished_abnormally", "abort", "remote_abandoned", "read_notif", "heartbeat",
                 "write_done", "stream_claimed", "stream_asked"],
     "source": "closed_at_shutdown", "why": "the worker was shutting down: it had let the request go"},
    {"trigger": "remote_abandoned", "source": ["abandoned_early", "released", "expired", "forgotten"],
     "why": "nothing is pinned for it (abandoned twice, or released already)"},
    {"trigger": "read_notif", "source": "released",
     "why": "released already (the reader's abandon overtook its read's notification)"},
    {"trigger": "read_notif", "source": "abandoned_early",
     "why": "another reader gave the request up before this worker heard of its finish, which frees it"},
    {"trigger": ["remote_abandoned", "read_notif"], "source": "refused_early",
     "why": "an early input for it was refused (too many waited): its lease frees the blocks"},
    {"trigger": "read_notif", "source": "forgotten",
     "why": "its prefill never finished here within a lease of an early input: forgotten"},
]

# A finish for a request whose early input was forgotten, or refused, is a new request.
SEND_NEW_AFTER_END = frozenset({"forgotten", "refused_early"})

# How the prefill side answers a claim (or heartbeat) for a request, by the
# state of its send machine (None: not known here). For a live machine the claim
# is applied as a heartbeat and the step answers (a transition: "ok"; a declared
# stale input: "unknown"), recorded and re-checked by replay; tests check that
# agrees with this table. For an ended or unknown request nothing is recorded
# (there is no machine to record it against) and this table answers.
# "unknown": ask again (the prefill worker may not have heard of the finish
# yet); "expired": the blocks are gone.
ANSWER_OK = "ok"
ANSWER_UNKNOWN = "unknown"
CLAIM_ANSWERS: Mapping[str | None, str] = {
    None: "unknown",
    "prefilling": "unknown",
    "streaming": "unknown",
    "streamed": "unknown",
    "abandoned_early": "unknown",
    "read_early": "unknown",
    "awaiting_pull": "ok",
    "writing": "ok",
    "releasing": "unknown",
    "released": "expired",
    "expired": "expired",
    "hold_expired": "expired",
    "forgotten": "unknown",
    "refused_early": "unknown",
    "closed_at_shutdown": "expired",
}


SEND = LifecycleSpec(
    name="send",
    states=tuple(SEND_STATES),
    initial="prefilling",
    terminal=frozenset({"released", "expired", "hold_expired", "forgotten", "refused_early", "closed_at_shutdown"}),
    transitions=tuple(SEND_TRANSITIONS),
    entry_states=frozenset({"prefilling"}),
    named_violations={
        ("expired", "read_notif"): "read_after_lease_expiry",
        ("expired", "heartbeat"): "heartbeat_after_lease_expiry",
        ("hold_expired", "read_notif"): "read_after_lease_expiry",
        ("hold_expired", "heartbeat"): "heartbeat_after_lease_expiry",
    },
    stale_inputs=tuple(SEND_STALE),
    new_after_end=SEND_NEW_AFTER_END,
)
