"""The inputs that move a request's lifecycle: one typed struct per trigger.

Events are facts that happened (a scheduler hook call, a handshake reply, a
NIXL completion, a timer firing), named in the past tense where English
allows. They are msgspec structs tagged by their trigger name, so the event
log records the exact input and replay decodes it back into the same type
(Temporal's lesson: record inputs, not only outcomes).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import msgspec.structs


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="trigger"):
    """Base of every lifecycle input. ``req`` is the local request id."""

    req: str

    @property
    def trigger(self) -> str:
        return type(self).__struct_config__.tag  # type: ignore[return-value]

    def inputs(self) -> dict[str, Any]:
        """The event's own fields, without ``req`` (which every record has)."""
        fields = msgspec.structs.asdict(self)
        del fields["req"]
        return fields


# --- receiving side (decode engine, do_remote_prefill) ----------------------


class Matched(Event, frozen=True, tag="matched"):
    """The scheduler found remote tokens to load for this request."""

    num_tokens: int
    remote_engine: str = ""
    remote_req: str = ""
    remote_host: str = ""
    remote_port: int = 0
    remote_blocks: int = 0
    # Not folded, and 0 from this version on: the params' expiry is advisory (the
    # worker reads it only to hold early reads back), the claim's answer decides the
    # lease (``HandshakeOk.lease_window_ns``). Kept so older logs decode as written.
    remote_expiry_ns: int = 0
    # Prefill ranks whose claims must all be granted before the reads (tensor
    # parallel sizes that differ: see kvsm.worker.tp_map), and the plan in words.
    sources: int = 1
    plan: str = ""
    # Block sizes differ between the engines: how the blocks are paired, in words.
    segments: str = ""
    # transfer_mode "push": the prefill workers write the blocks into ours.
    push: bool = False


class Allocated(Event, frozen=True, tag="allocated"):
    """vLLM allocated local blocks the remote KV will be written into."""

    block_ids: tuple[int, ...] = ()
    num_external_tokens: int = 0
    # Several KV cache groups: that many of ``block_ids`` belong to each, in turn
    # (empty: one group). Logged, so replay shows the blocks of each group.
    group_sizes: tuple[int, ...] = ()
    # Every prefill worker it reads from is known and readable now: the reads may
    # be posted at once, beside the claims, instead of after their answers.
    early: bool = False


class HandshakeOk(Event, frozen=True, tag="handshake_ok"):
    """The prefill side granted the claim: its blocks stay pinned for
    ``lease_window_ns`` from ``claim_sent_ns`` (when the claim left), which is
    what decides later whether the reads completed in time."""

    remote_engine: str = ""
    claim_sent_ns: int = 0
    lease_window_ns: int = 0
    source: int = 0  # which of the request's prefill ranks granted it (its index in the plan)


class ReadsPosted(Event, frozen=True, tag="reads_posted"):
    """NIXL READs for this request were posted; they may now write our blocks."""

    num_blocks: int = 0
    num_descs: int = 0


class NothingToRead(Event, frozen=True, tag="nothing_to_read"):
    """Every block was a local prefix hit: only the prefill side is notified."""


class AllReadsDone(Event, frozen=True, tag="all_reads_done"):
    """Every posted read completed successfully."""

    num_bytes: int = 0


class WritesAsked(Event, frozen=True, tag="writes_asked"):
    """Push mode: every prefill worker was asked to write the request's blocks
    into ours; none may write after ``deadline_wall_ns`` (wall clock), by when
    whatever was not written is known never to be."""

    num_blocks: int = 0
    deadline_wall_ns: int = 0


class WritesLanded(Event, frozen=True, tag="writes_landed"):
    """Push mode: every prefill worker's write completed (its NIXL notification
    came with it): our blocks hold the remote KV."""

    num_bytes: int = 0


class WritesStopped(Event, frozen=True, tag="writes_stopped"):
    """Push mode, a request that gave up: no prefill worker can write into its
    blocks any more (``why``: each write landed or failed, the writer refused or
    is gone, or the deadline every write was bound by passed)."""

    why: str = ""


class Error(Event, frozen=True, tag="error"):
    """A failure that ends the request; ``kind`` is a stable name for metrics."""

    kind: str
    detail: str = ""
    # The failure itself shows the peer is gone (a read ended in a disconnect):
    # nobody is left to tell that we will not read.
    peer_gone: bool = False
    # The answer to one of the request's claims (refused, or its blocks gone): it
    # fails the request only while its claims are out (the table's ``answers_a_claim``).
    claim: bool = False


class Timeout(Event, frozen=True, tag="timeout"):
    """A timer for this request fired; ``what`` names the timer."""

    what: str


