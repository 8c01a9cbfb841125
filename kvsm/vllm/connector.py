"""KVSMConnector: the class vLLM loads. A thin facade over the two halves.

vLLM builds one instance in the scheduler process (role SCHEDULER) and one
in every worker process (role WORKER). The scheduler instance delegates to
``kvsm.scheduler.SchedulerHalf``, the worker instance to
``kvsm.worker.WorkerHalf``; the only thing that crosses between them is the
per-step ``KVSMConnectorMetadata``. Load it with::

    --kv-transfer-config '{"kv_connector": "KVSMConnector", "kv_role": "kv_both",
                           "kv_connector_module_path": "kvsm.connector"}'

or, with kvsm installed, without the module path (``kvsm.vllm.plugin`` registers
the name through vLLM's ``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.pins import PinTarget
from kvsm.handshake import CompatInfo
from kvsm.runtime.stop import on_stop_requested, stop_on_exit
from kvsm.scheduler.half import SchedulerHalf
from kvsm.scheduler.stream_steps import GroupReach
from kvsm.vllm import stats as vllm_stats
from kvsm.vllm.config import kvsm_config, unknown_extra_keys
from kvsm.vllm.metadata import KVSMConnectorMetadata
from kvsm.worker import WorkerHalf
from kvsm.worker.stats import StatsRecorder

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvsm.connector")

# Pins close this long before a draining engine core's wait (vLLM's
# shutdown_timeout) is over, so it runs out of work and exits before it is killed.
_DRAIN_MARGIN_S = 2.0
# Where vLLM's engine-core process defines its SIGTERM/SIGINT handler (the one that
# starts the drain: run_engine_core); only that handler gets the stop notice.
_ENGINE_CORE_MODULE = "vllm.v1.engine.core"


def _allow_amx(kv_caches: dict[str, torch.Tensor]) -> None:
    """Ask Linux for this process's AMX tile permission (``ARCH_REQ_XCOMP_PERM``)
    where vLLM-CPU's attention will use AMX (bfloat16 caches on a CPU with AMX).

    Why: vLLM's ``amx`` attention kernel executes tile instructions without
    asking; it works only because oneDNN asked first, in a GEMM large enough for
    AMX. A decode engine's first forward pass is a loaded request's last token
    (M = 1 GEMMs, no AMX), so its attention died of SIGILL (measured here:
    a bfloat16 Qwen3 decode engine, rc -4 in ``cpu_attention_with_kv_cache``
    on its first transferred request; a single engine's first prefill asks in
    time). The permission is per process and asking twice is harmless.
    """
    import torch

    tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, (list, tuple)) else (v,))]
    if not any(getattr(t, "dtype", None) == torch.bfloat16 for t in tensors):
        return
    cpu = getattr(torch, "cpu", None)
    if cpu is None or not getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return
    if not cpu._init_amx():
        log.warning("kvsm: the AMX tile permission was refused; vLLM's AMX attention may fail")


def _open_log(cfg: KVSMConfig, role: str, rank: int) -> EventLog | None:
    path = cfg.event_log_path(role, rank)
    if path is None:
        return None
    return EventLog(path, role=role, engine_id=cfg.engine_id, rank=rank)


@dataclass
class KVSMWorkerChannel(KVConnectorHandshakeMetadata):
    """What each worker publishes at start for its own engine's scheduler (vLLM
    collects it inside the engine and hands it to the scheduler-side instance):
    where and how to tell it that a finished prefill is pinned."""

    target: PinTarget


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group of vLLM's KV cache config, as kvsm moves it."""

    kind: str  # full, sliding_window(w), chunked_local(c), mla, mamba(layout)
    block_size: int
    layers: tuple[str, ...]
    window: int = 0  # a sliding window's tokens (0: another kind)
    chunk: int = 0  # a chunked local attention's chunk (0: another kind)

    def describe(self) -> str:
        return f"{self.kind}/{self.block_size}x{len(self.layers)}"


