"""Sections 2 and 3 of tools/bench.py: kvsm against upstream NixlConnector over
real NIXL (UCX, DRAM) between real processes.

2. ``worker``    worker-side cost per step with N transfers in flight: the time
   vLLM's model-runner thread spends in ``start_load_kv`` +
   ``get_transfer_results`` (and in every worker-side connector call of a step),
   the CPU the decode and prefill processes burn meanwhile, and while idle.
3. ``transfer``  throughput of one transfer of ``transfer_blocks`` blocks of
   ``transfer_block_kib`` KiB in permuted order: kvsm, upstream, raw NIXL with
   prepared descriptor lists, and a ``numpy.take`` of the same bytes in one
   process (the physical limit here).

Processes (``tools/bench_nixl_peer.py``, started together and shared by both
sections; six of them import vLLM, ~6 CPU-s each: ~25 s on 2 cores), in
pairs of (decode or reader, prefill or target):

* ``kvsm``: ``KVSMConnector``, worker role, each with its own side channel;
* ``upstream``: vLLM's ``NixlConnector``, worker role, as it ships (NIXL's
  progress thread on, UCX ``num_threads=4``); the prefill engine's
  scheduler-side connector serves the side channel, as in an engine;
* ``upstream-np``: the same, its NIXL agent made without the progress thread
  (as kvsm's is), to tell its code's cost from the busy-polling thread's;
* ``kvsm-mt``: kvsm with ``num_threads`` UCX backend threads, as many as
  upstream asks for (section 2: CPU per transfer and idle; section 3: throughput);
* ``raw``: bare NIXL agents configured as kvsm's, prepared descriptor lists;
  ``raw-mt`` with UCX backend threads as upstream asks, ``raw-thp`` on
  huge pages (section 3's references).

Each decode worker runs the loops in its own process, calling the connector as
vLLM's model runner does, and reports what it timed; the benchmark process only
orchestrates. While one pair is measured every other process is frozen
(SIGSTOP): upstream's NIXL progress thread busy-polls a core per process, which
would otherwise slow whatever runs next to it. The connectors' runs alternate,
the order rotating each repetition, as in section 1. Every process is stopped
when section 3 ends, when a section fails, at exit, and (PR_SET_PDEATHSIG) when
this process dies.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import NO_TARGET, Row, Section, Sizes, Target, _rotated

from kvsm_testing.peer_process import PeerProcess
from kvsm_testing.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = Path(__file__).with_name("bench_nixl_peer.py")

LAYERS = 2  # the tiny model's (bench_nixl_peer.LAYERS)
BYTES_PER_TOKEN = 512  # one layer: 2 KV heads x (K + V) x head size 32 x float32
BLOCKS_PER_TRANSFER = 1  # section 2: one vLLM block (of every layer) per request
FORWARD_S = 0.002  # section 2: the model's forward pass, between bind and start_load_kv
POLL_S = 0.0001  # section 3: sleep between polls for completion (every method alike)
TRIALS = 3  # section 3: transfers per method per repetition (their median counts)
LEASE_S = 600  # pinned blocks never expire during a run (processes may sit frozen)
CONNECTORS = ("kvsm", "upstream", "upstream-np")  # upstream-np: NixlConnector without NIXL's progress thread
# kvsm with UCX backend threads (its num_threads key, as raw-mt): its CPU and idle
# CPU in section 2, its throughput in section 3.
KVSM_VARIANTS = ("kvsm-mt",)
RAWS = ("raw", "raw-mt", "raw-thp")  # raw-mt: UCX backend threads, as upstream asks; raw-thp: on huge pages
RAW_MT_THREADS = 4  # NixlConnector's default num_threads
IDLE_TARGET = Target("max", 0.05, "<= 0.05 (no busy polling)")


# --------------------------------------------------------------------------- processes


class PeerError(RuntimeError):
    pass


class Peer(PeerProcess):
    """One bench_nixl_peer.py process, driven by JSON lines."""

    error = PeerError

    def __init__(self, label: str, spec: dict[str, Any], log_dir: Path) -> None:
        # Own session: a Ctrl-C reaches only the benchmark, which then stops every
        # peer in order (and the peers die with it anyway: PR_SET_PDEATHSIG).
        super().__init__(label, PEER_SCRIPT, spec, log_dir, root=ROOT, start_new_session=True,
                         env={"KVSM_BENCH_PARENT": str(os.getpid()), "VLLM_LOGGING_LEVEL": "ERROR"})
        self.frozen = False

    def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        if self.frozen:
            raise PeerError(f"peer {self.label}: {op} sent while frozen")
        return super().call(op, timeout, **kw)

    def cpu(self) -> float:
        return float(self.call("cpu")["cpu_s"])

    def freeze(self) -> None:
        if not self.frozen and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def ask_to_quit(self) -> None:
        """Thaw and send "quit" without waiting (``close`` waits)."""
        self.thaw()
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.send("quit")

    def close(self, timeout: float = 20.0) -> None:
        """Stop the process: it shuts its connector down on "quit" (or on EOF);
        killed if it has not exited within ``timeout``."""
        try:
            if not self.hello.get("ready"):  # still starting (or failed to): nothing to shut down in order
                self.thaw()
                self.proc.kill()
            self.ask_to_quit()
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        finally:
            self.close_stderr()


@dataclass(frozen=True)
class Geometry:
    """One KV cache shape for every process (so the processes serve both sections)."""

    block_size: int  # tokens per vLLM block
    num_blocks: int  # per engine (block 0 is vLLM's null block and never moved)

    @property
    def block_bytes(self) -> int:
        return self.block_size * BYTES_PER_TOKEN

    @classmethod
    def for_sizes(cls, sizes: Sizes) -> Geometry:
        block_bytes = sizes.transfer_block_kib * 1024
        block_size, rest = divmod(block_bytes, BYTES_PER_TOKEN)
        # vLLM's CPU attention takes block sizes that are multiples of 32 tokens.
        if rest or block_size % 32:
            raise ValueError(f"transfer_block_kib={sizes.transfer_block_kib}: a block of the tiny model must hold a "
                             f"multiple of 32 tokens ({32 * BYTES_PER_TOKEN // 1024} KiB)")
        if sizes.transfer_blocks % LAYERS:
            raise ValueError(f"transfer_blocks={sizes.transfer_blocks} must split over {LAYERS} layers")
        need = max(sizes.transfer_blocks // LAYERS, max(sizes.worker_inflight) * BLOCKS_PER_TRANSFER)
        # make_scheduler's engine must hold one 2048-token request.
        return cls(block_size, max(need, -(-2048 // block_size) + 1) + 1)


class Fleet:
    """Every peer process of sections 2 and 3, started in parallel, each pair
    warmed up (handshake, first reads) before anything is measured."""

    def __init__(self, geometry: Geometry, tmp: Path) -> None:
        self.geometry = geometry
        self.log_dir = tmp / "bench-nixl"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        g = geometry
        self.peers: dict[str, Peer] = {}
        self.warm: set[str] = set()
        try:
            for name in (*CONNECTORS, *KVSM_VARIANTS):
                kind = name.split("-")[0]
                side, pin = _free_port(), _free_port()
                common = {"connector": kind, "block_size": g.block_size, "num_blocks": g.num_blocks,
                          "side_port": side, "pin_port": pin, "lease_s": LEASE_S,
                          "progress_thread": name != "upstream-np",
                          "num_threads": RAW_MT_THREADS if name == "kvsm-mt" else 0,
                          "event_log_dir": str(self.log_dir / "kvsm-events") if kind == "kvsm" else None}
                self._start(f"{name}-prefill", {"role": f"{kind}-prefill", "engine_id": f"bench-{name}-prefill",
                                                **common})
                self._start(f"{name}-decode", {"role": f"{kind}-decode", "engine_id": f"bench-{name}-decode",
                                               "remote_engine": f"bench-{name}-prefill",
                                               "remote_num_blocks": g.num_blocks, **common})
            for name in RAWS:
                raw = {"num_blocks": g.num_blocks, "block_bytes": g.block_bytes, "huge_pages": name == "raw-thp",
                       "num_threads": RAW_MT_THREADS if name == "raw-mt" else 0}
                self._start(f"{name}-target", {"role": "raw-target", "engine_id": f"bench-{name}-target", **raw})
                self._start(f"{name}-reader", {"role": "raw-reader", "engine_id": f"bench-{name}-reader", **raw})
            for p in self.peers.values():  # six of them import vLLM (~6 CPU-s each)
                p.ready(timeout=300)
            for name in RAWS:
                target = self.peers[f"{name}-target"].hello
                self.peers[f"{name}-reader"].call("connect", agent_metadata=target["agent_metadata"],
                                                  descs=target["descs"], name=target["name"])
            for p in self.peers.values():
                p.freeze()
        except BaseException:
            self.close()
            raise

    def _start(self, label: str, spec: dict[str, Any]) -> None:
        self.peers[label] = Peer(label, spec, self.log_dir)

    def pair(self, name: str) -> tuple[Peer, Peer]:
        """(the one that reads and measures, the one that is read)."""
        if name in RAWS:
            return self.peers[f"{name}-reader"], self.peers[f"{name}-target"]
        return self.peers[f"{name}-decode"], self.peers[f"{name}-prefill"]

    @contextlib.contextmanager
    def only(self, *running: Peer) -> Iterator[None]:
        """Freeze every other process while ``running`` run."""
        for p in self.peers.values():
            if p not in running:
                p.freeze()
        for p in running:
            p.thaw()
        try:
            yield
        finally:
            for p in running:
                p.freeze()

    def notes(self) -> list[str]:
        """What the processes said about themselves that a reader should know."""
        pinned = sorted({p.hello["affinity_note"] for p in self.peers.values() if p.hello.get("affinity_note")})
        if not pinned:
            return []
        return [(f"NixlConnector's worker, on the CPU, pins its thread to the last core of each NUMA node; the "
                 f"benchmark undoes it so that every connector runs on the same cores ({'; '.join(pinned)}).")]

    def close(self) -> None:
        """Stop every process, in parallel (each shuts its connector down, ~1 s
        for upstream's listener thread)."""
        for p in self.peers.values():
            with contextlib.suppress(Exception):
                p.ask_to_quit()
        deadline = time.monotonic() + 30.0
        for p in self.peers.values():
            with contextlib.suppress(Exception):
                p.close(timeout=max(1.0, deadline - time.monotonic()))
        self.peers.clear()


_FLEET: Fleet | None = None


def _fleet(sizes: Sizes, tmp: Path) -> Fleet:
    """The running fleet if it fits these sizes (section 3 reuses section 2's)."""
    global _FLEET
    geometry = Geometry.for_sizes(sizes)
    if _FLEET is not None and _FLEET.geometry != geometry:
        close_fleet()
    if _FLEET is None:
        _FLEET = Fleet(geometry, tmp)
    return _FLEET


def close_fleet() -> None:
    """Stop every peer process (idempotent; also run at exit)."""
    global _FLEET
    fleet, _FLEET = _FLEET, None
    if fleet is not None:
        fleet.close()


atexit.register(close_fleet)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------- 2. worker


def _steady(fleet: Fleet, name: str, run: str, inflight: int, steps: int, warm_steps: int) -> dict[str, Any]:
    decode, prefill = fleet.pair(name)
    with fleet.only(decode, prefill):
        p0 = prefill.cpu()
        r = decode.call("steady", timeout=600.0, run=run, inflight=inflight, steps=steps, warm_steps=warm_steps,
                        forward_s=FORWARD_S, bpr=BLOCKS_PER_TRANSFER, timeout_s=540.0)
        state = prefill.call("quiesce", timeout=60.0, within=30.0)
        p1 = prefill.cpu()
    if state["pending"]:
        raise RuntimeError(f"{name} prefill still holds {state['pending']} unread requests after run {run}")
    if state.get("errors"):
        raise RuntimeError(f"{name} prefill runner failed: {state['errors']}")
    r["prefill_cpu_s"] = p1 - p0
    return r


def _idle(fleet: Fleet, name: str, seconds: float) -> tuple[float, float]:
    """CPU-s per second each process of the pair burns with nothing to do."""
    decode, prefill = fleet.pair(name)
    with fleet.only(decode, prefill):
        time.sleep(0.3)  # let the last run's stragglers (notification polls, log flushes) settle
        d0, p0, t0 = decode.cpu(), prefill.cpu(), time.perf_counter()
        time.sleep(seconds)
        d1, p1, t1 = decode.cpu(), prefill.cpu(), time.perf_counter()
    return (d1 - d0) / (t1 - t0), (p1 - p0) / (t1 - t0)


def _warm_connectors(fleet: Fleet, names: Sequence[str] = CONNECTORS) -> None:
    """First contact of each pair: the handshake and the UCX wire-up."""
    for name in names:
        if name in fleet.warm:
            continue
        _steady(fleet, name, f"warm-{name}", inflight=4, steps=3, warm_steps=0)
        fleet.warm.add(name)


def bench_worker(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    sec = Section(2, "worker", "worker-side cost per step, transfers in flight (real NIXL, DRAM, two processes)")
    ok = False
    try:
        measured = (*CONNECTORS, *KVSM_VARIANTS)
        fleet = _fleet(sizes, tmp)
        _warm_connectors(fleet, measured)
        steps = sizes.worker_steps
        warm_steps = max(2, steps // 5)
        idle_s = 1.0 if steps >= 200 else 0.5 if steps >= 50 else 0.2
        runs: dict[tuple[str, int], list[dict[str, Any]]] = {(c, n): [] for c in measured for n in
                                                             sizes.worker_inflight}
        idle: dict[str, list[tuple[float, float]]] = {c: [] for c in measured}
        for rep in range(repeat):
            for n in sizes.worker_inflight:
                for name in _rotated(measured, rep):
                    runs[(name, n)].append(_steady(fleet, name, f"r{rep}-{name}-{n}", n, steps, warm_steps))
            for name in _rotated(measured, rep):
                idle[name].append(_idle(fleet, name, idle_s))

        notes = {"upstream": "", "upstream-np": "upstream without NIXL's progress thread in the upstream column",
                 "kvsm": f"kvsm with num_threads={RAW_MT_THREADS} in the kvsm column, kvsm without in the upstream "
                         f"column"}

        def row(measure: str, unit: str, n: int, f: Any, target: Target = NO_TARGET,
                against: str = "upstream") -> Row:
            who = "kvsm-mt" if against == "kvsm" else "kvsm"
            return Row(f"{n} in flight: {measure}", unit, [f(r) for r in runs[(who, n)]],
                       [f(r) for r in runs[(against, n)]], target, notes[against])

        def core_per_step(r: dict[str, Any]) -> float:
            return sum(r["core_ns"]) / len(r["core_ns"]) / 1000

        def decode_cpu_per_transfer(r: dict[str, Any]) -> float:
            return r["cpu_s"] / max(1, r["done"]) * 1e6

        for n in sizes.worker_inflight:
            sec.rows += [
                row("start_load_kv + get_transfer_results per step", "µs", n, core_per_step,
                    Target("ratio_max", 1.0, "<= 1.0x")),
                row("start_load_kv + get_transfer_results per step", "µs", n, core_per_step, against="upstream-np"),
                row("every worker-side connector call of a step", "µs", n,
                    lambda r: sum(r["every_ns"]) / len(r["every_ns"]) / 1000),
                row("start_load_kv + get_transfer_results per transfer", "µs", n,
                    lambda r: sum(r["core_ns"]) / 1000 / max(1, r["done"])),
                row("transfers completed", "/s", n, lambda r: r["done"] / r["wall_s"]),
                row("decode process CPU per step, all threads", "ms", n, lambda r: r["cpu_s"] / r["steps"] * 1000),
                row("decode process CPU per transfer, all threads", "µs", n, decode_cpu_per_transfer),
                row("decode process CPU per transfer, all threads", "µs", n, decode_cpu_per_transfer,
                    against="upstream-np"),
                row("decode process CPU per transfer, all threads", "µs", n, decode_cpu_per_transfer,
                    against="kvsm"),
                row("prefill process CPU per transfer served, all threads", "µs", n,
                    lambda r: r["prefill_cpu_s"] / max(1, r["started"]) * 1e6),
            ]
        sec.rows += [
            Row("idle: decode process CPU", "CPU-s/s", [d for d, _ in idle["kvsm"]],
                [d for d, _ in idle["upstream"]], IDLE_TARGET),
            Row("idle: prefill process CPU", "CPU-s/s", [p for _, p in idle["kvsm"]],
                [p for _, p in idle["upstream"]], IDLE_TARGET),
            Row("idle: decode process CPU", "CPU-s/s", [d for d, _ in idle["kvsm"]],
                [d for d, _ in idle["upstream-np"]], IDLE_TARGET,
                "upstream without NIXL's progress thread in the upstream column"),
            Row("idle: decode process CPU", "CPU-s/s", [d for d, _ in idle["kvsm-mt"]],
                [d for d, _ in idle["kvsm"]], IDLE_TARGET, notes["kvsm"]),
        ]
        g = fleet.geometry
        sec.notes += [
            (f"Each connector's decode worker (kvsm: KVSMConnector, upstream: vLLM's NixlConnector; worker role, "
             f"registered KV caches of the tiny model: {LAYERS} layers x {g.num_blocks} blocks of {g.block_size} "
             f"tokens = {g.block_bytes // 1024} KiB per layer, torch tensors) runs in its own process against its "
             f"own prefill worker in another (for upstream, that engine's scheduler-side connector serves the side "
             f"channel). Each step does what vLLM's model runner does: bind the metadata, {FORWARD_S * 1000:.0f} ms "
             f"of forward pass (a sleep), start_load_kv, wait_for_save, get_transfer_results, "
             f"get_block_ids_with_load_errors, get_kv_connector_stats, clear. New requests "
             f"({BLOCKS_PER_TRANSFER} block each: {BLOCKS_PER_TRANSFER * LAYERS * g.block_bytes // 1024} KiB, "
             f"scattered remote blocks) refill the in-flight set to N every step. {steps} steps measured after "
             f"{warm_steps} unmeasured, then a drain."),
            ("'per step' and decode CPU rows cover the measured steps; 'per transfer' divides by the transfers "
             "completed in them; prefill CPU divides by every transfer of the run (warm-up and drain included). "
             "Upstream posts each read inside start_load_kv, where UCX's cma (on the CPU) also copies it; kvsm "
             "posts the step's metadata to its event loop, which claims, reads and completes off the model-runner "
             "thread (its CPU shows in the CPU rows, not in the per-step time)."),
            ("upstream runs as it ships: its NIXL agent starts NIXL's progress thread, which polls UCX without "
             "sleeping (a core per process; on these 2 cores the decode and prefill processes' pollers take most "
             "of the machine from everything else). 'upstream without NIXL's progress thread' is the same "
             "NixlConnector with its agent made as kvsm's is (enable_prog_thread=False): its code's own cost."),
            (f"idle: both processes of a pair, 0.3 s after a run, nothing in flight, the prefill's model-runner "
             f"thread blocked (as an idle engine's); {idle_s} s per repetition."),
            ("The prefill side pins requests as the decode side asks (ahead of use, over a ZMQ socket, outside the "
             "timed calls); every other pair's processes are frozen (SIGSTOP) during a measurement. Each transfer's "
             "bytes are checked against the source pattern for the first 64 transfers of every run."),
            *fleet.notes(),
        ]
        ok = True
    finally:
        if not ok:
            close_fleet()
    return sec


# --------------------------------------------------------------------------- 3. transfer


def bench_transfer(sizes: Sizes, repeat: int, tmp: Path) -> Section:
    sec = Section(3, "transfer", f"transfer throughput, {sizes.transfer_blocks:,} x {sizes.transfer_block_kib} KiB "
                                 f"permuted, kvsm vs upstream vs raw NIXL vs memcpy")
    try:
        fleet = _fleet(sizes, tmp)
        _warm_connectors(fleet, (*CONNECTORS, *KVSM_VARIANTS))
        n = sizes.transfer_blocks // LAYERS  # vLLM blocks, each one descriptor per layer
        total_bytes = sizes.transfer_blocks * sizes.transfer_block_kib * 1024
        methods = (*CONNECTORS, *KVSM_VARIANTS, *RAWS, "memcpy")
        counter = {"i": 0}

        def measure(method: str, trials: int, seed: int) -> list[float]:
            counter["i"] += 1
            run = f"t{counter['i']}-{method}"
            if method == "memcpy":
                reader = fleet.peers["raw-reader"]
                with fleet.only(reader):
                    r = reader.call("memcpy", timeout=300.0, trials=trials, n=n, seed=seed)
            else:
                reader, target = fleet.pair(method)
                with fleet.only(reader, target):
                    r = reader.call("transfer", timeout=300.0, run=run, trials=trials, n=n, seed=seed,
                                    poll_s=POLL_S, timeout_s=120.0)
            return [ns / 1e6 for ns in r["ns"]]

        for method in methods:  # first big transfer of each: page faults, UCX's caches
            measure(method, 1, 1)
        ms: dict[str, list[float]] = {m: [] for m in methods}
        every: dict[str, list[list[float]]] = {m: [] for m in methods}
        for rep in range(repeat):
            for method in _rotated(methods, rep):
                trials = measure(method, TRIALS, 1000 + rep * TRIALS)
                every[method].append(trials)
                ms[method].append(_median(trials))

        thr = {m: [total_bytes / 2**30 / (v / 1000) for v in values] for m, values in ms.items()}

        def ratio(a: str, b: str) -> list[float]:
            return [x / y for x, y in zip(thr[a], thr[b], strict=True)]

        sec.rows += [
            Row("one transfer, start to reported done", "ms", ms["kvsm"], ms["upstream"]),
            Row("throughput", "GiB/s", thr["kvsm"], thr["upstream"]),
            Row("throughput", "GiB/s", thr["kvsm"], thr["upstream-np"],
                note="upstream without NIXL's progress thread in the upstream column"),
            Row("throughput", "GiB/s", thr["kvsm"], thr["raw"],
                note="raw NIXL, prepared descriptor lists, agent made as kvsm's, in the upstream column"),
            Row("throughput", "GiB/s", thr["kvsm"], thr["raw-mt"],
                note=f"raw NIXL as above with {RAW_MT_THREADS} UCX backend threads (upstream's num_threads) in the "
                     f"upstream column"),
            Row("throughput", "GiB/s", thr["kvsm"], thr["memcpy"],
                note="memcpy (numpy.take in one process) in the upstream column"),
            Row("kvsm / raw NIXL throughput", "x", ratio("kvsm", "raw"), None, Target("min", 0.95, ">= 0.95x"),
                note="the same agent configuration"),
            Row("kvsm / raw NIXL throughput", "x", ratio("kvsm", "raw-mt"),
                note=f"raw NIXL with {RAW_MT_THREADS} UCX backend threads"),
            Row("throughput with num_threads", "GiB/s", thr["kvsm-mt"], thr["raw-mt"],
                note=f"kvsm with num_threads={RAW_MT_THREADS} against raw NIXL with as many, in the upstream column"),
            Row("kvsm with num_threads / the best raw NIXL throughput", "x",
                [k / max(r, m) for k, r, m in zip(thr["kvsm-mt"], thr["raw"], thr["raw-mt"], strict=True)], None,
                Target("min", 0.95, ">= 0.95x"), note=f"num_threads={RAW_MT_THREADS}; best of raw and raw-mt per "
                                                       f"repetition"),
            Row("upstream / raw NIXL throughput", "x", ratio("upstream", "raw"), note="upstream's, in the kvsm column"),
            Row("raw NIXL / memcpy throughput", "x", ratio("raw", "memcpy"), note="raw's, in the kvsm column"),
            Row("raw NIXL throughput, huge pages", "GiB/s", thr["raw-thp"],
                note="raw NIXL's, in the kvsm column: the same read between numpy buffers (madvise MADV_HUGEPAGE)"),
        ]
        g = fleet.geometry
        sec.notes += [
            (f"One request of {n:,} vLLM blocks x {LAYERS} layers = {sizes.transfer_blocks:,} blocks of "
             f"{g.block_bytes // 1024} KiB ({total_bytes / 2**20:.0f} MiB), read into local blocks 1..{n} from "
             f"remote blocks 1..{n} in a random order (a new one each transfer), between two processes. "
             f"kvsm / upstream: from bind_connector_metadata + start_load_kv to the get_transfer_results that "
             f"reports it (polled every {POLL_S * 1e3:.1f} ms with a full start_load_kv + get_transfer_results, as "
             f"vLLM steps); kvsm's time includes its claim round trip over the side channel. raw NIXL: "
             f"make_prepped_xfer + transfer + check_xfer_state (same polling) on a bare agent without progress "
             f"thread. memcpy: numpy.take of the same permuted blocks inside one process."),
            (f"kvsm's NIXL agent (and 'raw NIXL') has one UCX worker: the copy (UCX's cma, process_vm_readv) "
             f"runs in the thread that calls transfer(). NixlConnector asks for num_threads={RAW_MT_THREADS}, which "
             f"makes NIXL's UCX backend split a transfer over backend threads, using both cores here: see "
             f"'upstream without progress thread' and 'raw NIXL ... UCX backend threads'."),
            ("Every buffer is a torch tensor (4 KiB pages), as vLLM's KV caches and the connectors' caches here "
             "are. numpy's own large arrays are madvise(MADV_HUGEPAGE)d (this machine's THP mode is 'madvise') "
             "and UCX's cma (process_vm_readv) reads those about twice as fast: the 'huge pages' row."),
            (f"Median of {TRIALS} transfers per repetition; every transfer's destination is zeroed before and "
             f"checked after (each block must hold its source block's pattern). Other pairs frozen meanwhile."),
        ]
        sec.extra["ms_per_trial"] = every
    finally:
        close_fleet()  # the last user of the processes
    return sec
