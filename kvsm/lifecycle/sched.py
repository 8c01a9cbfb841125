"""The scheduler half's lifecycle (``sched``): what it knows of each request
and which decisions it may take.

One machine per request that kvsm's scheduler half has business with, in the
engine's scheduler process: a decode request whose ``kv_transfer_params`` ask
for remote KV (``do_remote_prefill``), from ``new``, or a prefill request
served to a decode engine (``do_remote_decode`` on a producer), created in
``prefill_queued``. Declared like RECV, SEND and PEER (``table.py``), driven by
a ``LifecycleTracker`` and logged, so replay folds and re-checks it; the
scheduler half (``kvsm.scheduler``) only carries out the effects named here.

Its events, ``prepare`` callbacks, conditions and effects live in this file.
Its events join ``EVENT_TYPES`` here; ``table.py`` merges the rest into its
tables (which the compiled step and the log reader look up by name) and
compiles ``SCHED_DECLARATION`` into ``SCHED`` with the other lifecycles. This
module imports nothing of ``table.py``, so the core has no import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvsm.lifecycle.data import RequestMachine
from kvsm.lifecycle.events import EVENT_TYPES, Event

# --- events: the scheduler hooks' facts --------------------------------------


class ParamsIgnored(Event, frozen=True, tag="params_ignored"):
    """A decode request's ``kv_transfer_params`` cannot be used (malformed, another
    layout, a role or mode kvsm does not serve): it runs as a local request."""

    reason: str


class StreamRefused(ParamsIgnored, frozen=True, tag="stream_refused"):
    """A streamed decode leg from a kvsm prefill engine that this engine cannot
    serve (another block size, tensor parallel size, a state it cannot stream):
    it runs as a local request, and the prefill side is told at once, by the join
    key (``remote_req``), that nothing will be asked of it."""

    remote_engine: str = ""
    remote_req: str = ""


class _RemoteRead(Event, frozen=True):
    """Where a request reads blocks from (the engine and request that hold them,
    its side channel, its parallel sizes), and ``reader``: the request of this
    engine that reads them already ("" : none)."""

    remote_engine: str
    remote_req: str
    remote_host: str = ""
    remote_port: int = 0
    remote_tp_size: int = 1
    remote_pp_size: int = 1
    reader: str = ""


class ParamsRead(_RemoteRead, frozen=True, tag="params_read"):
    """A decode request's ``kv_transfer_params`` parsed: the prefill request it
    reads. ``rejected``: vLLM's stand-in for a request its API server rejected
    (aborted at once: nothing is read)."""

    rejected: bool = False


class BlocksAllocated(Event, frozen=True, tag="blocks_allocated"):
    """vLLM allocated the request's blocks (``update_state_after_alloc``), and with
    them ``num_external_tokens`` to load (0: none, or a full local prefix hit)."""

    num_external_tokens: int = 0


class RemoteTokensCounted(Event, frozen=True, tag="remote_tokens_counted"):
    """vLLM asked what the prefill side offers (``get_num_new_matched_tokens``):
    ``tokens`` to load beyond what this engine has, against ``kv_recompute_threshold``
    (fewer than ``threshold`` remote tokens are computed here, as upstream's key
    says). Counted only while the threshold is on."""

    tokens: int
    threshold: int


class LoadReported(Event, frozen=True, tag="load_reported"):
    """A worker reported the request in ``finished_recving``: vLLM stops waiting."""


class RequestFinished(Event, frozen=True, tag="request_finished"):
    """vLLM finished a decode request (``request_finished``): ``status`` its
    RequestStatus name. With ``bidirectional_kv_xfer``, a normal finish would
    hold its ``hold_blocks`` blocks for the next turn, against ``hold_budget``
    (blocks all holds may keep; 0: nothing is held)."""

    status: str = ""
    hold_blocks: int = 0
    hold_budget: int = 0


class HoldOffered(_RemoteRead, frozen=True, tag="hold_offered"):
    """A prefill request's params name a decode engine's hold of the conversation
    so far (``bidirectional_kv_xfer``): ``tokens`` of its prompt match the held
    ones."""

    tokens: int = 0


class ReleaseDecided(Event, frozen=True, tag="release_decided"):
    """The holds went over their budget: this one, the oldest, is released
    (``reason`` says by how much)."""

    reason: str = ""


class HoldEnded(Event, frozen=True, tag="hold_ended"):
    """The workers reported the hold's blocks free (``finished_sending``): read by
    the next turn, expired, or released."""


class PrefillFinished(Event, frozen=True, tag="prefill_finished"):
    """vLLM finished a prefill request: ``status`` its RequestStatus name,
    ``blocks`` how many it holds (distinct, not null), and how far its computed
    tokens run past the prompt where ``held_back`` tokens were left to the
    decode side (a Mamba/GDN state)."""

    status: str = ""
    blocks: int = 0
    past_prompt: int = 0
    held_back: int = 0


class SchedulerStopped(Event, frozen=True, tag="scheduler_stopped"):
    """The scheduler half shuts down while the request is live: it ends here."""


SCHED_EVENTS: tuple[type[Event], ...] = (ParamsIgnored, StreamRefused, ParamsRead, RemoteTokensCounted, BlocksAllocated,
                                         LoadReported, RequestFinished, PrefillFinished, SchedulerStopped,
                                         HoldOffered, ReleaseDecided, HoldEnded)


# --- the data ----------------------------------------------------------------


class SchedMachine(RequestMachine):
    """One request in the scheduler half. ``source`` and ``why`` are folded from
    the events; ``remote`` is the scheduler half's own (its parsed params, opaque
    here: no condition reads it and replay does not rebuild it), kept until the
    effect that uses them up starts the transfer or tells the prefill side."""

    __slots__ = ("source", "why", "remote", "recompute_tokens")

    def __init__(self, req: str, lifecycle: str, state: str, now_ns: int) -> None:
        super().__init__(req, lifecycle, state, now_ns)
        # The prefill request read: (engine, host, port, tp, pp, remote request id).
        self.source: tuple[str, str, int, int, int, str] = ("", "", 0, 0, 0, "")
        self.why = ""  # why the params were ignored, or why nothing was pinned
        self.remote: Any = None
        # Remote tokens left to compute here (kv_recompute_threshold); 0: none.
        self.recompute_tokens = 0

    @property
    def group(self) -> tuple[str, str, int, int, int]:
        """The prefill worker group its heartbeat claim goes to."""
        return self.source[:5]

    def snapshot(self) -> dict[str, Any]:
        out = super().snapshot()
        out.update({"source": self.source, "why": self.why, "recompute_tokens": self.recompute_tokens})
        return out


# --- prepare: fold an event's inputs into the data ---------------------------


def _note_params(m: SchedMachine, ev: _RemoteRead, now_ns: int) -> None:
    m.remote_engine = ev.remote_engine
    m.remote_req = ev.remote_req
    m.source = (ev.remote_engine, ev.remote_host, ev.remote_port, ev.remote_tp_size, ev.remote_pp_size,
                ev.remote_req)


def _note_hold(m: SchedMachine, ev: HoldOffered, now_ns: int) -> None:
    _note_params(m, ev, now_ns)  # (the same coordinates: the decode engine's, for its hold)
    m.num_tokens = ev.tokens


def _note_held(m: SchedMachine, ev: RequestFinished, now_ns: int) -> None:
    m.num_tokens = ev.hold_blocks


def _note_not_held(m: SchedMachine, ev: RequestFinished, now_ns: int) -> None:
    if ev.hold_blocks > ev.hold_budget > 0:
        m.why = (f"not held for a next turn: its {ev.hold_blocks} blocks exceed decoder_kv_hold_blocks "
                 f"({ev.hold_budget})")


def _note_release(m: SchedMachine, ev: ReleaseDecided, now_ns: int) -> None:
    m.why = ev.reason


def _note_ignored(m: SchedMachine, ev: ParamsIgnored, now_ns: int) -> None:
    m.why = ev.reason


def _note_second_reader(m: SchedMachine, ev: ParamsRead, now_ns: int) -> None:
    # The prefill side frees the blocks once the first read's notification is in:
    # a second reader could still be reading them then (they may be reused).
    m.why = (f"request {ev.reader} of this engine already reads prefill request {ev.remote_req!r} (the samples "
             f"of an n > 1 request, or a retry sent while the first is running): the prefill side frees its "
             f"blocks after one read")


def _note_recompute(m: SchedMachine, ev: RemoteTokensCounted, now_ns: int) -> None:
    m.recompute_tokens = ev.tokens
    m.why = (f"{ev.tokens} remote token(s) computed here: fewer than kv_recompute_threshold ({ev.threshold}); "
             f"the prefill side is told to unpin")


def _note_load(m: SchedMachine, ev: BlocksAllocated, now_ns: int) -> None:
    m.num_tokens = ev.num_external_tokens


def _note_refusal(m: SchedMachine, ev: PrefillFinished, now_ns: int) -> None:
    if ev.status not in NORMAL_FINISH or not ev.blocks:
        m.why = ev.status
    else:
        m.why = (f"{ev.past_prompt} generated token(s) computed after the prompt: a Mamba/GDN state holds "
                 f"every token computed, not the prompt's (send the prefill leg with max_tokens 1)")


SCHED_PREPARE: Mapping[str, Callable[[Any, Any, int], None]] = {
    "note_params": _note_params,
    "note_hold": _note_hold,
    "note_held": _note_held,
    "note_not_held": _note_not_held,
    "note_release": _note_release,
    "note_ignored": _note_ignored,
    "note_second_reader": _note_second_reader,
    "note_recompute": _note_recompute,
    "note_load": _note_load,
    "note_refusal": _note_refusal,
}

# --- conditions --------------------------------------------------------------

# vLLM's RequestStatus names of a normal finish: the prefill KV is complete.
NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})


def _rejected_upstream(m: SchedMachine, ev: ParamsRead) -> bool:
    return ev.rejected


def _read_by_another(m: SchedMachine, ev: ParamsRead) -> bool:
    """One reader per prefill request: another request of this engine reads it."""
    return ev.reader not in ("", m.req)


def _below_recompute_threshold(m: SchedMachine, ev: RemoteTokensCounted) -> bool:
    return 0 < ev.tokens < ev.threshold


def _hold_fits(m: SchedMachine, ev: RequestFinished) -> bool:
    """A normal finish with blocks to hold, within the holds' budget."""
    return 0 < ev.hold_blocks <= ev.hold_budget


