"""Peers and claims (decode engine): each prefill worker it reads from, and the
claims that ask whether a request's blocks are still pinned.

Each peer is a machine of the ``peer`` lifecycle (``kvsm.lifecycle.table``:
unconnected, alive, stale, dead with back-off, probing, closed): its NIXL
agent, its outages and its back-off are that machine's data, set by the
table's ``prepare`` callbacks, so replay re-applies them like any request's.
The table's transitions also fold what a peer's state allows into its data
(``needs_metadata``: claims fetch its metadata too; ``unreachable``: no
messages, new requests fail at once; ``agent_readable``: reads may go to it).

Why a claim before every read: the prefill side may have freed (and reused)
the blocks when its lease ran out. The claim extends the lease and says
whether the blocks are still pinned; the decode side's table then checks,
when the read completes, that it completed within one lease of the claim.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from kvsm.handoff.facts import HeartbeatTarget
from kvsm.handshake import (
    MAX_CLAIMS,
    ClaimsReply,
    HandshakeError,
    HandshakeIncompatible,
    HandshakeRefused,
    HandshakeResult,
    HandshakeTimeout,
    MetadataReply,
    peer_address,
)
from kvsm.handshake.relay import worker_name
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.data import PeerMachine
from kvsm.lifecycle.machine import Outcome
from kvsm.runtime.loop import LoopError, TimerHandle
from kvsm.worker.context import CLAIM_RETRY_NS, Claim, PeerIO, Periodic, S, WorkerContext
from kvsm.worker.recv_plan import ReadPlanner
from kvsm.worker.runner import Effect, EffectTable

# A claim answer (the prefill side's word), not a state of ours.
ANSWER_EXPIRED = "expired"


class ReadChecker(Protocol):
    """What the peers part asks of the receiving part: a claim's answer may find
    the reads posted behind it done already."""

    def check_reads_after_answer(self, reqs: list[str]) -> None: ...


class PeersAndClaims:
    """Peer machines, claims, heartbeats and abandons sent, handshake results (the
    peers part). ``reads`` is the receiving part, bound once both exist (each calls
    the other)."""

    reads: ReadChecker

    def __init__(self, ctx: WorkerContext, planner: ReadPlanner) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.loop = ctx.loop
        self.peers = ctx.peers
        self.stats = ctx.stats
        self.warn = ctx.warn
        self.planner = planner
        self._apply_recv = ctx.apply_recv
        self._apply_peer = ctx.apply_peer
        self._guard = ctx.guard
        self._note = ctx.note
        self._recv_io = ctx.recv_io
        self.peer_io: dict[str, PeerIO] = {}
        self.claims: dict[int, Claim] = {}
        self.oneway: dict[int, tuple[PeerIO, int]] = {}
        self._retry_flush: TimerHandle | None = None
        self._expiry_timer: TimerHandle | None = None
        self.effects: dict[str, Effect] = {
            "drop_agent": self._drop_agent,
            "fail_waiting": self._fail_waiting,
            "arm_backoff_timer": self._arm_backoff_timer,
            "cancel_backoff_timer": self._cancel_backoff_timer,
        }
        ctx.runner.register(self.peers, EffectTable(self.effects, self.peer_io.get, self._ended, self._effects_failed))

    def periodic(self) -> dict[Periodic, Callable[[], None]]:
        """How each periodic timer of this part is armed again (``Recovery``)."""
        return {Periodic.CLIENT_DEADLINES: self._rearm_client_expiry,
                Periodic.CLAIM_RETRY_FLUSH: self._forget_retry_flush}

    def _rearm_client_expiry(self) -> None:
        if self.ctx.client is not None:
            self._expiry_timer = None
            self._arm_client_expiry()

    def _forget_retry_flush(self) -> None:
        self._retry_flush = None

    def timers(self) -> list[TimerHandle | None]:
        return [self._retry_flush, self._expiry_timer, *(p.backoff_timer for p in self.peer_io.values())]

    # -- the peer machines -------------------------------------------------------------

    def peer(self, engine: str, host: str, port: int, rank: int | None = None, pp_rank: int = 0) -> PeerIO:
        """Prefill worker (``rank``, default: ours; ``pp_rank``: its pipeline stage) of
        the engine whose side channel is ``host:port`` (one port per engine: every
        request names the worker it is for)."""
        address = peer_address(host, port)
        rank = self.ctx.tp_rank if rank is None else rank
        key = f"{engine}@{address}" + (f"/tp{rank}" if rank else "") + (f"/pp{pp_rank}" if pp_rank else "")
        peer = self.peer_io.get(key)
        if peer is None:
            peer = self.peer_io[key] = PeerIO(key, engine, address, rank, pp_rank)
            self.peers.create(key)
        return peer

    def _peer_machine(self, peer: PeerIO) -> PeerMachine | None:
        m = self.peers.get(peer.key)
        return m if isinstance(m, PeerMachine) else None

    def agent_of(self, peer: PeerIO) -> str:
        m = self._peer_machine(peer)
        return m.agent if m is not None and m.agent_readable else ""

    def _ended(self, key: str, peer: PeerIO | None) -> None:
        self.peer_io.pop(key, None)

    def _effects_failed(self, key: str, peer: PeerIO | None, o: Outcome, failed: list[tuple[str, Exception]]) -> None:
        name, exc = failed[0]
        self.ctx.on_error(LoopError(exc, None, f"effect {name} of peer {key}", "post"))

    def _needs_metadata(self, peer: PeerIO) -> bool:
        m = self._peer_machine(peer)
        return m is not None and m.needs_metadata

    def reachable(self, peer: PeerIO) -> bool:
        """Whether messages go to ``peer`` (the one place that asks; a peer found dead
        gets none within its back-off, and new requests on it fail at once)."""
        m = self._peer_machine(peer)
        return m is None or not m.unreachable

    def mark_dead(self, peer: PeerIO, why: str, reason: str, sent_ns: int = 0) -> None:
        """Tell ``peer``'s machine it was found dead (``reason``: refused, silent,
        disconnected, unsettled); the table decides whether that is news."""
        self._apply_peer(ev.Died(req=peer.key, reason=reason, why=why[:300], sent_ns=sent_ns,
                                 backoff_ns=int(self.cfg.peer_backoff_s * S),
                                 backoff_max_ns=int(self.cfg.peer_backoff_max_s * S)))

    def _drop_agent(self, peer: PeerIO, o: Outcome) -> None:
        """Remove the dead peer's NIXL agent: that settles its reads, none can write
        afterwards (and no read is posted to it: its machine's ``agent_readable``). Its
        side-channel socket goes too: the probe after the back-off connects afresh
        (an inproc peer that restarted is never reconnected to otherwise, and over
        TCP what was queued for the dead process would reach its successor)."""
        m = self._peer_machine(peer)
        if m is not None and m.agent and self.ctx.transport is not None:
            self.ctx.transport.remove_peer(m.agent)
        others = [p for p in self.peer_io.values() if p is not peer and p.address == peer.address
                  and self.reachable(p)]
        if self.ctx.client is not None and not others:  # (other ranks of that engine still answer there)
            self.ctx.client.disconnect(peer.address)

    def _fail_waiting(self, peer: PeerIO, o: Outcome) -> None:
        m = self._peer_machine(peer)
        assert m is not None
        reason = getattr(o.event, "reason", "")
        self._note("worker.peer_dead", None, peer=peer.address, engine=peer.engine,
                   why=getattr(o.event, "why", ""), reason=reason,
                   retry_in_s=(m.dead_until_ns - self.loop.now_ns()) / S, failures=m.failures)
        self.warn.warning("peer_dead", "peer %s (%s) is dead: %s; failing its requests fast for %.1f s",
                          peer.address, peer.engine, m.last_error, (m.dead_until_ns - self.loop.now_ns()) / S)
        recv = self.ctx.recv  # (counted as a failure where it moves the request: Receiver._moved)
        for req, io in list(self._recv_io.items()):
            if req in recv and io.deals_with(peer):
                self._apply_recv(ev.PeerDead(req=req, peer=peer.key, reason=reason))

    def _arm_backoff_timer(self, peer: PeerIO, o: Outcome) -> None:
        m = self._peer_machine(peer)
        assert m is not None
        self.loop.cancel(peer.backoff_timer)
        peer.backoff_timer = self.loop.call_at(m.dead_until_ns, lambda: self._backoff_over(peer),
                                               label="peer back-off")

    def _backoff_over(self, peer: PeerIO) -> None:
        peer.backoff_timer = None
        if peer.key in self.peers:
            self._apply_peer(ev.BackoffOver(req=peer.key))

    def _cancel_backoff_timer(self, peer: PeerIO, o: Outcome) -> None:
        self.loop.cancel(peer.backoff_timer)
        peer.backoff_timer = None

    # -- claims ------------------------------------------------------------------------

    def flush_claims(self) -> None:
        """One claim message per peer for every request queued this turn."""
        queue = self.ctx.claim_queue
        if queue:
            self.ctx.claim_queue = {}
            assert self.ctx.client is not None
            now = self.loop.now_ns()
            deadline = now + int(self.cfg.handshake_timeout_s * S)
            for key, reqs in queue.items():
                try:
                    self._send_claim(key, reqs, now, deadline)
                except Exception as e:  # noqa: BLE001 - one peer's claim must not drop the others'
                    for req in reqs:
                        self.ctx.on_error(LoopError(e, req, "claim flush", "post"))
            self._after_send()

    def _send_claim(self, key: str, reqs: list[str], now: int, deadline: int) -> None:
        """Claim messages to one peer for ``reqs``: one per MAX_CLAIMS of them (the
        server refuses longer ones; a step may start more requests than that)."""
        assert self.ctx.client is not None
        peer = self.peer_io[key]
        pairs = []
        readers = 1
        for req in reqs:
            io = self._recv_io.get(req)
            if io is None:  # ended while queued
                continue
            pairs.append((req, io.start.remote_req))
            readers = next((link.readers for link in io.links if link.peer is peer), readers)
        fetch = self._needs_metadata(peer)
        for at in range(0, len(pairs), MAX_CLAIMS):
            chunk = pairs[at:at + MAX_CLAIMS]
            claims = [remote for _, remote in chunk]
            if fetch:  # every chunk asks: whichever reply comes first adds the agent
                rid = self.ctx.client.fetch_metadata(peer.address, peer.rank, peer.pp_rank, claims,
                                                 deadline_ns=deadline, expected_engine_id=peer.engine,
                                                 readers=readers)
            else:
                rid = self.ctx.client.heartbeat(peer.address, claims, deadline_ns=deadline, readers=readers,
                                            tp_rank=peer.rank, pp_rank=peer.pp_rank)
            self.claims[rid] = Claim(peer, now, chunk, fetch)

    def _retry_claim(self, req: str) -> None:
        io = self._recv_io.get(req)
        if io is None:
            return
        io.retry_timer = None
        m = self.ctx.recv.get(req)
        if m is None or io.claims_over:
            return  # its claims are over (the table stopped them: it failed or was aborted meanwhile)
        granted = m.claims_granted
        for i, link in enumerate(io.reads):
            if not granted & (1 << i):  # the ranks that granted it already are not asked again
                self.ctx.claim_queue.setdefault(link.peer.key, []).append(req)
        if self._retry_flush is None:  # one flush for every retry due now (a timer: it cannot be dropped)
            self._retry_flush = self.loop.call_later(0, self._flush_retries, label=Periodic.CLAIM_RETRY_FLUSH.value)

    def _flush_retries(self) -> None:
        self._retry_flush = None
        self.flush_claims()

    def _on_client_results(self, results: list[HandshakeResult]) -> None:
        for result in results:
            claim = self.claims.pop(result.request_id, None)
            if claim is not None:
                try:
                    self._on_claim_result(claim, result)
                except Exception as e:  # noqa: BLE001 - one bad reply must not drop the others
                    for req, _ in claim.reqs:
                        self.ctx.on_error(LoopError(e, req, "claim result", "reader"))
                continue
            answered = self.ctx.write_asks.pop(result.request_id, None)
            if answered is not None:  # push mode: a write ask's answer
                self.ctx.guard(None, answered, result)
                continue
            entry = self.oneway.pop(result.request_id, None)
            if entry is None:
                continue
            peer, sent_ns = entry
            m = self._peer_machine(peer)
            probe = m is not None and m.probe == result.request_id
            if probe and not isinstance(result.outcome, HandshakeError):  # the reads are only slow
                self._apply_peer(ev.Answered(req=peer.key, sent_ns=sent_ns))
            elif isinstance(result.outcome, HandshakeRefused):
                self.mark_dead(peer, str(result.outcome), "refused", sent_ns)
            elif isinstance(result.outcome, HandshakeTimeout):
                what = (f"reads in flight stalled: no answer to a liveness probe within {self.cfg.stall_timeout_s:g} s"
                        if probe else "no answer to a heartbeat/abandon")
                self.mark_dead(peer, f"{what}: {result.outcome}", "silent", sent_ns)

    def _on_claim_result(self, claim: Claim, result: HandshakeResult) -> None:
        peer = claim.peer
        outcome = result.outcome
        if isinstance(outcome, HandshakeError):
            self._note("worker.claim_failed", None, peer=peer.address, engine=peer.engine, fetch=claim.fetch,
                       worker=worker_name(peer.rank, peer.pp_rank), error=f"{outcome.code}: {outcome}"[:300],
                       reqs=[req for req, _ in claim.reqs])
            if isinstance(outcome, HandshakeRefused):
                # Nobody listens there any more (the process is gone): known at once,
                # no need to wait for a timeout. A silent peer still times out.
                self.mark_dead(peer, str(outcome), "refused", claim.sent_ns)
                return
            if isinstance(outcome, HandshakeTimeout):
                self.mark_dead(peer, str(outcome), "silent", claim.sent_ns)
                return  # a death fails every request waiting on this peer
            kind = "incompatible" if isinstance(outcome, HandshakeIncompatible) else "handshake"
            if outcome.code in ("engine_mismatch", "unauthenticated", "handshake_failed"):
                kind = outcome.code  # (the last two: the deployment's keys, on one side or the other)
            self._refuse(claim, kind, f"{peer.address}: {outcome}")
            return
        assert isinstance(outcome, (MetadataReply, ClaimsReply))
        if isinstance(outcome, MetadataReply) and self._needs_metadata(peer):
            assert self.ctx.transport is not None
            try:
                agent = self.ctx.transport.add_peer(outcome.agent_metadata)
            except ValueError as e:
                self._refuse(claim, "incompatible", f"{peer.address}: {e}")
                return
            except ConnectionError as e:  # its side channel answered, its NIXL agent cannot be reached
                self.mark_dead(peer, f"its NIXL agent: {e}", "disconnected", claim.sent_ns)
                return
            self._apply_peer(ev.AgentAdded(req=peer.key, agent=agent, engine=peer.engine, address=peer.address))
            self.stats.handshake_done((self.loop.now_ns() - claim.sent_ns) / S)
            self._note("worker.peer_added", None, peer=peer.address, engine=peer.engine, agent=agent)
        else:
            self._apply_peer(ev.Answered(req=peer.key, sent_ns=claim.sent_ns))
        # The claim's answer decides the lease: the prefill side's lease (ns; ms on
        # the wire only), from when the claim left, judged with LEASE_MARGIN_NS by
        # the table (check_lease). A peer that does not say is assumed to run ours.
        # The params' expiry time is the other, advisory route (recv: early reads).
        window = outcome.lease_ns or self.cfg.lease_ns
        for req, remote_req in claim.reqs:
            io = self._recv_io.get(req)
            if io is None:  # ended meanwhile
                continue
            status = outcome.claims.get(remote_req, "unknown")
            io.answers[status] = io.answers.get(status, 0) + 1  # logged when the claim phase ends
            if status == "ok":
                source = next((i for i, link in enumerate(io.reads) if link.peer is peer), 0)
                self._apply_recv(ev.HandshakeOk(req=req, remote_engine=peer.engine, claim_sent_ns=claim.sent_ns,
                                                lease_window_ns=window, source=source))
            elif status == ANSWER_EXPIRED:  # (fails it while its claims are out: the table's answers_a_claim)
                self._apply_recv(ev.Error(req=req, kind="lease_expired", claim=True, detail=(
                    f"prefill request {remote_req} on {peer.engine} is no longer pinned "
                    f"(its lease expired or it was released); its blocks may have been reused")))
            elif io.retry_timer is None and not io.claims_over:
                # Not known there (yet): the prefill worker may hear of the finish a
                # little later. It is asked again until the table ends the claims
                # (cancel_handshake_timer: granted, failed, or the handshake timeout).
                io.retry_timer = self.loop.call_later(CLAIM_RETRY_NS, partial(self._retry_claim, req),
                                                      req=req, label="claim retry")
        # Reads posted behind these claims: the prefill worker made its NIXL agent progress
        # as it answered (a small read completes only then), so they may be done already;
        # see now rather than at the next poll.
        self.reads.check_reads_after_answer([req for req, _ in claim.reqs])

    def _refuse(self, claim: Claim, kind: str, detail: str) -> None:
        """The claim was refused: each request it was for hears of it (the table
        fails those whose claims are still out, and counts it)."""
        recv = self.ctx.recv
        for req, _ in claim.reqs:
            if req in recv:
                self._apply_recv(ev.Error(req=req, kind=kind, detail=detail, claim=True))

    # -- one-way messages: abandons and heartbeats ------------------------------------------

    def tell_abandon(self, peer: PeerIO, remote_reqs: list[str], readers: int = 1) -> None:
        """Tell the prefill side we will never read these (so it can unpin now);
        nobody to tell when the peer is unreachable: its lease frees the blocks."""
        if self.ctx.client is None or not self.reachable(peer):
            return
        now = self.loop.now_ns()
        rid = self.ctx.client.abandon(peer.address, remote_reqs,
                                      deadline_ns=now + int(self.cfg.handshake_timeout_s * S),
                                      readers=readers, tp_rank=peer.rank, pp_rank=peer.pp_rank)
        self.oneway[rid] = (peer, now)
        self._after_send()

    def _send_heartbeat(self, target: HeartbeatTarget) -> None:
        if self.ctx.client is None or not target.claims:
            return
        try:
            plan = self.planner.read_plan(target.remote_tp_size)
        except ValueError:
            return  # its requests fail (tp_mismatch): nothing of theirs to keep pinned
        now = self.loop.now_ns()
        deadline = now + int(self.cfg.handshake_timeout_s * S)
        claims = list(target.claims)
        for rank, stage, readers, source in self.planner.workers_of(plan, target.remote_pp_size):
            if source is None:
                continue  # nobody reads that worker: it was told so, nothing to keep pinned there
            peer = self.peer(target.remote_engine, target.remote_host, target.remote_port, rank, stage)
            if not self.reachable(peer):
                continue
            for at in range(0, len(claims), MAX_CLAIMS):  # the server refuses longer messages
                rid = self.ctx.client.heartbeat(peer.address, claims[at:at + MAX_CLAIMS], deadline_ns=deadline,
                                            readers=readers, tp_rank=peer.rank, pp_rank=peer.pp_rank)
                self.oneway[rid] = (peer, now)
        self._after_send()

    # -- reads in flight: is their peer still there? ----------------------------------------

    def probe_liveness(self, due: list[PeerIO]) -> None:
        """One empty heartbeat to each of ``due`` (reads from it stalled), unless one
        is out already: the peer answers it (the reads are only slow) or its timeout
        marks the peer dead (``_on_client_results``), which settles the reads. It
        extends no lease (the claim alone grants one)."""
        client = self.ctx.client
        if client is None:
            return
        now = self.loop.now_ns()
        deadline = now + int(self.cfg.stall_timeout_s * S)
        sent = False
        for peer in due:
            m = self._peer_machine(peer)
            if m is None or m.unreachable or m.probe in self.oneway:  # (one probe at a time)
                continue
            rid = client.heartbeat(peer.address, (), deadline_ns=deadline, tp_rank=peer.rank, pp_rank=peer.pp_rank)
            self.oneway[rid] = (peer, now)
            self._apply_peer(ev.ProbeSent(req=peer.key, probe=rid))
            sent = True
        if sent:
            self._after_send()

    # -- the client's sockets and deadlines -----------------------------------------------

    def _after_send(self) -> None:
        """After messages went out: handle what they settled at once (a refused
        connection is known without waiting), and arm the client's next deadline."""
        assert self.ctx.client is not None
        self._on_client_results(self.ctx.client.poll_results())
        self._arm_client_expiry()

    def _watch_client_socket(self, sock: Any) -> None:
        def readable() -> None:
            assert self.ctx.client is not None
            self._on_client_results(self.ctx.client.on_readable(sock))
            self._arm_client_expiry()

        self.loop.add_reader(sock, readable, label="handshake client")

    def _arm_client_expiry(self) -> None:
        assert self.ctx.client is not None
        deadline = self.ctx.client.next_deadline_ns()
        timer = self._expiry_timer
        if timer is not None and not timer.cancelled and deadline is not None and timer.deadline_ns <= deadline:
            return
        self.loop.cancel(timer)
        self._expiry_timer = None
        if deadline is not None:
            self._expiry_timer = self.loop.call_at(deadline, self._expire_client, label=Periodic.CLIENT_DEADLINES.value)

    def _expire_client(self) -> None:
        assert self.ctx.client is not None
        self._expiry_timer = None
        self._on_client_results(self.ctx.client.expire(self.loop.now_ns()))
        self._arm_client_expiry()
