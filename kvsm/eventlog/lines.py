"""Reading event logs back as plain dicts, one per line, tolerating damage.

Why apart from ``kvsm.eventlog.reader``: these are the rules every line is
held to (``decode_line``), used on their own by tools and tests and, for the
lines that do not fit its typed records, by the reader's fast way. Every
damaged line is reported (``Problem``) by file and line number and reading
goes on.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kvsm.eventlog.schema import HEADER_FIELDS, SCHEMA_VERSION

__all__ = ["Problem", "ReadResult", "decode_line", "expand_paths", "iter_log", "read_logs"]

_HEADER = frozenset(HEADER_FIELDS)


@dataclass(frozen=True)
class Problem:
    """One damaged line (or, with ``line == 0``, a whole unreadable file)."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class ReadResult:
    """Records in file order (files in the order given), and what was wrong."""

    records: list[dict[str, Any]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """A directory stands for every ``*.jsonl`` in it, sorted by name."""
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            out.extend(sorted(q for q in path.glob("*.jsonl") if not q.is_dir()))
        else:
            out.append(path)
    return out


def iter_log(path: str | os.PathLike[str]) -> Iterator[dict[str, Any] | Problem]:
    """Yield each record (with ``_file`` and ``_line`` added) or a ``Problem``.

    A directory is read as its ``*.jsonl`` files. An unreadable file yields one
    ``Problem`` with line 0 and nothing else.
    """
    p = Path(path)
    if p.is_dir():
        try:
            with os.scandir(p):
                pass
        except OSError as e:
            yield Problem(str(path), 0, f"cannot list directory: {e.strerror or e}")
            return
        for q in expand_paths([p]):
            yield from iter_log(q)
        return
    name = str(path)
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed in the finally below
    except OSError as e:
        yield Problem(name, 0, f"cannot open: {e.strerror or e}")
        return
    lineno = 0
    try:
        for raw in f:
            lineno += 1
            yield decode_line(name, lineno, raw)
    except OSError as e:  # e.g. EISDIR on read, EIO on a dying disk
        yield Problem(name, 0 if lineno == 0 else lineno + 1, f"read error: {e.strerror or e}")
    finally:
        f.close()


def decode_line(name: str, lineno: int, raw: bytes) -> dict[str, Any] | Problem:
    """One line (with its newline, unless it is a file's unterminated last line)
    as a record tagged with ``_file``/``_line``, or the ``Problem`` with it."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if not raw.endswith(b"\n"):
            return Problem(name, lineno, f"truncated last line (no newline, {len(raw)} bytes): {e}")
        if not raw.strip():
            return Problem(name, lineno, "empty line")
        return Problem(name, lineno, f"not valid JSON: {e}")
    if type(rec) is not dict:
        return Problem(name, lineno, f"not a JSON object (a {type(rec).__name__})")
    if rec.get("schema") != SCHEMA_VERSION:
        if "schema" not in rec:
            return Problem(name, lineno, "missing header field 'schema'")
        return Problem(name, lineno, f"unsupported schema version {rec['schema']!r} (expected {SCHEMA_VERSION})")
    if not _HEADER <= rec.keys():
        missing = [k for k in HEADER_FIELDS if k not in rec]
        return Problem(name, lineno, f"missing header field(s): {', '.join(missing)}")
    rec["_file"] = name
    rec["_line"] = lineno
    return rec


def read_logs(paths: Iterable[str | os.PathLike[str]]) -> ReadResult:
    """Read every file (directories: their ``*.jsonl``); never raises on bad input."""
    result = ReadResult()
    records = result.records
    problems = result.problems
    append = records.append
    # Millions of fresh dicts that all survive make the cyclic GC rescan the
    # growing heap again and again (measured: 4x slower). They hold no cycles.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for path in paths:
            for item in iter_log(path):
                if type(item) is dict:
                    append(item)
                else:
                    problems.append(item)  # type: ignore[arg-type]
    finally:
        if gc_was_enabled:
            gc.enable()
    return result


# --- the typed fast path ----------------------------------------------------

# orjson reads an integer beyond 64 bits as a float, which replay then rejects
# as a malformed header (or an event's input as unbuildable); msgspec would
# keep it an int. Bounding the typed fields sends such a line down the dict
# path, where the old rules apply.