def _tokens_to_load(m: SchedMachine, ev: BlocksAllocated) -> bool:
    return ev.num_external_tokens > 0


def _kv_complete(m: SchedMachine, ev: PrefillFinished) -> bool:
    return ev.status in NORMAL_FINISH and ev.blocks > 0


def _prompt_state_only(m: SchedMachine, ev: PrefillFinished) -> bool:
    """No token computed past the prompt where a Mamba/GDN state is handed over
    (that state holds every token computed, not the prompt's)."""
    return not (ev.held_back and ev.past_prompt > 0)


SCHED_CONDITIONS: Mapping[str, Callable[[Any, Any], bool]] = {
    "rejected_upstream": _rejected_upstream,
    "read_by_another": _read_by_another,
    "below_recompute_threshold": _below_recompute_threshold,
    "hold_fits": _hold_fits,
    "tokens_to_load": _tokens_to_load,
    "kv_complete": _kv_complete,
    "prompt_state_only": _prompt_state_only,
}

# --- effects: what the scheduler half carries out ----------------------------

SCHED_EFFECTS: Mapping[str, str] = {
    "warn_ignored": "log why the params were ignored (the request runs as a local one)",
    "note_rejected": "log vLLM's stand-in for a request rejected upstream",
    "keep_params": "keep the parsed params: vLLM asks what they offer until it allocates",
    "recompute_locally": "answer vLLM that nothing is loaded: it computes the prompt itself",
    "take_reader": "become the one reader of the prefill request (the index by prefill request)",
    "drop_reader": "stop being its reader: another request of this engine may read it",
    "start_heartbeat": "heartbeat the prefill request's claim until vLLM allocates (the index by prefill worker group)",
    "stop_heartbeat": "stop heartbeating its claim",
    "start_load": "relay the read (RecvStart, awaited: vLLM waits for finished_recving) to the workers",
    "start_notify_only": "relay a start with nothing to read (a full local prefix hit): the prefill side unpins",
    "abandon_remote": "tell the prefill side to unpin: finished before vLLM allocated anything (RecvAbandon)",
    "abandon_stream": "tell the prefill side by the join key that its stream will not be asked for: it frees "
                      "its blocks at its finish, not at its lease's end (RecvAbandon)",
    "abort_load": "relay an abort of a load under way (RecvAbort, awaited): the worker reports it once settled",
    "start_send": "relay the prefill request's start to the workers (SendStart)",
    "queue_pin": "pin its blocks: hand the finish to the workers with the step's batch, return the params",
    "refuse_pin": "tell the workers nothing is pinned (why), at once",
    "hold_blocks": ("hold its blocks for the conversation's next turn (pinned with the holds' time to live) and "
                    "return params naming them"),
    "make_room": "release the oldest holds until all fit the budget again (each a release_decided)",
    "release_hold": "tell the workers to release the hold (freed at once unless a reader claimed it)",
    "note_not_held": "log why a finished decode request is not held",
    "forget_hold": "take the hold out of the budget's count (its blocks are free)",
}