def kv_groups_of(kv_cache_config: KVCacheConfig | None) -> tuple[KVGroup, ...]:
    """The KV cache groups kvsm reads, or ValueError naming one it cannot.

    Attention groups (full, MLA, sliding window) index their blocks by position
    on both engines, and a position a group no longer needs holds the null
    block: those move block for block. A Mamba/GDN state group (no speculative
    slots) moves its state block the same way, with the prompt's last token held
    back on the prefill side (``SchedulerHalf``'s ``hold_back_tokens``).
    Chunked local attention (Llama 4) is a sliding window that jumps a chunk at
    a time: blocks of chunks before the current one are null, the rest move.
    Any other kind (speculative state slots, ...) is refused at start rather
    than transferred wrongly."""
    if kv_cache_config is None:
        return ()
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = []
    several = len(kv_cache_config.kv_cache_groups) > 1
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is MLAAttentionSpec:
            kind = "mla"
        elif type(spec) is FullAttentionSpec:
            kind = "full"
        elif type(spec) is SlidingWindowSpec:
            kind = f"sliding_window({spec.sliding_window})"
        elif type(spec) is ChunkedLocalAttentionSpec:
            kind = f"chunked_local({spec.attention_chunk_size})"
        elif type(spec) is MambaSpec and not spec.num_speculative_blocks:
            # One state per request position; its conv-state layout must agree (vLLM picks it per host).
            kind = f"mamba({os.environ.get('VLLM_SSM_CONV_STATE_LAYOUT', '')})"
        elif not several:  # one group: its blocks move whole, whatever its kind (as before groups existed)
            kind = type(spec).__name__
        else:
            raise ValueError(f"KVSMConnector: KV cache group {g} is a {type(spec).__name__} (layers "
                             f"{list(group.layer_names)[:3]}...); kvsm moves full, sliding-window, chunked local "
                             f"and MLA attention groups and Mamba/GDN state without speculative slots only")
        window = int(spec.sliding_window) if type(spec) is SlidingWindowSpec else 0
        chunk = int(spec.attention_chunk_size) if type(spec) is ChunkedLocalAttentionSpec else 0
        groups.append(KVGroup(kind, int(spec.block_size), tuple(group.layer_names), window, chunk))
    if getattr(kv_cache_config, "transfer_group_ids", tuple(range(len(groups)))) != tuple(range(len(groups))):
        raise ValueError(f"KVSMConnector: vLLM transfers only KV cache groups "
                         f"{kv_cache_config.transfer_group_ids} of {len(groups)}; kvsm moves every group")
    return tuple(groups)


