"""Decode-to-prefill reuse on real engines: multi-turn conversations over an
offline pair with ``bidirectional_kv_xfer``.

Two vLLM engines (tiny local model, CPU, a process each, both ``kv_both``):
each turn's prefill leg goes with the previous turn's decode answer's
``kv_transfer_params`` (as a router forwards them), so the prefill engine
reads the conversation so far from the decode engine's hold and computes only
the new tokens; the decode engine then reads back only what it lacks. Every
turn's output must equal a single engine's (the decode engine itself, its
prefix cache salted apart); the prefill engine's cached tokens say what came
from the hold; the blocks that arrived are byte for byte the held ones;
corrupting a hold breaks the output. Then the faults: a hold released under
the holds' budget (the next turn recomputes, right, and replay names why), a
hold's time to live, a prefill engine killed while it reads a hold and a
decode engine killed under a conversation. Nothing is held afterwards and
replay finds no violation.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import require

require("vllm")

from kvsm.replay import analyse
from kvsm_testing import build_tiny_model
from kvsm_testing.pd_pair import PDEngine, started
from kvsm_testing.ports import free_port_run
from kvsm_testing.reliability import wait_until

pytestmark = pytest.mark.slow

BLOCK = 32
ANSWER = 60  # tokens generated per turn
NEW = 20  # the client's new tokens per turn
TTL_S = 8.0
BUDGET = 14  # blocks all holds may keep on the decode engine
BIDIRECTIONAL = {"bidirectional_kv_xfer": True, "kv_load_failure_policy": "recompute"}
DECODE_EXTRA = {**BIDIRECTIONAL, "decoder_kv_blocks_ttl": TTL_S, "decoder_kv_hold_blocks": BUDGET,
                "kv_lease_duration": 4}
PREFILL_EXTRA = {**BIDIRECTIONAL, "handshake_timeout": 2}
RNG = random.Random(20261206)


def _tokens(n: int) -> list[int]:
    return [RNG.randrange(10, 1100) for _ in range(n)]


def _engine(name: str, engine_id: str, port: int, cpu: int, extra: dict[str, Any], tmp: Path) -> PDEngine:
    return PDEngine(name, "kv_both", model=build_tiny_model(), port=port, engine_id=engine_id, log_dir=tmp / "logs",
                    workdir=tmp, cpu=cpu, wait=False, extra=extra, llm_kwargs={"block_size": BLOCK},
                    max_model_len=1024)


class Conversation:
    """One client's turns: the prompt so far and the decode engine's last hold."""

    def __init__(self, name: str, first: int) -> None:
        self.name = name
        self.prompt = _tokens(first)
        self.hold: dict[str, Any] | None = None
        self.turns = 0


class Pair:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.ports = free_port_run(6)
        self.prefill, self.decode = started(
            _engine("prefill", "prefill-h", self.ports, 0, PREFILL_EXTRA, tmp),
            _engine("decode", "decode-h", self.ports + 2, 1, DECODE_EXTRA, tmp))
        self.killed: set[str] = set()

    def turn(self, conv: Conversation, *, check: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """One turn through the pair (prefill leg with the last hold's params, then the
        decode leg with the prefill's); the output checked against the single engine."""
        prompt = list(conv.prompt)
        (pout,) = self.prefill.generate([prompt], 1, [dict(conv.hold) if conv.hold else {"do_remote_decode": True}])
        params = dict(pout["kv_transfer_params"])
        params.pop("remote_prefill_cached_tokens", None)
        (dout,) = self.decode.generate([prompt], ANSWER, [params])
        if check:
            (ref,) = self.decode.generate([prompt], ANSWER, cache_salt=f"ref-{conv.name}-{conv.turns}")
            assert pout["token_ids"][0] == ref["token_ids"][0], f"{conv.name} turn {conv.turns}: prefill's token"
            assert dout["token_ids"] == ref["token_ids"], f"{conv.name} turn {conv.turns}"
        conv.hold = dout["kv_transfer_params"]
        conv.prompt = prompt + dout["token_ids"] + _tokens(NEW)
        conv.turns += 1
        return pout, dout

    def sched(self, engine: PDEngine) -> dict[str, int]:
        return engine.request({"op": "state"})["scheduler"]

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = Pair(tmp_path_factory.mktemp("holds"))
    try:
        yield p
    finally:
        p.close()


def _held_tokens(pair: Pair, conv: Conversation) -> int:
    """Tokens of the conversation's next prompt that the prefill engine may read
    from the hold (its full blocks), beyond what the prefill engine has itself."""
    assert conv.hold is not None
    return int(conv.hold["remote_num_tokens"])


def _records(logs: Path, pattern: str) -> list[dict[str, Any]]:
    out = []
    for f in logs.glob(pattern):
        data = f.read_text()
        out += [json.loads(line) for line in data[:data.rfind("\n") + 1].splitlines() if line.strip()]
    return out


def test_four_turns_read_the_conversation_from_the_decode_engine(pair: Pair) -> None:
    """Each turn's prefill reads the held conversation (its answer included, which
    the prefill engine never computed) and computes only the new tokens; every
    output is the single engine's; the holds never pass their budget."""
    conv = Conversation("a", 100)
    pout, _ = pair.turn(conv)
    assert pout["num_cached_tokens"] == 0
    for _ in range(3):
        held = _held_tokens(pair, conv)
        hold_req = conv.hold["remote_request_id"] if conv.hold else ""
        assert conv.hold and conv.hold["do_remote_decode"] and conv.hold["remote_engine_id"] == "decode-h"
        pout, dout = pair.turn(conv)
        # The prefill engine's prompt came from the hold, but the last token and the new ones.
        assert pout["num_cached_tokens"] == held, (pout["num_cached_tokens"], held)
        # The decode engine has the conversation itself: it reads only the new blocks.
        assert dout["num_cached_tokens"] == len(conv.prompt) - ANSWER - NEW
        assert pair.sched(pair.decode)["held_blocks"] <= BUDGET
        # The hold read was released by the read (not by its time to live).
        wait_until(lambda req=hold_req: req not in pair.decode.request({"op": "state"})["worker"]["send"], 5,
                   f"hold {hold_req} released by the prefill engine's read")


def test_arrived_blocks_are_the_held_ones_and_a_corrupted_hold_breaks_the_output(pair: Pair) -> None:
    """Byte for byte: what the prefill engine received is what the decode engine
    held. Then a hold overwritten before the next turn reads it: the output is no
    longer the single engine's (the comparison tells a right transfer from a wrong one)."""
    conv = Conversation("b", 150)
    pair.turn(conv)
    pair.prefill.request({"op": "watch_arrivals"})
    assert conv.hold is not None
    held_ids = conv.hold["remote_block_ids"][0]
    (held_digests,) = pair.decode.request({"op": "digest", "block_ids": [held_ids]})["digests"]
    pair.turn(conv)
    arrivals = pair.prefill.request({"op": "arrivals"})["arrivals"]
    assert len(arrivals) == 1, arrivals.keys()
    (arrived,) = next(iter(arrivals.values()))
    # The prefill engine had the first turn's prompt blocks itself: the rest arrived.
    local = 150 // BLOCK
    assert [d for d in arrived if d][-len(held_ids) + local:] == held_digests[local:]
    # Corrupt the held blocks past the prefill engine's own prefix, then take the turn.
    assert conv.hold is not None
    held_ids = conv.hold["remote_block_ids"][0]
    pair.decode.request({"op": "corrupt", "block_ids": held_ids[local + 2:], "seed": 3})
    prompt = list(conv.prompt)
    (ref,) = pair.decode.generate([prompt], ANSWER, cache_salt="ref-b-corrupt")
    _, dout = pair.turn(conv, check=False)
    assert dout["token_ids"] != ref["token_ids"]


def test_a_hold_released_under_the_budget_is_recomputed_right_and_replay_names_why(pair: Pair) -> None:
    """Turn 3's hold is released because another conversation's hold pushed the
    holds over decoder_kv_hold_blocks: turn 3 computes its prompt (right), and
    replay's cause says the hold was released under memory pressure."""
    conv, other = Conversation("c", 100), Conversation("d", 220)
    pair.turn(conv)
    pair.turn(conv)  # turn 2: its hold (8 blocks) waits for turn 3
    assert conv.hold is not None
    released = conv.hold["remote_request_id"]
    pair.turn(other)  # 9 more blocks: over the budget of 14, the oldest goes
    wait_until(lambda: released not in pair.decode.request({"op": "state"})["worker"]["send"], 5,
               f"hold {released} released under the budget")
    assert pair.sched(pair.decode)["held_blocks"] <= BUDGET
    local = (len(conv.prompt) - ANSWER - NEW) // BLOCK * BLOCK  # turn 2's prompt blocks: the prefill engine's own
    pout, _ = pair.turn(conv)  # turn 3: recomputed
    assert pout["num_cached_tokens"] <= local
    pout, _ = pair.turn(conv)  # turn 4 reads turn 3's hold again
    assert pout["num_cached_tokens"] > local
    decode_sched = _records(pair.logs, "decode-h.scheduler.*.jsonl")
    why = [r for r in decode_sched if r.get("req") == released and r.get("event") == "release_decided"]
    assert why and "memory pressure" in why[0]["input"]["reason"], why
    # The cause line, from both engines' logs as they stand.
    report = analyse(sorted(pair.logs.glob("*.jsonl")))
    causes = [c for c in report.causes if c.engine_id == "prefill-h" and "released under memory pressure" in c.line]
    assert causes, [c.line for c in report.causes]
    assert "held tokens recomputed here" in causes[0].line and released in causes[0].line


def test_holds_end_with_their_time_to_live_and_every_block_comes_back(pair: Pair) -> None:
    """The conversations above left their last holds: each ends unread, at its
    time to live or under the budget; the decode engine holds nothing, every
    block is free again."""
    def drained() -> dict[str, Any] | None:
        state = pair.decode.request({"op": "state"})
        return state if not state["worker"]["send"] else None

    state = wait_until(drained, TTL_S + 10, "every hold on the decode engine's worker to end")
    # The four conversations' last holds: the budget released the older ones as the
    # next came, the last ran out its time to live.
    ended = state["stats"]["holds_ended"]
    assert ended.get("expired", 0) >= 1 and ended.get("released", 0) >= 1, ended
    # vLLM takes the blocks back at its next step, which the next request makes.
    pair.decode.generate([_tokens(5)], 1)
    state = pair.decode.request({"op": "state"})
    sched = state["scheduler"]
    assert not sched["held"] and not sched["hold_releasing"] and not sched["held_blocks"], sched
    assert state["requests"] == 0  # vLLM keeps no finished request for its blocks
    wait_until(lambda: any(r.get("dst") == "hold_expired" for r in _records(pair.logs, "decode-h.worker.*.jsonl")),
               5, "the decode worker's log to record the hold's expiry")


def test_a_prefill_engine_killed_while_it_reads_a_hold(pair: Pair) -> None:
    """The prefill engine dies right after it claimed a hold (its read in flight or
    done): the decode engine frees the hold within its bounds and serves on."""
    conv = Conversation("e", 180)
    pair.turn(conv)
    assert conv.hold is not None
    hold_req = conv.hold["remote_request_id"]
    proc = pair.prefill.proc
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"op": "generate", "prompts": [conv.prompt], "max_tokens": 1,
                                 "params": [conv.hold]}) + "\n")
    proc.stdin.flush()

    def claimed() -> bool:
        return any(r.get("req") == hold_req and r.get("event") == "heartbeat"
                   for r in _records(pair.logs, "decode-h.worker.*.jsonl"))
    wait_until(claimed, 10, f"the prefill engine's claim of hold {hold_req}", interval=0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    pair.killed.add("prefill-h")
    wait_until(lambda: hold_req not in pair.decode.request({"op": "state"})["worker"]["send"], TTL_S + 10,
               f"hold {hold_req} freed after its reader died")
    # A fresh prefill engine; the decode engine serves the conversation on.
    pair.prefill.close()
    (pair.prefill,) = started(_engine("prefill2", "prefill-h2", pair.ports + 4, 0, PREFILL_EXTRA, pair.tmp))
    conv.hold = None  # (the hold is gone: the turn computes its prompt)
    pair.turn(conv)
    pair.turn(conv)


def test_a_decode_engine_killed_under_a_conversation(pair: Pair) -> None:
    """The decode engine dies holding the conversation: the next turn's prefill
    cannot read the hold and computes its prompt; its first token is still the
    single engine's, and replay of the surviving engine finds no violation."""
    conv = Conversation("f", 120)
    pair.turn(conv)
    (ref,) = pair.decode.generate([list(conv.prompt)], 1, cache_salt="ref-f-1")
    pair.decode.proc.send_signal(signal.SIGKILL)
    pair.decode.proc.wait(10)
    pair.killed.add("decode-h")
    started_at = time.monotonic()
    assert conv.hold is not None
    (pout,) = pair.prefill.generate([conv.prompt], 1, [conv.hold])
    assert pout["token_ids"] == ref["token_ids"]
    assert pout["num_cached_tokens"] == 120 // BLOCK * BLOCK  # its own first turn's blocks: nothing read
    assert time.monotonic() - started_at < 10
    pair.prefill.close()  # a clean stop: its log ends with its shutdown
    report = analyse(sorted(pair.logs.glob("*.jsonl")))
    survivors = [f for f in report.findings if f.engine_id == "prefill-h2"]
    assert not survivors, [str(f) for f in survivors]
    failed = [c for c in report.causes if c.engine_id == "prefill-h2" and c.lifecycle == "recv"]
    assert len(failed) == 1, [c.line for c in report.causes]
