"""Reading event logs back, tolerating what crashes and full disks leave.

Why: replay runs on logs of processes that may have died mid-write. Every
damaged line is reported by file and line number and reading goes on; the
caller (replay) decides what the damage means. Only the header keys and the
schema version are checked per record, which keeps reading well above
200k records/s.

Two ways in, one set of rules:

* ``iter_log`` / ``read_logs``: every line becomes a ``dict`` (orjson;
  ``kvsm.eventlog.lines``, re-exported here).
* ``scan_log`` (replay's way, about twice as fast): every line is decoded
  straight into a typed record (msgspec, no dict; header types, and for a
  lifecycle event its ``input`` as that event's struct, checked in C). A line
  that does not fit goes through ``iter_log``'s own rules (``decode_line``) and
  comes back as a ``dict`` or a ``Problem``, so the fast way never accepts a
  line the slow one would reject: it only sorts the well-formed majority out
  first.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin, get_type_hints

import msgspec
import orjson

from kvsm.eventlog.lines import Problem, ReadResult, decode_line, expand_paths, iter_log, read_logs
from kvsm.lifecycle.events import EVENT_TYPES, Event
from kvsm.lifecycle.table import EFFECTS, LIFECYCLES

__all__ = ["FileScan", "Problem", "ReadResult", "Record", "decode_line", "expand_paths", "input_dict", "iter_log",
           "read_back",
           "read_logs", "record_from_dict", "scan_log"]

_Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def _record_get(self: Any, name: str, default: Any = None) -> Any:
    attr = _ITEM_NAMES.get(name)
    if attr is None:
        return default
    value = getattr(self, attr)
    return input_dict(value) if attr == "input" else value


def _record_getitem(self: Any, name: str) -> Any:
    if name not in _ITEM_NAMES:
        raise KeyError(name)
    return _record_get(self, name)


class Record(msgspec.Struct, gc=False, rename={"file": "_file", "line": "_line"}):
    """One record of schema v1 with the fields replay reads, typed.

    Extra fields of a record (a ``log`` record's message fields, say) are not
    kept: replay reads the line again when it has to show one in full.
    ``file``/``line`` say where it was read (the dict form's ``_file``/``_line``).
    ``r["name"]`` and ``r.get("name")`` work as on the dict form, for callers
    written against it.

    Lines of a lifecycle event (``event`` names a trigger, ``req`` and
    ``lifecycle`` are strings, names are the table's) decode into the per-event
    variants below instead, whose ``input`` is that event's struct, already
    checked; a ``Record``'s own ``input`` is the plain object. ``input_dict``
    gives either as a dict.
    """

    schema: Literal[1]
    seq: _Int
    t_mono_ns: _Int
    t_wall_ns: _Int
    pid: _Int
    role: str
    engine_id: str
    rank: _Int
    kind: str
    req: str | None
    event: str
    src: str | None
    dst: str | None
    lifecycle: str | None = None
    input: dict[str, Any] = {}
    effects: tuple[str, ...] = ()
    blocks: tuple[_Int, ...] = ()
    violation: str | None = None
    stale: str = ""  # a declared stale input: why it no longer applies
    dropped: Any = None  # log_overflow
    clean: Any = None  # worker.shutdown
    live: Any = None  # worker.shutdown
    file: str = ""
    line: int = 0

    __getitem__ = _record_getitem
    get = _record_get


StreamKey = tuple[str, str, int, int]  # engine_id, role, rank, pid: one process's log
_STREAM_OF = attrgetter("engine_id", "role", "rank", "pid")

_ITEM_NAMES: dict[str, str] = {
    **{f: f for f in Record.__struct_fields__ if f not in ("file", "line")}, "_file": "file", "_line": "line"}
RECORD_FIELDS: tuple[str, ...] = tuple(f for f in Record.__struct_fields__ if f not in ("file", "line"))


def _bounded(tp: Any) -> Any:
    """``tp`` with every ``int`` in it bounded like ``_Int``."""
    if tp is int:
        return _Int
    if get_origin(tp) is tuple:
        return tuple[tuple(a if a is Ellipsis else _bounded(a) for a in get_args(tp))]  # type: ignore[misc]
    return tp


def _input_type(cls: type[Event]) -> type[Event]:
    """``cls`` as decoded from a record's ``input``: ``req`` is not in it (it is
    the record's), ints bounded. A subclass, so the callbacks see the same type.
    Never looser than ``event_from_record`` (the tests fuzz both): a line it
    rejects goes down the dict path, where ``event_from_record`` judges it."""
    hints = get_type_hints(cls)
    fields: list[Any] = [("req", str, "")]
    for f in msgspec.structs.fields(cls):
        if f.name == "req":
            continue
        tp = _bounded(hints[f.name])
        if tp is hints[f.name]:
            continue
        if f.required:
            fields.append((f.name, tp))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, tp, f.default))
        else:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
    return cast("type[Event]", msgspec.defstruct(f"Logged{cls.__name__}", fields, bases=(cls,), kw_only=True,
                                                 frozen=True, tag=cls.__struct_config__.tag, module=__name__))


# Names a lifecycle record uses, as literals: the decoder hands out one shared
# string object per name instead of a fresh one per record, which replay's
# passes read without a cache miss each (a million records: ~0.5 s).
_Lifecycle = Literal[tuple(sorted(LIFECYCLES))]  # type: ignore[valid-type]
_State = Literal[tuple(sorted({s for spec in LIFECYCLES.values() for s in spec.states}))]  # type: ignore[valid-type]
_Effect = Literal[tuple(sorted(EFFECTS))]  # type: ignore[valid-type]


def _variant(event: str, input_field: tuple[Any, ...], stream: StreamKey | None) -> type[Any]:
    """The ``Record`` of a lifecycle record whose ``event`` is ``event``, tagged
    by it: ``req`` a string, ``kind``, ``lifecycle``, states and effects names
    the table declares (anything else decodes as a plain ``Record``), and, given
    a ``stream``, that process's header values. The fields replay reads on every
    record come first (fewer cache lines)."""
    engine_id, role, rank, pid = (str, str, _Int, _Int) if stream is None else (
        Literal[stream[0]], Literal[stream[1]], Literal[stream[2]], Literal[stream[3]])
    fields: list[Any] = [
        ("kind", Literal["create", "transition", "violation"]),
        ("dst", _State | None),
        ("src", _State | None),
        ("effects", tuple[_Effect, ...], ()),  # type: ignore[valid-type]
        ("lifecycle", _Lifecycle),
        ("req", str),
        ("violation", str | None, None),
        ("stale", str, ""),
        ("blocks", tuple[_Int, ...], ()),
        input_field,
        ("seq", _Int),
        ("t_mono_ns", _Int),
        ("t_wall_ns", _Int),
        ("schema", Literal[1]),
        ("pid", pid),
        ("role", role),
        ("engine_id", engine_id),
        ("rank", rank),
        ("file", str, ""),
        ("line", int, 0),
    ]
    ns = {"event": event, "dropped": None, "clean": None, "live": None,
          "__getitem__": _record_getitem, "get": _record_get}
    return msgspec.defstruct(f"Record_{event}", fields, tag_field="event", tag=event, gc=False, kw_only=True,
                             rename={"file": "_file", "line": "_line"}, namespace=ns, module=__name__)


def _event_input(cls: type[Event]) -> tuple[Any, ...]:
    """The ``input`` field of an event's records: its struct, required where the
    event has required fields (a line without it goes the dict way, where
    rebuilding fails as it should), else defaulting to the all-defaults event
    (what rebuilding from no input gives)."""
    logged = _input_type(cls)
    if any(f.required for f in msgspec.structs.fields(cls) if f.name != "req"):
        return ("input", logged)
    return ("input", logged, logged())  # type: ignore[call-arg]  # req defaults to "" in the logged subclass


_EVENT_INPUTS = {tag: _event_input(cls) for tag, cls in EVENT_TYPES.items()}


def _typed_decoder(stream: StreamKey | None) -> Callable[[bytes], Any]:
    """Decode a line into its per-event record (``stream``: only a record of
    that process fits, so a file that decodes whole is that one process's log,
    and its names are shared objects too)."""
    # A create record's ``input`` is the object, if any (the runtime writes none).
    variants = [_variant("create", ("input", dict[str, Any] | None, None), stream)] + [
        _variant(tag, field_, stream) for tag, field_ in _EVENT_INPUTS.items()]
    return msgspec.json.Decoder(Union[tuple(variants)]).decode  # noqa: UP007


_decode_typed = _typed_decoder(None)
_stream_decoder = functools.lru_cache(maxsize=64)(_typed_decoder)
_decode_record = msgspec.json.Decoder(Record).decode
_LOG_MARKER = b'"kind":"log'  # as the writer spells it: log, log_start, log_overflow
_MACHINE_KINDS = frozenset({"create", "transition", "violation"})


def input_dict(value: Any) -> Any:
    """A record's ``input`` as the dict the line holds (a decoded event struct
    back to its fields; anything else as it is)."""
    if isinstance(value, Event):
        return value.inputs()
    return value


@dataclass
class FileScan:
    """One file's lines, in order: a typed record for a line that fits the types,
    a ``dict`` for a well-formed line that does not (``decode_line``'s rules
    accept it; the caller judges it), and what was wrong in ``problems``.
    ``plain`` lists the items that are ``Record`` (not a per-event variant):
    the decoder checked their header types but not that a lifecycle record has
    a string ``req`` and ``lifecycle``."""

    path: str
    items: list[Any] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    has_dicts: bool = False
    plain: list[Record] = field(default_factory=list)
    stream: StreamKey | None = None  # every record's (engine_id, role, rank, pid), when one and known


def scan_log(path: str | os.PathLike[str]) -> FileScan:
    """Read one log file into typed records (see the module docstring)."""
    name = str(path)
    scan = FileScan(name)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        # Cannot open, a directory, a read error part way: iter_log's rules
        # say which lines still count and how to report the rest.
        scan.has_dicts = True
        for item in iter_log(path):
            if type(item) is Problem:
                scan.problems.append(item)
            else:
                scan.items.append(item)
        return scan
    lines = data.split(b"\n")
    del data
    tail = lines.pop()  # b"" when the file ends with a newline
    if tail:
        lines.append(tail)
    # A process writes its own log: decode with its header values fixed (the
    # first line that decodes at all names them), so a file that decodes whole
    # is that one stream.
    stream: StreamKey | None = None
    for raw in lines[:8]:
        try:
            stream = _STREAM_OF(_decode_record(raw))
        except msgspec.DecodeError:
            continue
        break
    typed = _decode_typed if stream is None else _stream_decoder(stream)
    plain = scan.plain

    def decode(raw: bytes) -> Any:
        # A diagnostic line fits no per-event variant (its ``event`` is free):
        # tried there first, each would raise and restart the batch (~20 us a
        # line). One that merely mentions the marker decodes as a plain
        # ``Record``, listed in ``plain`` if it claims a machine kind.
        if _LOG_MARKER in raw:
            rec = _decode_record(raw)
            if rec.kind in _MACHINE_KINDS:
                plain.append(rec)
            return rec
        return typed(raw)

    items: list[Any] = []
    dirty = False
    n = len(lines)
    rest = iter(lines)
    while True:
        try:
            # extend() keeps what it decoded before a misfit raised; the misfit
            # itself was taken from ``rest``, which goes on after it.
            items.extend(map(decode, rest))
        except msgspec.DecodeError:  # includes ValidationError
            dirty = True
            lineno = len(items) + 1
            item = _misfit(scan, lineno, lines[lineno - 1], lineno == n and bool(tail))
            if stream is not None and item is not None and type(item) is not dict and _STREAM_OF(item) != stream:
                stream = None  # another process's record in this file
            items.append(item)
            continue
        break
    scan.stream = stream
    lineno = 0
    if not dirty:
        for rec in items:
            lineno += 1
            rec.file = name
            rec.line = lineno
        scan.items = items
        return scan
    kept: list[Any] = []
    for item in items:
        lineno += 1
        if item is None:
            continue
        if type(item) is not dict:
            item.file = name
            item.line = lineno
        kept.append(item)
    scan.items = kept
    return scan


def _misfit(scan: FileScan, lineno: int, raw: bytes, unterminated: bool) -> Any:
    """One line of a chunk that did not decode as a whole: a typed record, a
    ``Record``, a dict, or None (its ``Problem`` is in ``scan.problems``)."""
    try:
        return _decode_typed(raw)
    except msgspec.DecodeError:
        pass
    try:
        rec = _decode_record(raw)
    except msgspec.DecodeError:
        pass
    else:
        scan.plain.append(rec)
        return rec
    item = decode_line(scan.path, lineno, raw if unterminated else raw + b"\n")
    if type(item) is Problem:
        scan.problems.append(item)
        return None
    scan.has_dicts = True
    return item


def record_from_dict(rec: dict[str, Any]) -> Record:
    """The typed form of a dict record that passed the caller's own checks,
    field values as they are (no validation: the caller has done it)."""
    kw = {name: rec[name] for name in RECORD_FIELDS if name in rec}
    for name in ("effects", "blocks"):
        value = kw.get(name)
        if type(value) is list:
            kw[name] = tuple(value)
    return Record(**kw, file=rec.get("_file", ""), line=rec.get("_line", 0))


def read_back(r: Record, lines_of: dict[str, list[bytes] | None]) -> dict[str, Any] | None:
    """``r``'s line as it was written (every field), read again from its file
    (``lines_of`` caches each file's lines); None if the line is gone or changed."""
    if r.file not in lines_of:
        try:
            lines_of[r.file] = Path(r.file).read_bytes().split(b"\n")
        except OSError:
            lines_of[r.file] = None
    lines = lines_of[r.file]
    d: Any = None
    if lines is not None and 0 < r.line <= len(lines):
        try:
            d = orjson.loads(lines[r.line - 1])
        except orjson.JSONDecodeError:
            d = None
    if type(d) is not dict or d.get("seq") != r.seq or d.get("event") != r.event:
        return None
    return d
