"""The prefill side of the side channel: one ROUTER socket, never raising out of
``on_readable`` whatever arrives (upstream's listener thread died on the first
malformed message, vLLM #54757)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvsm.handshake.address import INPROC_PREFIX, peer_address
from kvsm.handshake.codec import _clip, decode_request, encode
from kvsm.handshake.keys import ZAP_DOMAIN, SideChannelKeys
from kvsm.handshake.messages import (
    CLAIM_STATUSES,
    MAX_FRAME_BYTES,
    MAX_ID_LENGTH,
    MAX_REPLY_BYTES,
    Abandon,
    ClaimsReply,
    ClaimStatus,
    CompatInfo,
    ErrorReply,
    HandshakeProtocolError,
    Heartbeat,
    MetadataReply,
    MetadataRequest,
    Reply,
    Request,
    WriteAsk,
    compat_hash,
    wire_lease_ms,
)
from kvsm.handshake.relay import RankRelay, worker_name
from kvsm.handshake.zap import ZapHandler, rate_limited

log = logging.getLogger("kvsm.handshake")

MetadataProvider = Callable[[int, int], "tuple[str, bytes, bytes, int] | None"]
"""(tp_rank, pp_rank) -> (agent_name, agent_metadata, layout, meta_version), or None
for a rank this engine does not have. Called per request: a re-registered agent
is served from the next request on."""

ClaimsHandler = Callable[[str, str, list[str], int], dict[str, str]]
"""(kind, requester, claims, readers) -> {claim: "ok" | "expired" | "unknown"} for
every claim; kind is "claim" (with a metadata request), "heartbeat" or "abandon";
readers: how many ranks of the requester's engine have business with them here."""

WritesHandler = Callable[["WriteAsk"], dict[str, str]]
"""A push-mode write ask -> {prefill request: "ok" | "expired" | "unknown"} for each
of its writes (the statuses of a claim's answer)."""

_CLAIM_KIND = {MetadataRequest: "claim", Heartbeat: "heartbeat", Abandon: "abandon"}
_MONITOR_EVENTS: dict[int, str] = {
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "zmtp_ok",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "zmtp_failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "zmtp_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth_failed",  # (counted by the ZAP handler as refused)
}
_MAX_FRAMES = 3  # [identity, (empty delimiter from REQ), payload]