def _register_events() -> None:
    """Put this lifecycle's events into ``EVENT_TYPES`` (checked: no trigger taken)."""
    mine = {str(cls.__struct_config__.tag): cls for cls in SCHED_EVENTS}
    taken = set(EVENT_TYPES) & set(mine)
    if taken:
        raise ValueError(f"lifecycle 'sched': triggers already declared elsewhere: {sorted(taken)}")
    EVENT_TYPES.update(mine)


_register_events()

# --- the declaration ---------------------------------------------------------

SCHED_STATES = [
    # decode side
    "new",
    "running_to_hold",
    "ignored",
    "claiming",
    "recomputing",
    "computing_locally",
    "rejected",
    "loading",
    "loaded",
    "held",
    "hold_releasing",
    # prefill side
    "prefill_queued",
    "reuse_claiming",
    "reuse_declined",
    "reuse_loading",
    "prefilling",
    # ends
    "done",
    "ran_locally",
    "abandoned",
    "aborted_loading",
    "left_to_reader",
    "pinned",
    "not_pinned",
    "hold_released",
    "closed_at_shutdown",
]
SCHED_TERMINAL = frozenset({"done", "ran_locally", "abandoned", "aborted_loading", "left_to_reader", "pinned",
                            "not_pinned", "hold_released", "closed_at_shutdown"})
