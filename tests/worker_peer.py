"""Prefill-side kvsm workers in their own process, for tests/test_worker_nixl.py.

Run as ``python tests/worker_peer.py SPEC_JSON``. SPEC is::

    {"defer_start": false,            # true: build everything, bind only on "start"
     "workers": [{"name": "A", "engine_id": "prefill-A", "port": 5601,
                  "lease_s": 30.0, "seed": 1, "log": "/tmp/x.jsonl",
                  "config": {"notif_poll_interval_s": 0.5}}, ...]}   # config: optional

Each worker is a real ``kvsm.worker.WorkerHalf`` (role ``kv_producer``) over
its own ``NixlTransport`` and its own vLLM-CPU-layout KV caches
(``GEOMETRY``), filled with ``pattern(seed)`` so that the decode side can check
every byte it read. The process is driven by JSON lines: one command on stdin,
one reply on stdout. Commands (``w`` names a worker):

``start``                   start the deferred workers (bind their side channels)
``submit``  w, step, send_start [req], send_finish [[req, [blocks]]],
            send_abort [req], stream_preempted [[req, at_ns]]
                                                    post one step's metadata
``sent``                    {w: {req: t_monotonic}} of every finished_sending so far
``wait_sent`` w, reqs, within                        block until all reqs are sent
``state``   w               WorkerHalf.debug_state()
``hold_notifs`` w, seconds  deliver NIXL notifications to the loop only after ``seconds``
``inject``  w, path, victim, times, hold, skip   make one loop handler raise (``inject_fault``)
``faults``  w               {path: times raised} of every fault injected into ``w``
``clear_faults`` w          restore every handler ``inject`` replaced
``fill``    w, blocks, seed overwrite those blocks of every layer with ``pattern(seed)``'s
                            (the prefill engine reusing freed blocks for another request)
``stream_step`` w, step, send_start [[req, key]], stream_steps [[req, blocks, start, end, last]],
            fill_seed, fill_first_seed, layer_delay_s, saved_first, wait
                            one forward pass of vLLM's model thread over streamed requests
                            (``_Worker.model_step``, on a thread of its own): replies once it is
                            over with {"saving": [when each layer_saved was called], "layers":
                            [when each returned], "over": when submit returned}
                            (``time.monotonic()``), or at once with ``wait`` false
                            (``step_wait`` then). ``step`` must differ from every other step
                            number the worker was given
``step_wait`` w, within     wait for w's last stream_step; its reply
``flush``                   flush every event log
``quit``                    shut every worker down and exit

A worker spec may carry ``"geometry"`` (overrides of ``GEOMETRY``, e.g. bigger
blocks so that a read takes long enough to kill the process during it); the
decode side must then use the same overrides. ``"pp_size"``, ``"pp_rank"`` and
``"layers"`` (global layer indices) make it one pipeline parallel stage of its
engine, holding those layers only (``pattern(seed)``'s rows of them); stage 0
binds the engine's port and relays to the others. ``"tp_size"`` and
``"tp_rank"`` make it one tensor parallel rank, holding its share of the KV
heads (``pattern(seed)``'s heads of it, heads-major blocks).

``pin_target`` w           where the worker's pin channel is (``PinTarget`` fields),
                            for a real scheduler half to pin through

Start-up prints ``{"ready": true, "pid": ..., "workers": {name: {"agent", "port"}}}``.
A background thread drains every worker's ``take_results`` every 2 ms and
stamps each finished_sending with ``time.monotonic()`` (system-wide on
Linux, so the test process can compare it with its own clock).

vLLM is *not* imported: ``kvsm.vllm.metadata`` and ``kvsm.worker.stats`` only need a few
base classes from it, and importing vLLM costs ~6 s of CPU per process on the
test machine. ``_stub_vllm`` serves every ``vllm.*`` import with stand-ins
(set ``KVSM_PEER_REAL_VLLM=1`` to import the real package instead).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import types
from typing import Any

import numpy as np

# vLLM-CPU layout: [num_blocks, kv_heads, block_size, 2 * head_size] per layer.
GEOMETRY = {"num_blocks": 64, "layers": 2, "kv_heads": 2, "block_size": 16, "head_size": 32}


def layer_names(layers: int = GEOMETRY["layers"]) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def geometry(overrides: dict[str, int] | None = None) -> dict[str, int]:
    """``GEOMETRY`` with ``overrides`` (a worker spec's ``"geometry"``)."""
    return {**GEOMETRY, **(overrides or {})}


def shape(geom: dict[str, int] | None = None) -> tuple[int, int, int, int]:
    g = geometry(geom)
    return (g["num_blocks"], g["kv_heads"], g["block_size"], 2 * g["head_size"])


def pattern(seed: int, geom: dict[str, int] | None = None) -> np.ndarray:
    """The bytes of every layer of a cache filled with ``seed``: ``[layers, *shape]`` int32.

    Random per (layer, block, element), so a block read from the wrong remote
    block, the wrong layer or the wrong engine never compares equal."""
    return np.random.default_rng(seed).integers(-(2**31), 2**31, size=(geometry(geom)["layers"], *shape(geom)),
                                                dtype=np.int32)


def make_caches(seed: int | None, geom: dict[str, int] | None = None,
                layers: list[int] | None = None, heads: tuple[int, int] | None = None) -> dict[str, Any]:
    """Per-layer float32 KV caches: ``pattern(seed)`` (prefill) or zeros (``seed=None``, decode).
    ``layers``: only those (a pipeline parallel stage's), each with its row of the pattern;
    ``heads``: only heads ``[start, start + count)`` of each block (a tensor parallel rank's)."""
    import torch

    caches = {}
    pat = pattern(seed, geom) if seed is not None else None
    start, count = heads if heads is not None else (0, geometry(geom)["kv_heads"])
    for i, name in enumerate(layer_names(geometry(geom)["layers"])):
        if layers is not None and i not in layers:
            continue
        full = shape(geom)
        t = torch.zeros((full[0], count, *full[2:]), dtype=torch.float32)
        if pat is not None:
            t.view(torch.int32).numpy()[...] = pat[i][:, start:start + count]
        caches[name] = t
    return caches


def compat_fields(geom: dict[str, int] | None = None, **overrides: Any) -> dict[str, Any]:
    """The CompatInfo both sides use (overrides make an incompatible one)."""
    g = geometry(geom)
    fields = {"model": "kvsm-test-tiny", "dtype": "float32", "num_layers": g["layers"],
              "num_kv_heads": g["kv_heads"], "head_size": g["head_size"], "block_size": g["block_size"],
              "kv_layout": f"block-major {g['kv_heads']}x{g['block_size']}x{2 * g['head_size']}"}
    fields.update(overrides)
    return fields


def config_fields(engine_id: str, kv_role: str, port: int, geom: dict[str, int] | None = None,
                  **overrides: Any) -> dict[str, Any]:
    """KVSMConfig keyword arguments for a test worker."""
    fields: dict[str, Any] = {
        "engine_id": engine_id, "kv_role": kv_role, "kv_buffer_device": "cpu", "side_channel_host": "127.0.0.1",
        "side_channel_port": port, "lease_s": 30.0, "heartbeat_interval_s": 5.0, "handshake_timeout_s": 2.0,
        "transfer_timeout_s": 5.0, "peer_backoff_s": 1.0, "peer_backoff_max_s": 4.0,
        "notif_poll_interval_s": 0.001, "event_log_dir": None, "backends": ("UCX",), "tp_size": 1, "dp_rank": 0,
        "pp_size": 1, "dcp_size": 1, "block_size": geometry(geom)["block_size"],
        "kv_load_failure_policy": "fail"}
    fields.update(overrides)
    return fields


def agent_name(engine_id: str, pp_rank: int = 0, tp_rank: int = 0) -> str:
    """The agent name kvsm.connector gives that worker of ``engine_id`` (a restart keeps it)."""
    return f"kvsm-{engine_id}-dp0-tp{tp_rank}" + (f"-pp{pp_rank}" if pp_rank else "")


# --------------------------------------------------------------------- fault injection


class InjectedFault(RuntimeError):
    """What an injected handler raises (a bug in that handler, as the loop sees it)."""


def _mentions(victim: str, value: Any, depth: int = 0) -> bool:
    """Whether one handler argument (a request id, an event or a RecvStart, a list
    of claims, a ``_Claim`` with its ``reqs``, notifications) concerns ``victim``."""
    if depth > 6:
        return False
    if isinstance(value, str):
        return value == victim
    if isinstance(value, bytes):
        return value == victim.encode()
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_mentions(victim, v, depth + 1) for v in value)
    if getattr(value, "req", None) == victim:
        return True
    reqs = getattr(value, "reqs", None)
    return reqs is not None and _mentions(victim, reqs, depth + 1)


