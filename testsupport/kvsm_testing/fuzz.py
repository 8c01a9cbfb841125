"""Hostile clients for kvsm's sockets: the side channel
(``kvsm.handshake.HandshakeServer``, :class:`SideChannelFuzzer`) and the pin
channel (``kvsm.handoff.pins.PinChannelServer``, :class:`PinChannelFuzzer`,
described there).

Why: the upstream listener thread dies on the first malformed message (vLLM
#54757). kvsm's server promises never to stop, to answer or refuse every
message it reads (and count it), and to bound what a peer can make it hold.
This fuzzer attacks a *live* server (e.g. a vLLM engine's prefill worker) the
ways a broken or hostile peer can, and keeps its own books so a test can
reconcile them with the server's counters.

What it sends (all seeded: same seed, same bytes):

* through DEALER sockets (pipelined, every reply read and checked against the
  protocol's rules): random bytes, truncated and mutated valid requests,
  random msgpack, wrong field types, missing/extra fields, unknown ``type``
  tags, unsupported protocol versions, a wrong compatibility hash, unknown
  ranks, too many or too long claim ids, msgpack headers claiming 64 MiB or
  2**32 elements, deep nesting, bad framing (2..64 frames, and messages of
  thousands of frames), REQ-style delimiters, and valid metadata requests,
  heartbeats and abandons (claim ids that name no real request);
* through REQ and ROUTER peers (the other socket types a ROUTER talks to);
* through socket types a ROUTER refuses (PUSH, PUB, PAIR, PULL, SUB, XPUB,
  XSUB): never delivered, libzmq fails their ZMTP handshake;
* frames between ``MAX_REQUEST_BYTES`` and ``MAX_FRAME_BYTES`` (read, refused
  ``oversized``) and over ``MAX_FRAME_BYTES`` (libzmq drops the connection);
* raw TCP: random bytes and HTTP probes (libzmq may read such bytes as ZMTP
  1.0 frames, so they can become ``malformed`` messages: at most one per two
  bytes), a hand-made ZMTP 3 handshake followed by a frame header claiming
  64 MiB, and connections held half-open (silent, half a greeting, half a
  frame) for the length of the storm.

The books (:class:`FuzzReport`): ``expected`` is, per outcome ("served" or
the error code), how many messages the server must have handled that way;
every such message's reply is read and compared (``answered``,
``mismatches``, ``unanswered``). ``undeliverable`` counts what libzmq must
drop before the server's handler; ``raw_bytes`` bounds what raw TCP may add to
``malformed``.

Nothing here imports vLLM; only ``kvsm.handshake``, ``kvsm.handoff.pins``,
ZMQ and msgspec.
"""

from __future__ import annotations

import random
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvsm.handoff.facts import SendFinish
from kvsm.handoff.pins import (
    MAX_BLOCKS_PER_PIN,
    MAX_MESSAGE_BYTES,
    MAX_PINS_PER_MESSAGE,
    TOKEN_BYTES,
    PinChannelServer,
    decode_pins,
    encode_pins,
)
from kvsm.handshake import (
    MAX_CLAIMS,
    MAX_FRAME_BYTES,
    MAX_ID_LENGTH,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    Abandon,
    ClaimsReply,
    CompatInfo,
    ErrorReply,
    HandshakeProtocolError,
    MetadataReply,
    MetadataRequest,
    compat_hash,
    decode_reply,
    decode_request,
    peer_address,
)

__all__ = ["FuzzReport", "PinChannelFuzzer", "PinFuzzReport", "SideChannelFuzzer", "foreign_engine_token",
           "zmtp3_greeting"]

MiB = 1 << 20
# Socket types a ROUTER does not accept: their ZMTP handshake fails, nothing is delivered.
REFUSED_SOCKET_TYPES = {"PUSH": zmq.PUSH, "PUB": zmq.PUB, "PAIR": zmq.PAIR, "PULL": zmq.PULL,
                        "SUB": zmq.SUB, "XPUB": zmq.XPUB, "XSUB": zmq.XSUB}
_SENDING_TYPES = {"PUSH", "PUB", "PAIR", "XPUB"}
# How many times each bulk case is drawn relative to the others.
_WEIGHTS: dict[str, int] = {
    "random_bytes": 12, "truncated": 10, "random_msgpack": 10, "wrong_type": 10, "missing_field": 5,
    "extra_field": 4, "unknown_type": 4, "bad_protocol": 4, "wrong_hash": 6, "unknown_rank": 6,
    "bad_claims": 3, "huge_header": 6, "deep_nesting": 2, "bad_framing": 6, "req_delimiter": 3,
    "valid_heartbeat": 4, "valid_abandon": 3, "valid_metadata": 2, "empty": 1,
}


def zmtp3_greeting(socket_type: bytes = b"DEALER") -> bytes:
    """A ZMTP 3.0 client greeting (NULL mechanism) and its READY command, by hand."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return greeting + b"\x04" + bytes([len(body)]) + body


def _long_frame_header(size: int, more: bool = False) -> bytes:
    """A ZMTP 3 long-frame header announcing ``size`` bytes."""
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", size)


@dataclass
class FuzzReport:
    """The fuzzer's books; see the module docstring."""

    sent: Counter[str] = field(default_factory=Counter)  # messages sent, by case
    expected: Counter[str] = field(default_factory=Counter)  # outcome -> messages the server must handle so
    answered: Counter[str] = field(default_factory=Counter)  # outcome -> replies read
    mismatches: list[str] = field(default_factory=list)  # the first few replies that broke the rules
    unanswered: int = 0  # delivered messages whose reply never came
    undeliverable: Counter[str] = field(default_factory=Counter)  # case -> messages libzmq must drop
    raw_bytes: int = 0  # raw TCP garbage sent (may become at most raw_bytes // 2 malformed messages)
    connections: Counter[str] = field(default_factory=Counter)  # kind -> connections opened
    held_open: int = 0
    abandoned_claims: int = 0  # claim ids in abandons the server serves (it remembers them, boundedly)
    big_bytes: int = 0  # bytes actually sent in frames over MAX_REQUEST_BYTES
    claimed_bytes: int = 0  # bytes announced (and never sent) by frame and msgpack headers
    seconds: float = 0.0

    @property
    def messages(self) -> int:
        """Every message sent, delivered or not."""
        return sum(self.sent.values())

    @property
    def delivered(self) -> int:
        """Messages that must reach the server's handler (each gets one reply)."""
        return sum(self.expected.values())

    @property
    def refused(self) -> int:
        return sum(n for outcome, n in self.expected.items() if outcome != "served")

    def summary(self) -> str:
        rate = self.messages / self.seconds if self.seconds else 0.0
        return (f"{self.messages} messages in {self.seconds:.1f} s ({rate:.0f}/s): {self.delivered} delivered "
                f"({dict(sorted(self.expected.items()))}), {sum(self.undeliverable.values())} undeliverable "
                f"({dict(sorted(self.undeliverable.items()))}), {self.raw_bytes} raw bytes, "
                f"{self.held_open} held half-open, {self.big_bytes / MiB:.0f} MiB in big frames, "
                f"{self.claimed_bytes / MiB:.0f} MiB claimed; mismatches {len(self.mismatches)}, "
                f"unanswered {self.unanswered}")


