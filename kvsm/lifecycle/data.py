"""The data a lifecycle's machines carry: what its ``prepare`` callbacks fold in
and its conditions read.

Plain objects with slots, one class per kind of machine (``LifecycleSpec.
machine_cls`` says which): thousands are live at once, and nothing here is
registered with a ``transitions.Machine`` (whose add_model is O(n)).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PeerMachine", "RequestMachine"]


class RequestMachine:
    """One request's (or peer's) lifecycle state and the data its transitions need.

    Plain object with slots: thousands are live at once, and nothing here is
    registered with a ``transitions.Machine`` (whose add_model is O(n)).
    """

    __slots__ = (
        "req",
        "lifecycle",
        "state",
        "created_ns",
        "updated_ns",
        "block_ids",
        "remote_engine",
        "remote_req",
        "num_tokens",
        "reads_expected",
        "reads_seen",
        "readers_done",
        "claimants",
        "reads_held",
        "claims_needed",
        "claims_granted",
        "lease_deadline_ns",
        "claim_granted_ns",
        "lease_window_ns",
        "late_ns",
        "reads_done_ns",
        "failure",
        "num_events",
        "hold",
        "push",
    )

    def __init__(self, req: str, lifecycle: str, state: str, now_ns: int) -> None:
        self.req = req
        self.lifecycle = lifecycle
        self.state = state
        self.created_ns = now_ns
        self.updated_ns = now_ns
        self.block_ids: tuple[int, ...] = ()
        self.remote_engine = ""
        self.remote_req = ""
        self.num_tokens = 0
        self.reads_expected = 0
        self.reads_seen = 0
        # Prefill side: the decode ranks through with this request (read or abandoned).
        self.readers_done: frozenset[str] = frozenset()
        # Prefill side: the decode ranks that claimed it here, and those whose read
        # notification came before their claim (counted when the claim comes).
        self.claimants: frozenset[str] = frozenset()
        self.reads_held: frozenset[str] = frozenset()
        # Decode side: prefill ranks to claim, and a bit per rank that granted its claim.
        self.claims_needed = 1
        self.claims_granted = 0
        self.lease_deadline_ns = 0
        # Decode side: when the granting claim left, how long it pins the blocks,
        # and how late (ns, > 0) the reads completed against that lease.
        self.claim_granted_ns = 0
        self.lease_window_ns = 0
        self.late_ns = 0
        self.reads_done_ns = 0  # decode side: when the reads completed (0: not yet)
        self.failure = ""
        self.num_events = 0
        self.hold = False  # prefill side: a decode engine's hold for a next turn, not a prefill
        self.push = False  # decode side: the prefill workers write the blocks (transfer_mode "push")

    def snapshot(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in RequestMachine.__slots__}

    def __repr__(self) -> str:
        return f"<RequestMachine {self.lifecycle}:{self.req} {self.state}>"


class PeerMachine(RequestMachine):
    """One remote worker this worker reads from (lifecycle ``peer``): its NIXL
    agent and its outage record. ``req`` is the peer's key, ``engine@address``."""

    __slots__ = ("agent", "failures", "backoff_ns", "dead_until_ns", "news_ns", "last_error", "agent_readable",
                 "needs_metadata", "unreachable", "probe")

    def __init__(self, req: str, lifecycle: str, state: str, now_ns: int) -> None:
        super().__init__(req, lifecycle, state, now_ns)
        self.agent = ""  # the NIXL agent name once its metadata is loaded ("" : none)
        # What the peer allows, folded by the table's transitions (the worker reads
        # these, never the state): reads may be posted to ``agent``; a claim must
        # fetch its metadata (again); no message goes to it (dead, within its back-off).
        self.agent_readable = False
        self.needs_metadata = True
        self.unreachable = False
        self.probe = -1  # the liveness probe outstanding (its request id; -1: none)
        self.failures = 0  # outages in a row
        self.backoff_ns = 0  # the next outage's back-off (0: the configured base)
        self.dead_until_ns = 0
        # When we last learned whether it is alive (it died, or it answered): a
        # message sent before then that times out tells nothing new.
        self.news_ns = 0
        self.last_error = ""

    def snapshot(self) -> dict[str, Any]:
        out = super().snapshot()
        out.update({name: getattr(self, name) for name in PeerMachine.__slots__})
        return out
