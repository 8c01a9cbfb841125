#!/usr/bin/env python3
"""One process of tools/bench_nixl.py: a connector's prefill or decode worker,
or a raw NIXL agent. Real NIXL (UCX, DRAM) between real processes.

Run as ``python tools/bench_nixl_peer.py SPEC_JSON``; SPEC names the ``role``:

``kvsm-prefill`` / ``upstream-prefill``
    The worker-role connector (``kvsm.connector.KVSMConnector`` or vLLM's
    ``NixlConnector``) over KV caches filled with a known pattern, driven by a
    model-runner thread the way vLLM drives it (bind metadata, start_load_kv,
    get_transfer_results, ...), plus the side channel (kvsm: its own, in the
    worker; upstream: the scheduler-side connector's listener thread, as in an
    engine). Requests are "finished with do_remote_decode" on demand: the decode
    side asks over a ZMQ "pin" socket for requests up to an index and gets an
    answer once they are pinned (kvsm: ``SendStart`` + ``SendFinish(ok)``;
    upstream: ``reqs_in_batch`` + ``reqs_to_send``). The model-runner thread
    steps every ``STEP_S`` while pinned requests wait to be read (a prefill
    engine keeps stepping while it holds blocks for the decode side) and sleeps
    in ``zmq.Poller`` otherwise.
``kvsm-decode`` / ``upstream-decode``
    The worker-role connector over zeroed caches; runs the benchmark's loops
    (``steady``: N transfers in flight, one vLLM step at a time; ``transfer``:
    one big permuted transfer at a time) and reports what it measured.
``raw-target`` / ``raw-reader``
    Bare ``nixl_agent``s (no progress thread): the target registers the same
    pattern; the reader reads it with prepared descriptor lists
    (``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state``) and also
    times a ``numpy.take`` of the same bytes inside its own memory.

Protocol: one JSON command per line on stdin, one JSON reply per line on stdout
(``{"ok": true, ...}``); start-up prints ``{"ready": true, ...}``. EOF on stdin
ends the process, and so does the benchmark process's death (PR_SET_PDEATHSIG),
even while it is stopped with SIGSTOP (the benchmark freezes the pairs it is
not measuring).

KV geometry: the tiny local model's (kvsm_testing.tiny_model: 2 layers, 2 KV
heads, head size 32, float32) in vLLM-CPU's layout, one tensor per layer of
shape ``[num_blocks, 2, block_size, 64]``, so a block of one layer is
``block_size * 512`` bytes (block_size 128: 64 KiB). Block ``b`` of layer ``l``
holds the float ``l * 1e6 + b`` everywhere on the prefill side, so the decode
side checks every block it read came from the right place.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvsm_testing.ports import free_port as _free_port  # noqa: E402  (outside the ephemeral range)

LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 32
HOST = "127.0.0.1"
STEP_S = 0.001  # the prefill model-runner thread's step while it holds blocks
TAG_LAYER = 1_000_000.0


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def tags(layer: int, blocks: np.ndarray | Sequence[int]) -> np.ndarray:
    """The value every float of block ``b`` of ``layer`` holds on the prefill side."""
    return layer * TAG_LAYER + np.asarray(blocks, dtype=np.float64)


def permuted_blocks(n: int, seed: int) -> list[int]:
    """``n`` distinct block ids 1..n in a seeded random order (block 0 is vLLM's null block)."""
    return (np.random.default_rng(seed).permutation(n) + 1).tolist()


def remote_blocks(plan: dict[str, Any], i: int) -> list[int]:
    """The prefill blocks request ``i`` of a run reads (both sides compute it).

    ``steady``: ``bpr`` blocks per request, walking the pool with a stride prime
    to its size (so consecutive requests read scattered blocks); ``perm``: all of
    blocks 1..n in a random order seeded by the request's index."""
    if plan["kind"] == "steady":
        bpr, usable, stride = plan["bpr"], plan["usable"], plan["stride"]
        return [1 + ((i * bpr + j) * stride) % usable for j in range(bpr)]
    if plan["kind"] == "perm":
        return permuted_blocks(plan["n"], plan["seed"] + i)
    raise ValueError(f"unknown plan {plan!r}")


def remote_req_id(run: str, i: int) -> str:
    return f"{run}-p{i}"


def _die_with_parent() -> None:
    """SIGKILL this process when the benchmark process dies, even if SIGSTOPped."""
    parent = int(os.environ.get("KVSM_BENCH_PARENT", "0") or 0)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if parent and os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


# --------------------------------------------------------------------------- connectors


def make_caches(num_blocks: int, block_size: int, fill: bool) -> dict[str, Any]:
    """Per-layer caches; ``fill``: the pattern, else zeros written (pages faulted in)."""
    import torch

    caches = {}
    for layer, name in enumerate(layer_names()):
        t = torch.empty(num_blocks, KV_HEADS, block_size, 2 * HEAD_SIZE, dtype=torch.float32)
        if fill:
            t.copy_(torch.from_numpy(tags(layer, range(num_blocks)).astype(np.float32)).view(-1, 1, 1, 1)
                    .expand_as(t))
        else:
            t.zero_()
        caches[name] = t
    return caches


class Connector:
    """A worker-role connector (kvsm or upstream) and the calls a vLLM step makes."""

    def __init__(self, spec: dict[str, Any], producer: bool) -> None:
        self.kind = spec["connector"]  # "kvsm" | "upstream"
        self.spec = spec
        self.engine_id = spec["engine_id"]
        self.block_size = spec["block_size"]
        self.num_blocks = spec["num_blocks"]
        self.side_port = spec["side_port"]  # this engine's (prefill) or the peer's (decode)
        self.harness: Any = None  # prefill, upstream: the scheduler-side connector serving the side channel
        self.affinity_note = ""
        role = "kv_producer" if producer else "kv_consumer"
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvsm_testing.scheduler import make_scheduler

        common = {"kv_role": role, "block_size": self.block_size, "num_blocks": self.num_blocks,
                  "max_num_seqs": 256, "engine_id": self.engine_id}
        if self.kind == "kvsm":
            extra = {"side_channel_host": HOST, "side_channel_port": self.side_port if producer else _free_port(),
                     "kv_lease_duration": spec["lease_s"], "heartbeat_interval": spec["lease_s"] / 6}
            if spec.get("event_log_dir"):
                extra["event_log_dir"] = spec["event_log_dir"]
            if spec.get("num_threads"):
                extra["num_threads"] = spec["num_threads"]
            h = make_scheduler(extra_config=extra, **common)
            h.close()
            from kvsm.vllm.connector import KVSMConnector

            self.conn = KVSMConnector(h.vllm_config, KVConnectorRole.WORKER, h.scheduler.kv_cache_config)
        else:
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_port if producer else _free_port())
            h = make_scheduler(kv_connector="NixlConnector", kv_connector_module_path=None,
                               extra_config={"kv_lease_duration": int(spec["lease_s"])}, **common)
            from vllm.config import set_current_vllm_config
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
                NixlConnector,
                base_worker,
            )
            from vllm.distributed.parallel_state import (
                ensure_model_parallel_initialized,
                init_distributed_environment,
            )

            if not spec.get("progress_thread", True):
                # The variant without NIXL's progress thread: the same worker, its
                # agent made as kvsm's is (UCX then progresses only inside its calls).
                make_config = base_worker.nixl_agent_config

                def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
                    return make_config(*args, **{**kwargs, "enable_prog_thread": False})

                base_worker.nixl_agent_config = without_progress_thread
            affinity = os.sched_getaffinity(0)
            with set_current_vllm_config(h.vllm_config):
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://{HOST}:{_free_port()}")
                ensure_model_parallel_initialized(1, 1)
                self.conn = NixlConnector(h.vllm_config, KVConnectorRole.WORKER, h.scheduler.kv_cache_config)
            pinned = os.sched_getaffinity(0)
            if pinned != affinity:
                # On CPU the worker pins the calling thread to the last core of each
                # NUMA node (a core for KV transfers, in an engine whose model threads
                # are bound elsewhere). Here that would squeeze the benchmark's driver
                # thread onto one core next to NIXL's busy progress thread: undo it,
                # so both connectors run on the same cores.
                os.sched_setaffinity(0, affinity)
                self.affinity_note = f"worker pinned the thread to cores {sorted(pinned)}; restored {sorted(affinity)}"
            if producer:
                self.harness = h  # its connector serves the side channel (NixlConnector's listener)
            else:
                h.close()
        self.caches = make_caches(self.num_blocks, self.block_size, fill=producer)
        self.conn.register_kv_caches(self.caches)
        if self.harness is not None:
            payload = self.conn.get_handshake_metadata()
            self.harness.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): payload})
        self.producer = producer
        self._step = 0
        self._extra_hooks: list[Callable[[], Any]] = [
            getattr(self.conn, name) for name in ("get_kv_connector_kv_cache_events", "build_connector_worker_meta")
            if callable(getattr(self.conn, name, None))]

    # -- metadata, as each connector's scheduler half would build it

    def recv_meta(self, reqs: Sequence[tuple[str, str, Sequence[int], Sequence[int]]]) -> Any:
        """Decode: ``(local req, remote req, local blocks, remote blocks)`` each."""
        self._step += 1
        if self.kind == "kvsm":
            from kvsm.vllm.metadata import KVSMConnectorMetadata, RecvStart

            meta = KVSMConnectorMetadata(self._step)
            meta.recv_start = [
                RecvStart(req=req, remote_engine=self.spec["remote_engine"], remote_req=rreq, remote_host=HOST,
                          remote_port=self.side_port, remote_tp_size=1, remote_block_ids=tuple(rb),
                          local_block_ids=tuple(lb), num_tokens=len(lb) * self.block_size, awaited=True)
                for req, rreq, lb, rb in reqs]
            return meta
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
            NixlConnectorMetadata,
        )

        meta = NixlConnectorMetadata()
        for req, rreq, lb, rb in reqs:
            meta.add_new_req_to_recv(req, (list(lb),), {
                "remote_block_ids": [list(rb)], "remote_engine_id": self.spec["remote_engine"],
                "remote_request_id": rreq, "remote_host": HOST, "remote_port": self.side_port, "tp_size": 1,
                "remote_num_tokens": len(rb) * self.block_size}, awaiting_kvs=True)
        return meta

    def send_meta(self, finished: Sequence[tuple[str, Sequence[int]]]) -> Any:
        """Prefill: these requests finished (do_remote_decode) holding these blocks."""
        self._step += 1
        if self.kind == "kvsm":
            from kvsm.vllm.metadata import KVSMConnectorMetadata, SendFinish, SendStart

            meta = KVSMConnectorMetadata(self._step)
            meta.send_start = [SendStart(req=r) for r, _ in finished]
            meta.send_finish = [SendFinish(req=r, ok=True, block_ids=tuple(b)) for r, b in finished]
            return meta
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
            NixlConnectorMetadata,
        )

        meta = NixlConnectorMetadata()
        now = time.perf_counter()
        meta.scheduler_clock = now
        meta.reqs_in_batch = {r for r, _ in finished}
        meta.reqs_to_send = {r: now + self.spec["lease_s"] for r, _ in finished}
        return meta

    # -- one step

    def step(self, meta: Any, forward_s: float = 0.0) -> tuple[int, int, Any]:
        """What vLLM's model runner does with the connector in one step (KV
        connector mixin, async loads): bind; the forward pass (``forward_s`` of
        sleep); start_load_kv; wait_for_save; get_transfer_results; the load
        errors, stats and the rest; clear. Returns (ns in start_load_kv +
        get_transfer_results, ns in every connector call, the transfer results)."""
        clock = time.perf_counter_ns
        c = self.conn
        t0 = clock()
        c.bind_connector_metadata(meta)
        t1 = clock()
        if forward_s:
            time.sleep(forward_s)
        t2 = clock()
        c.start_load_kv(None)
        t3 = clock()
        c.wait_for_save()
        t4 = clock()
        results = c.get_transfer_results(set())
        t5 = clock()
        c.get_block_ids_with_load_errors()
        c.get_kv_connector_stats()
        for hook in self._extra_hooks:
            hook()
        c.clear_connector_metadata()
        t6 = clock()
        core = (t3 - t2) + (t5 - t4)
        every = (t1 - t0) + (t6 - t2)
        return core, every, results

    def settle(self) -> None:
        """Return once the metadata already handed to the connector is applied:
        kvsm's worker applies it on its event loop (callables run in the order
        they were posted), upstream's inside start_load_kv. So a pin is answered
        only when a claim for it would find it pinned."""
        if self.kind == "kvsm":
            half = self.conn.worker_half
            assert half is not None
            half.loop.call(lambda: None, timeout=10.0, label="bench: metadata applied")

    def empty_meta(self) -> Any:
        return self.send_meta([]) if self.producer else self.recv_meta([])

    def shutdown(self) -> None:
        self.conn.shutdown()
        if self.harness is not None:
            self.harness.close()


