"""Two ``kv_both`` engines used both ways: "forward" prefills on engine A and
decodes on engine B, "backward" the other way round (tests/test_pd_tp.py,
tests/test_pd_block_mismatch.py). One pair of engine starts serves both
directions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsm_testing.pd_pair import PDEngine

DIRECTIONS = ("forward", "backward")


class BothWays:
    """``engines``: (A, B); ``blocks``: their tokens per block; ``ids``: their
    engine ids (the names of their event logs under ``logs``)."""

    def __init__(self, engines: Sequence[PDEngine], blocks: tuple[int, int], ids: tuple[str, str],
                 logs: Path) -> None:
        self.engines = tuple(engines)
        self.blocks = blocks
        self.ids = ids
        self.logs = logs

    @staticmethod
    def way(direction: str) -> tuple[int, int]:
        """(prefill, decode) engine indices for ``direction``."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return (0, 1) if direction == "forward" else (1, 0)

    def prefill(self, direction: str) -> PDEngine:
        return self.engines[self.way(direction)[0]]

    def decode(self, direction: str) -> PDEngine:
        return self.engines[self.way(direction)[1]]

    def block_sizes(self, direction: str) -> tuple[int, int]:
        p, d = self.way(direction)
        return self.blocks[p], self.blocks[d]

    def decode_id(self, direction: str) -> str:
        return self.ids[self.way(direction)[1]]

    def records(self, pattern: str) -> list[dict[str, Any]]:
        """Every record of the event logs matching ``pattern`` (a partly written
        last line, which the writer thread may still be finishing, is skipped)."""
        out: list[dict[str, Any]] = []
        for f in sorted(self.logs.glob(pattern)):
            for line in f.read_text(errors="replace").splitlines():
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        return out

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