class PeerDead(Event, frozen=True, tag="peer_dead"):
    """The remote engine this request depends on is known to be dead.
    ``reason``: how it was found out (refused: nothing listens; silent: no
    answer in time; known_dead: found dead earlier, within its back-off)."""

    peer: str
    reason: str = ""


class InternalError(Event, frozen=True, tag="internal_error"):
    """kvsm itself failed handling this request (a bug or an unexpected library
    error caught by the loop): the request fails, every other one goes on."""

    where: str
    detail: str = ""


class Abort(Event, frozen=True, tag="abort"):
    """vLLM finished the request before the connector was done with it."""


class ReadsQuiesced(Event, frozen=True, tag="reads_quiesced"):
    """No posted read can write into this request's blocks any more.
    ``completed``: how many of them completed (each carried its notification
    to the prefill side, which then needs no abandon)."""

    completed: int = 0


# --- sending side (prefill engine, do_remote_decode) ------------------------


class FinishedOk(Event, frozen=True, tag="finished_ok"):
    """Prefill finished normally: the blocks are pinned for the decode side.
    ``pinned_ns``: when the scheduler pinned them (the lease runs from then;
    0: from this event); ``via``: how the worker heard of it."""

    block_ids: tuple[int, ...] = ()
    expected_reads: int = 1
    lease_ns: int = 30_000_000_000
    pinned_ns: int = 0
    via: str = ""
    # A decode engine's finished request held for its conversation's next turn
    # (bidirectional_kv_xfer): its lease is the hold's time to live.
    hold: bool = False


class FinishedAbnormally(Event, frozen=True, tag="finished_abnormally"):
    """Prefill ended by length cap, error or stop before the KV was usable."""

    reason: str = ""


class Heartbeat(Event, frozen=True, tag="heartbeat"):
    """The decode side is still coming (a claim, or a heartbeat for a request it
    holds): extend the lease. ``reader``: the decode rank that said so."""

    lease_ns: int = 30_000_000_000
    reader: str = ""


class ReadNotif(Event, frozen=True, tag="read_notif"):
    """One decode reader says it has finished reading our blocks."""

    reader: str = ""
    readers: int = 1  # decode ranks that read (or tell) this rank, the reader says
    early: bool = False  # the read was posted ahead of its claim (counted once the claim came)
    # For a request this worker had not heard of: the early inputs already waiting
    # (the table refuses this one at MAX_EARLY_INPUTS); 0 otherwise.
    early_waiting: int = 0


class WriteAsked(Event, frozen=True, tag="write_asked"):
    """Push mode: a decode rank (``reader``, one of ``readers``) asked this worker
    to write the pinned blocks into its own, by ``deadline_wall_ns`` (wall clock)."""

    reader: str
    readers: int = 1
    num_blocks: int = 0
    deadline_wall_ns: int = 0


class StreamAsked(Event, frozen=True, tag="stream_asked"):
    """Streamed push: a decode rank (``reader``, one of ``readers``) asked this
    worker to write each layer of the request into its blocks as it is computed,
    by ``deadline_wall_ns`` (wall clock)."""

    reader: str
    readers: int = 1
    num_blocks: int = 0
    deadline_wall_ns: int = 0


class StreamClaimed(Event, frozen=True, tag="stream_claimed"):
    """Streamed push: a decode rank claimed (or heartbeat) the request by its join
    key, possibly before its prefill finished here."""

    lease_ns: int = 30_000_000_000
    reader: str = ""


class StreamJoined(Event, frozen=True, tag="stream_joined"):
    """Streamed push: the machine named by a join key (an input by the key that came
    before this worker knew it) meets the prefill request the key names, ``joined``."""

    joined: str


class StreamPreempted(Event, frozen=True, tag="stream_preempted"):
    """Streamed push: vLLM preempted the prefill and freed its blocks (at ``at_ns``
    at the latest, the loop's clock); it computes the request again later, into
    other blocks. ``unsure``: the decode ranks with a write from the freed blocks
    not seen over before then (the worker's transport check), whose bytes may be
    another request's; ``notified``: those of them whose write in question carried
    the landed notification (the rank may take the bytes for its KV already)."""

    at_ns: int = 0
    unsure: tuple[str, ...] = ()
    notified: tuple[str, ...] = ()


class WriteDone(Event, frozen=True, tag="write_done"):
    """Push mode: the write to ``reader`` is over (``ok``: completed, its
    notification sent with it; else failed, ``detail`` says why, or cancelled at
    its deadline): nothing of it is in flight any more."""

    reader: str
    readers: int = 1
    ok: bool = True
    detail: str = ""


class LeaseExpired(Event, frozen=True, tag="lease_expired"):
    """Nobody read the pinned blocks in time; they are freed."""


