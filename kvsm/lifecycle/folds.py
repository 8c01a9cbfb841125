"""The lifecycles' ``prepare`` callbacks: how each event's inputs fold into a
machine's data before the table's conditions read it (``table.PREPARE``).

Folds only: what a machine does next is decided in ``table.py`` (its
conditions and transitions), never here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvsm.lifecycle.data import PeerMachine, RequestMachine

# The lease's one margin: a read must complete this much inside the lease its
# claim granted (the prefill side's clock and timer may run a little ahead of
# ours), and reads go out ahead of their claims only until this much before the
# lease the params announced ends.
LEASE_MARGIN_NS = 500_000_000

# --- prepare: fold an event's inputs into the request's data ----------------


def _take_remote(m: RequestMachine, ev: Any, now_ns: int) -> None:
    m.remote_engine = ev.remote_engine
    m.remote_req = ev.remote_req
    m.num_tokens = ev.num_tokens
    m.claims_needed = max(1, ev.sources)
    m.push = ev.push


def _hold_blocks(m: RequestMachine, ev: Any, now_ns: int) -> None:
    m.block_ids = tuple(ev.block_ids)


def _pin_blocks(m: RequestMachine, ev: Any, now_ns: int) -> None:
    m.block_ids = tuple(ev.block_ids)
    m.reads_expected = max(m.reads_expected, ev.expected_reads)
    # The lease runs from the scheduler's decision, never from later: a worker
    # that hears of the pin late must not hold the blocks longer than promised.
    start = min(ev.pinned_ns, now_ns) if ev.pinned_ns > 0 else now_ns
    m.lease_deadline_ns = start + ev.lease_ns
    m.hold = ev.hold


def _end_lease_soon(m: RequestMachine, ev: Any, now_ns: int) -> None:
    """A claimed hold asked to release: no claim extends it any more, and it ends
    once the last claim's read can no longer come (a claim granted before now reads
    within a lease of it)."""
    m.lease_deadline_ns = min(m.lease_deadline_ns, now_ns + ev.lease_ns)


def _extend_lease(m: RequestMachine, ev: Any, now_ns: int) -> None:
    m.lease_deadline_ns = max(m.lease_deadline_ns, now_ns + ev.lease_ns)


def _count_read(m: RequestMachine, ev: Any, now_ns: int) -> None:
    """A decode rank is through (its read's notification, or its abandon). Each
    counts once; how many there are, each of them says (tensor parallel sizes may
    differ: several decode ranks read one prefill rank)."""
    m.reads_expected = max(m.reads_expected, ev.readers)
    _count(m, ev.reader)


def _count(m: RequestMachine, reader: str) -> None:
    if reader not in m.readers_done:
        m.readers_done = m.readers_done | {reader}
        m.reads_seen += 1


def _note_writer(m: RequestMachine, ev: Any, now_ns: int) -> None:
    """Push mode: a decode rank asked for its write; it is through once that write is over."""
    m.reads_expected = max(m.reads_expected, ev.readers)
    m.claimants = m.claimants | {ev.reader}


def _note_read(m: RequestMachine, ev: Any, now_ns: int) -> None:
    """A decode rank's read notification. A read posted ahead of its claim counts
    once that rank has claimed the request here; before (its claim still on the
    way), it is held until the claim comes, so that the claim finds the blocks
    pinned and is granted rather than told they are gone. Any other read was
    posted after its claim was granted: it counts at once."""
    m.reads_expected = max(m.reads_expected, ev.readers)
    if not ev.early or ev.reader in m.claimants:
        _count(m, ev.reader)
    else:
        m.reads_held = m.reads_held | {ev.reader}


def _note_claimant(m: RequestMachine, ev: Any, now_ns: int) -> None:
    """A decode rank claimed (or heartbeat) the request: its read, if one was
    held for this, counts now."""
    reader = ev.reader
    if not reader:  # (an older decode side names nobody: its claims always came first)
        return
    m.claimants = m.claimants | {reader}
    if reader in m.reads_held:
        m.reads_held = m.reads_held - {reader}
        _count(m, reader)


def _note_grant(m: RequestMachine, ev: Any, now_ns: int) -> None:
    """A prefill rank granted its claim. With several, the reads must complete
    within the earliest lease of all: the first grant's window, from the first claim."""
    bit = 1 << ev.source
    if m.claims_granted & bit:
        return  # a second answer of that rank: its first grant stands
    if not m.claims_granted or ev.claim_sent_ns + ev.lease_window_ns < m.claim_granted_ns + m.lease_window_ns:
        m.claim_granted_ns = ev.claim_sent_ns
        m.lease_window_ns = ev.lease_window_ns
    m.claims_granted |= bit


def _note_reads_done(m: RequestMachine, ev: Any, now_ns: int) -> None:
    m.reads_done_ns = now_ns


def _check_lease(m: RequestMachine, ev: Any, now_ns: int) -> None:
    # A read must complete this much inside the lease its claim granted (a
    # quarter of a short lease): the prefill side's clock and its lease timer
    # may run a little ahead of ours. Reads that completed before the grant came
    # are judged by when they completed.
    window = m.lease_window_ns
    margin = min(LEASE_MARGIN_NS, window // 4)
    done = m.reads_done_ns or now_ns
    m.late_ns = done - (m.claim_granted_ns + window - margin) if window > 0 else 0


def _note_late_reads(m: RequestMachine, ev: Any, now_ns: int) -> None:
    m.failure = f"lease_expired: the reads completed {m.late_ns / 1e9:.3f} s past the lease the claim granted"


def _note_failure(m: RequestMachine, ev: Any, now_ns: int) -> None:
    detail = (getattr(ev, "kind", None) or getattr(ev, "what", None) or getattr(ev, "where", None)
              or getattr(ev, "reason", None))
    m.failure = f"{ev.trigger}:{detail}" if detail else ev.trigger


def _take_agent(m: PeerMachine, ev: Any, now_ns: int) -> None:
    m.agent = ev.agent
    m.agent_readable = True
    m.needs_metadata = False
    _note_answer(m, ev, now_ns)


def _note_answer(m: PeerMachine, ev: Any, now_ns: int) -> None:
    m.unreachable = False
    m.probe = -1
    m.failures = 0
    m.backoff_ns = 0
    m.dead_until_ns = 0
    m.news_ns = max(m.news_ns, getattr(ev, "sent_ns", 0))


def _note_read_failed(m: PeerMachine, ev: Any, now_ns: int) -> None:
    """Its memory may have been re-registered: the next claim fetches its metadata
    again (reads still go to the agent meanwhile)."""
    m.needs_metadata = True


def _note_probe(m: PeerMachine, ev: Any, now_ns: int) -> None:
    m.probe = ev.probe


def _end_backoff(m: PeerMachine, ev: Any, now_ns: int) -> None:
    """The back-off ran out: the next claim probes it (fetching its metadata)."""
    m.unreachable = False


def _note_death(m: PeerMachine, ev: Any, now_ns: int) -> None:
    # Its agent is dropped (``drop_agent`` reads ``agent`` for that): no read goes to
    # it, and no message until its back-off ends or it answers.
    m.agent_readable = False
    m.needs_metadata = True
    m.unreachable = True
    m.probe = -1
    backoff = m.backoff_ns or ev.backoff_ns
    m.failures += 1
    m.last_error = f"{ev.reason}: {ev.why}" if ev.why else ev.reason
    m.dead_until_ns = now_ns + backoff
    m.news_ns = now_ns
    m.backoff_ns = min(backoff * 2, ev.backoff_max_ns)


PREPARE: Mapping[str, Callable[[Any, Any, int], None]] = {
    "take_remote": _take_remote,
    "hold_blocks": _hold_blocks,
    "pin_blocks_data": _pin_blocks,
    "extend_lease_data": _extend_lease,
    "end_lease_soon": _end_lease_soon,
    "count_read": _count_read,
    "note_read": _note_read,
    "note_writer": _note_writer,
    "note_claimant": _note_claimant,
    "note_reads_done": _note_reads_done,
    "note_failure": _note_failure,
    "note_grant": _note_grant,
    "check_lease": _check_lease,
    "note_late_reads": _note_late_reads,
    "take_agent": _take_agent,
    "note_answer": _note_answer,
    "note_death": _note_death,
    "note_read_failed": _note_read_failed,
    "end_backoff": _end_backoff,
    "note_probe": _note_probe,
}