# --------------------------------------------------------------------------- prefill side


class Prefill:
    """A prefill worker that pins requests when the decode side asks, on its
    model-runner thread, and reports what it served."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import zmq

        self.conn = Connector(spec, producer=True)
        self.ctx = zmq.Context()
        self.pin = self.ctx.socket(zmq.ROUTER)
        self.pin.setsockopt(zmq.LINGER, 0)
        self.pin.bind(f"tcp://{HOST}:{spec['pin_port']}")
        self.ctrl_addr = f"inproc://prefill-ctrl-{os.getpid()}"
        self.ctrl_runner = self.ctx.socket(zmq.PAIR)
        self.ctrl_runner.bind(self.ctrl_addr)
        self.ctrl = self.ctx.socket(zmq.PAIR)
        self.ctrl.connect(self.ctrl_addr)
        self.ctrl_lock = threading.Lock()
        self.pinned: dict[str, int] = {}  # run -> pinned up to (exclusive)
        self.pending: set[str] = set()  # pinned, finished_sending not seen yet
        self.served = 0
        self.steps = 0
        self.errors: list[str] = []
        self.runner = threading.Thread(target=self._run, name="bench-prefill-runner", daemon=True)
        self.runner.start()

    def hello(self) -> dict[str, Any]:
        return {"affinity_note": self.conn.affinity_note}

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.pin, zmq.POLLIN)
        poller.register(self.ctrl_runner, zmq.POLLIN)
        pack = msgspec.msgpack.encode
        while True:
            events = dict(poller.poll(int(STEP_S * 1000) if self.pending else None))
            finished: list[tuple[str, list[int]]] = []
            acks: list[tuple[bytes, str, int]] = []
            if self.pin in events:
                while True:
                    try:
                        ident, raw = self.pin.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    run, upto, plan = msgspec.msgpack.decode(raw)
                    start = self.pinned.get(run, 0)
                    for i in range(start, upto):
                        finished.append((remote_req_id(run, i), remote_blocks(plan, i)))
                    self.pinned[run] = max(start, upto)
                    acks.append((ident, run, self.pinned[run]))
            if self.ctrl_runner in events:
                cmd = self.ctrl_runner.recv_pyobj()
                if cmd == "stop":
                    self.ctrl_runner.send_pyobj("stopped")
                    return
                self.ctrl_runner.send_pyobj({"pending": len(self.pending), "served": self.served,
                                             "steps": self.steps, "errors": self.errors[-5:]})
            if finished or self.pending:
                try:
                    _, _, results = self.conn.step(self.conn.send_meta(finished))
                    if finished:
                        self.conn.settle()
                except Exception as e:  # noqa: BLE001 - reported to the benchmark, which fails the section
                    self.errors.append(f"{type(e).__name__}: {e}")
                    continue
                self.steps += 1
                self.pending.update(r for r, _ in finished)
                done = results.finished_sending or set()
                self.served += len(done & self.pending)
                self.pending -= done
            for ident, run, upto in acks:
                self.pin.send_multipart([ident, pack((run, upto))])

    def ask(self, what: str, timeout_s: float = 10.0) -> Any:
        """A question to the model-runner thread (which owns the connector)."""
        with self.ctrl_lock:
            self.ctrl.send_pyobj(what)
            if not self.ctrl.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"prefill runner did not answer {what!r} within {timeout_s} s")
            return self.ctrl.recv_pyobj()

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "state":
            return self.ask("state")
        if op == "quiesce":  # wait until every pinned request was read and reported
            deadline = time.monotonic() + cmd.get("within", 30.0)
            while True:
                state = self.ask("state")
                if not state["pending"] or time.monotonic() > deadline:
                    return state
                time.sleep(0.01)
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self) -> None:
        try:
            self.ask("stop")
        finally:
            self.runner.join(timeout=5)
            self.conn.shutdown()
            self.pin.close(0)
            self.ctrl.close(0)
            self.ctrl_runner.close(0)
            self.ctx.term()


# --------------------------------------------------------------------------- decode side


class Decode:
    """A decode worker running the benchmark's loops against one prefill peer."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import zmq

        self.conn = Connector(spec, producer=False)
        self.ctx = zmq.Context()
        self.pin = self.ctx.socket(zmq.DEALER)
        self.pin.setsockopt(zmq.LINGER, 0)
        self.pin.connect(f"tcp://{HOST}:{spec['pin_port']}")
        self.pinned: dict[str, int] = {}
        self.asked: dict[str, int] = {}
        self.layers = [t.view(t.shape[0], -1) for t in self.conn.caches.values()]

    def hello(self) -> dict[str, Any]:
        return {"affinity_note": self.conn.affinity_note}

    # -- pins

    def _ask_pins(self, run: str, upto: int, plan: dict[str, Any]) -> None:
        if upto > self.asked.get(run, 0):
            self.pin.send(msgspec.msgpack.encode((run, upto, plan)))
            self.asked[run] = upto

    def _take_acks(self, block_until: tuple[str, int] | None = None, timeout_s: float = 30.0) -> None:
        """Read the prefill's answers; with ``block_until`` wait until that run is
        pinned that far."""
        import zmq

        deadline = time.monotonic() + timeout_s
        while True:
            while True:
                try:
                    raw = self.pin.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                run, upto = msgspec.msgpack.decode(raw)
                self.pinned[run] = max(self.pinned.get(run, 0), upto)
            if block_until is None or self.pinned.get(block_until[0], 0) >= block_until[1]:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"prefill did not pin {block_until} within {timeout_s} s "
                                   f"(pinned {self.pinned.get(block_until[0], 0)})")
            self.pin.poll(int(min(left, 1.0) * 1000))

    # -- checks

    def _check(self, local: Sequence[int], remote: Sequence[int]) -> None:
        """Every local block holds the remote block's pattern (first and last float
        of each block; every float of a few)."""
        loc = np.asarray(local)
        for layer, t in enumerate(self.layers):
            arr = t.numpy()
            want = tags(layer, remote).astype(np.float32)
            got_first, got_last = arr[loc, 0], arr[loc, -1]
            if not (np.array_equal(got_first, want) and np.array_equal(got_last, want)):
                bad = int(np.flatnonzero((got_first != want) | (got_last != want))[0])
                raise AssertionError(f"layer {layer}: local block {loc[bad]} holds {got_first[bad]}, "
                                     f"expected remote block {remote[bad]} ({want[bad]})")
            for k in np.linspace(0, len(loc) - 1, num=min(4, len(loc)), dtype=int):
                if not (arr[loc[k]] == want[k]).all():
                    raise AssertionError(f"layer {layer}: local block {loc[k]} is not all {want[k]}")

    def _zero(self, local: Sequence[int]) -> None:
        loc = np.asarray(local)
        if len(loc) and np.array_equal(loc, np.arange(loc[0], loc[0] + len(loc))):
            for t in self.layers:
                t[int(loc[0]):int(loc[0]) + len(loc)].zero_()
        else:
            for t in self.layers:
                t.numpy()[loc] = 0

    # -- section 2: N transfers in flight

    def steady(self, run: str, inflight: int, steps: int, warm_steps: int, forward_s: float, bpr: int,
               timeout_s: float) -> dict[str, Any]:
        """Keep ``inflight`` transfers of ``bpr`` blocks in flight, one vLLM step
        at a time; measure ``steps`` steps after ``warm_steps``, then drain."""
        c = self.conn
        usable = c.spec["remote_num_blocks"] - 1
        plan = {"kind": "steady", "bpr": bpr, "usable": usable, "stride": _stride(usable)}
        lookahead = 3 * inflight + 64
        free: deque[int] = deque(np.random.default_rng(7).permutation(np.arange(1, c.num_blocks)).tolist())
        if len(free) < inflight * bpr:
            raise ValueError(f"{c.num_blocks} decode blocks cannot hold {inflight} x {bpr} blocks in flight")
        flight: dict[str, tuple[int, tuple[int, ...], list[int]]] = {}  # req -> (index, local, remote)
        nxt = 0
        total = warm_steps + steps
        core_ns: list[int] = []
        every_ns: list[int] = []
        done_in_window = 0
        checked = 0
        failed: list[str] = []
        cpu0 = wall0 = 0.0
        cpu1 = wall1 = 0.0
        step = 0
        final: int | None = None  # after the window: read what was pinned, then stop
        deadline = time.monotonic() + timeout_s
        while True:
            measuring = warm_steps <= step < total
            if step == warm_steps:
                cpu0, wall0 = time.process_time(), time.perf_counter()
            if step == total:
                cpu1, wall1 = time.process_time(), time.perf_counter()
                final = self.asked.get(run, 0)
            limit = final if final is not None else nxt + inflight
            if final is None:
                self._ask_pins(run, nxt + lookahead, plan)
            self._take_acks()
            want = min(inflight - len(flight), limit - nxt)
            if want > 0 and self.pinned.get(run, 0) < nxt + want:
                self._take_acks(block_until=(run, nxt + want))
            new = []
            for _ in range(max(0, want)):
                local = tuple(free.popleft() for _ in range(bpr))
                remote = remote_blocks(plan, nxt)
                req = f"{run}-d{nxt}"
                flight[req] = (nxt, local, remote)
                new.append((req, remote_req_id(run, nxt), local, remote))
                nxt += 1
            core, every, results = c.step(c.recv_meta(new), forward_s)
            if measuring:
                core_ns.append(core)
                every_ns.append(every)
            failed.extend(results.failed_recving or ())
            for req in results.finished_recving or ():
                entry = flight.pop(req, None)
                if entry is None:
                    continue
                _, local, remote = entry
                if checked < 64 and req not in failed:  # spot checks, outside the timed calls
                    self._check(local, remote)
                    checked += 1
                free.extend(local)
                if measuring:
                    done_in_window += 1
            step += 1
            if failed:
                raise RuntimeError(f"{len(failed)} transfers failed, e.g. {failed[:3]}")
            if final is not None and nxt >= final and not flight:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"steady run {run}: step {step}, {len(flight)} in flight, "
                                   f"{nxt} started, pinned {self.pinned.get(run, 0)}")
        return {"steps": steps, "core_ns": core_ns, "every_ns": every_ns, "done": done_in_window,
                "cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0, "started": nxt, "checked": checked,
                "drain_steps": step - total}

    # -- section 3: one big permuted transfer at a time

    def transfer(self, run: str, trials: int, n: int, seed: int, poll_s: float, timeout_s: float) -> dict[str, Any]:
        """``trials`` transfers of blocks 1..n in permuted order (one request each);
        ns from start_load_kv to the get_transfer_results that reports it."""
        c = self.conn
        plan = {"kind": "perm", "n": n, "seed": seed}
        local = list(range(1, n + 1))
        out: list[int] = []
        clock = time.perf_counter_ns
        for t in range(trials):
            self._ask_pins(run, t + 1, plan)
            self._take_acks(block_until=(run, t + 1))
            remote = remote_blocks(plan, t)
            self._zero(local)
            req = f"{run}-d{t}"
            meta = c.recv_meta([(req, remote_req_id(run, t), local, remote)])
            deadline = time.monotonic() + timeout_s
            t0 = clock()
            results = self._poll_step(meta)
            while req not in (results.finished_recving or ()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer {req} not done within {timeout_s} s")
                time.sleep(poll_s)
                # As vLLM's next step would: upstream posts reads whose handshake
                # finished in the background only inside start_load_kv.
                results = self._poll_step(c.empty_meta())
            t1 = clock()
            if req in (results.failed_recving or ()):
                raise RuntimeError(f"transfer {req} failed")
            out.append(t1 - t0)
            self._check(local, remote)
        return {"ns": out}

    def _poll_step(self, meta: Any) -> Any:
        c = self.conn.conn
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        results = c.get_transfer_results(set())
        c.clear_connector_metadata()
        return results

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.pop("op")
        if op == "steady":
            return self.steady(**cmd)
        if op == "transfer":
            return self.transfer(**cmd)
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self) -> None:
        self.conn.shutdown()
        self.pin.close(0)
        self.ctx.term()


