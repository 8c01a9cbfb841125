"""``WorkerHalf``: the worker half of KVSMConnector, assembled from its parts.

One per worker process (one per tensor parallel rank of each pipeline stage). It owns the machines of
the three lifecycles (recv, send, peer) and one event-loop thread
(``kvsm.runtime.loop``) that does everything else: the side channel (a handshake
server when this engine prefills for others, a handshake client when it
decodes), the pin channel, every NIXL call after registration, every timer.

vLLM's model-runner thread only does two things here: ``submit`` posts the
step's metadata to the loop, and ``take_results`` / ``take_invalid_blocks``
take what the loop has put in a small locked results box. Nothing it calls
waits for I/O. This module imports no vLLM (a test enforces it).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from kvsm.config import KVSMConfig
from kvsm.eventlog.log import EventLog
from kvsm.handoff.facts import StepFacts
from kvsm.handoff.pins import PinChannelServer, PinTarget
from kvsm.handshake import CompatInfo, HandshakeClient, HandshakeServer
from kvsm.handshake.keys import SideChannelKeys
from kvsm.handshake.relay import internal_endpoint
from kvsm.lifecycle import events as ev
from kvsm.lifecycle.clock import SYSTEM_CLOCK, Clock
from kvsm.runtime.loop import EventLoop, LoopError, TimerHandle
from kvsm.transport.base import Transport
from kvsm.worker.context import WorkerContext, log
from kvsm.worker.keys import KeysWatch, open_side_channel_notice
from kvsm.worker.peers import PeersAndClaims
from kvsm.worker.recovery import Recovery
from kvsm.worker.recv import Receiver
from kvsm.worker.recv_plan import ReadPlanner
from kvsm.worker.send import Sender
from kvsm.worker.stats import StatsRecorder


class WorkerHalf:
    """Worker-side state of one engine's connector (one tensor-parallel rank): the
    composition of its parts (``receiver``, ``sender``, ``peers_and_claims``,
    ``recovery``) over one ``WorkerContext``."""

    def __init__(self, cfg: KVSMConfig, tp_rank: int, *, pp_rank: int = 0, event_log: EventLog | None = None,
                 stats: StatsRecorder | None = None, clock: Clock = SYSTEM_CLOCK,
                 loop_options: Mapping[str, Any] | None = None) -> None:
        if not 0 <= pp_rank < max(1, cfg.pp_size):
            raise ValueError(f"pipeline stage {pp_rank} out of range for pipeline parallel {cfg.pp_size}")
        self.cfg = cfg
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.log = event_log
        self.stats = stats or StatsRecorder()
        # ``clock``/``loop_options`` let the simulation run the real worker on virtual time.
        name = f"{cfg.engine_id}-tp{tp_rank}" + (f"-pp{pp_rank}" if pp_rank else "")
        self.loop = EventLoop(name, on_error=self._on_loop_error, clock=clock, **(loop_options or {}))
        ctx = self.ctx = WorkerContext(cfg, tp_rank, pp_rank, event_log, self.stats, self.loop)
        self.results = ctx.results
        self.warn = ctx.warn
        self.recv = ctx.recv
        self.send = ctx.send
        self.peers = ctx.peers
        self.state_counts = ctx.state_counts
        planner = ReadPlanner(ctx)
        self.peers_and_claims = PeersAndClaims(ctx, planner)
        self.receiver = Receiver(ctx, planner, self.peers_and_claims)
        self.peers_and_claims.reads = self.receiver.reads
        self.sender = Sender(ctx)
        self.recovery = Recovery(ctx, self.sender, {
            **self.receiver.reads.periodic(), **self.sender.periodic(), **self.peers_and_claims.periodic()})
        ctx.on_error = self.recovery.on_loop_error
        self._side_channel_seen: dict[str, int] = {}
        self._relay_timer: TimerHandle | None = None
        self.keys_watch: KeysWatch | None = None
        self._started = False
        self._posted_early = -1  # the step whose metadata its first layer posted (model thread)

    def _on_loop_error(self, err: LoopError) -> None:
        self.ctx.on_error(err)

    # The I/O objects opened at start live in the context every part reads.
    @property
    def transport(self) -> Transport | None:
        return self.ctx.transport

    @property
    def server(self) -> HandshakeServer | None:
        return self.ctx.server

    @property
    def client(self) -> HandshakeClient | None:
        return self.ctx.client

    @property
    def pins(self) -> PinChannelServer | None:
        return self.ctx.pins

    @property
    def compat(self) -> CompatInfo | None:
        return self.ctx.compat

    @property
    def agent_name(self) -> str:
        return self.ctx.agent_name

    # ================================================================ any thread

    def start(self, transport: Transport, compat: CompatInfo) -> None:
        """Take over the registered transport and start the loop and side channel."""
        self.ctx.transport = transport
        self.ctx.compat = compat
        self.ctx.agent_name = transport.name
        self.loop.start()
        self._started = True
        self.loop.call(self._open_side_channel, timeout=30.0, label="open side channel")
        self.ctx.note("worker.started", None, agent=self.agent_name, kv_role=self.cfg.kv_role,
                   side_channel=self.server.address if self.server else None,
                   pin_channel=self.pins.endpoint if self.pins else None)

    def submit(self, meta: StepFacts) -> None:
        """Hand one step's metadata to the loop (never blocks). If the loop cannot
        take it (stopped, or drowning), every request in it fails visibly now
        rather than wait forever."""
        if not meta or meta.step == self._posted_early:
            return  # (nothing, or posted already by the step's first layer: streamed push)
        if not self._started:
            raise RuntimeError("KVSMConnector worker: metadata arrived before register_kv_caches")
        if not self.loop.post(lambda: self._on_metadata(meta), label=f"metadata step {meta.step}"):
            self._refuse_step(meta)

    def _refuse_step(self, meta: StepFacts) -> None:
        """The step never reaches the loop: tell vLLM now (any thread; the results
        box is locked). Loads fail; releases and finishes are reported done, so no
        block stays held: an unpinned prefill only means its claims go unanswered."""
        log.error("kvsm worker %s: could not post step %d's metadata to the loop (%s); failing its %d "
                  "receive(s), releasing its %d finish(es)", self.loop.name, meta.step, self.loop.stats(),
                  len(meta.recv_start), len(meta.send_finish))
        for start in meta.recv_start:
            if start.awaited:
                self.results.failed(start.req, start.local_block_ids)
        for abort in meta.recv_abort:
            self.results.received(abort.req)
        for finish in meta.send_finish:
            self.results.sent(finish.req)
        self.stats.failure("internal")
        self.ctx.note("worker.step_refused", None, step=meta.step, recv_start=[s.req for s in meta.recv_start],
                   recv_abort=[a.req for a in meta.recv_abort], send_finish=[f.req for f in meta.send_finish])

    def layer_saved(self, layer: str, meta: StepFacts) -> None:
        """vLLM's forward pass is done with ``layer`` (model thread; posts only, and
        for a streamed prompt's very last layer waits a moment for the post to be served).
        vLLM hands the step's metadata over (``start_load_kv``) only after the
        forward pass; a step that computes a streamed request posts it with its
        first layer instead, so the loop knows the step's blocks before its layers."""
        streamer = self.sender.writer.streamer
        if meta.stream_steps and meta.step != self._posted_early:
            self.submit(meta)
            self._posted_early = meta.step
            streamer.stepping(True, final=any(st.last for st in meta.stream_steps))
        streamer.layer_saved(layer)

    def step_over(self) -> None:
        """vLLM's forward pass of the step is over (model thread; posts only)."""
        self.sender.writer.streamer.step_over()

    def pin_target(self) -> PinTarget | None:
        """How this engine's scheduler reaches this worker's pin channel (None: it
        serves no prefills, or has not started)."""
        return self.pins.target(self.tp_rank, self.pp_rank) if self.pins is not None else None

    def take_results(self) -> tuple[set[str], set[str], set[str]]:
        return self.results.take()

    def take_invalid_blocks(self) -> set[int]:
        return self.results.take_invalid()

    def shutdown(self) -> None:
        if self._started:
            try:
                self.loop.call(self._close_on_loop, timeout=10.0, label="shutdown")
            except Exception as e:  # noqa: BLE001 - shutting down regardless
                log.warning("kvsm worker %s: closing on the loop failed: %s", self.loop.name, e)
            self.loop.stop(timeout=10.0)
            self._started = False
        if self.log is not None:
            self.log.close()

    # ================================================================ loop thread

    def _on_metadata(self, meta: StepFacts) -> None:
        guard, receiver, sender, peers = self.ctx.guard, self.receiver, self.sender, self.peers_and_claims
        for start in meta.recv_start:
            exc = guard(start.req, receiver._on_recv_start, start)
            if exc is not None and not self.recv.known(start.req):
                guard(start.req, receiver._fail_untracked, (start, exc))
        for abandon in meta.recv_abandon:
            guard(abandon.req, receiver._on_recv_abandon, abandon)
        for abort in meta.recv_abort:
            guard(abort.req, receiver._on_recv_abort, abort)
        for s in meta.send_start:
            if self.send.known(s.req):
                continue  # its finish came first, straight from the scheduler
            self.send.create(s.req)
        if meta.send_start or meta.stream_steps or meta.stream_preempted:
            sender.writer.streamer.on_step(meta.send_start, meta.stream_steps, meta.stream_preempted)
        for finish in meta.send_finish:
            guard(finish.req, sender._on_send_finish, (finish, "next_step"))
        for target in meta.heartbeats:
            guard(None, peers._send_heartbeat, target)
        peers.flush_claims()
        receiver.post_claimed_early()  # (right behind their claims)
        if meta.stopping:  # the engine drains to stop and its time is up: pins close
            for m in self.send.live_accepting("drain_over"):
                guard(m.req, self.ctx.apply_send, ev.DrainOver(req=m.req))

    def _open_side_channel(self) -> None:
        assert self.compat is not None
        if self.cfg.side_channel_keys:
            self.keys_watch = KeysWatch(self.cfg, self.loop, self._use_keys, self.ctx.note, self.stats.side_channel)
        elif (self.tp_rank, self.pp_rank) == (0, 0):
            log.warning(open_side_channel_notice(self.cfg))
        keys = self.keys_watch.keys if self.keys_watch is not None else None
        if self.cfg.produces:
            # One port per engine: rank 0 of stage 0 binds it and relays the other workers'
            # requests to the private endpoints they bind (kvsm.handshake.relay).
            cfg = self.cfg
            endpoint = partial(internal_endpoint, cfg.side_channel_host, cfg.side_channel_port, cfg.engine_id)
            me = (self.tp_rank, self.pp_rank)
            others = [(k, s) for s in range(max(1, cfg.pp_size)) for k in range(cfg.tp_size) if (k, s) != (0, 0)]
            server = self.ctx.server = HandshakeServer(
                cfg.engine_id, self.compat, self.sender._provide, self.sender._on_claims,
                host=self._bind_host(), port=cfg.side_channel_port, context=self.loop.context,
                lease_ns=cfg.lease_ns, rank=self.tp_rank, pp_rank=self.pp_rank, now_ns=self.loop.now_ns,
                relay_to={w: endpoint(*w) for w in others} if me == (0, 0) else None,
                internal=endpoint(*me) if me != (0, 0) else "", keys=keys, on_writes=self.sender.writer.on_ask)
            for sock in server.sockets():
                self.loop.add_reader(sock, partial(self._on_side_channel, sock), label="handshake server")
            pins = self.ctx.pins = PinChannelServer(self.loop.context, self.sender._on_pins,
                                                    lambda fn, label: self.loop.post(fn, label=label))
            for sock in pins.sockets():
                self.loop.add_reader(sock, pins.on_readable, label="pin channel")
        if self.cfg.consumes:
            self.ctx.client = HandshakeClient(
                # Named as our NIXL agent: the prefill side counts each decode rank once,
                # by this name in its abandons and by the agent in its reads' notifications.
                self.compat, requester=self.agent_name or f"{self.cfg.engine_id}/tp{self.tp_rank}",
                context=self.loop.context,
                on_socket_added=self.peers_and_claims._watch_client_socket,
                on_socket_removed=self.loop.remove_reader, keys=keys)
        if self.keys_watch is not None:
            self.keys_watch.start()

    def _use_keys(self, keys: SideChannelKeys) -> None:
        """Rotated keys: the server (only the rank that binds the port has keys) and the client."""
        if self.server is not None and self.server.keys is not None:
            self.server.set_keys(keys)
        if self.client is not None:
            self.client.set_keys(keys)

    def _on_side_channel(self, sock: Any = None) -> None:
        """Serve what arrived, then count it by outcome for the stats (a few dict
        operations per batch of messages, not per message)."""
        assert self.server is not None
        self.server.on_readable(sock)
        self._arm_relay_expiry()
        now = _side_channel_outcomes(self.server.stats())
        last = self._side_channel_seen
        delta = {k: n - last.get(k, 0) for k, n in now.items() if n != last.get(k, 0)}
        if delta:
            self._side_channel_seen = now
            self.stats.side_channel(delta)

    def _arm_relay_expiry(self) -> None:
        """A timer for the first relayed request that may go unanswered (rank 0 only)."""
        assert self.server is not None
        deadline = self.server.next_deadline_ns()
        timer = self._relay_timer
        if deadline is None or (timer is not None and not timer.cancelled and timer.deadline_ns <= deadline):
            return
        self.loop.cancel(timer)
        self._relay_timer = self.loop.call_at(deadline, self._expire_relayed, label="relayed requests")

    def _expire_relayed(self) -> None:
        self._relay_timer = None
        if self.server is not None:
            self.server.expire(self.loop.now_ns())
            self._arm_relay_expiry()

    def _bind_host(self) -> str:
        host = self.cfg.side_channel_host
        return "127.0.0.1" if host == "localhost" else host

    def _close_on_loop(self) -> None:
        # The log's last record says what was still live and what was still held, so
        # replay can tell a clean stop from a crash and a leak check has its figures.
        # Peers are closed first: a peer is no request, and its machine ends here.
        ctx = self.ctx
        for m in self.peers.live():
            ctx.apply_peer(ev.Closed(req=m.req))
        # Every request still live ends closed at shutdown: pinned blocks are freed,
        # blocks taken for reads go back, so the log's last records balance the ledger.
        for m in self.send.live():
            ctx.guard(m.req, ctx.apply_send, ev.Shutdown(req=m.req))
        for m in self.recv.live():
            ctx.guard(m.req, ctx.apply_recv, ev.Shutdown(req=m.req))
        ctx.note("worker.shutdown", None, clean=True,
                   live={"recv": self.recv.states(), "send": self.send.states()},
                   resources=self.resources(),
                   side_channel=self.server.stats() if self.server else None,
                   pin_channel=self.pins.stats() if self.pins else None,
                   client=self.client.stats() if self.client else None)
        for h in self._timers():
            self.loop.cancel(h)
        if self.keys_watch is not None:
            self.keys_watch.stop()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            for sock in self.server.sockets():
                self.loop.remove_reader(sock)
            self.server.close()
        if self.pins is not None:
            for sock in self.pins.sockets():
                self.loop.remove_reader(sock)
            self.pins.close()
        if self.transport is not None:
            close = getattr(self.transport, "close", None)
            if close is not None:
                close()

    def resources(self) -> dict[str, int]:
        """How much per-request state this worker holds (loop thread): every count
        but ``peers``/``transport_peers``, ``client_sockets`` and the loop's
        ``readers`` returns to 0 once the requests it served have ended (on a prefill
        worker that served a reader, ``loop_timers`` keeps its notification poll), so
        a growing count is a leak."""
        out = {
            "recv_machines": len(self.recv),
            "send_machines": len(self.send),
            "recv_io": len(self.ctx.recv_io),
            "send_io": len(self.sender.send_io),
            "claims": len(self.peers_and_claims.claims),
            "claim_queue": sum(len(q) for q in self.ctx.claim_queue.values()),
            "oneway": len(self.peers_and_claims.oneway),
            "polling": len(self.ctx.polling),
            "peers": len(self.peers_and_claims.peer_io),
        }
        if self.transport is not None:
            out.update({f"transport_{k}": v for k, v in self.transport.resources().items()})
        if self.client is not None:
            out["client_pending"] = self.client.pending_count()
            out["client_sockets"] = self.client.socket_count()
        loop = self.loop.stats()
        # (the key directory's check is no request's, and always pending)
        out["loop_timers"] = loop["timers_pending"] - (1 if self.keys_watch and self.keys_watch.timer else 0)
        out["loop_readers"] = loop["readers"]
        return out

    def _timers(self) -> list[TimerHandle | None]:
        return [self._relay_timer, *self.receiver.timers(), *self.sender.timers(), *self.peers_and_claims.timers()]

    # ================================================================ introspection

    def debug_state(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """A snapshot for tests and debugging (runs on the loop; with many requests
        live it waits behind their work, hence the timeout to choose)."""

        def snap() -> dict[str, Any]:
            peers: dict[str, Any] = {}
            peer_states = self.peers.states()
            for p in self.peers_and_claims.peer_io.values():
                m = self.peers.get(p.key)
                if m is not None:
                    peers[p.key] = {"state": peer_states[p.key], "agent": self.peers_and_claims.agent_of(p) or None,
                                    "dead_until_ns": getattr(m, "dead_until_ns", 0),
                                    "failures": getattr(m, "failures", 0),
                                    "last_error": getattr(m, "last_error", "")}
            return {
                "recv": self.recv.states(),
                "send": self.send.states(),
                "peers": peers,
                "io": {"recv": len(self.ctx.recv_io), "send": len(self.sender.send_io),
                       "claims": len(self.peers_and_claims.claims), "oneway": len(self.peers_and_claims.oneway),
                       "polling": len(self.ctx.polling)},
                "server": self.server.stats() if self.server else None,
                "pin_channel": self.pins.stats() if self.pins else None,
                "client": self.client.stats() if self.client else None,
                "loop": self.loop.stats(),
                "resources": self.resources(),
            }

        return self.loop.call(snap, timeout=timeout_s, label="debug_state")


def _side_channel_outcomes(server_stats: dict[str, Any]) -> dict[str, int]:
    """``HandshakeServer.stats()`` flattened to cumulative counts by outcome:
    ``served``, each refusal's error code, replies that could not be sent,
    connections refused by the deployment's keys (``unauthenticated``) and ZMTP
    handshakes that failed (``handshake_failed``: no keys, a wrong server key, not ZMQ)."""
    out = {"served": sum(server_stats.get("served", {}).values())}
    out.update(server_stats.get("errors", {}))
    if refused := server_stats.get("auth", {}).get("refused"):
        out["unauthenticated"] = refused
    if failed := server_stats.get("connections", {}).get("zmtp_failed"):
        out["handshake_failed"] = failed
    for key in ("reply_dropped_full", "reply_unroutable", "reply_failed"):
        if server_stats.get(key):
            out[key] = server_stats[key]
    return out