_LIVE = [s for s in SCHED_STATES if s not in SCHED_TERMINAL]
_PREFILL = ["prefill_queued", "prefilling"]
_REUSE_UNALLOCATED = ["reuse_claiming", "reuse_declined"]

SCHED_TRANSITIONS: list[dict[str, Any]] = [
    # -- decode: judging the params (on_new_request)
    {"trigger": "params_ignored", "source": "new", "dest": "ignored", "prepare": "note_ignored",
     "after": "warn_ignored"},
    {"trigger": "stream_refused", "source": "new", "dest": "ignored", "prepare": "note_ignored",
     "after": ["warn_ignored", "abandon_stream"]},
    # vLLM's stand-in for a rejected request is aborted at once: nothing is read. The
    # prefill side is told at its finish, unless a live request of this engine reads it.
    {"trigger": "params_read", "source": "new", "dest": "left_to_reader", "prepare": "note_params",
     "conditions": ["rejected_upstream", "read_by_another"], "after": "note_rejected"},
    {"trigger": "params_read", "source": "new", "dest": "rejected", "conditions": "rejected_upstream",
     "after": ["keep_params", "note_rejected"]},
    # One reader per prefill request: its blocks are freed after one read.
    {"trigger": "params_read", "source": "new", "dest": "ignored", "prepare": "note_second_reader",
     "conditions": "read_by_another", "after": "warn_ignored"},
    {"trigger": "params_read", "source": "new", "dest": "claiming",
     "after": ["keep_params", "take_reader", "start_heartbeat"]},
    # -- decode: vLLM asks what the prefill side offers (get_num_new_matched_tokens), while
    # kv_recompute_threshold is on: so few remote tokens are computed here, not read.
    {"trigger": "remote_tokens_counted", "source": "claiming", "dest": "recomputing", "prepare": "note_recompute",
     "conditions": "below_recompute_threshold", "after": "recompute_locally"},
    {"trigger": "remote_tokens_counted", "source": "claiming", "dest": "claiming"},
    {"trigger": "blocks_allocated", "source": "recomputing", "dest": "computing_locally",
     "after": ["stop_heartbeat", "start_notify_only"]},
    # -- decode: vLLM allocates (update_state_after_alloc), once a transfer
    {"trigger": "blocks_allocated", "source": "claiming", "dest": "loading", "prepare": "note_load",
     "conditions": "tokens_to_load", "after": ["stop_heartbeat", "start_load"]},
    {"trigger": "blocks_allocated", "source": "claiming", "dest": "loaded",
     "after": ["stop_heartbeat", "start_notify_only"]},
    {"trigger": "blocks_allocated", "source": "rejected", "dest": "loading", "prepare": "note_load",
     "conditions": "tokens_to_load", "after": "start_load"},
    {"trigger": "blocks_allocated", "source": "rejected", "dest": "loaded", "after": "start_notify_only"},
    {"trigger": "load_reported", "source": "loading", "dest": "loaded"},
    # -- decode: vLLM finishes it
    {"trigger": "request_finished", "source": "ignored", "dest": "ran_locally"},
    {"trigger": "request_finished", "source": "claiming", "dest": "abandoned",
     "after": ["stop_heartbeat", "drop_reader", "abandon_remote"]},
    {"trigger": "request_finished", "source": "rejected", "dest": "abandoned", "after": "abandon_remote"},
    {"trigger": "request_finished", "source": "recomputing", "dest": "abandoned",
     "after": ["stop_heartbeat", "drop_reader", "abandon_remote"]},
    {"trigger": "request_finished", "source": "computing_locally", "dest": "held", "prepare": "note_held",
     "conditions": "hold_fits", "after": ["drop_reader", "hold_blocks", "make_room"]},
    {"trigger": "request_finished", "source": "computing_locally", "dest": "ran_locally", "prepare": "note_not_held",
     "after": ["drop_reader", "note_not_held"]},
    # vLLM keeps the blocks until a worker reports the request in finished_recving.
    {"trigger": "request_finished", "source": "loading", "dest": "aborted_loading",
     "after": ["drop_reader", "abort_load"]},
    # bidirectional_kv_xfer: a normal finish is held for the conversation's next turn,
    # within the holds' budget (the oldest holds make room); its params name it.
    {"trigger": "request_finished", "source": "loaded", "dest": "held", "prepare": "note_held",
     "conditions": "hold_fits", "after": ["drop_reader", "hold_blocks", "make_room"]},
    {"trigger": "request_finished", "source": "loaded", "dest": "done", "prepare": "note_not_held",
     "after": ["drop_reader", "note_not_held"]},
    # A request that asked only to be held at its finish (kvsm_hold: a router that
    # learns a streamed turn's hold this way, or a prompt it sent a decode engine alone).
    {"trigger": "request_finished", "source": "running_to_hold", "dest": "held", "prepare": "note_held",
     "conditions": "hold_fits", "after": ["hold_blocks", "make_room"]},
    {"trigger": "request_finished", "source": "running_to_hold", "dest": "ran_locally", "prepare": "note_not_held",
     "after": "note_not_held"},
    {"trigger": "release_decided", "source": "held", "dest": "hold_releasing", "prepare": "note_release",
     "after": "release_hold"},
    {"trigger": "hold_ended", "source": "held", "dest": "hold_released", "after": "forget_hold"},
    {"trigger": "hold_ended", "source": "hold_releasing", "dest": "hold_released"},
    # -- prefill
    {"trigger": "blocks_allocated", "source": "prefill_queued", "dest": "prefilling", "after": "start_send"},
    # -- prefill of a next turn whose conversation a decode engine holds (bidirectional_kv_xfer):
    # it reads the held blocks it lacks, like a decode request, then prefills the new tokens.
    {"trigger": "params_ignored", "source": "prefill_queued", "dest": "=", "prepare": "note_ignored",
     "after": "warn_ignored"},
    {"trigger": "hold_offered", "source": "prefill_queued", "dest": "=", "prepare": "note_second_reader",
     "conditions": "read_by_another", "after": "warn_ignored"},
    {"trigger": "hold_offered", "source": "prefill_queued", "dest": "reuse_claiming", "prepare": "note_hold",
     "after": ["keep_params", "take_reader", "start_heartbeat"]},
    {"trigger": "remote_tokens_counted", "source": "reuse_claiming", "dest": "reuse_declined",
     "prepare": "note_recompute", "conditions": "below_recompute_threshold", "after": "recompute_locally"},
    {"trigger": "remote_tokens_counted", "source": "reuse_claiming", "dest": "reuse_claiming"},
    {"trigger": "blocks_allocated", "source": "reuse_claiming", "dest": "reuse_loading", "prepare": "note_load",
     "conditions": "tokens_to_load", "after": ["stop_heartbeat", "start_send", "start_load"]},
    {"trigger": "blocks_allocated", "source": _REUSE_UNALLOCATED, "dest": "prefilling",
     "after": ["stop_heartbeat", "drop_reader", "start_send", "start_notify_only"]},
    {"trigger": "load_reported", "source": "reuse_loading", "dest": "prefilling", "after": "drop_reader"},
    {"trigger": "prefill_finished", "source": _REUSE_UNALLOCATED, "dest": "not_pinned", "prepare": "note_refusal",
     "after": ["stop_heartbeat", "drop_reader", "abandon_remote", "refuse_pin"]},
    # vLLM keeps the blocks until a worker reports the load in finished_recving.
    {"trigger": "prefill_finished", "source": "reuse_loading", "dest": "not_pinned", "prepare": "note_refusal",
     "after": ["drop_reader", "abort_load", "refuse_pin"]},
    {"trigger": "prefill_finished", "source": _PREFILL, "dest": "pinned",
     "conditions": ["kv_complete", "prompt_state_only"], "after": "queue_pin"},
    {"trigger": "prefill_finished", "source": _PREFILL, "dest": "not_pinned", "prepare": "note_refusal",
     "after": "refuse_pin"},
    # -- a clean stop ends every live request
    {"trigger": "scheduler_stopped", "source": _LIVE, "dest": "closed_at_shutdown"},
]