def _stride(m: int) -> int:
    """A stride prime to ``m`` near ``m / 2.6`` (scatters consecutive blocks)."""
    import math

    s = max(1, int(m / 2.618))
    while math.gcd(s, m) != 1:
        s += 1
    return s


# --------------------------------------------------------------------------- raw NIXL


def _raw_agent(name: str, num_threads: int = 0) -> Any:
    """As kvsm's transport makes its agent: no progress thread (it would busy-poll
    a core), no listener. ``num_threads``: UCX backend threads (upstream asks for
    4), which split a transfer's descriptors between them."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                              backends=["UCX"], num_threads=num_threads))


def _raw_buffers(num_blocks: int, block_bytes: int, fill: bool, huge_pages: bool) -> list[np.ndarray]:
    """One buffer per layer, allocated by torch as the connectors' KV caches are
    (and vLLM's): ordinary 4 KiB pages, the same alignment. ``huge_pages``: by
    numpy instead, which madvise()s big arrays MADV_HUGEPAGE; with this
    machine's THP mode ("madvise") that gives huge pages, which UCX's cma reads
    about twice as fast."""
    out = []
    for _ in range(LAYERS):
        if huge_pages:
            out.append(np.empty((num_blocks, block_bytes // 4), dtype=np.float32))
        else:
            import torch  # NIXL imports it anyway

            out.append(torch.empty(num_blocks, block_bytes // 4, dtype=torch.float32).numpy())  # holds the tensor
    for layer, a in enumerate(out):
        if fill:
            a[...] = tags(layer, range(num_blocks)).astype(np.float32)[:, None]
        else:
            a[...] = 0
    return out


def _block_descs(bufs: list[np.ndarray]) -> np.ndarray:
    """Every block of every layer, layer-major: ``N x 3`` (addr, len, dev)."""
    rows = []
    for a in bufs:
        nb, bb = a.shape[0], a.shape[1] * 4
        addrs = a.ctypes.data + np.arange(nb, dtype=np.uint64) * np.uint64(bb)
        rows.append(np.stack([addrs, np.full(nb, bb, dtype=np.uint64), np.zeros(nb, dtype=np.uint64)], axis=1))
    return np.concatenate(rows).astype(np.uint64)


class RawTarget:
    """A NIXL agent over the pattern; polls its notifications (which also drives
    its side of the UCX connection) every ms, as kvsm's prefill loop does while
    reads are expected."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.bufs = _raw_buffers(spec["num_blocks"], spec["block_bytes"], fill=True,
                                 huge_pages=spec.get("huge_pages", False))
        self.agent = _raw_agent(spec["engine_id"], spec.get("num_threads", 0))
        regs = np.array([[a.ctypes.data, a.nbytes, 0] for a in self.bufs], dtype=np.uint64)
        self.reg = self.agent.register_memory(regs, "DRAM")
        self.notifs = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.poller = threading.Thread(target=self._poll, name="raw-target-notifs", daemon=True)
        self.poller.start()

    def _poll(self) -> None:
        while not self.stop.wait(STEP_S):
            with self.lock:
                got = self.agent.get_new_notifs()
            self.notifs += sum(len(v) for v in got.values())

    def hello(self) -> dict[str, Any]:
        with self.lock:  # the agent is single-threaded (NIXL_THREAD_SYNC_NONE)
            metadata = self.agent.get_agent_metadata()
        return {"agent_metadata": base64.b64encode(metadata).decode(), "name": self.agent.name,
                "descs": _block_descs(self.bufs).tolist()}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "state":
            return {"notifs": self.notifs}
        raise ValueError(f"unknown op {cmd['op']!r}")

    def shutdown(self) -> None:
        self.stop.set()
        self.poller.join(timeout=5)
        with self.lock:
            self.agent.deregister_memory(self.reg)


