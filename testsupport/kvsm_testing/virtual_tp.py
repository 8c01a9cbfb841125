"""A prefill engine and a decode engine of different tensor parallel sizes, on virtual time.

Like ``VirtualPair``, but each engine has one real ``WorkerHalf`` per rank:
``prefill_tp`` prefill workers, each answering for its own rank on the
engine's one side-channel port (over inproc ZMQ; rank 0 binds it and relays
the other ranks' requests to them: ``kvsm.handshake.relay``), and ``decode_tp`` decode
workers, each reading the prefill ranks its plan names (``kvsm.worker.tp_map``).
Every rank's ``InMemoryAgent`` holds blocks of its share of the model's
``kv_heads`` (heads-major: a block is its heads one after another), so a read
of the wrong heads, a missing read or one into the wrong place shows as wrong
bytes: ``holds`` compares every head of every local block with what the
prefill engine computed for that head.

A test plays vLLM on both engines: ``finish`` pins a request on every prefill
rank (as the scheduler's pin channel does), ``start`` starts it on every
decode rank, ``abort`` aborts it on some; ``sent`` and ``recving`` say what each
rank reported and when (virtual ns).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import orjson
import zmq

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import RecvAbort, RecvStart, SendFinish, SendStart, StepFacts
from kvsm.handshake import CompatInfo
from kvsm.lifecycle.clock import VirtualClock
from kvsm.runtime.group import DrivenLoops
from kvsm.transport.base import XferHandle
from kvsm.transport.memory import Fault, InMemoryAgent, InMemoryFabric
from kvsm.worker import WorkerHalf
from kvsm.worker.tp_map import heads_of
from kvsm_testing.virtual_pair import VirtualTime

MS = 1_000_000
S = 1_000_000_000
PORT = 5600
BLOCK_TOKENS = 16
PREFILL, DECODE = "prefill-tp", "decode-tp"


def head_bytes(head: int, block: int, size: int) -> bytes:
    """What prefill block ``block`` holds for global KV head ``head``."""
    seed = f"h{head}/b{block}/".encode()
    return (seed * (size // len(seed) + 1))[:size]


class TPPair(VirtualTime):
    """``prefill_tp`` prefill ranks and ``decode_tp`` decode ranks of a model with
    ``kv_heads`` KV heads (``replicated``: every rank holds them all, as MLA's latent)."""

    def __init__(self, prefill_tp: int, decode_tp: int, *, kv_heads: int = 2, replicated: bool = False,
                 head_bytes_each: int = 32, num_blocks: int = 32, log_dir: Path | None = None,
                 lease_s: float = 30.0) -> None:
        self.clock = VirtualClock()
        self.loops = DrivenLoops(self.clock, zmq.Context())
        self.fabric = InMemoryFabric(self.clock, latency_ns=200_000, fault_for=self._fault_for)
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.kv_heads, self.replicated = kv_heads, replicated
        self.unit = head_bytes_each
        self.num_blocks = num_blocks
        self.log_dir = log_dir
        self.log_paths: list[Path] = []
        self.fault_of: dict[tuple[str, int], Fault] = {}  # (decode req, prefill rank) -> fault of that read
        self.compat = CompatInfo(model="kvsm-virtual-tp", dtype="uint8", num_layers=1, num_kv_heads=kv_heads,
                                 head_size=head_bytes_each, block_size=BLOCK_TOKENS, kv_layout="heads-major")
        self.sent: list[dict[str, int]] = [{} for _ in range(prefill_tp)]
        self.recving: list[dict[str, int]] = [{} for _ in range(decode_tp)]
        self.failed: list[dict[str, int]] = [{} for _ in range(decode_tp)]
        self.local_of: dict[str, tuple[int, ...]] = {}
        self.remote_of: dict[str, tuple[int, ...]] = {}  # prefill req -> its blocks
        self.reads_of: dict[str, str] = {}  # decode req -> the prefill req it reads
        self._steps: dict[str, int] = {}
        self._next_block = 0
        self._closed = False
        share = "replicated" if replicated else "heads"
        self.prefill_agents = [self._agent(f"{PREFILL}#{k}", prefill_tp, k) for k in range(prefill_tp)]
        self.prefill: list[WorkerHalf | None] = [
            self._worker(PREFILL, "kv_producer", prefill_tp, k, share, lease_s) for k in range(prefill_tp)]
        for k, agent in enumerate(self.prefill_agents):
            self._fill(agent, prefill_tp, k)
        self.decode_agents = [self._agent(f"{DECODE}#{r}", decode_tp, r) for r in range(decode_tp)]
        self.decode = [self._worker(DECODE, "kv_consumer", decode_tp, r, share, lease_s) for r in range(decode_tp)]
        for k, w in enumerate(self.prefill):
            assert w is not None
            w.start(self.prefill_agents[k], self.compat)
        for r, w2 in enumerate(self.decode):
            w2.start(self.decode_agents[r], self.compat)
        self.run()

    # -- engines ----------------------------------------------------------------

    def heads_at(self, tp: int, rank: int) -> range:
        if self.replicated:
            return range(0, self.kv_heads)
        return range(*heads_of(rank, tp, self.kv_heads))

    def _agent(self, name: str, tp: int, rank: int) -> InMemoryAgent:
        return InMemoryAgent(self.fabric, name, self.num_blocks, self.unit * len(self.heads_at(tp, rank)))

    def _fill(self, agent: InMemoryAgent, tp: int, rank: int) -> None:
        for b in range(self.num_blocks):
            agent.write_block(b, b"".join(head_bytes(h, b, self.unit) for h in self.heads_at(tp, rank)))

    def _worker(self, engine_id: str, role: str, tp: int, rank: int, share: str, lease_s: float) -> WorkerHalf:
        cfg = KVSMConfig(
            engine_id=engine_id, kv_role=role, kv_buffer_device="cpu", side_channel_host=f"inproc:{engine_id}",
            side_channel_port=PORT, lease_s=lease_s, heartbeat_interval_s=lease_s / 6, handshake_timeout_s=1.0,
            transfer_timeout_s=2.0, peer_backoff_s=1.0, peer_backoff_max_s=16.0, notif_poll_interval_s=0.001,
            event_log_dir=None, backends=("memory",), tp_size=tp, dp_rank=0, pp_size=1, dcp_size=1,
            block_size=BLOCK_TOKENS, kv_load_failure_policy="fail", kv_heads=self.kv_heads, tp_share=share)
        log = None
        if self.log_dir is not None:
            path = self.log_dir / f"{engine_id}.rank{rank}.jsonl"
            path.unlink(missing_ok=True)
            self.log_paths.append(path)
            log = EventLog(path, role="worker", engine_id=engine_id, rank=rank, clock=self.clock,
                           pid=2_000_000 + len(self.log_paths))
        return WorkerHalf(cfg, rank, event_log=log, clock=self.clock, loop_options=self.loops.loop_options())

    def _stuck(self) -> str:
        return f"decode ranks: {[w.debug_state()['recv'] for w in self.decode]}"

    def _collect(self) -> None:
        now = self.now_ns
        for r, w in enumerate(self.decode):
            sent, recving, failed = w.take_results()
            w.take_invalid_blocks()
            assert not sent and failed <= recving
            for req in failed:
                self.failed[r].setdefault(req, now)
            for req in recving:
                self.recving[r].setdefault(req, now)
        for k, pw in enumerate(self.prefill):
            if pw is None:
                continue
            sent, recving, failed = pw.take_results()
            assert not recving and not failed
            for req in sent:
                self.sent[k].setdefault(req, now)

    # -- vLLM's part ------------------------------------------------------------

    def _submit(self, worker: WorkerHalf, key: str, **facts: list[Any]) -> None:
        step = self._steps[key] = self._steps.get(key, 0) + 1
        meta = StepFacts(step)
        for name, items in facts.items():
            getattr(meta, name).extend(items)
        worker.submit(meta)

    def finish(self, req: str, blocks: tuple[int, ...]) -> None:
        """The prefill engine finished ``req``: every rank pins ``blocks``."""
        self.remote_of[req] = blocks
        now = self.now_ns
        for k, w in enumerate(self.prefill):
            if w is not None:
                self._submit(w, f"p{k}", send_start=[SendStart(req)],
                             send_finish=[SendFinish(req=req, ok=True, block_ids=blocks, pinned_ns=now)])
        self._settle()

    def start(self, req: str, remote_req: str, ranks: Iterable[int] | None = None, push: bool = False) -> None:
        """vLLM allocated blocks for ``req`` on every decode rank (or ``ranks``);
        ``push``: the prefill ranks write them (transfer_mode push)."""
        remote = self.remote_of[remote_req]
        self.reads_of[req] = remote_req
        local = self.local_of.setdefault(req, self._blocks(len(remote)))
        for r in range(self.decode_tp) if ranks is None else ranks:
            self._submit(self.decode[r], f"d{r}", recv_start=[RecvStart(
                req=req, remote_engine=PREFILL, remote_req=remote_req, remote_host=f"inproc:{PREFILL}",
                remote_port=PORT, remote_tp_size=self.prefill_tp, remote_block_ids=remote, local_block_ids=local,
                num_tokens=len(remote) * BLOCK_TOKENS, awaited=True, push=push)])
        self._settle()

    def abort(self, req: str, ranks: Iterable[int]) -> None:
        for r in ranks:
            self._submit(self.decode[r], f"d{r}", recv_abort=[RecvAbort(req=req, awaited=True)])
        self._settle()

    def kill_prefill(self, rank: int) -> None:
        """``kill -9`` of the process of prefill rank ``rank``."""
        w = self.prefill[rank]
        assert w is not None
        w.loop.stop()
        self.fabric.kill(self.prefill_agents[rank].name)
        if w.log is not None:
            w.log.close()
        self.prefill[rank] = None

    def _blocks(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self._next_block, self._next_block + n))
        self._next_block += n
        assert self._next_block <= self.num_blocks, "test bug: out of decode blocks"
        return out

    # -- what arrived -----------------------------------------------------------

    def holds(self, req: str, rank: int) -> bool:
        """Decode rank ``rank``'s blocks of ``req`` hold, head by head, the prefill
        engine's bytes for the heads that rank holds."""
        agent = self.decode_agents[rank]
        heads = self.heads_at(self.decode_tp, rank)
        for lb, rb in zip(self.local_of[req], self.remote_of[self.reads_of[req]], strict=True):
            want = b"".join(head_bytes(h, rb, self.unit) for h in heads)
            if agent.read_block(lb) != want:
                return False
        return True

    def records(self, engine_id: str, rank: int) -> list[dict[str, Any]]:
        for w in (*self.decode, *self.prefill):
            if w is not None and w.log is not None:
                w.log.flush()
        path = next(p for p in self.log_paths if p.name == f"{engine_id}.rank{rank}.jsonl")
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

    def resources(self) -> list[dict[str, int]]:
        return [w.resources() for w in (*self.decode, *self.prefill) if w is not None]

    def _fault_for(self, handle: XferHandle) -> Fault:
        rank = int(handle.peer.rsplit("#", 1)[1]) if "#" in handle.peer else -1
        return self.fault_of.get((handle.tag, rank), Fault.NONE)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in (*self.decode, *self.prefill):
            if w is not None:
                w.shutdown()
        self.loops.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
