"""The scheduler half of KVSMConnector: relays vLLM's decisions to the workers.

It does no I/O of its own beyond the pin channel. vLLM's scheduler calls its
hooks; each hook turns into an event of the request's ``sched`` machine
(``kvsm.lifecycle.sched``: what the scheduler half knows of each request and
which decisions it may take), moved by a ``LifecycleTracker`` and logged like
the workers' machines, so replay re-checks every decision. This class only
carries out the effects the transition names: facts for the workers
(``StepFacts``, handed to every worker by the next ``build_connector_meta``,
where the request's worker-side machine lives), ``kv_transfer_params``, notes.

What it keeps besides the machines: two indexes derived from them, kept by the
effects that the table names (``take_reader``/``drop_reader``,
``start_heartbeat``/``stop_heartbeat``): the one request of this engine that
reads each prefill request, and the heartbeat claims per prefill worker group.

A finished prefill does not wait for a step: its pin (or "nothing pinned")
goes straight to every local worker (``pin_handoff``), and the decision is
logged (``sched.pinned``), so replay can tell "decided, never received" from
"never decided". Per hook the cost is a dict lookup, and for a request kvsm
serves one table step.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import (
    PRODUCER_KEY,
    HeartbeatTarget,
    RecvAbandon,
    RecvAbort,
    RemoteParams,
    SendFinish,
    SendStart,
    StepFacts,
)
from kvsm.handoff.pins import PinTarget
from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.lifecycle.events import Event
from kvsm.lifecycle.machine import LifecycleTracker, Outcome
from kvsm.lifecycle.sched import (
    NORMAL_FINISH,
    BlocksAllocated,
    HoldEnded,
    LoadReported,
    PrefillFinished,
    ReleaseDecided,
    RemoteTokensCounted,
    RequestFinished,
    SchedMachine,
    SchedulerStopped,
)
from kvsm.lifecycle.table import SCHED
from kvsm.scheduler.block_pairing import NULL_BLOCK
from kvsm.scheduler.holds import HOLD_ASKED_KEY, HoldIndex, held_tokens, hold_offer, judge_hold_params
from kvsm.scheduler.params import (
    HELD_BACK_KEY,
    Source,
    hold_back_last_tokens,
    judge_decode_params,
    prefill_offer,
    remote_block_sizes,
)
from kvsm.scheduler.pin_handoff import PIN_VIA_STEP_ENV, PinHandoff
from kvsm.scheduler.recv_start import plan_recv_start
from kvsm.scheduler.stream_steps import GroupReach, StreamSteps

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HELD_BACK_KEY", "PIN_VIA_STEP_ENV", "SchedulerHalf"]

log = logging.getLogger("kvsm.scheduler")

Group = tuple[str, str, int, int, int]  # a prefill worker group: (engine, host, port, tp, pp)
# An effect: the request's machine, the event, what the hook has besides (vLLM's
# request, blocks...); what it returns, if anything, is the hook's answer.
Effect = Callable[[SchedMachine, Any, Any], Any]


class SchedulerHalf:
    """Scheduler-side state of one engine's connector.

    ``group_block_sizes``: the tokens per block of each KV cache group (vLLM's
    ``kv_cache_config.kv_cache_groups``, in order); empty: one group of
    ``cfg.block_size``. With several groups every block list is one per group,
    indexed by position (block ``j`` of a group holds its tokens ``j * size``
    on), and a group that keeps no block at a position (a sliding window's
    past) has the null block there.
    """

    def __init__(self, cfg: KVSMConfig, event_log: EventLog | None = None, *, clock: Clock = SYSTEM_CLOCK,
                 group_block_sizes: tuple[int, ...] = (), hold_back_tokens: int = 0,
                 step_facts: Callable[[int], StepFacts] = StepFacts, stream_unsupported: str = "",
                 stream_reach: tuple[GroupReach, ...] = ()) -> None:
        self.cfg = cfg
        # Makes each step's facts: the vLLM adapter passes its KVSMConnectorMetadata
        # (StepFacts on vLLM's base class), so that this half never imports vLLM.
        self._step_facts = step_facts
        self.log = event_log
        self._group_block_sizes = group_block_sizes or (cfg.block_size,)
        # Prompt tokens the prefill side leaves for the decode side to compute (1 with
        # a Mamba/GDN state group: the state moved is that of the prompt but its
        # last token, which the decode engine then feeds once, as vLLM needs).
        self._hold_back = hold_back_tokens
        # Why this engine cannot stream (transfer_mode "stream"), "" where it can; and
        # the streamed prefills it computes, whose steps the workers hear of (per KV
        # cache group, how far back it reads: all of it by default).
        reach = stream_reach or (GroupReach(),) * len(self._group_block_sizes)
        if len(reach) != len(self._group_block_sizes):
            raise ValueError(f"stream_reach names {len(reach)} KV cache groups, group_block_sizes "
                             f"{len(self._group_block_sizes)}")
        self._stream_unsupported = stream_unsupported or ("" if len(set(self._group_block_sizes)) == 1 else (
            f"its KV cache groups' blocks hold {list(self._group_block_sizes)} tokens; streamed push writes "
            f"groups of one block size"))
        if hold_back_tokens and not self._stream_unsupported:
            self._stream_unsupported = "Mamba/GDN state is not streamed (its last prompt token is held back)"
        self._streams = StreamSteps(reach, self._group_block_sizes[0])
        self.requests = LifecycleTracker(SCHED, clock, listener=self._on_outcome)
        self._pins = PinHandoff(event_log)
        self._warned_late_flush = False
        self._warned_producers: set[str] = set()  # prefill engines whose params lacked PRODUCER_KEY
        # Indexes of the machines, kept by their effects: heartbeat claims per prefill
        # worker group, and the one request of this engine reading each prefill request.
        self._claims: dict[Group, set[str]] = defaultdict(set)
        self._reader_of: dict[Source, str] = {}
        self._holds = HoldIndex()  # a decode engine's holds for next turns, oldest first
        self._next_heartbeat = time.monotonic() + cfg.heartbeat_interval_s
        self._step = 0
        self._meta = step_facts(0)
        # When the engine's stop was requested, the monotonic time from which each
        # step tells the workers to close their pins (request_stop); None: running.
        self._close_pins_at: float | None = None
        self._effects: dict[str, Effect] = {
            "warn_ignored": self._warn_ignored, "note_rejected": self._note_rejected,
            "take_reader": self._take_reader, "drop_reader": self._drop_reader,
            "start_heartbeat": self._start_heartbeat, "stop_heartbeat": self._stop_heartbeat,
            "keep_params": self._keep_params, "recompute_locally": self._recompute_locally,
            "start_load": self._start_load, "start_notify_only": self._start_notify_only,
            "abandon_remote": self._abandon_remote, "abandon_stream": self._abandon_stream,
            "abort_load": self._abort_load,
            "start_send": self._start_send, "queue_pin": self._queue_pin, "refuse_pin": self._refuse_pin,
            "hold_blocks": self._hold_blocks, "make_room": self._make_room, "release_hold": self._release_hold,
            "note_not_held": self._note_not_held, "forget_hold": self._forget_hold,
        }
        missing = {e for rules in SCHED.rules.values() for r in rules for e in r.effects} - set(self._effects)
        if missing:
            raise RuntimeError(f"SchedulerHalf: no handler for the sched lifecycle's effects {sorted(missing)}")

    # -- the machines ---------------------------------------------------------

    def _machine(self, req: str) -> SchedMachine | None:
        """The request's live machine (None: kvsm has no business with it, or no more)."""
        return self.requests.get(req)  # type: ignore[return-value]  # SCHED's machine_cls

    def _apply(self, m: SchedMachine, event: Event, context: Any = None) -> Any:
        """Move the request's machine and carry out the effects its transition names;
        the last effect's answer (if any) is the hook's."""
        answer = None
        for name in self.requests.apply(event).effects:
            said = self._effects[name](m, event, context)
            if said is not None:
                answer = said
        return answer

    def _on_outcome(self, o: Outcome) -> None:
        if self.log is not None:
            self.log.record_outcome(o)
        if o.violation is not None:
            log.warning("kvsm: %s", o.describe())

    # -- the workers ----------------------------------------------------------

    def connect_workers(self, targets: list[PinTarget]) -> None:
        """Open the pin channel to this engine's workers."""
        self._pins.connect(targets)

    def _flush_pins(self) -> None:
        self._meta.send_finish += self._pins.flush()

    # -- both roles -----------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        req = request.request_id
        if params.get("do_remote_decode") and self.cfg.produces:
            if self._hold_back and hold_back_last_tokens(request, params, self._hold_back):
                self._note("sched.held_back", req, tokens=self._hold_back, prompt_tokens=request.num_prompt_tokens)
            self.requests.create(req, "prefill_queued")
            m = self._machine(req)
            if self._streams.wanted(params):
                if self._stream_unsupported:
                    self._note("sched.stream_refused", req, why=self._stream_unsupported)
                else:
                    self._streams.add(request, params)
            if params.get("remote_block_ids") and m is not None:  # a decode engine holds the conversation
                judged = judge_hold_params(request, params, self.cfg, self._group_block_sizes, self._reader_of)
                self._apply(m, judged.event, judged.remote)
            return
        if params.get(HOLD_ASKED_KEY) and self.cfg.bidirectional and not params.get("do_remote_prefill"):
            self.requests.create(req, "running_to_hold")  # computed here, held at its finish
            return
        if not params.get("do_remote_prefill") or not self.requests.create(req).ok:
            return
        m = self._machine(req)
        if m is None:
            return
        judged = judge_decode_params(request, params, self.cfg, self._group_block_sizes, self._reader_of,
                                     self._stream_unsupported)
        if judged.foreign and judged.remote is not None:
            self._warn_foreign(req, judged.remote.remote_engine)
        self._apply(m, judged.event, judged.remote)

    def _warn_foreign(self, req: str, engine: str) -> None:
        """Params without kvsm's producer key: a router that rebuilt them, or a prefill
        engine on another connector (upstream ``NixlConnector``'s params look the same,
        but its side channel speaks another protocol, and reading from it fails). Said
        once per prefill engine; the request goes on."""
        if engine in self._warned_producers or len(self._warned_producers) >= 64:
            return
        self._warned_producers.add(engine)
        log.warning("kvsm: kv_transfer_params from prefill engine %r carry no %r key: if that engine does not run "
                    "KVSMConnector (upstream NixlConnector, say), kvsm cannot read from it and its requests will "
                    "fail at the handshake; a router that rebuilds the params must keep kvsm's keys", engine,
                    PRODUCER_KEY)
        self._note("sched.foreign_producer", req, remote_engine=engine, key=PRODUCER_KEY)

    # -- decode side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        m = self._machine(request.request_id)
        remote = None if m is None else m.remote
        if m is None or remote is None or m.recompute_tokens:
            return 0, False
        available = request.num_prompt_tokens
        if remote.stream:  # the prefill computes the whole prompt meanwhile
            count = available - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        if remote.remote_num_tokens is not None:
            available = min(available, remote.remote_num_tokens)
        # What every group's blocks cover (by position, nulls included).
        for ids, size in zip(remote.remote_block_ids, remote_block_sizes(remote, self._group_block_sizes),
                             strict=True):
            available = min(available, len(ids) * size)
        count = available - num_computed_tokens
        if count > 0 and self.cfg.recompute_threshold and self._apply(m, RemoteTokensCounted(
                req=m.req, tokens=count, threshold=self.cfg.recompute_threshold)):
            return 0, False  # the table chose: so few tokens are computed here
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req = request.request_id
        m = self._machine(req)
        if m is not None:
            self._apply(m, BlocksAllocated(req=req, num_external_tokens=num_external_tokens), (request, blocks))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._flush_pins()
        for req in connector_output.finished_recving or ():
            m = self._machine(req)
            if m is not None:
                self._apply(m, LoadReported(req=req))
        if self._holds:
            for req in connector_output.finished_sending or ():
                m = self._machine(req)
                if m is not None:  # (a finished prefill's machine ended at its pin)
                    self._apply(m, HoldEnded(req=req))

    # -- finishing ------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """One KV cache group's form of ``request_finished_all_groups``."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        req = request.request_id
        self._streams.discard(req)
        m = self._machine(req)
        if m is None:
            return False, None
        status = request.status.name
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_decode") and self.cfg.produces):
            hold, budget = 0, 0
            if self.cfg.bidirectional and status in NORMAL_FINISH:
                offered, m.why = held_tokens(request, self._group_block_sizes)
                # What the hold keeps out of the pool: every block of the request.
                hold = len({b for ids in block_ids for b in ids if b != NULL_BLOCK}) if offered else 0
                budget = self.cfg.hold_budget_blocks
            offer = self._apply(m, RequestFinished(req=req, status=status, hold_blocks=hold, hold_budget=budget),
                                (request, block_ids))
            return (True, offer) if offer is not None else (False, None)
        # What is pinned: every block of every group, each once, never the null block.
        blocks = tuple(dict.fromkeys(b for ids in block_ids for b in ids if b != NULL_BLOCK))
        event = PrefillFinished(req=req, status=status, blocks=len(blocks),
                                past_prompt=request.num_computed_tokens - request.num_prompt_tokens,
                                held_back=self._hold_back)
        offer = self._apply(m, event, (request, block_ids, blocks))
        return (True, offer) if offer is not None else (False, None)

    # -- effects: what the sched lifecycle's transitions name -----------------

    def _warn_ignored(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """Bad kv_transfer_params: the request runs as a plain local one (as upstream
        does), and the reason is logged where an operator will look for it."""
        log.warning("kvsm: request %s will not use KV transfer: %s", m.req, m.why)
        self._note("sched.params_ignored", m.req, reason=m.why)

    def _note_rejected(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """vLLM's stand-in for a decode request its API server rejected before the
        engine saw it (a bad argument, say): prompt ``[0]``, that request's params,
        aborted at once, so that the connector frees what the prefill side holds
        (``AsyncLLM.notify_kv_transfer_request_rejected``)."""
        self._note("sched.rejected_upstream", m.req, remote_req=m.remote_req,
                   **({"kept_for": ev.reader} if ev.reader else {}))

    def _recompute_locally(self, m: SchedMachine, ev: Any, context: Any) -> bool:
        return True  # get_num_new_matched_tokens answers (0, False)

    def _keep_params(self, m: SchedMachine, ev: Any, remote: Any) -> None:
        m.remote = remote

    def _take_reader(self, m: SchedMachine, ev: Any, context: Any) -> None:
        self._reader_of[m.source] = m.req

    def _drop_reader(self, m: SchedMachine, ev: Any, context: Any) -> None:
        if self._reader_of.get(m.source) == m.req:  # (a rejected request never took the slot)
            del self._reader_of[m.source]

    def _start_heartbeat(self, m: SchedMachine, ev: Any, context: Any) -> None:
        self._claims[m.group].add(m.remote_req)

    def _forget_hold(self, m: SchedMachine, ev: Any, context: Any) -> None:
        self._holds.remove(m.req)

    def _stop_heartbeat(self, m: SchedMachine, ev: Any, context: Any) -> None:
        claims = self._claims.get(m.group)
        if claims is not None:
            claims.discard(m.remote_req)
            if not claims:
                del self._claims[m.group]

    def _start_load(self, m: SchedMachine, ev: Any, context: Any) -> None:
        self._relay_start(m, context, ev.num_external_tokens)

    def _start_notify_only(self, m: SchedMachine, ev: Any, context: Any) -> None:
        self._relay_start(m, context, 0)

    def _relay_start(self, m: SchedMachine, context: tuple[Request, KVCacheBlocks], num_external_tokens: int) -> None:
        """The request's one transfer, or with nothing to read its prefill side's unpin."""
        request, blocks = context
        remote, m.remote = m.remote, None  # used up: vLLM may allocate again, nothing more is matched
        self._meta.recv_start.append(plan_recv_start(m.req, remote, blocks.blocks, num_external_tokens,
                                                     self._group_block_sizes))
        # Only one transfer per request (vLLM may call again once it is loaded).
        request.kv_transfer_params["do_remote_prefill"] = False

    def _abandon_remote(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """Finished before vLLM allocated anything: free the prefill side's blocks now."""
        remote, m.remote = m.remote, None
        self._queue_abandon(m.req, remote)
        self._note("sched.finished_unallocated", m.req, status=ev.status)

    def _abandon_stream(self, m: SchedMachine, ev: Any, remote: RemoteParams) -> None:
        self._queue_abandon(m.req, remote)

    def _queue_abandon(self, req: str, remote: RemoteParams) -> None:
        self._meta.recv_abandon.append(RecvAbandon(
            req=req, remote_engine=remote.remote_engine, remote_req=remote.remote_req,
            remote_host=remote.remote_host, remote_port=remote.remote_port,
            remote_tp_size=remote.remote_tp_size, remote_pp_size=remote.remote_pp_size))

    def _abort_load(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """Finished while its blocks were still being loaded (vLLM keeps them until a
        worker reports finished_recving for it): the worker reports it once no read
        can write any more."""
        self._meta.recv_abort.append(RecvAbort(req=m.req, awaited=True))
        self._note("sched.finished_while_loading", m.req, status=ev.status)

    def _start_send(self, m: SchedMachine, ev: Any, context: Any) -> None:
        self._meta.send_start.append(SendStart(m.req, stream=self._streams.key_of(m.req)))

    def _queue_pin(self, m: SchedMachine, ev: Any, context: Any) -> dict[str, Any]:
        """Pin the blocks: handed over in one batch per step, by update_connector_output,
        which vLLM calls in the same update_from_output once every request of the step
        is through request_finished (else by the next build_connector_meta)."""
        request, block_ids, blocks = context
        cfg = self.cfg
        pinned_ns = self.requests.clock.monotonic_ns()
        self._pins.pending.append(SendFinish(req=m.req, ok=True, block_ids=blocks, pinned_ns=pinned_ns))
        via = self._pins.path()
        if self.log is not None:
            self.log.emit("log", "sched.pinned", m.req, block_ids=blocks, pinned_ns=pinned_ns,
                          lease_deadline_ns=pinned_ns + cfg.lease_ns, via=via, workers=self._pins.workers)
        # A prefill leg asked for more than one token (a client's default max_tokens):
        # its KV goes on past the prompt, and the decode request, sent the prompt,
        # reads the prompt's part (the blocks are read by position).
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        return prefill_offer(cfg, request, block_ids, num_tokens, self._group_block_sizes)

    def _refuse_pin(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """Nothing pinned: no hurry, but no step needed either."""
        self._meta.send_finish += self._pins.hand([SendFinish(req=m.req, ok=False, reason=m.why)])
        self._note("sched.prefill_finished", m.req, ok=False, status=ev.status, via=self._pins.path(),
                   **({} if m.why == ev.status else {"why": m.why}))

    def _hold_blocks(self, m: SchedMachine, ev: Any, context: Any) -> dict[str, Any]:
        """Keep the blocks for the next turn: pinned like a finished prefill's, with
        the holds' time to live for a lease (a claim then reads within its own)."""
        request, block_ids = context
        blocks = tuple(dict.fromkeys(b for ids in block_ids for b in ids if b != NULL_BLOCK))
        pinned_ns = self.requests.clock.monotonic_ns()
        self._pins.pending.append(SendFinish(req=m.req, ok=True, block_ids=blocks, pinned_ns=pinned_ns,
                                             lease_ns=self.cfg.hold_ttl_ns, hold=True))
        self._holds.add(m.req, len(blocks))
        offered, _ = held_tokens(request, self._group_block_sizes)
        self._note("sched.held", m.req, blocks=len(blocks), tokens=offered,
                   holds=len(self._holds), held_blocks=self._holds.total, budget=self.cfg.hold_budget_blocks,
                   ttl_s=self.cfg.hold_ttl_s)
        return hold_offer(self.cfg, request, block_ids[0], offered, self._group_block_sizes[0])

    def _make_room(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """Release the oldest holds until every hold fits the budget again."""
        budget = self.cfg.hold_budget_blocks
        for victim, total in self._holds.oldest_over(budget, keep=m.req):
            held = self._machine(victim)
            if held is not None:
                self._apply(held, ReleaseDecided(req=victim, reason=(
                    f"released under memory pressure: {total} blocks held for next turns, over "
                    f"decoder_kv_hold_blocks ({budget}); the oldest hold goes first")))

    def _release_all_holds(self, reason: str) -> None:
        for victim, _ in self._holds.oldest_over(-1, keep=""):
            held = self._machine(victim)
            if held is not None:
                self._apply(held, ReleaseDecided(req=victim, reason=reason))

    def _release_hold(self, m: SchedMachine, ev: Any, context: Any) -> None:
        """In the pin hand-off's order: never ahead of the hold's own pin."""
        self._holds.remove(m.req)
        self._pins.pending.append(SendFinish(req=m.req, ok=False, reason=m.why, release=True,
                                             lease_ns=self.cfg.lease_ns))

    def _note_not_held(self, m: SchedMachine, ev: Any, context: Any) -> None:
        if m.why and ev.status in NORMAL_FINISH and self.cfg.bidirectional:
            self._note("sched.not_held", m.req, why=m.why)

    # -- per step -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepFacts:
        if self._pins.pending:  # vLLM finished requests without update_connector_output after them
            self._note("sched.pins_flushed_late", None, reqs=[f.req for f in self._pins.pending])
            if not self._warned_late_flush:
                self._warned_late_flush = True
                log.warning("kvsm: finished prefills were handed to the workers only at the next step "
                            "(vLLM did not call update_connector_output after request_finished)")
            self._flush_pins()
        meta = self._meta
        if self._streams:
            meta.stream_steps = self._streams.steps(scheduler_output)
            meta.stream_preempted = self._streams.preempted(scheduler_output, self.requests.clock.monotonic_ns())
            for p in meta.stream_preempted:
                self._note("sched.stream_preempted", p.req, at_ns=p.at_ns)
        self._step += 1
        self._meta = self._step_facts(self._step)
        if self._claims:
            now = time.monotonic()
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + self.cfg.heartbeat_interval_s
                meta.heartbeats = [
                    HeartbeatTarget(remote_engine=engine, remote_host=host, remote_port=port,
                                    remote_tp_size=tp, claims=tuple(claims), remote_pp_size=pp)
                    for (engine, host, port, tp, pp), claims in self._claims.items()]
        if self._close_pins_at is not None:
            if self._holds:  # a stopping engine serves no next turn: its holds go now, not at its drain's end
                self._release_all_holds("released: the engine is stopping")
                self._flush_pins()
            if time.monotonic() >= self._close_pins_at:
                meta.stopping = True
        return meta

    def request_stop(self, drain_s: float = 0.0) -> None:
        """The engine was asked to stop (SIGTERM to its engine core: the end of an
        offline script, ``vllm serve`` stopping). vLLM keeps stepping while any
        finished prefill's blocks are pinned, and kills the process when its wait
        is over; so once ``drain_s`` has passed (reads of the pins may still come
        meanwhile) every step asks the workers to close their pins. Safe in a
        signal handler: it only stores a number."""
        if self._close_pins_at is None:
            self._close_pins_at = time.monotonic() + max(0.0, drain_s)

    # -- introspection --------------------------------------------------------

    def pending_counts(self) -> dict[str, int]:
        """Live requests in each state and the indexes' sizes (tests check they drain)."""
        return {**self.requests.count_by_state(), "heartbeat_groups": len(self._claims),
                "readers": len(self._reader_of), "held_blocks": self._holds.total, "streams": len(self._streams)}

    def _note(self, event: str, req: str | None, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)

    def shutdown(self) -> None:
        """A clean stop: the step's pins go out, every live request ends
        ``closed_at_shutdown`` (its log then reads as a clean stop, not a crash)."""
        self._flush_pins()
        for live in self.requests.live():
            self._apply(live, SchedulerStopped(req=live.req))  # type: ignore[arg-type]  # SCHED's machine_cls
        self._pins.close()
        if self.log is not None:
            self.log.close()