class RawReader:
    """Reads the raw target's blocks with NIXL, and copies them with numpy."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.num_blocks, self.block_bytes = spec["num_blocks"], spec["block_bytes"]
        self.huge_pages = spec.get("huge_pages", False)
        self.bufs = _raw_buffers(self.num_blocks, self.block_bytes, fill=False, huge_pages=self.huge_pages)
        self.src: list[np.ndarray] = []  # the memcpy's source, made on first use
        self.agent = _raw_agent(spec["engine_id"], spec.get("num_threads", 0))
        regs = np.array([[a.ctypes.data, a.nbytes, 0] for a in self.bufs], dtype=np.uint64)
        self.reg = self.agent.register_memory(regs, "DRAM")
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_descs(self.bufs), "DRAM")
        self.remote: Any = None
        self.peer = ""
        self.remote_blocks = 0

    def hello(self) -> dict[str, Any]:
        return {}

    def connect(self, agent_metadata: str, descs: list[list[int]], name: str) -> dict[str, Any]:
        loaded = self.agent.add_remote_agent(base64.b64decode(agent_metadata))
        self.peer = loaded.decode() if isinstance(loaded, bytes) else loaded
        if self.peer != name:
            raise RuntimeError(f"loaded agent {self.peer!r}, expected {name!r}")
        self.remote = self.agent.prep_xfer_dlist(self.peer, np.array(descs, dtype=np.uint64), "DRAM")
        self.remote_blocks = len(descs) // LAYERS
        self.agent.make_connection(self.peer)
        return {}

    def _indices(self, blocks: Sequence[int], per_layer: int) -> np.ndarray:
        b = np.asarray(blocks, dtype=np.int64)
        return (np.arange(LAYERS, dtype=np.int64)[:, None] * per_layer + b[None, :]).reshape(-1).astype(np.int32)

    def _check(self, local: Sequence[int], remote: np.ndarray | Sequence[int]) -> None:
        loc = np.asarray(local)
        for layer, a in enumerate(self.bufs):
            want = tags(layer, remote).astype(np.float32)
            if not (np.array_equal(a[loc, 0], want) and np.array_equal(a[loc, -1], want)):
                raise AssertionError(f"raw: layer {layer} holds the wrong blocks")

    def _zero(self, n: int) -> None:
        for a in self.bufs:
            a[1:n + 1] = 0

    def transfer(self, run: str, trials: int, n: int, seed: int, poll_s: float, timeout_s: float) -> dict[str, Any]:
        """NIXL READ of blocks 1..n of both layers, remote order permuted; ns from
        ``make_prepped_xfer`` to the ``check_xfer_state`` that says DONE."""
        out: list[int] = []
        clock = time.perf_counter_ns
        local = list(range(1, n + 1))
        for t in range(trials):
            remote = permuted_blocks(n, seed + t)
            self._zero(n)
            deadline = time.monotonic() + timeout_s
            t0 = clock()
            li = self._indices(local, self.num_blocks)
            ri = self._indices(remote, self.remote_blocks)
            h = self.agent.make_prepped_xfer("READ", self.local, li, self.remote, ri,
                                             notif_msg=f"{run}-{t}".encode())
            st = self.agent.transfer(h)
            while st != "DONE":
                if st not in ("PROC", "DONE"):
                    raise RuntimeError(f"raw read: NIXL state {st}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw read not done within {timeout_s} s")
                time.sleep(poll_s)
                st = self.agent.check_xfer_state(h)
            t1 = clock()
            self.agent.release_xfer_handle(h)
            out.append(t1 - t0)
            self._check(local, remote)
        return {"ns": out}

    def memcpy(self, trials: int, n: int, seed: int) -> dict[str, Any]:
        """The same bytes, same permutation, one process: ``numpy.take`` of the
        source's permuted blocks into blocks 1..n (one pass, unbuffered)."""
        if not self.src:
            self.src = _raw_buffers(self.num_blocks, self.block_bytes, fill=True, huge_pages=self.huge_pages)
        out: list[int] = []
        clock = time.perf_counter_ns
        for t in range(trials):
            remote = np.asarray(permuted_blocks(n, seed + t))
            self._zero(n)
            t0 = clock()
            for src, dst in zip(self.src, self.bufs, strict=True):
                np.take(src, remote, axis=0, out=dst[1:n + 1], mode="clip")
            t1 = clock()
            out.append(t1 - t0)
            self._check(range(1, n + 1), remote)
        return {"ns": out}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.pop("op")
        if op == "connect":
            return self.connect(**cmd)
        if op == "transfer":
            return self.transfer(**cmd)
        if op == "memcpy":
            return self.memcpy(**cmd)
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self) -> None:
        if self.remote is not None:
            self.remote.release()
        self.local.release()
        if self.peer:
            self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)