class Fault:
    """One handler replaced by a wrapper that raises ``InjectedFault``.

    ``path`` names the handler from the WorkerHalf: an attribute chain
    (``_lease_expired``, ``server._provide``, ``transport.get_notifs``) whose last
    step may be a key of a dict (``_send_effects.free_blocks``: the effect tables
    hold bound methods taken at construction, so patching the method would miss
    them). It raises when an argument concerns ``victim`` (every time, or
    ``times`` times), or with no victim the next ``times`` calls; the first
    ``skip`` such calls pass (to reach a later call site). ``hold=True``
    runs the handler first and, when its result concerns the victim (or, with no
    victim, is not empty), keeps the result for the next call and raises: a
    ``get_notifs`` that fails after taking notifications off NIXL, without
    losing them."""

    def __init__(self, root: Any, path: str, *, victim: str | None = None, times: int | None = None,
                 hold: bool = False, skip: int = 0) -> None:
        *parents, self.leaf = path.split(".")
        obj = root
        for name in parents:
            obj = getattr(obj, name)
        self.path = path
        self.container = obj
        self.is_item = isinstance(obj, dict)
        self.original = obj[self.leaf] if self.is_item else getattr(obj, self.leaf)
        self.had_own = self.is_item or self.leaf in getattr(obj, "__dict__", {})
        self.victim = victim
        self.left = times if times is not None else (None if victim is not None else 1)
        self.hold = hold
        self.skip = skip
        self.held: list[Any] = []
        self.fired = 0
        self.calls = 0
        self._set(self._wrapper())

    def _set(self, fn: Any) -> None:
        if self.is_item:
            self.container[self.leaf] = fn
        else:
            setattr(self.container, self.leaf, fn)

    def _armed(self, concerned: bool) -> bool:
        if not concerned or (self.left is not None and self.left <= 0):
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def _raise(self) -> None:
        self.fired += 1
        if self.left is not None:
            self.left -= 1
        who = f" for {self.victim}" if self.victim is not None else ""
        raise InjectedFault(f"injected into {self.path}{who}")

    def _wrapper(self) -> Any:
        original = self.original

        def wrapped(*args: Any, **kw: Any) -> Any:
            self.calls += 1
            if self.hold:
                got = self.held + list(original(*args, **kw))
                self.held = []
                concerned = bool(got) if self.victim is None else any(
                    _mentions(self.victim, item) for item in got)
                if self._armed(concerned):
                    self.held = got
                    self._raise()
                return got
            concerned = self.victim is None or _mentions(self.victim, (args, tuple(kw.values())))
            if self._armed(concerned):
                self._raise()
            return original(*args, **kw)

        wrapped.__name__ = getattr(original, "__name__", self.leaf)
        return wrapped

    def restore(self) -> None:
        if self.had_own:
            self._set(self.original)
        else:
            delattr(self.container, self.leaf)