class KVSMConnector(KVConnectorBase_V1, SupportsHMA):
    """Pull-mode prefill/decode KV transfer over NIXL with explicit lifecycles.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on (several KV
    cache groups: full attention beside sliding window, ...), and calls
    ``request_finished_all_groups`` with every group's blocks."""

    # Tokens this connector loads came from another engine over the network.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._cancel_stop: Callable[[], None] = lambda: None
        self._unwrap_signals: Callable[[], None] = lambda: None
        self.kv_groups = kv_groups_of(kv_cache_config)
        cfg = kvsm_config(vllm_config)
        if any(g.kind.startswith("mamba") for g in self.kv_groups):
            # Its conv and recurrent state are split over heads inside one page, not heads-major.
            cfg = dataclasses.replace(cfg, tp_share="none: Mamba/GDN state pages are not laid out by heads")
        if cfg.bidirectional and not cfg.hold_budget_blocks:
            # Holds for next turns take at most a quarter of the KV cache by default.
            num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
            cfg = dataclasses.replace(cfg, hold_budget_blocks=max(1, num_blocks // 4))
        self.cfg = cfg
        unknown = unknown_extra_keys(vllm_config)
        if unknown:
            log.warning("KVSMConnector: ignoring unknown kv_connector_extra_config keys %s", unknown)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.stats = StatsRecorder(source=f"{self.cfg.engine_id}/scheduler")
            self._scheduler = SchedulerHalf(self.cfg, _open_log(self.cfg, "scheduler", 0),
                                            group_block_sizes=tuple(g.block_size for g in self.kv_groups),
                                            hold_back_tokens=int(any(g.kind.startswith("mamba")
                                                                     for g in self.kv_groups)),
                                            step_facts=KVSMConnectorMetadata,
                                            stream_unsupported=_stream_unsupported(self.kv_groups, self.cfg),
                                            stream_reach=tuple(GroupReach(g.window, g.chunk)
                                                               for g in self.kv_groups))
            # vLLM's engine core drains on SIGTERM while pins are live, and is killed
            # when its wait is over: the scheduler half closes the pins in time.
            drain_s = max(0.0, float(getattr(vllm_config, "shutdown_timeout", 0) or 0) - _DRAIN_MARGIN_S)
            self._unwrap_signals = on_stop_requested(partial(self._scheduler.request_stop, drain_s),
                                                     owner=_ENGINE_CORE_MODULE)
        else:
            rank, stage = _tp_rank(), _pp_rank()
            # One source per worker: vLLM adds their state counts up.
            self.stats = StatsRecorder(source=f"{self.cfg.engine_id}/tp{rank}" + (f"/pp{stage}" if stage else ""))
            # (a pipeline stage's workers hold a run of the layers: see kvsm.worker.recv)
            self._worker = WorkerHalf(self.cfg, rank, pp_rank=stage, stats=self.stats,
                                      event_log=_open_log(self.cfg, "worker", stage * self.cfg.tp_size + rank))
        # A clean stop on every exit: vLLM calls shutdown() from its engine shutdown,
        # but not at the end of an offline script nor on SIGTERM in a process of
        # the default disposition (kvsm.runtime.stop); idempotent either way.
        self._cancel_stop = stop_on_exit(_stop_later(weakref.ref(self)))

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvsm.transport.layout import describe_kv_caches
        from kvsm.transport.nixl import NixlTransport

        worker = self._require_worker()
        groups = self.kv_groups
        if len(groups) > 1:
            # Layers vLLM adds beside its groups (cross-layer KV sharing aliases) are not moved.
            ours = {name for g in groups for name in g.layers}
            kv_caches = {name: t for name, t in kv_caches.items() if name in ours}
        # Attention layers' blocks are heads-major on vLLM-CPU ([heads, tokens, 2 * head_size]):
        # a rank of another tensor parallel size reads its run of heads out of them.
        attention = {name for g in groups if g.kind == "full" or g.kind.startswith(("sliding_window", "chunked_local"))
                     for name in g.layers} if groups else set(kv_caches)
        heads = int(self._vllm_config.model_config.get_num_kv_heads(self._vllm_config.parallel_config))
        tokens, token_layout = self._token_planes(kv_caches)
        layout = describe_kv_caches(kv_caches, groups=[g.layers for g in groups] if len(groups) > 1 else None,
                                    heads={name: heads for name in attention}
                                    if self.cfg.tp_share == "heads" else None, tokens=tokens)
        want = "VRAM" if self.cfg.kv_buffer_device == "cuda" else "DRAM"
        if layout.mem_type != want:
            raise ValueError(
                f"kv_buffer_device is {self.cfg.kv_buffer_device!r} but the KV caches are in {layout.mem_type}; "
                f"kvsm registers the KV caches themselves (no staging buffer), so set kv_buffer_device to "
                f"{'cuda' if layout.mem_type == 'VRAM' else 'cpu'}")
        if layout.mem_type == "DRAM":
            _allow_amx(kv_caches)
        name = (f"kvsm-{self.cfg.engine_id}-dp{self.cfg.dp_rank}-tp{worker.tp_rank}"
                + (f"-pp{worker.pp_rank}" if worker.pp_rank else ""))
        transport = NixlTransport(name, layout, backends=self.cfg.backends, num_threads=self.cfg.num_threads)
        first = next(iter(kv_caches.values()))
        model_config = self._vllm_config.model_config
        compat = CompatInfo(
            model=str(model_config.model),
            dtype=str(first.dtype).removeprefix("torch."),
            # The model's, not this worker's: pipeline stages hold runs of the layers (the
            # layouts then say which, and a read moves the layers both workers hold).
            num_layers=int(model_config.get_total_num_hidden_layers()),
            # The model's, not this rank's: engines of other tensor parallel sizes agree on it.
            num_kv_heads=self.cfg.kv_heads,
            head_size=int(model_config.get_head_size()),
            block_size=self.cfg.block_size,
            kv_layout="block-major " + "x".join("H" if i == 0 and layout.regions[0].heads else
                                                "T" if i == 1 and token_layout else str(d)
                                                for i, d in enumerate(tuple(first.shape)[1:])),
            kv_groups=" ".join(g.describe() for g in groups) if len(groups) > 1 else "",
            token_layout=token_layout,
        )
        worker.start(transport, compat)

    def _token_planes(self, kv_caches: dict[str, torch.Tensor]) -> tuple[dict[str, Any], str]:
        """How this engine's blocks hold their tokens, where kvsm can read blocks of
        another size into them: one full-attention group on vLLM-CPU's attention
        (``kvsm.vllm.token_layout``). Elsewhere ({}, ""): block sizes must be equal."""
        from kvsm.vllm.token_layout import cpu_attention_isa, token_planes

        groups = self.kv_groups
        if len(groups) > 1 or (groups and groups[0].kind != "full") or self.cfg.kv_buffer_device != "cpu":
            return {}, ""
        first_name, first = next(iter(kv_caches.items()))
        head_size = int(self._vllm_config.model_config.get_head_size())
        layer = self._vllm_config.compilation_config.static_forward_context.get(first_name)
        isa = cpu_attention_isa(layer, first.dtype, self.cfg.block_size, head_size,
                                str(self._vllm_config.cache_config.cache_dtype))
        return token_planes(kv_caches, isa, head_size, self.cfg.block_size)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSMConnectorMetadata), f"unexpected connector metadata {type(meta).__name__}"
        self._require_worker().submit(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete between steps (asynchronous, pull mode)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Streamed push: the layer's KV of this step is in place (posted to the loop,
        which writes it; only a streamed prompt's very last layer waits, 5 ms at
        most, for that post to be served)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSMConnectorMetadata), f"unexpected connector metadata {type(meta).__name__}"
        self._require_worker().layer_saved(layer_name, meta)

    def wait_for_save(self) -> None:
        """The step's forward pass is over; the writes go on without it."""
        self._require_worker().step_over()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._require_worker().take_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form: failed receives are still reported through their blocks
        (get_block_ids_with_load_errors)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid = self._require_worker().take_invalid_blocks()
        # vLLM refuses block-level load errors for a model of several KV cache
        # groups (it raises): there the request is failed whole, by failed_recving.
        return invalid if len(self.kv_groups) <= 1 else set()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        target = self._require_worker().pin_target()
        return KVSMWorkerChannel(target) if target is not None else None

    def get_kv_connector_stats(self) -> vllm_stats.KVSMStats | None:
        if self._worker is None:
            return None
        for lifecycle, counts in self._worker.state_counts.items():
            self.stats.set_states(lifecycle, dict(counts))
        return vllm_stats.wrap(self.stats.take())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> vllm_stats.KVSMStats | None:
        return vllm_stats.build_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return vllm_stats.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Close the halves (their last records say how each request ended). Runs
        once, whichever of vLLM's engine shutdown, interpreter exit or SIGTERM
        comes first; the others find it done."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            if self._worker is not None:
                self._worker.shutdown()
            if self._scheduler is not None:
                self._scheduler.shutdown()
        finally:
            self._cancel_stop()
            self._unwrap_signals()

    # ============================================================= scheduler side

    def on_new_request(self, request: Request) -> None:
        self._require_scheduler().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._require_scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._require_scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._require_scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._require_scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._require_scheduler().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls (``SupportsHMA``), one list of blocks per KV cache group."""
        return self._require_scheduler().request_finished_all_groups(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load restores every group of the request (not only the prefix-cacheable
        ones): vLLM must not zero any of the blocks kvsm reads into."""
        return tuple(range(max(1, len(self.kv_groups))))

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' pin channels, handed over by vLLM once they all started."""
        targets = []
        for rank, channel in sorted(metadata.items()):
            if not isinstance(channel, KVSMWorkerChannel):
                raise TypeError(f"KVSMConnector: worker {rank} published {type(channel).__name__}, "
                                f"expected KVSMWorkerChannel (a different connector in the workers?)")
            targets.append(channel.target)
        self._require_scheduler().connect_workers(targets)

    # ================================================================ helpers

    @property
    def scheduler_half(self) -> SchedulerHalf | None:
        return self._scheduler

    @property
    def worker_half(self) -> WorkerHalf | None:
        return self._worker

    def _require_worker(self) -> WorkerHalf:
        if self._worker is None:
            raise RuntimeError("KVSMConnector: a worker-side method was called on the scheduler-side instance")
        return self._worker

    def _require_scheduler(self) -> SchedulerHalf:
        if self._scheduler is None:
            raise RuntimeError("KVSMConnector: a scheduler-side method was called on the worker-side instance")
        return self._scheduler


def _stream_unsupported(groups: tuple[KVGroup, ...], cfg: KVSMConfig) -> str:
    """Why this engine cannot stream (``""``: it can): streamed push writes the
    attention groups' blocks by position, layer by layer, rank to rank."""
    other = [g.kind for g in groups if g.kind not in ("full", "mla") and not g.window and not g.chunk]
    if other:
        return (f"its KV cache groups include {other[0]}; streamed push moves full attention, MLA, "
                f"sliding window and chunked local attention groups only")
    if cfg.pp_size > 1:
        return "pipeline parallel engines are not supported by streamed push"
    return ""


def _stop_later(ref: weakref.ref[KVSMConnector]) -> Any:
    """The exit hook: shuts the connector down if it still exists (a weak
    reference, so the hook does not keep a dropped connector alive)."""
    def stop() -> None:
        connector = ref()
        if connector is not None:
            connector.shutdown()
    return stop


def _pp_rank() -> int:
    """This worker's pipeline parallel stage (0 where vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except (AssertionError, RuntimeError, ImportError, AttributeError):
        return int(os.environ.get("KVSM_PP_RANK", "0"))


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's groups are not set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return int(os.environ.get("KVSM_TP_RANK", "0"))