# --------------------------------------------------------------------------- main

ROLES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "kvsm-prefill": Prefill, "upstream-prefill": Prefill,
    "kvsm-decode": Decode, "upstream-decode": Decode,
    "raw-target": RawTarget, "raw-reader": RawReader,
}


def main(argv: list[str]) -> int:
    _die_with_parent()
    # stdout carries the protocol only: whatever a library prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    spec = json.loads(argv[0])

    def reply(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg, default=str) + "\n")
        proto.flush()

    try:
        peer = ROLES[spec["role"]](spec)
    except Exception as e:  # noqa: BLE001 - the benchmark prints it
        import traceback

        traceback.print_exc()
        reply({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    reply({"ready": True, "pid": os.getpid(), **peer.hello()})
    try:
        for line in sys.stdin:  # EOF: the benchmark is gone
            cmd = json.loads(line)
            op = cmd.get("op")
            try:
                if op == "cpu":
                    out = {"cpu_s": time.process_time(), "threads": threading.active_count()}
                elif op == "quit":
                    out = {}
                else:
                    out = peer.handle(dict(cmd))
                reply({"ok": True, **out})
            except Exception as e:  # noqa: BLE001 - reported to the benchmark
                import traceback

                traceback.print_exc()
                reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
            if op == "quit":
                break
    finally:
        peer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