class _Dealer:
    """One DEALER connection with its replies still to read, in sending order."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.inflight: deque[tuple[str, str]] = deque()  # (case, expected outcome)


class SideChannelFuzzer:
    """Attacks the side channel at ``host:port``; see the module docstring.

    ``ranks`` are the (tp_rank, pp_rank) the server has (a metadata request for
    another is refused ``unknown_rank``). The server's CompatInfo is learned
    from its first refusal, which carries it, so requests can be made valid or
    exactly one field wrong.
    """

    def __init__(self, host: str, port: int, *, seed: int = 0, ranks: frozenset[tuple[int, int]] = frozenset({(0, 0)}),
                 window: int = 64, reply_timeout_s: float = 30.0, context: zmq.Context | None = None,
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.host, self.port = host, port
        # (public, secret, server public), Z85: an attacker holding a deployment key,
        # so that its ZMQ sockets get past CURVE and reach the handler.
        self.curve = curve
        self.address = peer_address(host, port)
        self.rng = random.Random(seed)
        self.ranks = ranks
        self.window = window
        self.reply_timeout_s = reply_timeout_s
        self.report = FuzzReport()
        self.compat: CompatInfo | None = None
        self.hash = ""
        self._ctx = context or zmq.Context.instance()
        self._dealer: _Dealer | None = None
        self._dealer_uses = 0
        self._held: list[socket.socket] = []
        self._parked: list[zmq.Socket] = []  # sockets closed at the end (their bytes must get out first)
        self._claim_ids = 0
        self._cases: list[tuple[str, Callable[[], list[bytes]]]] = [
            (name, getattr(self, f"_case_{name}")) for name in _WEIGHTS]
        self._case_weights = list(_WEIGHTS.values())

    # ------------------------------------------------------------------ rules

    def expected_outcome(self, frames: list[bytes]) -> str:
        """What the server must answer a DEALER message of ``frames``: "served" or
        the error code (kvsm.handshake's rules, applied here independently)."""
        if len(frames) == 1:
            payload = frames[0]
        elif len(frames) == 2 and frames[0] == b"":
            payload = frames[1]  # REQ framing: the empty delimiter is accepted and echoed
        else:
            return "malformed"
        try:
            request = decode_request(payload)
        except HandshakeProtocolError as e:
            return e.code
        if isinstance(request, MetadataRequest):
            if request.compat_hash != self.hash:
                return "incompatible"
            if (request.tp_rank, request.pp_rank) not in self.ranks:
                return "unknown_rank"
        return "served"

    @staticmethod
    def outcome_of(reply_frames: list[bytes]) -> tuple[str, Any]:
        """(outcome, decoded reply) of a reply; outcome "bad_reply" if it is not one."""
        try:
            reply = decode_reply(reply_frames[-1])
        except HandshakeProtocolError as e:
            return "bad_reply", e
        return (reply.code if isinstance(reply, ErrorReply) else "served"), reply

    # ------------------------------------------------------------------ storm

    def learn_compat(self) -> CompatInfo:
        """Send one malformed message; the refusal carries the server's CompatInfo."""
        sock = self._socket(zmq.DEALER)
        try:
            sock.send(b"\xc1")
            self.report.sent["learn_compat"] += 1
            self.report.expected["malformed"] += 1
            if not sock.poll(int(self.reply_timeout_s * 1000)):
                raise TimeoutError(f"no answer from the side channel at {self.address}")
            outcome, reply = self.outcome_of(sock.recv_multipart())
            self.report.answered[outcome] += 1
            if not isinstance(reply, ErrorReply) or reply.compat is None:
                raise RuntimeError(f"{self.address} answered garbage without its CompatInfo: {reply!r}")
        finally:
            sock.close(linger=0)
        self.compat, self.hash = reply.compat, compat_hash(reply.compat)
        return reply.compat

    def storm(self, messages: int, *, hold_open: int = 24, big_frames: int = 16, over_limit_frames: int = 8,
              claimed_64mib: int = 32, side_every: int = 200, deadline_s: float = 120.0,
              on_progress: Callable[[FuzzReport], None] | None = None) -> FuzzReport:
        """Send at least ``messages`` messages, mostly pipelined through DEALERs, with
        the other attacks interleaved (one every ``side_every`` messages), and read
        every reply. Raises TimeoutError past ``deadline_s``. The report accumulates
        over successive storms of one fuzzer."""
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        if self.compat is None:
            self.learn_compat()
        self._hold_half_open(hold_open)
        big = ["big_frame"] * big_frames + ["over_limit_frame"] * over_limit_frames + ["claim_64mib"] * claimed_64mib
        side = ["req_peer", "router_peer", "refused_type", "raw_garbage", "http_probe", "many_frames"]
        side_attacks = [side[i % len(side)] for i in range(max(1, messages // side_every))] + big
        self.rng.shuffle(side_attacks)
        every = max(1, messages // max(1, len(side_attacks)))
        i = 0
        target = self.report.messages + messages
        while self.report.messages < target or side_attacks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"storm past its {deadline_s} s deadline: {self.report.summary()}")
            if side_attacks and i % every == 0:
                getattr(self, f"_attack_{side_attacks.pop()}")()
            else:
                name, make = self.rng.choices(self._cases, self._case_weights)[0]
                self._send_dealer(name, make())
            i += 1
            if on_progress is not None and i % 1000 == 0:
                on_progress(self.report)
        self._drain_dealer(0)
        self.close()
        self.report.seconds += time.monotonic() - t0  # the books add up over several storms
        return self.report

    def close(self) -> None:
        """Close every socket this fuzzer still holds (held-open ones included)."""
        if self._dealer is not None:
            self._drain_dealer(0)
            self._dealer.sock.close(linger=0)
            self._dealer = None
        for s in self._held:
            s.close()
        self._held.clear()
        for z in self._parked:
            z.close(linger=2000)  # an over-limit frame still queued gets its chance to go out
        self._parked.clear()

    # ------------------------------------------------------------------ DEALER path

    def _secure(self, sock: zmq.Socket) -> zmq.Socket:
        if self.curve is not None:
            public, secret, server = self.curve
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        return sock

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._secure(self._ctx.socket(kind))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.reply_timeout_s * 1000))
        sock.connect(self.address)
        return sock

    def _send_dealer(self, case: str, frames: list[bytes]) -> None:
        """Send one message on the current DEALER (a fresh one every ~1000) and read
        replies while more than ``window`` are outstanding."""
        if self._dealer is None or self._dealer_uses >= 1000:
            if self._dealer is not None:
                self._drain_dealer(0)
                self._dealer.sock.close(linger=0)
            self._dealer = _Dealer(self._socket(zmq.DEALER))
            self._dealer_uses = 0
            self.report.connections["dealer"] += 1
        expected = self._expect(case, frames)
        self._dealer.sock.send_multipart(frames, copy=len(frames) > 1 or len(frames[0]) < 65536)
        self._dealer_uses += 1
        self._dealer.inflight.append((case, expected))
        self._drain_dealer(self.window)

    def _expect(self, case: str, frames: list[bytes]) -> str:
        """Book one message that will reach the server's handler; its expected outcome."""
        expected = self.expected_outcome(frames)
        self.report.sent[case] += 1
        self.report.expected[expected] += 1
        if expected == "served":
            request = decode_request(frames[-1])
            if isinstance(request, Abandon):
                self.report.abandoned_claims += len(request.claims)
        return expected

    def _drain_dealer(self, keep: int) -> None:
        d = self._dealer
        if d is None:
            return
        while len(d.inflight) > keep:
            try:
                frames = d.sock.recv_multipart()
            except zmq.Again:
                # Never answered: count them all and start afresh (order would be lost).
                self.report.unanswered += len(d.inflight)
                self._mismatch(f"no reply within {self.reply_timeout_s} s to {len(d.inflight)} messages "
                               f"(first: {d.inflight[0]})")
                d.inflight.clear()
                d.sock.close(linger=0)
                self._dealer = None
                return
            case, expected = d.inflight.popleft()
            self._check(case, expected, frames)

    def _check(self, case: str, expected: str, frames: list[bytes]) -> None:
        outcome, reply = self.outcome_of(frames)
        self.report.answered[outcome] += 1
        if outcome != expected:
            self._mismatch(f"{case}: expected {expected}, got {outcome}: {reply!r:.300}")
        elif outcome == "served" and not isinstance(reply, (MetadataReply, ClaimsReply)):
            self._mismatch(f"{case}: served with a {type(reply).__name__}")

    def _mismatch(self, text: str) -> None:
        if len(self.report.mismatches) < 50:
            self.report.mismatches.append(text)

    # ------------------------------------------------------------------ payloads

    def _claim_id(self) -> str:
        self._claim_ids += 1
        return f"fuzz-{self._claim_ids}-{self.rng.getrandbits(32):08x}"  # names no real request

    def _valid(self, kind: str | None = None) -> dict[str, Any]:
        kind = kind or self.rng.choice(["metadata_req", "heartbeat", "abandon"])
        msg: dict[str, Any] = {"type": kind, "protocol": PROTOCOL_VERSION, "nonce": self.rng.getrandbits(62),
                               "requester": f"fuzzer/{self.rng.randrange(1000)}",
                               "claims": [self._claim_id() for _ in range(self.rng.randint(0, 4))]}
        if kind == "metadata_req":
            tp, pp = self.rng.choice(sorted(self.ranks))
            msg.update(tp_rank=tp, pp_rank=pp, compat_hash=self.hash)
        return msg

    def _random_value(self, depth: int = 0) -> Any:
        r = self.rng
        kinds = ["int", "neg", "big", "float", "str", "bin", "none", "bool"] + (["list", "map"] if depth < 3 else [])
        kind = r.choice(kinds)
        if kind == "int":
            return r.randint(0, 300)
        if kind == "neg":
            return -r.randint(1, 2**63)
        if kind == "big":
            return r.randint(2**62, 2**64 - 1)
        if kind == "float":
            return r.choice([0.5, -1.0, float("inf"), float("nan"), 1e300])
        if kind == "str":
            return "".join(r.choice("ab\u00e9\u4e2d\x00 ") for _ in range(r.randint(0, 20)))
        if kind == "bin":
            return r.randbytes(r.randint(0, 20))
        if kind == "none":
            return None
        if kind == "bool":
            return r.random() < 0.5
        if kind == "list":
            return [self._random_value(depth + 1) for _ in range(r.randint(0, 4))]
        return {str(self._random_value(depth + 1))[:12]: self._random_value(depth + 1) for _ in range(r.randint(0, 4))}

    @staticmethod
    def _mp(value: Any) -> bytes:
        return msgspec.msgpack.encode(value)

    def _case_random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randint(1, 512))]

    def _case_truncated(self) -> list[bytes]:
        data = self._mp(self._valid())
        return [data[: self.rng.randint(1, len(data) - 1)]]

    def _case_random_msgpack(self) -> list[bytes]:
        return [self._mp(self._random_value())]

    def _case_wrong_type(self) -> list[bytes]:
        msg = self._valid()
        key = self.rng.choice([k for k in msg if k != "type"])
        msg[key] = self.rng.choice([str(msg[key]), [msg[key]], {"v": 1}, -1, 2**64 - 1, None, 1.5, b"\x00"])
        return [self._mp(msg)]

    def _case_missing_field(self) -> list[bytes]:
        msg = self._valid()
        del msg[self.rng.choice([k for k in msg if k not in ("nonce", "claims")])]
        return [self._mp(msg)]

    def _case_extra_field(self) -> list[bytes]:
        msg = self._valid()
        msg[self.rng.choice(["extra", "engine_id", "x" * 100, ""])] = self._random_value()
        return [self._mp(msg)]

    def _case_unknown_type(self) -> list[bytes]:
        msg = self._valid()
        msg["type"] = self.rng.choice(["metadata", "error", "claims", "", "x" * 300, 7, None, ["metadata_req"]])
        return [self._mp(msg)]

    def _case_bad_protocol(self) -> list[bytes]:
        msg = self._valid()
        msg["protocol"] = self.rng.choice([0, 2, 99, -1, 2**40, "1", 1.0, None])
        return [self._mp(msg)]

    def _case_wrong_hash(self) -> list[bytes]:
        msg = self._valid("metadata_req")
        msg["compat_hash"] = self.rng.choice([self.rng.randbytes(32).hex(), self.hash[:-1] + "0"
                                              if not self.hash.endswith("0") else self.hash[:-1] + "1", "x"])
        return [self._mp(msg)]

    def _case_unknown_rank(self) -> list[bytes]:
        msg = self._valid("metadata_req")
        while (msg["tp_rank"], msg["pp_rank"]) in self.ranks:
            msg["tp_rank"], msg["pp_rank"] = self.rng.randrange(1 << 16), self.rng.choice([0, 0, 1, 65535])
        return [self._mp(msg)]

    def _case_bad_claims(self) -> list[bytes]:
        msg = self._valid()
        msg["claims"] = self.rng.choice([
            ["c"] * (MAX_CLAIMS + 1), ["c" * (MAX_ID_LENGTH + 1)], [""], [1, 2], "claim", {"a": "ok"}])
        return [self._mp(msg)]

    def _case_huge_header(self) -> list[bytes]:
        """msgpack headers announcing 64 MiB (or 2**32 - 1 elements) with a few bytes
        behind them: a decoder that trusts the header allocates before it reads."""
        claim = 64 * MiB
        header = self.rng.choice([
            b"\xc6" + struct.pack(">I", claim),  # bin 32
            b"\xdb" + struct.pack(">I", claim),  # str 32
            b"\xdd\xff\xff\xff\xff",  # array 32
            b"\xdf\xff\xff\xff\xff",  # map 32
            b"\xc9" + struct.pack(">I", claim) + b"\x01",  # ext 32
        ])
        tail = self.rng.randbytes(self.rng.randint(0, 64))
        self.report.claimed_bytes += claim
        if self.rng.random() < 0.5:  # inside an otherwise plausible request
            return [b"\x82\xa4type\xacmetadata_req\xa6claims" + header + tail]
        return [header + tail]

    def _case_deep_nesting(self) -> list[bytes]:
        depth = self.rng.choice([100, 1000, 50_000])
        return [self.rng.choice([b"\x91", b"\x81\xa1a"]) * depth + b"\xc0"]

    def _case_bad_framing(self) -> list[bytes]:
        """Two to 64 frames (not the one-frame DEALER or the two-frame REQ shape)."""
        payload = self._mp(self._valid())
        n = self.rng.randint(2, 64)
        frames = [self.rng.randbytes(self.rng.randint(0, 16)) for _ in range(n - 1)] + [payload]
        if n == 2 and frames[0] == b"":
            frames[0] = b"x"
        return frames

    def _case_req_delimiter(self) -> list[bytes]:
        """A DEALER speaking REQ framing: answered like a REQ (delimiter echoed)."""
        return [b"", self.rng.choice([self._mp(self._valid()), self.rng.randbytes(8)])]

    def _case_valid_heartbeat(self) -> list[bytes]:
        return [self._mp(self._valid("heartbeat"))]

    def _case_valid_abandon(self) -> list[bytes]:
        return [self._mp(self._valid("abandon"))]

    def _case_valid_metadata(self) -> list[bytes]:
        return [self._mp(self._valid("metadata_req"))]

    def _case_empty(self) -> list[bytes]:
        return [b""]

    # ------------------------------------------------------------------ other attacks

    def _attack_many_frames(self) -> None:
        """One message of thousands of frames (libzmq has no per-message frame limit)."""
        n = self.rng.choice([1000, 5000])
        self._send_dealer("many_frames", [b"f"] * (n - 1) + [self._mp(self._valid())])

    def _attack_big_frame(self) -> None:
        """A frame over MAX_REQUEST_BYTES but under MAX_FRAME_BYTES: read, refused oversized."""
        size = self.rng.randint(MAX_REQUEST_BYTES + 1, MAX_FRAME_BYTES)
        self.report.big_bytes += size
        self._send_dealer("big_frame", [self.rng.randbytes(16) * (size // 16) + b"\x00" * (size % 16)])

    def _attack_over_limit_frame(self) -> None:
        """A frame over MAX_FRAME_BYTES on its own DEALER: libzmq drops the connection
        before any of it reaches the server's handler."""
        size = self.rng.randint(MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES + MiB)
        sock = self._socket(zmq.DEALER)
        sock.send(b"\x00" * size, copy=False)
        self._parked.append(sock)
        self.report.sent["over_limit_frame"] += 1
        self.report.undeliverable["over_limit_frame"] += 1
        self.report.connections["over_limit"] += 1
        self.report.big_bytes += size

    def _attack_claim_64mib(self) -> None:
        """A hand-made ZMTP 3 handshake, then a frame header announcing 64 MiB (over the
        server's per-frame limit) and a few KiB: the server must drop the connection
        without allocating what was announced."""
        s = self._raw_connect()
        if s is None:
            return
        try:
            s.sendall(zmtp3_greeting() + _long_frame_header(64 * MiB) + self.rng.randbytes(4096))
        except OSError:
            pass  # dropped already: that is the point
        self._held.append(s)
        self.report.sent["claim_64mib"] += 1
        self.report.undeliverable["claim_64mib"] += 1
        self.report.claimed_bytes += 64 * MiB
        self.report.connections["claim_64mib"] += 1

    def _attack_req_peer(self) -> None:
        """A REQ client: strict send/receive alternation, its own framing."""
        sock = self._socket(zmq.REQ)
        self.report.connections["req"] += 1
        try:
            for _ in range(self.rng.randint(2, 6)):
                name, make = self.rng.choices(self._cases, self._case_weights)[0]
                frames = make()
                if len(frames) != 1:
                    frames = [self._mp(self._valid())]
                expected = self._expect("req_peer", frames)
                sock.send(frames[0])
                try:
                    reply = sock.recv_multipart()
                except zmq.Again:
                    self.report.unanswered += 1
                    self._mismatch(f"req_peer/{name}: no reply")
                    return
                self._check(f"req_peer/{name}", expected, reply)
        finally:
            sock.close(linger=0)

    def _attack_router_peer(self) -> None:
        """A ROUTER connecting to the ROUTER (it names the server's routing id itself)."""
        sock = self._secure(self._ctx.socket(zmq.ROUTER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.RCVTIMEO, int(self.reply_timeout_s * 1000))
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, b"side-channel")
        sock.connect(self.address)
        self.report.connections["router"] += 1
        try:
            payload = self._mp(self._valid())
            give_up = time.monotonic() + self.reply_timeout_s
            while True:  # routable only once the connection is up
                try:
                    sock.send_multipart([b"side-channel", payload])
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH or time.monotonic() > give_up:
                        raise
                    time.sleep(0.005)
            expected = self._expect("router_peer", [payload])
            try:
                reply = sock.recv_multipart()
            except zmq.Again:
                self.report.unanswered += 1
                self._mismatch("router_peer: no reply")
                return
            self._check("router_peer", expected, reply[1:])
        finally:
            sock.close(linger=0)

    def _attack_refused_type(self) -> None:
        """A socket type a ROUTER refuses; what it sends must never be delivered."""
        name = self.rng.choice(sorted(REFUSED_SOCKET_TYPES))
        sock = self._secure(self._ctx.socket(REFUSED_SOCKET_TYPES[name]))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self.report.connections[f"refused_{name}"] += 1
        if name in _SENDING_TYPES:
            for _ in range(3):
                try:
                    sock.send(self._mp(self._valid()), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self.report.sent[f"refused_{name}"] += 1
                self.report.undeliverable[f"refused_{name}"] += 1
        self._parked.append(sock)

    def _raw_connect(self) -> socket.socket | None:
        try:
            return socket.create_connection((self.host, self.port), timeout=5)
        except OSError:
            self._mismatch("raw TCP connect refused: the side channel stopped listening")
            return None

    def _attack_raw_garbage(self) -> None:
        s = self._raw_connect()
        if s is None:
            return
        data = self.rng.randbytes(self.rng.randint(1, 4096))
        try:
            s.sendall(data)
        except OSError:
            pass
        self.report.raw_bytes += len(data)
        self.report.sent["raw_garbage"] += 1
        self.report.connections["raw"] += 1
        self._held.append(s)  # closed at the end: until then it stays open

    def _attack_http_probe(self) -> None:
        s = self._raw_connect()
        if s is None:
            return
        data = b"GET /metrics HTTP/1.1\r\nHost: prefill\r\n\r\n"
        try:
            s.sendall(data)
        except OSError:
            pass
        self.report.raw_bytes += len(data)
        self.report.sent["http_probe"] += 1
        self.report.connections["raw"] += 1
        self._held.append(s)

    def _hold_half_open(self, n: int) -> None:
        """Connections left hanging for the whole storm: silent ones, half a ZMTP
        greeting, and a completed handshake with half a frame."""
        for i in range(n):
            s = self._raw_connect()
            if s is None:
                return
            kind = ("silent", "half_greeting", "half_frame")[i % 3]
            try:
                if kind == "half_greeting":
                    s.sendall(zmtp3_greeting()[:11])
                elif kind == "half_frame":
                    s.sendall(zmtp3_greeting() + _long_frame_header(MAX_REQUEST_BYTES // 2) + b"\x00" * 1024)
            except OSError:
                pass
            self._held.append(s)
            self.report.held_open += 1
            self.report.connections[f"held_{kind}"] += 1


# =============================================================================== the pin channel


@dataclass
class PinFuzzReport:
    """The pin-channel fuzzer's books (see :class:`PinChannelFuzzer`)."""

    sent: Counter[str] = field(default_factory=Counter)  # messages sent, by case (delivered or not)
    expected: Counter[str] = field(default_factory=Counter)  # server stats key -> messages it must count so
    undeliverable: Counter[str] = field(default_factory=Counter)  # case -> messages libzmq must drop
    connections: Counter[str] = field(default_factory=Counter)  # kind -> connections opened
    mismatches: list[str] = field(default_factory=list)  # the fuzzer's own rules disagreeing, stalled sends
    real_id_pins: int = 0  # pins naming a request the engine really has (always with a wrong token)
    real_ids: set[str] = field(default_factory=set)  # which requests those named
    held_open: int = 0
    big_bytes: int = 0  # bytes sent in frames of at least 1 MiB
    seconds: float = 0.0

    @property
    def messages(self) -> int:
        """Every message sent, delivered or not."""
        return sum(self.sent.values())

    @property
    def delivered(self) -> int:
        """Messages that must reach the server's ``on_readable`` (each counted once)."""
        return sum(self.expected.values())

    def summary(self) -> str:
        rate = self.messages / self.seconds if self.seconds else 0.0
        return (f"{self.messages} messages in {self.seconds:.1f} s ({rate:.0f}/s): {self.delivered} delivered "
                f"({dict(sorted(self.expected.items()))}), {sum(self.undeliverable.values())} undeliverable "
                f"({dict(sorted(self.undeliverable.items()))}), {self.real_id_pins} pins naming "
                f"{len(self.real_ids)} real requests, {self.held_open} held half-open, "
                f"{self.big_bytes / MiB:.0f} MiB in big frames, connections {dict(sorted(self.connections.items()))}; "
                f"mismatches {len(self.mismatches)}; sent by case {dict(sorted(self.sent.items()))}")


# Socket types whose ZMTP handshake a PULL fails (libzmq accepts only PUSH peers):
# whatever they send is never delivered. Checked in tests/test_fuzz_storm.py with a
# socket monitor.
PULL_REFUSED_SOCKET_TYPES = {"PUB": zmq.PUB, "DEALER": zmq.DEALER, "PAIR": zmq.PAIR, "REQ": zmq.REQ,
                             "XPUB": zmq.XPUB, "XSUB": zmq.XSUB, "ROUTER": zmq.ROUTER, "PULL": zmq.PULL,
                             "SUB": zmq.SUB, "REP": zmq.REP}
_PULL_SENDING_TYPES = {"PUB": 3, "DEALER": 3, "PAIR": 3, "REQ": 1, "XPUB": 3, "XSUB": 3}  # messages each sends
_PIN_WEIGHTS: dict[str, int] = {
    "random_frames": 14, "wrong_token": 10, "bad_size_token": 6, "foreign_token": 6, "real_ids": 14,
    "wrong_shape": 10, "wrong_types": 12, "too_many_pins": 2, "bad_framing": 8, "empty": 2,
}


def foreign_engine_token() -> bytes:
    """The token of another engine's pin channel: a real one (opened and closed here)."""
    server = PinChannelServer(zmq.Context.instance(), lambda pins, via: None, lambda fn, label: False)
    try:
        return server.token
    finally:
        server.close()


class PinChannelFuzzer:
    """A hostile LOCAL sender (same user) against a worker's pin channel
    (``kvsm.handoff.pins.PinChannelServer``) at ``endpoint`` (``ipc://...``).

    What it sends (all seeded), through PUSH sockets (the only type a PULL's
    ZMTP handshake accepts), a fresh one every ~1000 messages:

    * random bytes in 1..3 frames; empty frames;
    * a valid pins payload behind a right-sized wrong token (random, zeros,
      ones, another engine's token with one bit flipped), a wrong-sized one
      (0..4096 bytes), and another engine's real token (``foreign_engine_token``);
    * correct-looking pins for requests the engine really has (``real_ids``,
      e.g. read from its log during the run) behind a wrong token: they must
      pin, release and expire nothing;
    * wrong shapes (maps, scalars, pins of 4 or 6 fields, truncated or
      non-msgpack bytes) and wrong types or ranges in each field; too many pins
      (``MAX_PINS_PER_MESSAGE + 1``), a pin of ``MAX_BLOCKS_PER_PIN + 1``
      blocks, a msgpack header claiming 2**32 - 1 pins;
    * bad framing: 3..64 frames, token and payload in one frame;

    interleaved with (one every ``messages / side attacks``): frames of
    ``MAX_MESSAGE_BYTES`` and one byte less (delivered, refused),
    frames over ``MAX_MESSAGE_BYTES`` on their own PUSH (libzmq drops the
    connection: never delivered, nor anything behind them on it), connect /
    disconnect churn (silent, or 1..20 messages and a lingering close: those
    are delivered), and sockets of the types a PULL refuses
    (``PULL_REFUSED_SOCKET_TYPES``: never delivered). Raw connections held
    half-open for the storm (silent, half a greeting, a PUSH handshake and half
    a frame, a frame header over the limit) deliver nothing. Raw garbage is not
    sent: libzmq may read it as ZMTP 1.0 frames, and the books are exact.

    The rules (``expected_outcome``): not two frames -> ``malformed``; a token
    that is not the engine's -> ``bad_token`` (checked before the payload is
    decoded); the right token and a payload ``decode_pins`` refuses ->
    ``malformed``; else ``accepted_local_socket``. Against a live engine the
    fuzzer never knows the token (``token=None``), so every two-frame message
    is ``bad_token``; a test that owns the server can pass its token and so
    reach the decoder. Each case also says what it means to produce; a
    disagreement with the rules is a mismatch.

    ``storm`` sends are blocking with a timeout (a server that stops reading
    stalls the fuzzer, and each stalled send is a mismatch, not sent).
    """

    def __init__(self, endpoint: str, *, seed: int = 0, real_ids: Callable[[], list[str]] | None = None,
                 token: bytes | None = None, foreign_token: bytes | None = None, send_timeout_s: float = 30.0,
                 linger_s: float = 10.0, context: zmq.Context | None = None) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"not a pin channel endpoint: {endpoint!r}")
        self.endpoint = endpoint
        self.path = endpoint.removeprefix("ipc://")
        self.rng = random.Random(seed)
        self.token = token
        self.foreign = foreign_token if foreign_token is not None else foreign_engine_token()
        self._real_ids = real_ids
        self._ids: list[str] = []
        self._named: list[str] = []  # the real request ids the message being built names
        self.send_timeout_s = send_timeout_s
        self.linger_s = linger_s
        self.report = PinFuzzReport()
        self._ctx = context or zmq.Context.instance()
        self._push: zmq.Socket | None = None
        self._push_uses = 0
        self._held: list[socket.socket] = []
        self._parked: list[zmq.Socket] = []
        self._fake_ids = 0
        self._foreign_types = 0
        self._too_many: list[bytes] = []  # built once: they are big
        self._cases = [(name, getattr(self, f"_pin_{name}")) for name in _PIN_WEIGHTS]
        self._case_weights = list(_PIN_WEIGHTS.values())

    # ------------------------------------------------------------------ rules

    def expected_outcome(self, frames: list[bytes]) -> str:
        """The server stats key a message of ``frames`` must land in
        (kvsm.handoff.pins's rules, applied here independently; a payload is judged
        by kvsm's own decoder)."""
        if len(frames) != 2:
            return "malformed"
        token, payload = frames
        if self.token is None or len(token) != TOKEN_BYTES or token != self.token:
            return "bad_token"
        try:
            decode_pins(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "malformed"
        return "accepted_local_socket"

    # ------------------------------------------------------------------ storm

    def storm(self, messages: int, *, spread_s: float = 0.0, under_limit_frames: int = 4, over_limit_frames: int = 4,
              churn: int = 24, foreign_types: int = 20, hold_open: int = 8, deadline_s: float = 120.0) -> PinFuzzReport:
        """Send ``messages`` bulk messages with the side attacks interleaved, paced
        to take about ``spread_s`` seconds (0: as fast as the server reads), then
        close every socket (lingering, so what was sent gets out). Raises
        TimeoutError past ``deadline_s``. The report accumulates over storms."""
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        self._hold_half_open(hold_open)
        side = (["under_limit"] * under_limit_frames + ["over_limit"] * over_limit_frames + ["churn"] * churn
                + ["foreign_type"] * foreign_types)
        self.rng.shuffle(side)
        every = max(1, messages // max(1, len(side)))
        bulk = 0
        i = 0
        while bulk < messages or side:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"pin storm past its {deadline_s} s deadline: {self.report.summary()}")
            if spread_s > 0 and i % 64 == 0:
                ahead = t0 + spread_s * bulk / max(1, messages) - now
                if ahead > 0:
                    time.sleep(ahead)
            if i % 256 == 0 and self._real_ids is not None:
                self._ids = list(self._real_ids())[-64:]
            if side and (i % every == 0 or bulk >= messages):
                getattr(self, f"_attack_{side.pop()}")()
            else:
                self._send_bulk()
                bulk += 1
            i += 1
        self.close()
        self.report.seconds += time.monotonic() - t0
        return self.report

    def close(self) -> None:
        """Close every socket (lingering ones get ``linger_s`` to flush)."""
        if self._push is not None:
            self._push.close(linger=int(self.linger_s * 1000))
            self._push = None
        for s in self._held:
            s.close()
        self._held.clear()
        for z in self._parked:
            z.close(linger=0)
        self._parked.clear()

    # ------------------------------------------------------------------ sending

    def _socket(self, kind: int = zmq.PUSH) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, int(self.linger_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(self.send_timeout_s * 1000))
        sock.connect(self.endpoint)
        return sock

    def _send(self, sock: zmq.Socket, case: str, frames: list[bytes], intent: str | None) -> bool:
        """Send one message that must be delivered, and book it; False if it stalled."""
        try:
            sock.send_multipart(frames, copy=all(len(f) < 65536 for f in frames))
        except zmq.Again:
            self._mismatch(f"{case}: send stalled for {self.send_timeout_s} s (the server stopped reading?)")
            return False
        expected = self.expected_outcome(frames)
        if intent is not None and intent != expected:
            self._mismatch(f"{case}: meant to be {intent}, the rules say {expected}: {[f[:80] for f in frames]}")
        self.report.sent[case] += 1
        self.report.expected[expected] += 1
        self.report.big_bytes += sum(len(f) for f in frames if len(f) >= MiB)
        return True

    def _send_bulk(self, sock: zmq.Socket | None = None) -> None:
        if sock is None:
            if self._push is None or self._push_uses >= 1000:
                if self._push is not None:
                    self._push.close(linger=int(self.linger_s * 1000))
                self._push = self._socket()
                self._push_uses = 0
                self.report.connections["push"] += 1
            sock = self._push
            self._push_uses += 1
        name, make = self.rng.choices(self._cases, self._case_weights)[0]
        self._named = []
        frames, intent = make()
        if self._send(sock, name, frames, intent) and self._named:
            self.report.real_id_pins += len(self._named)
            self.report.real_ids.update(self._named)

    def _mismatch(self, text: str) -> None:
        if len(self.report.mismatches) < 50:
            self.report.mismatches.append(text)

    # ------------------------------------------------------------------ payloads

    def _fake_id(self) -> str:
        self._fake_ids += 1
        return f"pinfuzz-{self._fake_ids}-{self.rng.getrandbits(32):08x}"  # names no real request

    def _pins(self, ids: list[str]) -> bytes:
        r = self.rng
        return encode_pins([SendFinish(req=req, ok=r.random() < 0.7,
                                       block_ids=tuple(r.randrange(1, 64) for _ in range(r.randint(0, 3))),
                                       reason=r.choice(["", "FINISHED_ABORTED"]), pinned_ns=time.monotonic_ns())
                            for req in ids])

    def _valid_payload(self) -> bytes:
        return self._pins([self._fake_id() for _ in range(self.rng.randint(1, 4))])

    def _wrong_token(self) -> bytes:
        """A right-sized token that is not the engine's."""
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:
            tok = r.randbytes(TOKEN_BYTES)
        elif kind == 1:
            tok = b"\x00" * TOKEN_BYTES
        elif kind == 2:
            tok = b"\xff" * TOKEN_BYTES
        elif kind == 3:
            flip = bytearray(self.foreign)
            flip[r.randrange(len(flip))] ^= 1 << r.randrange(8)
            tok = bytes(flip)
        else:
            tok = self.foreign[::-1]
        return tok if tok != self.token else bytes(b ^ 1 for b in tok)

    def _token_for_garbage(self) -> bytes:
        """The engine's token where the fuzzer knows it (to reach the decoder), half the time."""
        if self.token is not None and self.rng.random() < 0.5:
            return self.token
        return self._wrong_token()

    def _refused_by(self, token: bytes) -> str:
        return "malformed" if token == self.token else "bad_token"

    def _pin_random_frames(self) -> tuple[list[bytes], str | None]:
        r = self.rng
        return [r.randbytes(r.randint(0, 256)) for _ in range(r.randint(1, 3))], None

    def _pin_wrong_token(self) -> tuple[list[bytes], str | None]:
        return [self._wrong_token(), self._valid_payload()], "bad_token"

    def _pin_bad_size_token(self) -> tuple[list[bytes], str | None]:
        r = self.rng
        n = r.choice([0, 1, 16, TOKEN_BYTES - 1, TOKEN_BYTES + 1, 48, 64, 4096])
        base = r.choice([self.foreign, self.token or self.foreign, r.randbytes(64)])
        tok = (base * (n // len(base) + 1))[:n]
        return [tok, self._valid_payload()], "bad_token"

    def _pin_foreign_token(self) -> tuple[list[bytes], str | None]:
        return [self.foreign, self._valid_payload()], "bad_token"

    def _pin_real_ids(self) -> tuple[list[bytes], str | None]:
        """Correct-looking pins for requests the engine has, behind a token that is
        not its own (random, or another engine's). Before any is known: fake ids."""
        if not self._ids:
            return self._pin_wrong_token()
        ids = self.rng.sample(self._ids, min(len(self._ids), self.rng.randint(1, 8)))
        self._named = ids
        tok = self.foreign if self.rng.random() < 0.3 else self._wrong_token()
        return [tok, self._pins(ids)], "bad_token"

    def _pin_wrong_shape(self) -> tuple[list[bytes], str | None]:
        r = self.rng
        tok = self._token_for_garbage()
        good = ["r-1", True, [1, 2], "", 0]
        shape = r.randrange(10)
        if shape == 0:
            value: Any = {"req": "r-1", "ok": True, "block_ids": [1]}  # a map, not a list
        elif shape == 1:
            value = good  # one pin, not a list of pins
        elif shape == 2:
            value = [{"req": "r-1", "ok": True, "block_ids": [1], "reason": "", "pinned_ns": 0}]
        elif shape == 3:
            value = [good[:4]]  # a field short
        elif shape == 4:
            value = [good + [0, False, False, 7]]  # a field too many (past the hold's optional three)
        elif shape == 5:
            value = r.choice([None, 7, -1, "pins", 1.5, True, b"\x01\x02"])
        elif shape == 6:
            value = [[good]]  # nested one level too deep
        elif shape == 7:
            payload = self._valid_payload()
            return [tok, payload[: r.randint(1, len(payload) - 1)]], self._refused_by(tok)  # truncated
        elif shape == 8:
            return [tok, b"\xc1" + r.randbytes(r.randint(0, 32))], self._refused_by(tok)  # never msgpack
        else:
            return [tok, b""], self._refused_by(tok)
        return [tok, msgspec.msgpack.encode(value)], self._refused_by(tok)

    def _pin_wrong_types(self) -> tuple[list[bytes], str | None]:
        """One pin with one field of the wrong type or out of its range."""
        r = self.rng
        tok = self._token_for_garbage()
        pin: list[Any] = [self._fake_id(), True, [1, 2, 3], "", 12345, 0, False, False]
        field_ = r.randrange(8)
        wrong: list[list[Any]] = [
            [7, None, "", "x" * 257, b"r", ["r"]],  # req: not a 1..256-character string
            ["yes", 1, 0, None, 1.0, []],  # ok: not a bool
            [["a"], [-1], [1 << 40], "1,2", {"0": 1}, [1.5], None, [True]],  # block_ids
            [None, 5, "x" * 513, ["r"], b""],  # reason: not a string of at most 512 characters
            [-1, "0", 1.5, None, [0], -(2**63)],  # pinned_ns: not an int >= 0
            [-1, "0", 1.5, None],  # lease_ns (a hold's): not an int >= 0
            ["yes", 1, None],  # hold: not a bool
            ["no", 0, []],  # release: not a bool
        ]
        pin[field_] = r.choice(wrong[field_])
        pins = [pin] if r.random() < 0.7 else [["ok-1", True, [], "", 0], pin]  # behind a good pin, too
        return [tok, msgspec.msgpack.encode(pins)], self._refused_by(tok)

    def _pin_too_many_pins(self) -> tuple[list[bytes], str | None]:
        if not self._too_many:
            one = msgspec.msgpack.encode(["r", True, [1], "", 0])
            n = MAX_PINS_PER_MESSAGE + 1
            many_pins = b"\xdd" + struct.pack(">I", n) + one * n
            n = MAX_BLOCKS_PER_PIN + 1
            big_pin = b"\x91\x95\xa1r\xc3\xdd" + struct.pack(">I", n) + b"\x01" * n + b"\xa0\x00"
            self._too_many = [many_pins, big_pin, b"\xdd\xff\xff\xff\xff" + one]  # the last claims 2**32 - 1
        tok = self._token_for_garbage()
        return [tok, self.rng.choice(self._too_many)], self._refused_by(tok)

    def _pin_bad_framing(self) -> tuple[list[bytes], str | None]:
        r = self.rng
        tok = self.token if self.token is not None and r.random() < 0.5 else self._wrong_token()
        payload = self._valid_payload()
        kind = r.randrange(3)
        if kind == 0:
            return [tok + payload], "malformed"  # one frame
        if kind == 1:
            return [payload], "malformed"  # no token
        n = r.randint(3, 64)
        return [tok, payload] + [r.randbytes(r.randint(0, 16)) for _ in range(n - 2)], "malformed"

    def _pin_empty(self) -> tuple[list[bytes], str | None]:
        return ([b""], "malformed") if self.rng.random() < 0.5 else ([b"", b""], "bad_token")

    # ------------------------------------------------------------------ other attacks

    def _attack_under_limit(self) -> None:
        """A frame of MAX_MESSAGE_BYTES or one byte less (the largest libzmq delivers):
        the server reads it and refuses it. Two sizes one allocator chunk apart, so
        a buffer freed is reused and RSS measures leaks, not fragmentation."""
        r = self.rng
        size = MAX_MESSAGE_BYTES - r.randrange(2)
        big = r.randbytes(16) * (size // 16) + b"\x00" * (size % 16)
        kind = r.randrange(3)
        if kind == 0:
            frames, intent = [self._wrong_token(), big], "bad_token"
        elif kind == 1:
            frames, intent = [big], "malformed"
        else:
            frames, intent = [big, self._valid_payload()], "bad_token"  # the "token" is the big frame
        if self._push is None:
            self._push = self._socket()
            self._push_uses = 0
            self.report.connections["push"] += 1
        self._send(self._push, "under_limit", frames, intent)

    def _attack_over_limit(self) -> None:
        """A frame over MAX_MESSAGE_BYTES, alone on its own PUSH: libzmq drops the
        connection at the frame's header; nothing of the message reaches Python."""
        r = self.rng
        size = r.randint(MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES + MiB)
        big = b"\x00" * size
        frames = r.choice([[big], [self._wrong_token(), big], [big, self._valid_payload()]])
        sock = self._socket()
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # once dropped, stay away
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self._mismatch("over_limit: send stalled")
        self._parked.append(sock)
        self.report.sent["over_limit"] += 1
        self.report.undeliverable["over_limit"] += 1
        self.report.connections["over_limit"] += 1
        self.report.big_bytes += size

    def _attack_churn(self) -> None:
        """Connect and go: silently (nothing delivered), or after 1..20 messages and
        a lingering close (all delivered)."""
        sock = self._socket()
        n = self.rng.choice([0, 0, 1, 1, 2, 5, 20])
        self.report.connections[f"churn_{'silent' if n == 0 else 'send'}"] += 1
        if n == 0:
            sock.close(linger=0)
            return
        for _ in range(n):
            self._send_bulk(sock)
        sock.close(linger=int(self.linger_s * 1000))

    def _attack_foreign_type(self) -> None:
        """A socket type a PULL refuses: the ZMTP handshake fails, nothing is delivered."""
        names = sorted(PULL_REFUSED_SOCKET_TYPES)
        name = names[self._foreign_types % len(names)]  # each in turn: every one is tried
        self._foreign_types += 1
        sock = self._ctx.socket(PULL_REFUSED_SOCKET_TYPES[name])
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one failed handshake each, not one every 100 ms
        sock.connect(self.endpoint)
        self.report.connections[f"refused_{name}"] += 1
        for _ in range(_PULL_SENDING_TYPES.get(name, 0)):
            frames, _ = self._pin_wrong_token()
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:
                continue  # not even queued
            self.report.sent[f"refused_{name}"] += 1
            self.report.undeliverable[f"refused_{name}"] += 1
        self._parked.append(sock)

    def _hold_half_open(self, n: int) -> None:
        """Raw connections left hanging for the storm: silent, half a ZMTP greeting, a
        PUSH handshake and half a frame, a frame header over MAX_MESSAGE_BYTES."""
        for i in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            try:
                s.connect(self.path)
            except OSError as e:
                s.close()
                self._mismatch(f"raw connect to {self.path} failed: {e}")
                return
            kind = ("silent", "half_greeting", "half_frame", "over_limit_header")[i % 4]
            try:
                if kind == "half_greeting":
                    s.sendall(zmtp3_greeting(b"PUSH")[:11])
                elif kind == "half_frame":
                    s.sendall(zmtp3_greeting(b"PUSH") + _long_frame_header(64 * 1024) + b"\x00" * 1024)
                elif kind == "over_limit_header":
                    s.sendall(zmtp3_greeting(b"PUSH") + _long_frame_header(64 * MiB) + b"\x00" * 4096)
            except OSError:
                pass  # dropped already
            self._held.append(s)
            self.report.held_open += 1
            self.report.connections[f"held_{kind}"] += 1
