"""A clean stop on every exit: an offline prefill process whose pins are still
live when it ends leaves a log replay reads as clean ("closed at shutdown"),
whether its script just ends or it gets SIGTERM. (``kill -9`` still reads as a
crash: tests/test_reliability_servers.py's killed prefill server, whose pins
replay finds left open, not_terminal_at_end.)

Three real prefill engines (tiny model, CPU; two single-process, as the test
harnesses run vLLM's offline pattern, and one with vLLM's default engine-core
process) start side by side, each generates with
``do_remote_decode`` (so its worker pins the blocks for a decode engine that
never comes), and each then ends one way. Each writes its own log directory.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from conftest import require

require("vllm")

from kvsm.replay import analyse, main
from kvsm_testing import build_tiny_model
from kvsm_testing.pd_pair import PDEngine, started
from kvsm_testing.ports import free_port_run

pytestmark = pytest.mark.slow

PROMPT = [10 + (7 * i) % 1000 for i in range(300)]  # two full blocks and a partial one


def _replay(logs: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``kvsm-replay``'s exit status and output for one engine's logs."""
    capsys.readouterr()
    rc = main([str(logs)])
    return rc, capsys.readouterr().out


def _send_finals(logs: Path) -> dict[str, str | None]:
    report = analyse(sorted(logs.glob("*.jsonl")))
    return {m.req: m.final_state for m in report.machines if m.lifecycle == "send"}


def test_a_script_s_end_and_sigterm_leave_a_clean_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = build_tiny_model()
    base = free_port_run(6)
    ways = ("end", "sigterm", "end-mp")
    # "end-mp": vLLM's default, the engine core in a process of its own. At the script's
    # end vLLM sends it SIGTERM and it drains while it has work, which a live pin is: the
    # connector closes its pins so that it exits before vLLM's wait is over and it is killed.
    mp = {"end-mp": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}}
    engines = started(*(PDEngine(f"prefill-{way}", "kv_producer", model=model, port=base + 2 * i,
                                 engine_id=f"prefill-{way}", log_dir=tmp_path / way, workdir=tmp_path / f"work-{way}",
                                 cpu=i % 2, env=mp.get(way), wait=False) for i, way in enumerate(ways)))
    by_way = dict(zip(ways, engines, strict=True))
    try:
        # Pins live: a decode request would read them within the lease (30 s); none comes.
        for engine in engines:
            params = engine.prefill_params([PROMPT])
            assert params[0]["remote_block_ids"], params
        for way, engine in by_way.items():
            if way not in mp:  # (the worker is in this process only without multiprocessing)
                state = engine.request({"op": "state"})["worker"]
                assert state is not None, way

        # (a) the script ends: no shutdown by hand, the interpreter's exit does it.
        assert by_way["end"].end() == 0, by_way["end"].tail()
        assert by_way["end-mp"].end() == 0, by_way["end-mp"].tail()
        # (b) SIGTERM while it waits for its next command.
        by_way["sigterm"].proc.send_signal(signal.SIGTERM)
        assert by_way["sigterm"].wait() == 128 + signal.SIGTERM, by_way["sigterm"].tail()
    finally:
        for engine in engines:
            engine.close()

    for way in ("end", "sigterm", "end-mp"):
        logs = tmp_path / way
        finals = _send_finals(logs)
        assert finals and set(finals.values()) == {"closed_at_shutdown"}, (way, finals)
        report = analyse(sorted(logs.glob("*.jsonl")))
        assert not report.findings, (way, [str(f) for f in report.findings])
        assert any(c.rule == "closed_at_shutdown" for c in report.causes), (way, report.causes)
        rc, out = _replay(logs, capsys)
        assert rc == 0, (way, out)
        assert "closed at shutdown" in out, (way, out)
        assert "no violations" in out, (way, out)