SCHED_STALE: list[dict[str, Any]] = [
    {"trigger": "blocks_allocated", "source": ["loading", "loaded", "prefilling", "computing_locally"],
     "why": "vLLM allocates again after the load or a preemption: one transfer, one start per request"},
    {"trigger": "blocks_allocated", "source": ["ignored", "running_to_hold"], "why": "it runs as a local request"},
    {"trigger": "remote_tokens_counted", "source": ["recomputing", "computing_locally", "loading", "loaded",
                                                    "reuse_declined", "reuse_loading", "prefilling"],
     "why": "vLLM asks again (a preemption, or blocks not free yet): counted once"},
    {"trigger": "blocks_allocated", "source": "reuse_loading",
     "why": "vLLM allocates again after the load or a preemption: one transfer, one start per request"},

]

# ``LifecycleSpec``'s arguments: ``table.py`` compiles them into ``SCHED``.
SCHED_DECLARATION: Mapping[str, Any] = {
    "name": "sched",
    "states": tuple(SCHED_STATES),
    "initial": "new",
    "terminal": SCHED_TERMINAL,
    "transitions": tuple(SCHED_TRANSITIONS),
    "entry_states": frozenset({"new", "prefill_queued", "running_to_hold"}),
    "stale_inputs": tuple(SCHED_STALE),
    "machine_cls": SchedMachine,
}