class _Refusal(Exception):
    """Internal: answer this request with ErrorReply(code, detail)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code
        self.detail = detail


class HandshakeServer:
    """Prefill side: answers metadata requests, heartbeats and abandons.

    One ROUTER socket: any number of clients of any socket type (DEALER, REQ) are
    served concurrently and none can wedge it (a REQ that never reads its reply
    only fills its own pipe; replies are sent NOBLOCK with ROUTER_MANDATORY so a
    reply that cannot be delivered is counted, not blocked on). ROUTER_HANDOVER
    stays off so that a peer cannot take over another client's routing id.

    ``host`` is an address to bind over TCP (``port`` 0: the OS chooses), or
    ``inproc:NAME``: then it binds ``inproc://NAME-port`` on ``context``
    (:func:`peer_address`), for engines that share one process and context.

    Call :meth:`on_readable` from the loop thread whenever any socket in
    :meth:`sockets` is readable (the second one is a monitor counting TCP
    connections, ZMTP failures and disconnects: a frame over MAX_FRAME_BYTES is
    dropped by libzmq, which closes that connection, and it shows only there).

    With ``keys`` (the deployment's CURVE keys) the TCP socket is a CURVE server
    and a ZAP handler on the loop lets in only clients holding one of them: a
    stranger never reaches :meth:`_handle`, so it gets no answer of any kind,
    no error detail and no ``compat``. A third socket in :meth:`sockets` is that
    handler's. :meth:`set_keys` changes the keys of a running server.
    Readiness must be level-triggered (zmq.Poller): at most ``max_batch``
    messages are handled per call so a flood cannot starve the loop's timers.

    Memory per hostile connection is bounded by rcvhwm x MAX_FRAME_BYTES inbound
    (libzmq has no limit on frames per multipart message, so a peer that sends
    endless frames in one message is not bounded: a known libzmq limitation) and
    by sndhwm replies outbound for a peer that never reads them.
    """

    def __init__(self, engine_id: str, compat: CompatInfo, provide: MetadataProvider,
                 on_claims: ClaimsHandler, *, host: str = "127.0.0.1", port: int = 0,
                 context: zmq.Context | None = None, max_batch: int = 1024,
                 rcvhwm: int = 16, sndhwm: int = 1000, lease_ns: int = 0, rank: int | None = None,
                 pp_rank: int = 0, relay_to: Mapping[int | tuple[int, int], str] | None = None,
                 internal: str = "", keys: SideChannelKeys | None = None,
                 now_ns: Callable[[], int] = time.monotonic_ns, on_writes: WritesHandler | None = None) -> None:
        self.engine_id = engine_id
        # The worker this server answers for, (tp_rank, pp_rank); requests for other
        # workers are relayed (``relay_to``: (tp_rank, pp_rank), or a tp_rank of stage
        # 0, -> its internal endpoint) or refused (rank None: any rank is answered
        # here, ``provide`` decides). ``internal``: bind that private endpoint instead
        # of host:port, for rank 0's relay only.
        self.rank = rank
        self.pp_rank = pp_rank
        self._internal = bool(internal)
        self._now_ns = now_ns
        # The worker's lease (ns, 0: not stated), in the wire's unit once, here.
        self.lease_ns = lease_ns
        self._lease_ms = wire_lease_ms(lease_ns)
        self.compat = compat
        self.compat_hash = compat_hash(compat)
        self._provide = provide
        self._on_claims = on_claims
        self._on_writes = on_writes
        self._max_batch = max_batch
        self._ctx = context or zmq.Context.instance()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._served: Counter[str] = Counter()
        self._connections: Counter[str] = Counter()
        self._closed = False

        inproc = host.startswith(INPROC_PREFIX)
        # Ranks' private endpoints (ipc in a 0700 directory) carry what rank 0 let in.
        self.keys = keys if not internal else None
        self._zap = ZapHandler(self._ctx, self.keys, label=f"side channel of {engine_id}") if self.keys else None
        router = self._ctx.socket(zmq.ROUTER)
        try:
            if self.keys is not None:
                router.setsockopt(zmq.CURVE_SERVER, 1)
                router.setsockopt(zmq.CURVE_SECRETKEY, self.keys.own.secret)
                router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
                router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: nobody in
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Inbound: a small queue per connection is only flow control (libzmq stops
            # reading that TCP connection), and bounds what a hostile peer can park
            # here to rcvhwm x MAX_FRAME_BYTES. Outbound: a reply that finds its
            # peer's queue full is dropped and counted, never waited for; keep that
            # queue deep, since libzmq learns of reads only every sndhwm/2 messages.
            router.setsockopt(zmq.RCVHWM, rcvhwm)
            router.setsockopt(zmq.SNDHWM, sndhwm)
            # A peer stalled in the ZMTP 3 greeting is dropped after 5 s. (Bytes that
            # do not start like ZMTP 3 are read as ZMTP 1.0 frames, libzmq's legacy
            # path: such a peer stays connected until it closes; it costs an fd.)
            router.setsockopt(zmq.HANDSHAKE_IVL, 5000)
            # Drop connections of clients that vanished without a FIN.
            router.setsockopt(zmq.HEARTBEAT_IVL, 10_000)
            router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
            if internal:
                router.bind(internal)
            elif inproc:
                # Exactly the endpoint peer_address(host, port) names, so that a
                # client given (host, port) finds it; the port is only a name here.
                router.bind(peer_address(host, port))
            else:
                if ":" in host:
                    router.setsockopt(zmq.IPV6, 1)
                router.bind(peer_address(host, port or "*"))  # "*": the OS chooses; see self.port
        except zmq.ZMQError as e:
            router.close(linger=0)
            if self._zap is not None:
                self._zap.close()
            raise OSError(f"handshake server could not bind {host}:{port or '*'}: {e}") from e
        self._router = router
        self.address: str = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = port if inproc or internal else int(self.address.rsplit(":", 1)[1])
        self._relay = RankRelay(self._ctx, relay_to) if relay_to else None
        events = 0
        for event in _MONITOR_EVENTS:
            events |= event
        self._monitor = router.get_monitor_socket(events=events)

    # ---- loop interface

    def sockets(self) -> list[zmq.Socket]:
        """The sockets the loop must poll for reading; both go to on_readable()."""
        if self._closed:
            return []
        return [self._router, self._monitor, *(self._relay.sockets() if self._relay else ()),
                *((self._zap.socket,) if self._zap is not None else ())]

    def on_readable(self, sock: zmq.Socket | None = None) -> int:
        """Handle what is ready on both sockets (``sock`` is accepted for the loop's
        callback signature and ignored): at most max_batch requests; returns how
        many were handled. Never raises."""
        if self._closed:
            return 0
        if sock is not None and self._relay is not None and self._relay.owns(sock):
            return self._relay_replies(sock)
        if self._zap is not None and sock is self._zap.socket:
            return self._zap.on_readable()
        self._drain_monitor()
        handled = 0
        while handled < self._max_batch:
            try:
                frames = self._recv_frames()
            except zmq.Again:
                break
            except zmq.ZMQError as e:  # ETERM / ENOTSOCK during shutdown
                self._count_error("recv_failed", f"recv failed: {e}")
                break
            handled += 1
            try:
                self._handle(frames)
            except Exception:  # noqa: BLE001 - never let a message kill the loop
                self._count_error("internal", "unexpected failure handling a message", exc_info=True)
        return handled

    def stats(self) -> dict[str, Any]:
        """Counters: received/replied totals, requests served by type, refusals by
        error code, replies that could not be delivered, connection events."""
        return {
            **dict(self._counts),
            "served": dict(self._served),
            "errors": dict(self._errors),
            "connections": dict(self._connections),
            **({"auth": self._zap.stats()} if self._zap is not None else {}),
        }

    def set_keys(self, keys: SideChannelKeys) -> bool:
        """Serve with ``keys`` from now on. When the key in use changed, or a key
        was removed, the TCP endpoint is bound afresh: every connection drops (one
        that a removed key let in must not stay), clients re-send what was in
        flight (:class:`~kvsm.handshake.client.HandshakeClient` does). Returns
        whether the socket was rebound. A server started without keys cannot take
        them (raises ValueError): its peers could not talk to it meanwhile."""
        if self._zap is None or self.keys is None:
            raise ValueError("this side channel was started without side_channel_keys")
        old, self.keys = self.keys, keys
        self._zap.set_keys(keys)
        if old.own.public == keys.own.public and set(old.publics) <= set(keys.publics):
            return False
        self.on_readable()  # answer what is here before its connections go
        self._router.unbind(self.address)
        self._router.setsockopt(zmq.CURVE_SECRETKEY, keys.own.secret)
        deadline = time.monotonic_ns() + 2_000_000_000  # real time, whatever clock the loop runs on
        while True:  # the old listener's close is the I/O thread's: usually done at once
            try:
                self._router.bind(self.address)
                return True
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic_ns() > deadline:
                    raise OSError(f"side channel of {self.engine_id}: could not bind {self.address} "
                                  f"again with the new keys: {e}") from e
                time.sleep(0.001)

    def close(self) -> None:
        """Close both sockets (unregister them from the poller first)."""
        if self._closed:
            return
        self._closed = True
        if self._relay is not None:
            self._relay.close()
        if self._zap is not None:
            self._zap.close()
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._router.close(linger=0)

    # ---- internals

    def _recv_frames(self) -> list[bytes]:
        """One multipart message; beyond _MAX_FRAMES+1 frames the rest is read and
        dropped without being kept (the message is malformed anyway)."""
        frames = [self._router.recv(zmq.NOBLOCK)]
        extra = 0
        while self._router.getsockopt(zmq.RCVMORE):
            frame = self._router.recv(zmq.NOBLOCK)  # the rest of a message is already here
            if len(frames) <= _MAX_FRAMES:
                frames.append(frame)
            else:
                extra += 1
        if extra:
            frames.append(b"")  # keep the count wrong; content is never read
        return frames

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except Exception:  # noqa: BLE001 - a monitor hiccup is not worth dying for
                self._connections["monitor_unreadable"] += 1
                return
            self._connections[_MONITOR_EVENTS.get(event["event"], f"event_{event['event']}")] += 1

    def _handle(self, frames: list[bytes]) -> None:
        self._counts["received"] += 1
        identity = frames[0]
        if self._internal:  # rank 0's relay: [its routing id, correlation id, payload]
            if len(frames) != 3:
                self._counts["relay_malformed"] += 1
                return
            envelope, payload = [identity, frames[1]], frames[2]
        elif len(frames) == 2:
            envelope, payload = [identity], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            envelope, payload = [identity, b""], frames[2]
        else:
            # Reply in the framing the peer most likely uses, so it can read the refusal.
            envelope = [identity, b""] if len(frames) > 1 and frames[1] == b"" else [identity]
            shape = "1 frame" if len(frames) == 1 else f"{len(frames) - 1} frames"
            self._refuse(envelope, None, "malformed",
                         f"expected one payload frame (DEALER) or an empty delimiter and one "
                         f"payload frame (REQ), got {shape} after the routing id")
            return
        try:
            request = decode_request(payload)
        except HandshakeProtocolError as e:
            self._refuse(envelope, e.nonce, e.code, e.detail)
            return
        if self.rank is not None and (request.tp_rank, request.pp_rank) != (self.rank, self.pp_rank):
            self._relay_request(request, envelope, payload)
            return
        try:
            reply = self._answer(request)
        except _Refusal as r:
            self._refuse(envelope, request.nonce, r.code, r.detail)
            return
        except Exception as e:  # noqa: BLE001 - a callback bug must not stop the server
            self._refuse(envelope, request.nonce, "internal",
                         f"the prefill side failed answering {type(request).__name__}: "
                         f"{type(e).__name__}: {e}", exc_info=True)
            return
        self._served[type(request).__name__] += 1
        self._send(envelope, reply)

    def _answer(self, request: Request) -> Reply:
        if isinstance(request, MetadataRequest):
            if request.compat_hash != self.compat_hash:
                raise _Refusal("incompatible",
                               f"compat hash {request.compat_hash[:16]}... differs from this "
                               f"engine's {self.compat_hash[:16]}...; the reply's compat field "
                               f"holds this engine's CompatInfo to compare against")
            provided = self._provide(request.tp_rank, request.pp_rank)
            if provided is None:
                raise _Refusal("unknown_rank",
                               f"engine {self.engine_id} has no worker tp_rank={request.tp_rank} "
                               f"pp_rank={request.pp_rank}")
            agent_name, agent_metadata, layout, meta_version = _check_provided(provided)
            claims = self._claims("claim", request)
            return MetadataReply(
                nonce=request.nonce, engine_id=self.engine_id, tp_rank=request.tp_rank,
                pp_rank=request.pp_rank, compat=self.compat, compat_hash=self.compat_hash,
                agent_name=agent_name, agent_metadata=agent_metadata, layout=layout,
                meta_version=meta_version, claims=claims, lease_ms=self._lease_ms)
        if isinstance(request, WriteAsk):
            if self._on_writes is None:
                raise _Refusal("unsupported", f"engine {self.engine_id} takes no writes (push mode): it serves "
                                              f"no prefills")
            try:
                answers = self._on_writes(request)
            except ValueError as e:  # the worker cannot serve this ask at all: it says why
                raise _Refusal("refused", str(e)) from e
            return ClaimsReply(nonce=request.nonce, claims=self._checked(request, answers), lease_ms=self._lease_ms)
        return ClaimsReply(nonce=request.nonce, claims=self._claims(_CLAIM_KIND[type(request)], request),
                           lease_ms=self._lease_ms)

    # ---- other ranks (one port per engine: see kvsm.handshake.relay)

    def _relay_request(self, request: Request, envelope: list[bytes], payload: bytes) -> None:
        worker = (request.tp_rank, request.pp_rank)
        if self._relay is None or worker not in self._relay.endpoints:
            self._refuse(envelope, request.nonce, "unknown_rank",
                         f"engine {self.engine_id} has no worker tp_rank={worker[0]} pp_rank={worker[1]}")
            return
        why = self._relay.forward(worker, envelope, payload, request.nonce, self._now_ns())
        if why:
            self._refuse(envelope, request.nonce, why, f"engine {self.engine_id} could not pass the request on to "
                                                       f"its worker {worker_name(*worker)} ({why})")
            return
        self._counts["relayed"] += 1

    def _relay_replies(self, sock: zmq.Socket) -> int:
        assert self._relay is not None
        replies = self._relay.replies(sock)
        for envelope, payload in replies:
            try:
                self._router.send_multipart([*envelope, payload], zmq.NOBLOCK)
            except zmq.ZMQError:
                self._counts["reply_dropped"] += 1
            else:
                self._counts["relayed_replied"] += 1
        return len(replies)

    def next_deadline_ns(self) -> int | None:
        """When a relayed request times out next (None: none in flight)."""
        return self._relay.next_deadline_ns() if self._relay is not None else None

    def expire(self, now_ns: int) -> int:
        """Answer the relayed requests whose rank did not answer in time."""
        if self._relay is None:
            return 0
        late = self._relay.expire(now_ns)
        for envelope, nonce, worker in late:
            self._refuse(envelope, nonce, "rank_unavailable",
                         f"worker {worker_name(*worker)} of engine {self.engine_id} did not answer within "
                         f"{self._relay.timeout_ns / 1e9:.1f} s (its process gone, or not started yet)")
        return len(late)

    def _claims(self, kind: str, request: Request) -> dict[str, ClaimStatus]:
        if not request.claims:
            return {}
        answers = self._on_claims(kind, request.requester, list(request.claims), request.readers)
        return self._checked(request, answers, kind)

    def _checked(self, request: Request, answers: object, kind: str = "write_ask") -> dict[str, ClaimStatus]:
        """A handler's answers, one valid status per claim of ``request``, or ValueError."""
        if not isinstance(answers, dict):
            raise TypeError(f"on_claims returned {type(answers).__name__}, expected a dict")
        missing = [c for c in request.claims if c not in answers]
        bad = {c: s for c, s in answers.items() if s not in CLAIM_STATUSES}
        if missing or bad:
            raise ValueError(f"on_claims({kind!r}) answered badly: missing {missing[:5]}, "
                             f"invalid statuses {dict(list(bad.items())[:5])}")
        return cast("dict[str, ClaimStatus]", {c: answers[c] for c in request.claims})  # checked above

    def _refuse(self, envelope: list[bytes], nonce: int | None, code: str, detail: str,
                exc_info: bool = False) -> None:
        self._count_error(code, detail, exc_info=exc_info)
        self._send(envelope, ErrorReply(nonce=nonce or 0, code=code, detail=_clip(detail),
                                        compat=self.compat))

    def _count_error(self, code: str, detail: str, exc_info: bool = False) -> None:
        self._errors[code] += 1
        n = self._errors[code]
        if rate_limited(n):
            log.warning("handshake server %s: refused %d %s message(s) so far; latest: %s",
                        self.engine_id, n, code, _clip(detail, 300), exc_info=exc_info)

    def _send(self, envelope: list[bytes], reply: Reply) -> None:
        try:
            payload = encode(reply)
            if len(payload) > MAX_REPLY_BYTES:
                raise ValueError(f"reply of {len(payload)} bytes exceeds {MAX_REPLY_BYTES}")
        except Exception as e:  # noqa: BLE001 - e.g. the provider returned huge metadata
            self._count_error("internal", f"could not encode {type(reply).__name__}: {e}")
            payload = encode(ErrorReply(nonce=reply.nonce, code="internal", compat=self.compat,
                                        detail=_clip(f"could not encode the reply: {e}")))
        try:
            self._router.send_multipart([*envelope, payload], zmq.NOBLOCK)
        except zmq.Again:  # that peer's pipe is full: it does not read its replies
            self._counts["reply_dropped_full"] += 1
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer disconnected meanwhile
            self._counts["reply_unroutable" if e.errno == zmq.EHOSTUNREACH else "reply_failed"] += 1
        else:
            self._counts["replied"] += 1


def _check_provided(provided: Any) -> tuple[str, bytes, bytes, int]:
    """The provider's answer, type-checked so that a bug says what was wrong."""
    if not isinstance(provided, tuple) or len(provided) != 4:
        raise TypeError(f"provide() must return (agent_name, agent_metadata, layout, "
                        f"meta_version) or None, got {type(provided).__name__}")
    agent_name, agent_metadata, layout, meta_version = provided
    if not isinstance(agent_name, str) or not 0 < len(agent_name) <= MAX_ID_LENGTH:
        raise TypeError(f"provide(): agent_name must be a non-empty str of at most "
                        f"{MAX_ID_LENGTH} chars, got {agent_name!r:.80}")
    if not isinstance(agent_metadata, (bytes, bytearray, memoryview)):
        raise TypeError(f"provide(): agent_metadata must be bytes, got {type(agent_metadata).__name__}")
    if not isinstance(layout, (bytes, bytearray, memoryview)):
        raise TypeError(f"provide(): layout must be bytes, got {type(layout).__name__}")
    if type(meta_version) is not int or not -(1 << 63) <= meta_version < 1 << 63:
        raise TypeError(f"provide(): meta_version must be an int64, got {meta_version!r:.40}")
    if len(agent_metadata) + len(layout) > MAX_REPLY_BYTES - 64 * 1024:
        raise ValueError(f"provide(): {len(agent_metadata) + len(layout)} bytes of metadata and "
                         f"layout do not fit a {MAX_REPLY_BYTES}-byte reply")
    return agent_name, bytes(agent_metadata), bytes(layout), meta_version
