"""The decode side of the side channel: one DEALER socket per prefill peer, so
that a dead or slow peer only delays its own requests (upstream's one-worker
handshake executor let one dead peer delay every other handshake)."""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterable

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvsm.handshake.codec import decode_reply, decode_request, encode
from kvsm.handshake.keys import SideChannelKeys
from kvsm.handshake.messages import (
    MAX_REPLY_BYTES,
    PROTOCOL_VERSION,
    Abandon,
    ClaimsReply,
    CompatInfo,
    HandshakeError,
    HandshakeProtocolError,
    HandshakeRefused,
    HandshakeResult,
    HandshakeTimeout,
    Heartbeat,
    MetadataReply,
    MetadataRequest,
    Request,
    WriteAsk,
    compat_hash,
)
from kvsm.handshake.peer_socket import HANDSHAKE_FAILED, PeerSocket, ServerKeyChoice, close_pair, open_peer_socket
from kvsm.handshake.pending import Pending, judge

log = logging.getLogger("kvsm.handshake")

_MAX_RESENDS = 3


class HandshakeClient:
    """Decode side: sends requests to any number of prefill peers, one DEALER
    socket per peer so that a dead or slow peer only delays its own requests.

    Everything is driven by the owning loop thread: ``send``/``fetch_metadata``/
    ``heartbeat``/``abandon`` queue a request and return its id; the loop polls
    :meth:`sockets` and calls :meth:`on_readable` for a readable one, and calls
    :meth:`expire` at :meth:`next_deadline_ns` (same clock as the deadlines you
    pass). Each of those, and :meth:`poll_results`, returns the results that became
    known, each exactly once. No method raises on bad data (a bad address, a
    too-long claim id from ``kv_transfer_params``, a garbage reply): that becomes
    the request's result.

    Connecting is lazy (ZMQ): nothing fails at send time; the request is queued
    on the peer's socket and delivered once the connection is up. Each peer socket
    has a monitor (in :meth:`sockets` too; hand it to :meth:`on_readable` like the
    DEALER) so that a connection the peer's host *refuses* (a closed port: the
    process is gone or not started yet; a host reported unreachable counts the
    same) fails every request pending on that peer with :class:`HandshakeRefused`
    about a millisecond after the attempt, and a peer that was connected and died
    fails them when its reconnect is refused (a reconnect interval, 100 ms, later).
    The refused socket is closed; the next request to that address makes a fresh
    one and tries again. A peer that accepts the connection and never answers, and
    a host that drops connection attempts without a word, still time out at the
    deadline. ZMQ_IMMEDIATE is left off on purpose: with it a send fails while the
    connection is still being set up, even to a live peer.

    A timeout closes that peer's socket, so nothing queued for or arriving from the
    dead connection can ever be read, and re-sends that peer's other pending
    requests on a fresh socket. Replies carry the request's nonce; one that matches
    no pending request (late, duplicated, forged) is dropped and counted. A reply
    already waiting on the socket wins over a timeout or a refusal noticed with it.

    Register sockets with the poller through ``on_socket_added`` and unregister them
    through ``on_socket_removed``, which is called *before* a socket is closed (a
    closed socket left in a zmq.Poller makes poll() fail).

    With ``keys`` every peer socket is a CURVE client (this engine's key, and the
    server key of :class:`~kvsm.handshake.peer_socket.ServerKeyChoice`); a failed
    ZMTP handshake tries the deployment's next key and, when every key failed,
    fails that peer's requests "unauthenticated" (without keys: a peer that needs
    them fails them "handshake_failed") instead of letting libzmq retry for ever.
    A keyed server drops its connections when its keys change; what was pending
    on a dropped connection is sent again on a fresh socket (at most
    ``_MAX_RESENDS`` times per request; then the deadline decides).
    """

    def __init__(self, compat: CompatInfo, requester: str, *, context: zmq.Context | None = None,
                 on_socket_added: Callable[[zmq.Socket], object] | None = None,
                 on_socket_removed: Callable[[zmq.Socket], object] | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES, keys: SideChannelKeys | None = None) -> None:
        self.compat = compat
        self.compat_hash = compat_hash(compat)
        self.requester = requester
        self._ctx = context or zmq.Context.instance()
        self._on_added = on_socket_added
        self._on_removed = on_socket_removed
        self._max_reply_bytes = max_reply_bytes
        self._ids = itertools.count(1)
        self._server_keys = ServerKeyChoice(keys)
        self._peers: dict[str, PeerSocket] = {}
        self._by_socket: dict[zmq.Socket, PeerSocket] = {}
        self._pending: dict[int, Pending] = {}
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ns, request_id), lazily pruned
        self._results: list[HandshakeResult] = []
        self._stats: Counter[str] = Counter()
        self._closed = False

    # ---- requests

    def fetch_metadata(self, peer: str, tp_rank: int, pp_rank: int = 0,
                       claims: Iterable[str] = (), *, deadline_ns: int,
                       expected_engine_id: str | None = None, readers: int = 1) -> int:
        """Ask ``peer`` for the agent of (tp_rank, pp_rank) and claim ``claims``.
        With ``expected_engine_id``, a reply from another engine (the prefill engine
        restarted on the same port) is an error, not a silent switch."""
        request = MetadataRequest(protocol=PROTOCOL_VERSION, requester=self.requester,
                                  tp_rank=tp_rank, pp_rank=pp_rank,
                                  compat_hash=self.compat_hash, claims=list(claims), readers=readers)
        return self.send(peer, request, deadline_ns, expected_engine_id=expected_engine_id)

    def heartbeat(self, peer: str, claims: Iterable[str], *, deadline_ns: int, readers: int = 1,
                  tp_rank: int = 0, pp_rank: int = 0) -> int:
        """Extend the leases of ``claims`` on ``peer``'s worker (tp_rank, pp_rank)."""
        request = Heartbeat(protocol=PROTOCOL_VERSION, requester=self.requester, claims=list(claims),
                            readers=readers, tp_rank=tp_rank, pp_rank=pp_rank)
        return self.send(peer, request, deadline_ns)

    def abandon(self, peer: str, claims: Iterable[str], *, deadline_ns: int, readers: int = 1,
                tp_rank: int = 0, pp_rank: int = 0) -> int:
        """Tell ``peer``'s worker (tp_rank, pp_rank) these requests will never be read
        (by us: ``readers`` workers of our engine have business with them there)."""
        request = Abandon(protocol=PROTOCOL_VERSION, requester=self.requester, claims=list(claims),
                          readers=readers, tp_rank=tp_rank, pp_rank=pp_rank)
        return self.send(peer, request, deadline_ns)

    def send(self, peer: str, request: Request, deadline_ns: int, *,
             expected_engine_id: str | None = None) -> int:
        """Queue ``request`` (its nonce is replaced by the returned request id)."""
        if not isinstance(request, (MetadataRequest, Heartbeat, Abandon, WriteAsk)):
            raise TypeError(f"send() takes a MetadataRequest, Heartbeat, Abandon or WriteAsk, "
                            f"got {type(request).__name__}")
        request_id = next(self._ids)
        if self._closed:
            self._fail(request_id, peer, HandshakeError("closed", "the handshake client is closed"))
            return request_id
        try:
            payload = encode(msgspec.structs.replace(request, nonce=request_id))
            decode_request(payload)  # encoding does not check bounds; the server would refuse it
        except HandshakeProtocolError as e:
            self._fail(request_id, peer, HandshakeProtocolError(
                e.code, f"not sent, the server would refuse it: {e.detail}", peer=peer, nonce=request_id))
            return request_id
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as e:
            self._fail(request_id, peer, HandshakeProtocolError(
                "malformed", f"not sent, cannot be encoded: {e}", peer=peer, nonce=request_id))
            return request_id
        pending = Pending(request_id, peer, payload, deadline_ns,
                           MetadataReply if isinstance(request, MetadataRequest) else ClaimsReply,
                           expected_engine_id=expected_engine_id)
        if isinstance(request, MetadataRequest):
            pending.tp_rank, pending.pp_rank = request.tp_rank, request.pp_rank
        try:
            target = self._peer(peer)
        except (zmq.ZMQError, TypeError, ValueError) as e:  # the address came from kv_transfer_params
            self._fail(request_id, peer, HandshakeError(
                "bad_address", f"cannot connect to {peer!r}: {e}", peer=peer, nonce=request_id))
            return request_id
        self._pending[request_id] = pending
        target.pending.add(request_id)
        heapq.heappush(self._deadlines, (deadline_ns, request_id))
        self._transmit(target, pending)
        return request_id

    def cancel(self, request_id: int) -> bool:
        """Forget a pending request; its reply, if one comes, is dropped."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return False
        peer = self._peers.get(pending.peer)
        if peer is not None:
            peer.pending.discard(request_id)
        return True

    def disconnect(self, address: str) -> bool:
        """Close the socket to ``address`` (a peer found dead): what is queued on
        it for the dead process is discarded instead of reaching whatever listens
        there next, and the next request connects afresh. Requests still pending
        there keep their deadlines (they time out). False: no socket was open."""
        return self._drop_peer(address) is not None

    # ---- loop interface

    def sockets(self) -> list[zmq.Socket]:
        """The sockets to poll for reading right now: per peer in use, its DEALER
        and that DEALER's monitor."""
        return [s for p in self._peers.values() for s in (p.sock, p.monitor)]

    def on_readable(self, sock: zmq.Socket) -> list[HandshakeResult]:
        """Read every reply (DEALER) or connection event (monitor) waiting on
        ``sock``; returns the results that became known."""
        peer = self._by_socket.get(sock)
        if peer is None:
            pass  # a socket already replaced: nothing to read
        elif sock is peer.monitor:
            self._drain_monitor(peer)
        else:
            self._drain(peer)
        return self.poll_results()

    def expire(self, now_ns: int) -> list[HandshakeResult]:
        """Time out every request whose deadline is <= now_ns; reset those peers'
        sockets. Returns the results that became known (timeouts and others)."""
        due: list[Pending] = []
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            deadline_ns, request_id = heapq.heappop(self._deadlines)
            pending = self._pending.get(request_id)
            if pending is not None and pending.deadline_ns == deadline_ns:
                due.append(pending)
        # A reply that already arrived wins over a deadline the loop noticed first,
        # and so does a refusal (the more precise verdict).
        for address in {pending.peer for pending in due}:
            if (peer := self._peers.get(address)) is not None:
                self._drain(peer)
                self._drain_monitor(peer)
        reset: set[str] = set()
        for pending in due:
            if pending.request_id not in self._pending:
                continue  # answered by that drain
            request_id = pending.request_id
            self._take(request_id)
            self._stats["timeouts"] += 1
            self._results.append(HandshakeResult(request_id, pending.peer, HandshakeTimeout(
                "timeout", f"no reply from {pending.peer} by the deadline",
                peer=pending.peer, nonce=request_id)))
            reset.add(pending.peer)
        for address in reset:
            self._reset_peer(address)
        return self.poll_results()

    def next_deadline_ns(self) -> int | None:
        """When expire() next has something to do, or None."""
        while self._deadlines and self._deadlines[0][1] not in self._pending:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def poll_results(self) -> list[HandshakeResult]:
        """Results not returned yet (e.g. requests refused before reaching the wire)."""
        results, self._results = self._results, []
        return results

    def pending_count(self) -> int:
        return len(self._pending)

    def socket_count(self) -> int:
        """Sockets open for peers: a DEALER and its monitor per peer address (a
        timed-out or refused peer's pair is replaced)."""
        return len(self._by_socket)

    def stats(self) -> dict[str, int]:
        """sent, replies, stale_replies, malformed_replies, timeouts, socket_resets,
        refused (requests failed as refused), refused_sockets (peer sockets closed
        on a refusal)..."""
        return dict(self._stats)

    def close(self) -> None:
        """Close every socket, monitors included (on_socket_removed first); pending
        requests are dropped without a result."""
        self._closed = True
        for address in list(self._peers):
            self._drop_peer(address)
        self._pending.clear()
        self._deadlines.clear()

    # ---- internals

    @property
    def keys(self) -> SideChannelKeys | None:
        return self._server_keys.keys

    def set_keys(self, keys: SideChannelKeys | None) -> None:
        """Use ``keys`` from now on: every peer socket is made afresh with them
        (what is pending on it is sent again)."""
        self._server_keys.set_keys(keys)
        for address in list(self._peers):
            self._reset_peer(address)

    def _peer(self, address: str) -> PeerSocket:
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        peer = open_peer_socket(self._ctx, address, self._max_reply_bytes, self._server_keys.keys,
                                self._server_keys.key_for(address))
        self._peers[address] = peer
        self._by_socket[peer.sock] = peer
        self._by_socket[peer.monitor] = peer
        if self._on_added is not None:
            self._on_added(peer.sock)
            self._on_added(peer.monitor)
        return peer

    def _transmit(self, peer: PeerSocket, pending: Pending) -> None:
        try:
            peer.sock.send(pending.payload, zmq.NOBLOCK)
            self._stats["sent"] += 1
        except zmq.Again:  # SNDHWM requests already queued for a peer that is not reading
            self._take(pending.request_id)
            self._fail(pending.request_id, peer.address, HandshakeError(
                "send_queue_full", f"too many requests queued for {peer.address}",
                peer=peer.address, nonce=pending.request_id))

    def _drain(self, peer: PeerSocket) -> None:
        while True:
            try:
                frames = peer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                self._stats["recv_failed"] += 1
                log.warning("handshake client: recv from %s failed: %s", peer.address, e)
                return
            try:
                self._on_reply(peer, frames)
            except Exception:  # a hostile peer must not break the loop
                self._stats["internal"] += 1
                log.exception("handshake client: failed handling a reply from %s", peer.address)

    def _drain_monitor(self, peer: PeerSocket) -> None:
        """Track the peer's connection; a connect attempt that failed while no
        connection was up means the peer's host refuses it: fail its requests now."""
        while True:
            try:
                message = parse_monitor_message(peer.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except Exception:  # noqa: BLE001 - a monitor hiccup is not worth failing requests over
                self._stats["monitor_unreadable"] += 1
                return
            event = message["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                peer.connected = True
                self._server_keys.succeeded(peer.address)
            elif event == zmq.EVENT_CONNECTED:
                peer.connected = True
            elif event in HANDSHAKE_FAILED:
                self._handshake_failed(peer, event, message["value"])
                return  # its sockets are closed or replaced
            elif event == zmq.EVENT_DISCONNECTED:
                peer.connected = False
                if self.keys is not None and self._resend_after_drop(peer):
                    return
            elif event == zmq.EVENT_CLOSED and not peer.connected:
                self._refused(peer)
                return  # its sockets are closed; later events are moot

    def _handshake_failed(self, peer: PeerSocket, event: int, value: int) -> None:
        """Try the deployment's next key; when none is left, fail what is pending."""
        self._drain(peer)
        self._stats["handshake_failed"] += 1
        if self._server_keys.failed(peer.address):
            self._stats["server_key_switches"] += 1
            self._reset_peer(peer.address)
            return
        self._drop_peer(peer.address)
        for request_id in sorted(peer.pending):
            if request_id in self._pending:
                self._take(request_id)
                self._fail(request_id, peer.address, self._server_keys.failure(peer.address, event, value, request_id))

    def _resend_after_drop(self, peer: PeerSocket) -> bool:
        """A keyed server dropped the connection (its keys changed): what was in
        flight on it is lost, so send it again on a fresh socket."""
        pending = [self._pending[r] for r in peer.pending if r in self._pending]
        if not pending or any(p.resends >= _MAX_RESENDS for p in pending):
            return False
        for p in pending:
            p.resends += 1
        self._stats["resent_after_drop"] += len(pending)
        self._reset_peer(peer.address)
        return True

    def _refused(self, peer: PeerSocket) -> None:
        """Fail every request pending on ``peer`` as refused and close its sockets,
        so the next request to that address connects afresh."""
        self._drain(peer)  # a reply that arrived before the connection went wins
        self._drop_peer(peer.address)
        self._stats["refused_sockets"] += 1
        for request_id in sorted(peer.pending):
            if request_id not in self._pending:
                continue
            self._take(request_id)
            self._stats["refused"] += 1
            self._results.append(HandshakeResult(request_id, peer.address, HandshakeRefused(
                "refused", f"connection refused by {peer.address}", peer=peer.address, nonce=request_id)))

    def _on_reply(self, peer: PeerSocket, frames: list[bytes]) -> None:
        self._stats["replies"] += 1
        if len(frames) != 1:
            self._stats["malformed_replies"] += 1
            return
        try:
            reply = decode_reply(frames[0], self._max_reply_bytes)
        except HandshakeProtocolError as e:
            self._stats["malformed_replies"] += 1
            if e.nonce is not None and e.nonce in peer.pending:
                self._take(e.nonce)
                self._fail(e.nonce, peer.address, HandshakeProtocolError(
                    e.code, f"bad reply: {e.detail}", peer=peer.address, nonce=e.nonce))
            return
        if reply.nonce not in peer.pending:  # late (after a timeout), duplicated or forged
            self._stats["stale_replies"] += 1
            return
        pending = self._take(reply.nonce)
        self._stats["completed"] += 1
        self._results.append(HandshakeResult(pending.request_id, peer.address,
                                             judge(pending, reply, self.compat, self.compat_hash)))

    def _take(self, request_id: int) -> Pending:
        pending = self._pending.pop(request_id)
        peer = self._peers.get(pending.peer)
        if peer is not None:
            peer.pending.discard(request_id)
        return pending

    def _fail(self, request_id: int, peer: str, error: HandshakeError) -> None:
        self._stats[f"failed_{error.code}"] += 1
        self._results.append(HandshakeResult(request_id, peer, error))

    def _drop_peer(self, address: str) -> PeerSocket | None:
        peer = self._peers.pop(address, None)
        if peer is None:
            return None
        for sock in (peer.sock, peer.monitor):
            del self._by_socket[sock]
            if self._on_removed is not None:
                try:
                    self._on_removed(sock)
                except Exception:
                    log.exception("handshake client: on_socket_removed failed")
        close_pair(peer.sock, peer.monitor)
        return peer

    def _reset_peer(self, address: str) -> None:
        """Fresh socket for a peer that missed a deadline; re-send what is still pending
        (requests are idempotent: a claim or heartbeat applied twice extends a lease
        twice)."""
        old = self._drop_peer(address)
        if old is None:
            return
        self._stats["socket_resets"] += 1
        still_pending = sorted(old.pending)
        if not still_pending:
            return  # a new socket is made when one is next needed
        try:
            peer = self._peer(address)
        except zmq.ZMQError as e:  # cannot happen for an address that connected before
            for request_id in still_pending:
                self._take(request_id)
                self._fail(request_id, address, HandshakeError(
                    "bad_address", f"cannot reconnect to {address!r}: {e}", peer=address))
            return
        for request_id in still_pending:
            peer.pending.add(request_id)
            self._transmit(peer, self._pending[request_id])