class RemoteAbandoned(Event, frozen=True, tag="remote_abandoned"):
    """The decode side says it will never read (it aborted or failed early)."""

    reason: str = ""
    reader: str = ""
    readers: int = 1
    early_waiting: int = 0  # as ReadNotif's


class ReleaseAsked(Event, frozen=True, tag="release_asked"):
    """The decode engine's scheduler releases a hold (its holds went over their
    budget: the oldest go first). A hold no reader claimed is freed at once; a
    claimed one once its read is in, or its last claim's lease is over.
    ``lease_ns``: how long a claim granted before now may still read."""

    reason: str = ""
    lease_ns: int = 30_000_000_000


class AbandonExpired(Event, frozen=True, tag="abandon_expired"):
    """An early abandon waited a lease for its prefill to finish here, in vain."""


# --- peers (a decode worker's view of each prefill worker it reads from) ----
# ``req`` is the peer's key, ``engine@address``.


class AgentAdded(Event, frozen=True, tag="agent_added"):
    """The peer's NIXL metadata was loaded: reads can be posted to ``agent``."""

    agent: str
    engine: str = ""
    address: str = ""


class Answered(Event, frozen=True, tag="answered"):
    """The peer answered a claim sent at ``sent_ns``: it is alive."""

    sent_ns: int = 0


class Died(Event, frozen=True, tag="died"):
    """The peer is found dead (``reason``: refused, silent, disconnected,
    unsettled). ``sent_ns``: when the message that found it out was sent (0:
    not a message), so news older than what is known changes nothing.
    ``backoff_ns``/``backoff_max_ns``: the configured back-off."""

    reason: str
    why: str = ""
    sent_ns: int = 0
    backoff_ns: int = 1_000_000_000
    backoff_max_ns: int = 30_000_000_000


class ProbeSent(Event, frozen=True, tag="probe_sent"):
    """Reads from the peer stalled: a liveness probe (request ``probe``) went out.
    Its answer is ``answered``; its silence, ``died``."""

    probe: int


class ReadFailed(Event, frozen=True, tag="read_failed"):
    """A read from the peer failed without a disconnect: its memory may have been
    re-registered, so its metadata is fetched again with the next claim."""

    why: str = ""


class BackoffOver(Event, frozen=True, tag="backoff_over"):
    """The back-off after the peer's death ran out: the next claim probes it."""


class Closed(Event, frozen=True, tag="closed"):
    """The worker shuts down: it forgets the peer."""


class Shutdown(Event, frozen=True, tag="shutdown"):
    """The worker shuts down (a clean stop) while this request is still live:
    what it holds goes back, so its last record says it ended closed at
    shutdown instead of leaving it open as a crash would."""


class DrainOver(Event, frozen=True, tag="drain_over"):
    """The engine is stopping and its drain time is up (the scheduler's step says
    ``stopping``): a pin still waiting for its reader is closed now, so that vLLM
    gets its blocks back and can exit before it is killed."""


AnyEvent = Union[  # noqa: UP007  (a runtime object: EVENT_TYPES reads its __args__)
    Matched,
    Allocated,
    HandshakeOk,
    ReadsPosted,
    NothingToRead,
    AllReadsDone,
    WritesAsked,
    WritesLanded,
    WritesStopped,
    Error,
    Timeout,
    PeerDead,
    InternalError,
    Abort,
    ReadsQuiesced,
    FinishedOk,
    FinishedAbnormally,
    Heartbeat,
    ReadNotif,
    WriteAsked,
    StreamAsked,
    StreamClaimed,
    StreamJoined,
    StreamPreempted,
    WriteDone,
    LeaseExpired,
    RemoteAbandoned,
    AbandonExpired,
    ReleaseAsked,
    AgentAdded,
    Answered,
    Died,
    ProbeSent,
    ReadFailed,
    BackoffOver,
    Closed,
    Shutdown,
    DrainOver,
]

EVENT_TYPES: dict[str, type[Event]] = {
    t.__struct_config__.tag: t for t in AnyEvent.__args__  # type: ignore[attr-defined]
}



def event_from_record(trigger: str, req: str, inputs: dict[str, Any]) -> Event:
    """Rebuild a typed event from a log record's ``event``, ``req`` and ``input``.

    Raises ``ValueError`` naming the trigger when it is unknown or its inputs
    do not fit the event's fields.
    """
    cls = EVENT_TYPES.get(trigger)
    if cls is None:
        raise ValueError(f"unknown trigger {trigger!r}")
    try:
        return msgspec.convert({**inputs, "req": req}, cls)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad inputs for trigger {trigger!r}: {exc}") from exc
