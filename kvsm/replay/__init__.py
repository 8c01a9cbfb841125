"""Replay: fold event logs back into request lifecycles, check them, show them.

``tools/replay.py LOG...`` (also the ``kvsm-replay`` console script) merges the
logs of several processes of several engines and:

* lists requests with their final state and duration,
* shows one request's timeline across processes (``--request ID``; the id of
  either side: a decode request pulls in the prefill request it read from),
* reports violations: requests not terminal at the end of the log, illegal
  events the runtime recorded, blocks freed twice or never, reads after a
  lease expired, ``seq`` gaps (lost lines), dropped records, corrupt lines,
* re-applies each machine's recorded inputs to a fresh machine of its
  lifecycle, with the runtime's own step, and reports the first divergence
  from the recorded outcomes (for every lifecycle of ``LIFECYCLES``, or those
  passed to ``analyse(..., lifecycles=...)``),
* counts a request a clean stop closed (``closed_at_shutdown``: an offline
  script's end, SIGTERM, vLLM's engine shutdown) as terminal, and says so
  ("closed at shutdown": its summary line, a cause line); ``kill -9`` leaves
  no such record and still reads as a crash,
* honours an older clean shutdown: a process whose log ends with a ``worker.shutdown``
  record (``clean: true``) listing what was still live may leave exactly those
  requests, in exactly those states, mid-lifecycle: they are reported as *open
  at a clean shutdown* (information, not a violation). A request the record
  does not list, or lists in another state, and any record after it, are
  violations; a log without the record (a crash) keeps ``not_terminal_at_end``,
* names the cause of every failed, expired, closed or stuck request in one line, from
  the logs of both engines (``kvsm.replay.causes``: claim answers, the prefill
  scheduler's pin, its workers' receipt, a dead peer's reason...): information,
  not violations (a failed request is a legal outcome),
* exports a Perfetto / Chrome trace with one track per request (``--trace``),
* prints everything as JSON (``--json``).

The package, by concern: ``model`` (``Finding``, ``Machine``, ``Report``),
``fold`` (``analyse``: the one pass over each log, the block ledger, the
re-apply), ``checks`` (well-formed records, ``seq``, shutdowns, each machine's
end), ``causes`` (the rules) over ``evidence`` (what the logs hold for them,
indexed once), ``render`` (text, timeline, trace) and ``cli`` (``main``).

Speed (1M records in a few seconds; ``tools/bench.py --only replay``): lines
are decoded straight into typed ``Record`` structs (``kvsm.eventlog.reader``);
a file that is one process's log in ``seq`` order is grouped without sorting;
each stream is folded in one pass (machines, ``BlockLedger``, notes) and each
machine in that pass (re-apply, final state, the decode side's remote). The
re-apply is ``kvsm.lifecycle.machine``'s ``create_step``/``apply_step`` (the
tracker's own); only steps whose outcome the spec shows cannot depend on the
machine's data skip it (``kvsm.replay.fold``).

Exit status: 0 clean, 1 violations found, 2 unreadable input.
"""

from kvsm.replay.causes import CAUSE_STATES, NOTE_EVENTS, RULES, Cause, explain
from kvsm.replay.checks import _malformed, _record_ok
from kvsm.replay.cli import main
from kvsm.replay.fold import analyse
from kvsm.replay.model import (
    _MACHINE_KINDS,
    SHUTDOWN_EVENT,
    Finding,
    Machine,
    MachineKey,
    OpenAtShutdown,
    Report,
    StreamKey,
)
from kvsm.replay.render import chrome_trace, full_records, render_text, story, timeline

__all__ = [
    "CAUSE_STATES",
    "NOTE_EVENTS",
    "RULES",
    "SHUTDOWN_EVENT",
    "Cause",
    "Finding",
    "Machine",
    "MachineKey",
    "OpenAtShutdown",
    "Report",
    "StreamKey",
    "_MACHINE_KINDS",
    "_malformed",
    "_record_ok",
    "analyse",
    "chrome_trace",
    "explain",
    "full_records",
    "main",
    "render_text",
    "story",
    "timeline",
]
