"""The scheduler half of KVSMConnector: relays vLLM's decisions to the workers.

It owns no lifecycle and does no I/O. vLLM's scheduler calls its hooks; each
hook turns vLLM's decision into a fact (``kvsm.vllm.metadata``) that the next
``build_connector_meta`` hands to every worker, where the request's machine
lives. Every hook input is also written to this process's event log, so a
replay shows what the scheduler decided next to what the workers did.

What it must remember, and why:

* ``_remote``: decode requests with remote KV still to be matched (their
  leases are kept alive by heartbeats until vLLM allocates their blocks).
* ``_awaited``: decode requests whose blocks vLLM holds in
  WAITING_FOR_REMOTE_KVS until a worker reports them in finished_recving. An
  abort of one must be relayed with ``awaited=True`` so the worker reports it
  once no read can write any more; vLLM asserts on a finished_recving it is
  not waiting for, so the worker must know exactly which.
* ``_sending``: prefill requests whose worker-side machine was started.

A finished prefill does not wait for a step: ``request_finished`` sends the
pin (or "nothing pinned") straight to every local worker through
``kvsm.handoff.pins`` and records the decision (``sched.pinned``) in this
process's log, so replay can tell "decided, never received" from "never
decided". The step's metadata carries it only where no worker could be
reached directly.

Per-request cost is a few dict operations. What a hook decides reaches a
worker as an event its machine records (``matched``, ``allocated``,
``finished_ok``, ``abort``...), so this process's log carries only the
decisions no machine sees (parameters ignored, a finish before allocation or
during the load, an abnormal prefill finish): the hot path writes nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import (
    PRODUCER_KEY,
    PROMPT_FINGERPRINT_KEY,
    BadTransferParams,
    HeartbeatTarget,
    RecvAbandon,
    RecvAbort,
    RecvStart,
    RemoteParams,
    SendFinish,
    SendStart,
    StepFacts,
    parse_remote_params,
    prompt_fingerprint,
    prompt_mismatch,
)
from kvsm.handoff.pins import PinChannelClient, PinTarget
from kvsm.handshake.messages import PROTOCOL_VERSION
from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.scheduler.block_pairing import NULL_BLOCK
from kvsm.scheduler.block_pairing import pair_segments as _pair_segments

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvsm.scheduler")

# vLLM's RequestStatus names of a normal finish: the prefill KV is complete.
_NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})
# Tests and benchmarks only: send pins with the next step, as before the pin
# channel existed (reproduces an offline prefill engine's stuck pins).
PIN_VIA_STEP_ENV = "KVSM_PIN_VIA_STEP"


HELD_BACK_KEY = "_kvsm_held_back"  # in a prefill request's kv_transfer_params: tokens held back


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
                 step_facts: Callable[[int], StepFacts] = StepFacts) -> None:
        self.cfg = cfg
        # Makes each step's facts: the vLLM adapter passes its KVSMConnectorMetadata
        # (StepFacts on vLLM's base class), so that this half never imports vLLM.
        self._step_facts = step_facts
        self.log = event_log
        self._clock = clock
        self._group_block_sizes = group_block_sizes or (cfg.block_size,)
        # Prompt tokens the prefill side leaves for the decode side to compute (1 with
        # a Mamba/GDN state group: the state moved is that of the prompt but its
        # last token, which the decode engine then feeds once, as vLLM needs).
        self._hold_back = hold_back_tokens
        self._pins: PinChannelClient | None = None
        self._pin_via_step = os.environ.get(PIN_VIA_STEP_ENV, "") not in ("", "0")
        self._warned_no_channel = False
        self._warned_late_flush = False
        self._pending_pins: list[SendFinish] = []
        self._remote: dict[str, RemoteParams] = {}
        self._awaited: set[str] = set()
        self._sending: set[str] = set()
        self._bad: dict[str, str] = {}  # request -> why its kv_transfer_params were ignored
        self._foreign: set[str] = set()  # prefill engines whose params lacked PRODUCER_KEY (warned once)
        # Heartbeat claims per prefill worker group: (engine, host, port, tp) -> remote ids.
        self._claims: dict[tuple[str, str, int, int, int], set[str]] = defaultdict(set)
        # The one request of this engine that reads each prefill request, until it finishes:
        # (engine, host, port, tp, remote id) -> request.
        self._reader_of: dict[tuple[str, str, int, int, int, str], str] = {}
        self._reads_from: dict[str, tuple[str, str, int, int, int, str]] = {}  # its inverse
        self._claim_key: dict[str, tuple[tuple[str, str, int, int, int], str]] = {}
        self._next_heartbeat = time.monotonic() + cfg.heartbeat_interval_s
        self._step = 0
        self._meta = step_facts(0)

    # -- the workers ----------------------------------------------------------

    def connect_workers(self, targets: list[PinTarget]) -> None:
        """Open the pin channel to this engine's workers (vLLM hands over what each
        worker published at start, once they all registered their KV caches)."""
        if self._pins is not None:
            self._pins.close()
        self._pins = PinChannelClient(targets) if targets else None
        self._note("sched.workers_connected", None, workers=len(targets),
                   via=self._pins.via if self._pins else None,
                   ranks=sorted(t.tp_rank for t in targets), pin_via_step=self._pin_via_step,
                   **({"stages": sorted({t.pp_rank for t in targets})} if any(t.pp_rank for t in targets) else {}))

    def _path(self) -> str:
        """How a finish decided now reaches the workers."""
        if self._pins is None or self._pin_via_step:
            if self._pins is None and not self._warned_no_channel and not self._pin_via_step:
                self._warned_no_channel = True
                log.warning("kvsm: no direct channel to this engine's workers (vLLM did not hand over their "
                            "handshake metadata); finished prefills reach them with the next engine step")
            return "next_step"
        return self._pins.via

    def _hand_to_workers(self, finishes: list[SendFinish]) -> None:
        """Tell every worker now; what cannot be handed over goes with the next step."""
        if not finishes:
            return
        pins = self._pins
        if pins is None or self._pin_via_step:
            self._meta.send_finish += finishes
            return
        failed = pins.send(finishes)
        if failed:
            for finish in finishes:
                for rank, why in failed:
                    self._note("sched.pin_handoff_failed", finish.req, worker_rank=rank, error=why)
            log.error("kvsm: could not hand %d finished request(s) (%s...) to workers %s directly (%s); they go "
                      "with the next engine step", len(finishes), finishes[0].req, [r for r, _ in failed],
                      failed[0][1])
            self._meta.send_finish += finishes

    def _flush_pins(self) -> None:
        """The finishes of this step, in one hand-off per worker."""
        if self._pending_pins:
            pending, self._pending_pins = self._pending_pins, []
            self._hand_to_workers(pending)

    # -- both roles -----------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self.cfg.produces and self._hold_back:
            self._hold_back_last_tokens(request, params)
        if not params or not params.get("do_remote_prefill"):
            return
        req = request.request_id
        if not self.cfg.consumes:
            self._ignore(req, f"do_remote_prefill on an engine with kv_role {self.cfg.kv_role!r}")
            return
        mode = params.get("transfer_mode")  # absent: a producer older than the key (upstream's or kvsm's)
        if mode not in (None, "pull"):
            self._ignore(req, f"transfer_mode {mode!r}: the prefill engine's connector does not serve reads "
                              f"(NixlPushConnector writes into the decode engine), and kvsm only reads: "
                              f"transfer_mode 'pull'")
            return
        try:
            remote = parse_remote_params(params)
        except BadTransferParams as e:
            self._ignore(req, str(e))
            return
        if len(remote.remote_block_ids) != len(self._group_block_sizes):
            self._ignore(req, f"remote_block_ids has {len(remote.remote_block_ids)} KV cache group(s), this "
                              f"engine's KV cache {len(self._group_block_sizes)} (another model or layout?)")
            return
        if PRODUCER_KEY not in params:
            self._warn_foreign(req, remote.remote_engine)
        theirs, ours = self._remote_block_sizes(remote)[0], self._group_block_sizes[0]
        if max(theirs, ours) % min(theirs, ours):
            self._ignore(req, f"the prefill engine's blocks hold {theirs} tokens, this engine's {ours}: blocks of "
                              f"different sizes are read in segments, so one size must divide the other")
            return
        key = (remote.remote_engine, remote.remote_host, remote.remote_port, remote.remote_tp_size,
               remote.remote_pp_size)
        source = (*key, remote.remote_req)
        if getattr(request, "abort_immediately", False):
            self._rejected_upstream(request, remote, source)
            return
        mismatch = prompt_mismatch(params, remote.remote_num_tokens, request.prompt_token_ids,
                                   request.num_prompt_tokens)
        if mismatch:
            self._ignore(req, mismatch)
            return
        reader = self._reader_of.setdefault(source, req)
        if reader != req:
            # The prefill side frees the blocks once the first read's notification is in:
            # a second reader could still be reading them then (they may be reused).
            self._ignore(req, f"request {reader} of this engine already reads prefill request "
                              f"{remote.remote_req!r} (the samples of an n > 1 request, or a retry "
                              f"sent while the first is running): the prefill side frees its blocks "
                              f"after one read")
            return
        self._reads_from[req] = source
        self._remote[req] = remote
        self._claims[key].add(remote.remote_req)
        self._claim_key[req] = (key, remote.remote_req)

    def _rejected_upstream(self, request: Request, remote: RemoteParams, source: tuple[Any, ...]) -> None:
        """vLLM's stand-in for a decode request its API server rejected before the
        engine saw it (a bad argument, say): prompt ``[0]``, that request's params,
        aborted at once, so that the connector frees what the prefill side holds
        (``AsyncLLM.notify_kv_transfer_request_rejected``). Nothing is read: the
        abort that follows abandons the prefill request (``_decode_finished``),
        unless a live request of this engine reads it (a retry that got in)."""
        req = request.request_id
        reader = self._reader_of.get(source)
        if reader is not None:
            self._note("sched.rejected_upstream", req, remote_req=remote.remote_req, kept_for=reader)
            return
        self._remote[req] = remote
        self._note("sched.rejected_upstream", req, remote_req=remote.remote_req)

    def _warn_foreign(self, req: str, engine: str) -> None:
        """Params without kvsm's producer key: a router that rebuilt them, or a prefill
        engine on another connector (upstream ``NixlConnector``'s params look the same,
        but its side channel speaks another protocol, and reading from it fails). Said
        once per prefill engine; the request goes on."""
        if engine in self._foreign or len(self._foreign) >= 64:
            return
        self._foreign.add(engine)
        log.warning("kvsm: kv_transfer_params from prefill engine %r carry no %r key: if that engine does not run "
                    "KVSMConnector (upstream NixlConnector, say), kvsm cannot read from it and its requests will "
                    "fail at the handshake; a router that rebuilds the params must keep kvsm's keys", engine,
                    PRODUCER_KEY)
        self._note("sched.foreign_producer", req, remote_engine=engine, key=PRODUCER_KEY)

    def _remote_block_sizes(self, remote: RemoteParams) -> tuple[int, ...]:
        """Tokens per prefill block of each group: the params' ``remote_block_size``
        where one group has it (a kvsm producer says so), else this engine's."""
        if remote.remote_block_size is None or len(self._group_block_sizes) != 1:
            return self._group_block_sizes
        return (remote.remote_block_size,)

    def _hold_back_last_tokens(self, request: Request, params: dict[str, Any]) -> None:
        """Prefill only ``num_prompt_tokens - hold_back`` tokens: the state a
        Mamba/GDN group leaves is then the one the decode side needs before it
        computes the last prompt token itself (vLLM always computes at least one).
        Once per request (a preempted request comes back here)."""
        n = self._hold_back
        if params.get(HELD_BACK_KEY) or request.num_prompt_tokens <= n or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        params[HELD_BACK_KEY] = n
        self._note("sched.held_back", request.request_id, tokens=n, prompt_tokens=request.num_prompt_tokens)

    def _ignore(self, req: str, why: str) -> None:
        """Bad kv_transfer_params: the request runs as a plain local one (as upstream
        does), and the reason is logged where an operator will look for it."""
        self._bad[req] = why
        log.warning("kvsm: request %s will not use KV transfer: %s", req, why)
        self._note("sched.params_ignored", req, reason=why)

    def _stop_heartbeat(self, req: str) -> None:
        entry = self._claim_key.pop(req, None)
        if entry is not None:
            key, remote_req = entry
            claims = self._claims.get(key)
            if claims is not None:
                claims.discard(remote_req)
                if not claims:
                    del self._claims[key]

    # -- decode side ----------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote.get(request.request_id)
        if remote is None:
            return 0, False
        available = request.num_prompt_tokens
        if remote.remote_num_tokens is not None:
            available = min(available, remote.remote_num_tokens)
        # What every group's blocks cover (by position, nulls included).
        for ids, size in zip(remote.remote_block_ids, self._remote_block_sizes(remote), strict=True):
            available = min(available, len(ids) * size)
        count = available - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req = request.request_id
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self.cfg.produces:
            if req not in self._sending:
                self._sending.add(req)
                self._meta.send_start.append(SendStart(req))
            return
        remote = self._remote.pop(req, None)
        if remote is None:
            return  # not a remote prefill, or already started (vLLM calls again after the load)
        self._stop_heartbeat(req)
        sizes: tuple[int, ...] = ()
        problem = ""
        segmented: dict[str, Any] = {}
        remote_size = self._remote_block_sizes(remote)[0]
        if num_external_tokens > 0 and remote_size != self._group_block_sizes[0]:
            local, remote_ids, segmented, problem = _pair_segments(
                blocks.blocks[0], remote.remote_block_ids[0], self._group_block_sizes[0], remote_size,
                num_external_tokens)
        elif num_external_tokens > 0:
            local, remote_ids, sizes, problem = _pair_blocks(blocks.blocks, remote.remote_block_ids)
            if len(sizes) == 1:
                sizes = ()  # one group: the plain form
        else:  # a full local prefix hit: nothing to read, but the prefill side must unpin
            local = remote_ids = ()
        awaited = num_external_tokens > 0
        if awaited:
            self._awaited.add(req)
        self._meta.recv_start.append(RecvStart(
            req=req, remote_engine=remote.remote_engine, remote_req=remote.remote_req,
            remote_host=remote.remote_host, remote_port=remote.remote_port,
            remote_tp_size=remote.remote_tp_size, remote_block_ids=remote_ids,
            local_block_ids=local, num_tokens=num_external_tokens, awaited=awaited, group_sizes=sizes,
            problem=problem, remote_pp_size=remote.remote_pp_size, remote_expiry_s=remote.remote_expiry_s,
            **segmented))
        # Only one transfer per request (vLLM may call again once it is loaded).
        params["do_remote_prefill"] = False

    # -- prefill side and finishing -------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """One KV cache group's form of ``request_finished_all_groups``."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        req = request.request_id
        self._bad.pop(req, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_decode") and self.cfg.produces:
            return self._prefill_finished(request, block_ids)
        self._decode_finished(request)
        return False, None

    def _decode_finished(self, request: Request) -> None:
        req = request.request_id
        self._forget_reader(request)
        self._stop_heartbeat(req)
        remote = self._remote.pop(req, None)
        if remote is not None:
            # Finished before vLLM allocated anything: free the prefill side's blocks now.
            self._meta.recv_abandon.append(RecvAbandon(
                req=req, remote_engine=remote.remote_engine, remote_req=remote.remote_req,
                remote_host=remote.remote_host, remote_port=remote.remote_port,
                remote_tp_size=remote.remote_tp_size, remote_pp_size=remote.remote_pp_size))
            self._note("sched.finished_unallocated", req, status=request.status.name)
        elif req in self._awaited:
            # Finished while its blocks were still being loaded (vLLM keeps them
            # until a worker reports finished_recving for it).
            self._awaited.discard(req)
            self._meta.recv_abort.append(RecvAbort(req=req, awaited=True))
            self._note("sched.finished_while_loading", req, status=request.status.name)

    def _forget_reader(self, request: Request) -> None:
        source = self._reads_from.pop(request.request_id, None)
        if source is not None:
            del self._reader_of[source]

    def _prefill_finished(self, request: Request,
                          block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        req = request.request_id
        self._sending.discard(req)
        status = request.status.name
        # What is pinned: every block of every group, each once, never the null block.
        blocks = tuple(dict.fromkeys(b for ids in block_ids for b in ids if b != NULL_BLOCK))
        # A prefill leg asked for more than one token (a client's default max_tokens):
        # its KV goes on past the prompt, and the decode request, sent the prompt,
        # reads the prompt's part (the blocks are read by position).
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        refusal = status if status not in _NORMAL_FINISH or not blocks else ""
        if not refusal and self._hold_back and request.num_computed_tokens > request.num_prompt_tokens:
            refusal = (f"{request.num_computed_tokens - request.num_prompt_tokens} generated token(s) computed "
                       f"after the prompt: a Mamba/GDN state holds every token computed, not the prompt's "
                       f"(send the prefill leg with max_tokens 1)")
        if refusal:
            # Nothing pinned: no hurry, but no step needed either.
            self._hand_to_workers([SendFinish(req=req, ok=False, reason=refusal)])
            self._note("sched.prefill_finished", req, ok=False, status=status, via=self._path(),
                       **({} if refusal == status else {"why": refusal}))
            return False, None
        cfg = self.cfg
        pinned_ns = self._clock.monotonic_ns()
        # Handed over in one batch per step, by update_connector_output, which vLLM
        # calls in the same update_from_output once every request of the step is
        # through request_finished (else by the next build_connector_meta).
        self._pending_pins.append(SendFinish(req=req, ok=True, block_ids=blocks, pinned_ns=pinned_ns))
        via = self._path()
        if self.log is not None:
            self.log.emit("log", "sched.pinned", req, block_ids=blocks, pinned_ns=pinned_ns,
                          lease_deadline_ns=pinned_ns + cfg.lease_ns, via=via,
                          workers=self._pins.workers if self._pins else 0)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(ids) for ids in block_ids],  # one list per group, by position
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": req,
            "remote_host": cfg.side_channel_host,
            "remote_port": cfg.side_channel_port,
            "tp_size": cfg.tp_size,
            "dcp_size": cfg.dcp_size,
            "pp_size": cfg.pp_size,
            "remote_num_tokens": num_tokens,
            PRODUCER_KEY: PROTOCOL_VERSION,
            # One group: its tokens per block, so a decode engine of another block size pairs them
            # (several groups move block for block, each side's sizes equal: the compatibility check).
            **({"remote_block_size": self._group_block_sizes[0]} if len(self._group_block_sizes) == 1 else {}),
            **({} if request.prompt_token_ids is None else
               {PROMPT_FINGERPRINT_KEY: prompt_fingerprint(request.prompt_token_ids, num_tokens)}),
            # Wall-clock seconds, informational: the decode side's claim is what counts.
            "remote_blocks_expiry_time": time.time() + cfg.lease_s,
            # As upstream's pull scheduler: tells a router this is a pull (READ)
            # producer, not NixlPushConnector's WRITE one (its _TRANSFER_MODE).
            "transfer_mode": "pull",
        }

    # -- per step -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepFacts:
        if self._pending_pins:  # vLLM finished requests without update_connector_output after them
            self._note("sched.pins_flushed_late", None, reqs=[f.req for f in self._pending_pins])
            if not self._warned_late_flush:
                self._warned_late_flush = True
                log.warning("kvsm: finished prefills were handed to the workers only at the next step "
                            "(vLLM did not call update_connector_output after request_finished)")
            self._flush_pins()
        meta = self._meta
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
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._flush_pins()
        for req in connector_output.finished_recving or ():
            self._awaited.discard(req)

    # -- introspection --------------------------------------------------------

    def pending_counts(self) -> dict[str, int]:
        """How many requests each piece of state holds (tests check it drains)."""
        return {"remote": len(self._remote), "awaited": len(self._awaited), "sending": len(self._sending),
                "heartbeat_groups": len(self._claims), "ignored": len(self._bad), "readers": len(self._reader_of)}

    def _note(self, event: str, req: str | None, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit("log", event, req, **fields)

    def shutdown(self) -> None:
        self._flush_pins()
        if self._pins is not None:
            self._pins.close()
            self._pins = None
        if self.log is not None:
            self.log.close()


def _pair_blocks(local_groups: Any, remote_groups: tuple[tuple[int, ...], ...],
                 ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], str]:
    """Which local block each remote block is read into, group by group:
    (local ids, remote ids, how many of each group, what cannot be read).

    ``local_groups``: vLLM's blocks of the decode request per group (its
    ``KVCacheBlocks.blocks``: local prefix hits, which are hashed, then the new
    blocks; the null block where the group keeps nothing). Both sides index a
    group's blocks by position, so block ``j`` is read from the prefill's block
    ``j``: for every new, non-null local block. One the prefill side does not
    hold (past its list, or null there: a sliding window that moved on) cannot
    be filled, which fails the request rather than deliver a block of garbage.
    """
    local: list[int] = []
    remote: list[int] = []
    sizes: list[int] = []
    problems: list[str] = []
    for g, (blocks, theirs) in enumerate(zip(local_groups, remote_groups, strict=True)):
        n = 0
        for j, block in enumerate(blocks):
            if block.is_null or block.block_hash is not None:
                continue
            if j >= len(theirs) or theirs[j] == NULL_BLOCK:
                held = "past the end of its blocks" if j >= len(theirs) else "the null block there"
                problems.append(f"KV cache group {g}: block {j} is to be loaded, but the prefill side has {held} "
                                f"({len(theirs)} block ids)")
                continue
            local.append(block.block_id)
            remote.append(theirs[j])
            n += 1
        sizes.append(n)
    return tuple(local), tuple(remote), tuple(sizes), "; ".join(problems[:3])
