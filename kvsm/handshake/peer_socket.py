"""The client's socket to one prefill peer: a DEALER and its monitor, set up
the same way for every peer, CURVE included when the deployment has keys.

With keys, a client must name the server's public key before connecting. A
running deployment may hold more than one key during a rotation (the peer may
serve with the old one or the new one), so :class:`ServerKeyChoice` keeps, per
peer address, the key to try: the one that last worked, else this engine's
own; a failed CurveZMQ handshake moves on to the next trusted key, and only
when every key failed in a row is the peer's answer "unauthenticated".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import zmq

from kvsm.handshake.keys import SideChannelKeys
from kvsm.handshake.messages import HandshakeError

# What the client's monitors report. A connect attempt that fails on an opened fd
# (ECONNREFUSED: nothing listens; or an ICMP-unreachable host) closes that fd:
# EVENT_CLOSED, then EVENT_CONNECT_RETRIED. CLOSED alone is the signal: a
# CONNECT_RETRIED also follows every DISCONNECTED (it announces the reconnect timer,
# before any attempt) and every failed name lookup, and a peer that accepts TCP
# and stays silent shows only CONNECTED (plus ZMTP success for a ZMQ peer).
# A failed ZMTP handshake (a peer with keys when we have none or the reverse, a
# key it does not trust, a server key that is not its own) is one of
# HANDSHAKE_FAILED: libzmq would retry it for ever, so the client decides.
HANDSHAKE_FAILED = frozenset({zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                              zmq.EVENT_HANDSHAKE_FAILED_AUTH})
CLIENT_MONITOR_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                         | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
                         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                         | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(slots=True)
class PeerSocket:
    address: str
    sock: zmq.Socket
    monitor: zmq.Socket
    pending: set[int] = field(default_factory=set)
    # A TCP connection is up (monitor: CONNECTED or ZMTP handshake seen since the
    # socket was made or since the last DISCONNECTED).
    connected: bool = False


def open_peer_socket(ctx: zmq.Context, address: str, max_reply_bytes: int,
                     keys: SideChannelKeys | None, server_key: bytes | None) -> PeerSocket:
    """A connected DEALER to ``address`` with its monitor (made before connect():
    the first attempt's refusal comes within a millisecond). Raises on a bad address."""
    sock = ctx.socket(zmq.DEALER)
    monitor: zmq.Socket | None = None
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 10_000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30_000)
        if keys is not None:
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.own.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.own.secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key or keys.own.public)
        monitor = sock.get_monitor_socket(events=CLIENT_MONITOR_EVENTS)
        monitor.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
    except Exception:
        close_pair(sock, monitor)
        raise
    return PeerSocket(address, sock, monitor)


def close_pair(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    """Close a DEALER and its monitor (unregistered from the loop already)."""
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=0)


class ServerKeyChoice:
    """Per peer address: which of the deployment's keys to expect the server to
    hold, and how many handshakes failed in a row."""

    def __init__(self, keys: SideChannelKeys | None) -> None:
        self.keys = keys
        self._key: dict[str, bytes] = {}
        self._failures: Counter[str] = Counter()

    def set_keys(self, keys: SideChannelKeys | None) -> None:
        self.keys = keys
        trusted = set(keys.publics) if keys is not None else set()
        self._key = {a: k for a, k in self._key.items() if k in trusted}
        self._failures.clear()

    def key_for(self, address: str) -> bytes | None:
        if self.keys is None:
            return None
        return self._key.get(address, self.keys.own.public)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)

    def failed(self, address: str) -> bool:
        """A handshake with ``address`` failed: True if another key is left to try
        (it is chosen), False if every key failed in a row (the count starts over)."""
        self._failures[address] += 1
        keys = self.keys
        if keys is not None and self._failures[address] < len(keys.pairs):
            publics = keys.publics
            current = self.key_for(address)
            at = publics.index(current) if current in publics else -1
            self._key[address] = publics[(at + 1) % len(publics)]
            return True
        self._failures.pop(address, None)
        return False

    def failure(self, address: str, event: int, value: int, nonce: int | None = None) -> HandshakeError:
        """The error for the requests pending on a peer whose handshakes all failed."""
        keys = self.keys
        if keys is None:
            return HandshakeError(
                "handshake_failed",
                f"{address} would not complete a ZMQ handshake with an engine without keys: it requires "
                f"side_channel_keys (CURVE), or it is not a kvsm side channel ({zmq.Event(event).name})",
                peer=address, nonce=nonce)
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = f"it does not trust this engine's key {keys.own} (ZAP status {value})"
        else:
            why = (f"it serves with none of this engine's {len(keys.pairs)} key(s) "
                   f"({', '.join(str(p) for p in keys.pairs)}), or without keys")
        return HandshakeError("unauthenticated", f"the side channel at {address} did not let this engine "
                              f"in: {why}; check side_channel_keys on both engines", peer=address, nonce=nonce)