def inject_fault(half: Any, path: str, *, victim: str | None = None, times: int | None = None,
                 hold: bool = False, skip: int = 0) -> Fault:
    """Make the handler at ``path`` of WorkerHalf ``half`` raise (see ``Fault``)."""
    return Fault(half, path, victim=victim, times=times, hold=hold, skip=skip)


# --------------------------------------------------------------------- vLLM stand-ins


class _StubModule(types.ModuleType):
    """A ``vllm.*`` module whose every attribute is a fresh placeholder class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None, "__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: submodules resolve through this finder too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _stub_vllm() -> None:
    if os.environ.get("KVSM_PEER_REAL_VLLM") == "1":
        return
    sys.meta_path.insert(0, _StubFinder())


# --------------------------------------------------------------------- the process


class _Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        from kvsm.config import KVSMConfig
        from kvsm.eventlog.log import EventLog
        from kvsm.handshake import CompatInfo
        from kvsm.transport.layout import describe_kv_caches
        from kvsm.transport.nixl import NixlTransport
        from kvsm.worker import WorkerHalf

        self.name = spec["name"]
        self.engine_id = spec["engine_id"]
        self.port = spec["port"]
        self.geom = spec.get("geometry")
        self.layers = spec.get("layers")
        stage, tp, rank = spec.get("pp_rank", 0), spec.get("tp_size", 1), spec.get("tp_rank", 0)
        kv_heads = geometry(self.geom)["kv_heads"]
        per = kv_heads // tp
        self.caches = make_caches(spec["seed"], self.geom, self.layers, heads=(rank * per, per))
        self.heads = slice(rank * per, (rank + 1) * per)
        self.transport = NixlTransport(agent_name(self.engine_id, stage, rank), describe_kv_caches(
            self.caches, heads=dict.fromkeys(self.caches, per) if "tp_size" in spec else None))
        self.compat = CompatInfo(**compat_fields(self.geom, **spec.get("compat", {})))
        self.cfg = KVSMConfig(**config_fields(self.engine_id, "kv_producer", self.port, self.geom,
                                              lease_s=spec.get("lease_s", 30.0), pp_size=spec.get("pp_size", 1),
                                              tp_size=tp, kv_heads=kv_heads, **spec.get("config", {})))
        self.log = (EventLog(spec["log"], role="worker", engine_id=self.engine_id, rank=stage * tp + rank)
                    if spec.get("log") else None)
        self.half = WorkerHalf(self.cfg, rank, pp_rank=stage, event_log=self.log)
        self.started = False
        self.sent: dict[str, float] = {}
        self.other: dict[str, list[str]] = {"recving": [], "failed": [], "invalid": []}
        self.faults: list[Fault] = []
        self.patterns: dict[int, np.ndarray] = {}
        self.step_thread: threading.Thread | None = None
        self.step_out: dict[str, Any] = {}

    def start(self) -> None:
        if not self.started:
            self.half.start(self.transport, self.compat)
            self.started = True

    def hold_notifs(self, seconds: float) -> None:
        """For ``seconds``, NIXL notifications still arrive (the agent progresses) but
        reach the worker's loop only afterwards: a notification slower than the side
        channel, which nothing orders them against."""
        real = self.transport.get_notifs
        until = time.monotonic() + seconds
        held: list[tuple[str, bytes]] = []

        def get_notifs() -> list[tuple[str, bytes]]:
            got = real()
            if time.monotonic() < until:
                held.extend(got)
                return []
            out = held + got
            held.clear()
            return out

        self.transport.get_notifs = get_notifs  # the loop calls it through the instance

    def fill(self, blocks: list[int], seed: int) -> None:
        """Overwrite ``blocks`` of every layer with ``pattern(seed)``'s same blocks."""
        import torch

        new = pattern(seed, self.geom)
        for i, name in enumerate(layer_names(geometry(self.geom)["layers"])):
            if name not in self.caches:
                continue  # another pipeline stage's layer
            self.caches[name].view(torch.int32).numpy()[blocks] = new[i][blocks][:, self.heads]

    def _pattern(self, seed: int) -> np.ndarray:
        if seed not in self.patterns:
            self.patterns[seed] = pattern(seed, self.geom)
        return self.patterns[seed]

    def fill_tokens(self, layer: int, blocks: list[int], start: int, end: int, seed: int) -> None:
        """Tokens ``start..end`` of layer ``layer`` (a global index) of a request whose
        blocks by position are ``blocks`` take ``pattern(seed)``'s bytes (its same blocks)."""
        import torch

        name = layer_names(geometry(self.geom)["layers"])[layer]
        if name not in self.caches or end <= start:
            return
        size = geometry(self.geom)["block_size"]
        cache, src = self.caches[name].view(torch.int32).numpy(), self._pattern(seed)[layer]
        for pos in range(start // size, (end - 1) // size + 1):
            b, base = blocks[pos], pos * size
            lo, hi = max(start, base) - base, min(end, base + size) - base
            cache[b, :, lo:hi] = src[b, self.heads, lo:hi]

    def model_step(self, cmd: dict[str, Any]) -> None:
        """vLLM's model thread for one step that computes streamed requests. The step's
        tokens first take ``pattern(fill_first_seed)`` in every layer (not computed yet);
        then, layer by layer in the forward pass's order, they take ``pattern(fill_seed)``
        (computed) and ``half.layer_saved`` is called (``save_kv_layer``), then a pause of
        ``layer_delay_s``; ``saved_first`` plants a fault: ``layer_saved`` comes before
        the layer is computed (its pause in between), so its write may carry stale
        bytes. Then ``half.step_over()`` (``wait_for_save``) and ``half.submit(meta)``
        (``start_load_kv``, a no-op once the first layer posted the step)."""
        from kvsm.handoff.facts import SendStart, StreamStep
        from kvsm.vllm.metadata import KVSMConnectorMetadata

        meta = KVSMConnectorMetadata(cmd["step"])
        meta.send_start = [SendStart(req=r, stream=k) for r, k in cmd.get("send_start", [])]
        steps = [StreamStep(req=r, block_ids=(tuple(b),), start=s, end=e, last=bool(last))
                 for r, b, s, e, last in cmd.get("stream_steps", [])]
        meta.stream_steps = steps
        delay, saved_first = cmd.get("layer_delay_s", 0.0), cmd.get("saved_first", False)
        names = layer_names(geometry(self.geom)["layers"])
        mine = [(i, n) for i, n in enumerate(names) if n in self.caches]

        def compute(i: int, seed: int) -> None:
            for st in steps:
                self.fill_tokens(i, list(st.block_ids[0]), st.start, st.end, seed)

        for i, _ in mine:
            compute(i, cmd["fill_first_seed"])
        saving: list[float] = []
        saved: list[float] = []
        for i, name in mine:
            if not saved_first:
                compute(i, cmd["fill_seed"])
            saving.append(time.monotonic())
            self.half.layer_saved(name, meta)
            saved.append(time.monotonic())
            time.sleep(delay)
            if saved_first:
                compute(i, cmd["fill_seed"])
        self.half.step_over()
        self.half.submit(meta)
        self.step_out = {"saving": saving, "layers": saved, "over": time.monotonic()}

    def begin_step(self, cmd: dict[str, Any]) -> None:
        if self.step_thread is not None and self.step_thread.is_alive():
            raise RuntimeError(f"worker {self.name}: a step is under way already")

        def run() -> None:
            try:
                self.model_step(cmd)
            except Exception as e:  # noqa: BLE001 - reported by step_wait
                self.step_out = {"error": f"{type(e).__name__}: {e}"}

        self.step_out = {}
        self.step_thread = threading.Thread(target=run, name=f"model-{self.name}", daemon=True)
        self.step_thread.start()

    def end_step(self, within: float) -> dict[str, Any]:
        t = self.step_thread
        if t is None:
            raise RuntimeError(f"worker {self.name}: no step to wait for")
        t.join(within)
        if t.is_alive():
            raise TimeoutError(f"worker {self.name}: the step is not over after {within} s")
        self.step_thread = None
        if "error" in self.step_out:
            raise RuntimeError(self.step_out["error"])
        return dict(self.step_out)

    def drain(self) -> None:
        if not self.started:
            return
        sending, recving, failed = self.half.take_results()
        now = time.monotonic()
        for req in sending:
            self.sent.setdefault(req, now)
        self.other["recving"] += sorted(recving)
        self.other["failed"] += sorted(failed)
        self.other["invalid"] += sorted(self.half.take_invalid_blocks())


class Peer:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.workers = {w["name"]: _Worker(w) for w in spec["workers"]}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if not spec.get("defer_start"):
            self.start()
        self.poller = threading.Thread(target=self._poll, name="peer-results", daemon=True)
        self.poller.start()

    def start(self) -> None:
        with self.lock:
            for w in self.workers.values():
                w.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.002):
            with self.lock:
                for w in self.workers.values():
                    w.drain()

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "start":
            self.start()
            return {}
        if op == "submit":
            from kvsm.handoff.facts import StreamPreempted
            from kvsm.vllm.metadata import KVSMConnectorMetadata, SendFinish, SendStart

            meta = KVSMConnectorMetadata(cmd.get("step", 0))
            meta.send_start = [SendStart(req=r) for r in cmd.get("send_start", [])]
            meta.send_finish = [SendFinish(req=r, ok=True, block_ids=tuple(b)) for r, b in cmd.get("send_finish", [])]
            meta.send_finish += [SendFinish(req=r, ok=False, reason="FINISHED_ABORTED")
                                 for r in cmd.get("send_abort", [])]
            meta.stream_preempted = [StreamPreempted(req=r, at_ns=int(t)) for r, t in cmd.get("stream_preempted", [])]
            self.workers[cmd["w"]].half.submit(meta)
            return {}
        if op == "sent":
            with self.lock:
                return {"sent": {n: dict(w.sent) for n, w in self.workers.items()},
                        "other": {n: w.other for n, w in self.workers.items()}}
        if op == "wait_sent":
            w = self.workers[cmd["w"]]
            deadline = time.monotonic() + cmd["within"]
            while True:
                with self.lock:
                    sent = dict(w.sent)
                if all(r in sent for r in cmd["reqs"]) or time.monotonic() > deadline:
                    return {"sent": sent}
                time.sleep(0.002)
        if op == "state":
            return {"state": self.workers[cmd["w"]].half.debug_state()}
        if op == "hold_notifs":
            self.workers[cmd["w"]].hold_notifs(cmd["seconds"])
            return {}
        if op == "inject":
            w = self.workers[cmd["w"]]
            w.faults.append(inject_fault(w.half, cmd["path"], victim=cmd.get("victim"), times=cmd.get("times"),
                                         hold=cmd.get("hold", False), skip=cmd.get("skip", 0)))
            return {}
        if op == "faults":
            return {"faults": {f.path: f.fired for f in self.workers[cmd["w"]].faults}}
        if op == "clear_faults":
            w = self.workers[cmd["w"]]
            for f in reversed(w.faults):
                f.restore()
            w.faults.clear()
            return {}
        if op == "pin_target":
            target = self.workers[cmd["w"]].half.pin_target()
            assert target is not None, f"worker {cmd['w']} has no pin channel (not started?)"
            return {"target": {"tp_rank": target.tp_rank, "pid": target.pid, "endpoint": target.endpoint,
                               "token": target.token.hex(), "pp_rank": target.pp_rank}}
        if op == "fill":
            self.workers[cmd["w"]].fill(cmd["blocks"], cmd["seed"])
            return {}
        if op == "stream_step":
            w = self.workers[cmd["w"]]
            w.begin_step(cmd)
            return w.end_step(cmd.get("within", 10.0)) if cmd.get("wait", True) else {}
        if op == "step_wait":
            return self.workers[cmd["w"]].end_step(cmd.get("within", 10.0))
        if op == "flush":
            for w in self.workers.values():
                if w.log is not None:
                    w.log.flush()
            return {}
        if op == "quit":
            self.shutdown()
            return {}
        raise ValueError(f"unknown op {op!r}")

    def shutdown(self) -> None:
        self.stop.set()
        self.poller.join(timeout=5)
        for w in self.workers.values():
            if w.started:
                w.half.shutdown()  # closes the transport and the event log
            else:
                w.transport.close()
                if w.log is not None:
                    w.log.close()


def main(argv: list[str]) -> int:
    # stdout carries the protocol only: whatever a library prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _stub_vllm()
    spec = json.loads(argv[0])
    peer = Peer(spec)

    def reply(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg, default=str) + "\n")
        proto.flush()

    reply({"ready": True, "pid": os.getpid(), "vllm_stubbed": not hasattr(sys.modules.get("vllm"), "__version__"),
           "workers": {n: {"agent": w.transport.name, "port": w.port} for n, w in peer.workers.items()}})
    try:
        for line in sys.stdin:  # EOF: the test process is gone, do not outlive it
            cmd = json.loads(line)
            try:
                out = {"ok": True, **peer.handle(cmd)}
            except Exception as e:  # noqa: BLE001 - report it to the test
                out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            reply(out)
            if cmd["op"] == "quit":
                return 0
    finally:
        if not peer.stop.is_set():
            peer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
