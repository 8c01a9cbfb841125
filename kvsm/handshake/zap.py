"""libzmq's ZAP handler for the side channel, served by the loop thread itself.

A CURVE server socket asks ``inproc://zeromq.zap.01`` of its context whether
a client that completed the CurveZMQ handshake may in: the request carries the
client's long-term public key, which the client has proved it holds the secret
of. This handler answers from the deployment's keys (:mod:`kvsm.handshake.keys`):
200 for a key of the directory, 400 for anything else. It is a REP socket the
loop polls like every other; no thread of its own (pyzmq's
``ThreadAuthenticator`` would be one).

One handler per zmq context (libzmq's rule): a second keyed server on the same
context is refused with an error that says so. Refusals are counted and logged
at the 1st, 10th, 100th... so that a scanner cannot flood the log.
"""

from __future__ import annotations

import logging
from collections import Counter

import zmq

from kvsm.handshake.keys import ZAP_DOMAIN, SideChannelKeys, z85_to_raw

log = logging.getLogger("kvsm.handshake")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_VERSION = b"1.0"


def rate_limited(count: int) -> bool:
    """Log the 1st, 10th, 100th... occurrence: a flood must not flood the logs."""
    while count >= 10 and count % 10 == 0:
        count //= 10
    return count == 1


class ZapHandler:
    """Answers ZAP requests for the keyed side-channel socket(s) of one context."""

    def __init__(self, context: zmq.Context, keys: SideChannelKeys, *, label: str = "side channel",
                 max_batch: int = 256) -> None:
        self.label = label
        self._max_batch = max_batch
        self._counts: Counter[str] = Counter()
        self.set_keys(keys)
        sock = context.socket(zmq.REP)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise OSError(f"side_channel_keys: cannot serve authentication on this zmq context ({e}): "
                          f"another keyed kvsm server in this process already does; run one keyed "
                          f"prefill engine per process") from e
        self.socket = sock
        self._closed = False

    def set_keys(self, keys: SideChannelKeys) -> None:
        """From the next handshake on, let in exactly these keys."""
        self._trusted = {z85_to_raw(p.public): p.name for p in keys.pairs}

    def on_readable(self) -> int:
        """Answer every waiting request (at most max_batch); never raises."""
        handled = 0
        while handled < self._max_batch and not self._closed:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as e:  # ETERM during shutdown
                self._counts["recv_failed"] += 1
                log.warning("kvsm %s: ZAP receive failed: %s", self.label, e)
                break
            handled += 1
            try:
                reply = self._answer(frames)
            except Exception:
                log.exception("kvsm %s: ZAP request could not be handled", self.label)
                reply = [_VERSION, frames[1] if len(frames) > 1 else b"", b"500", b"internal", b"", b""]
            try:
                self.socket.send_multipart(reply, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self._counts["reply_failed"] += 1
                log.warning("kvsm %s: ZAP reply failed: %s", self.label, e)
        return handled

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # [version, request id, domain, address, routing id, mechanism, credentials...]
        request_id = frames[1] if len(frames) > 1 else b""
        if len(frames) < 7 or frames[0] != _VERSION:
            return self._refuse(request_id, "malformed ZAP request", "?")
        domain, address, mechanism = frames[2], frames[3].decode(errors="replace"), frames[5]
        if domain != ZAP_DOMAIN or mechanism != b"CURVE":
            return self._refuse(request_id, f"domain {domain!r:.40} mechanism {mechanism!r:.20}", address)
        name = self._trusted.get(frames[6])
        if name is None:
            return self._refuse(request_id, "a key that is not one of the deployment's", address)
        self._counts["accepted"] += 1
        return [_VERSION, request_id, b"200", b"OK", name.encode(), b""]

    def _refuse(self, request_id: bytes, why: str, address: str) -> list[bytes]:
        self._counts["refused"] += 1
        n = self._counts["refused"]
        if rate_limited(n):
            log.warning("kvsm %s: refused %d unauthenticated connection(s) so far; latest from %s: %s",
                        self.label, n, address, why)
        return [_VERSION, request_id, b"400", b"not a key of this deployment", b"", b""]

    def stats(self) -> dict[str, int]:
        """accepted, refused (connections), and reply or receive failures."""
        return dict(self._counts)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.socket.close(linger=0)
