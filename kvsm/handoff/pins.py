"""The pin channel: an engine's scheduler tells its own workers, at once, that a
finished prefill's blocks are pinned (or that nothing is).

Why it exists: vLLM hands the scheduler's decisions to the workers only with
the *next* engine step's connector metadata. A prefill engine that never
steps again (an offline ``LLM`` after ``generate`` returned; an idle server)
would leave its worker unaware that a request finished, and every decode
claim for it would be answered "unknown" until its timeout. So the
scheduler half sends each finish straight to every local worker the moment
``request_finished`` decides it; the step's metadata is only the fallback
when no worker can be reached directly (and the path tests use to reproduce
the old behaviour: ``KVSM_PIN_VIA_STEP=1``).

Two ways, chosen per worker from the handshake metadata vLLM collects from
the workers at start (``get_handshake_metadata`` ->
``set_xfer_handshake_metadata``, an engine-internal path no outsider can
write to):

* **in process** (the worker lives in the scheduler's process: vLLM's
  single-process executor, i.e. every engine with one worker): the finish is
  posted to that worker's loop. No socket, no serialization; a few µs.
* **local socket** (the multiprocess executor, TP > 1): a ZMQ ``PUSH`` to the
  worker's ``PULL`` on an ``ipc://`` path inside a fresh directory only this
  user can enter (0700), each message carrying a 32-byte secret that only
  the engine's own scheduler learned, through vLLM. The scheduler thread
  sends without blocking; a send that fails puts the finish into the next
  step's metadata.

What a worker accepts: exactly ``[token, msgpack list of pins]`` with the
right token, bounded sizes and types; anything else is refused and counted
(``PinChannelServer.stats``) and can pin, release or expire nothing.

Nothing here imports vLLM, NIXL or torch.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec
import zmq

from kvsm.handoff.facts import SendFinish

log = logging.getLogger("kvsm.handoff.pins")

TOKEN_BYTES = 32
MAX_PINS_PER_MESSAGE = 4096
MAX_BLOCKS_PER_PIN = 1 << 20
# libzmq drops a larger frame before it reaches Python.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# Refusals logged per kind before going quiet (every one is still counted).
_LOG_FIRST_REFUSALS = 10

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]


class _WirePin(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One finish as it travels: a compact array, every field bounded."""

    req: Id
    ok: bool
    block_ids: Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS_PER_PIN)]
    reason: Annotated[str, msgspec.Meta(max_length=512)]
    pinned_ns: Annotated[int, msgspec.Meta(ge=0)]
    # A decode engine's hold for a next turn (SendFinish's): its lease, and a release.
    lease_ns: Annotated[int, msgspec.Meta(ge=0)] = 0
    hold: bool = False
    release: bool = False


_Pins = Annotated[list[_WirePin], msgspec.Meta(max_length=MAX_PINS_PER_MESSAGE)]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Pins)


def encode_pins(pins: list[SendFinish]) -> bytes:
    return _encoder.encode([_WirePin(p.req, p.ok, list(p.block_ids), p.reason, p.pinned_ns, p.lease_ns, p.hold,
                                     p.release) for p in pins])


def decode_pins(data: bytes | memoryview) -> list[SendFinish]:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` naming what was wrong."""
    return [SendFinish(req=w.req, ok=w.ok, block_ids=tuple(w.block_ids), reason=w.reason, pinned_ns=w.pinned_ns,
                       lease_ns=w.lease_ns, hold=w.hold, release=w.release) for w in _decoder.decode(data)]


# --------------------------------------------------------------- in process

# token -> a function that posts pins to that worker's loop (False: not taken).
_IN_PROCESS: dict[bytes, Callable[[list[SendFinish]], bool]] = {}
_IN_PROCESS_LOCK = threading.Lock()


def _register_in_process(token: bytes, post: Callable[[list[SendFinish]], bool]) -> None:
    with _IN_PROCESS_LOCK:
        _IN_PROCESS[token] = post


def _unregister_in_process(token: bytes) -> None:
    with _IN_PROCESS_LOCK:
        _IN_PROCESS.pop(token, None)


def _in_process(token: bytes) -> Callable[[list[SendFinish]], bool] | None:
    with _IN_PROCESS_LOCK:
        return _IN_PROCESS.get(token)


# --------------------------------------------------------------- worker side

@dataclass(frozen=True)
class PinTarget:
    """How a scheduler reaches one worker: what that worker publishes at start."""

    tp_rank: int
    pid: int
    endpoint: str
    token: bytes
    pp_rank: int = 0  # its pipeline stage (every stage's workers hold pins of their own layers)


def _socket_directory() -> str:
    """A fresh 0700 directory for the worker's socket (short path: ipc paths are
    limited to ~107 bytes)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base) or len(base) > 48:
        base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvsm-pin-", dir=base)


class PinChannelServer:
    """Worker side: receives its scheduler's finishes. Lives on the worker's loop:
    ``sockets()`` to poll, ``on_readable()`` to drain; ``post_in_process`` is the
    in-process door (called on the scheduler's thread; it only posts)."""

    def __init__(self, context: zmq.Context, on_pins: Callable[[list[SendFinish], str], None],
                 post: Callable[[Callable[[], None], str], bool]) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._on_pins = on_pins
        self._post = post
        self._stats: Counter[str] = Counter()
        self._dir = _socket_directory()
        path = os.path.join(self._dir, "pins")
        self.endpoint = f"ipc://{path}"
        sock = context.socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.bind(self.endpoint)
            os.chmod(path, 0o600)
        except Exception:
            sock.close(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._sock = sock
        _register_in_process(self.token, self.post_in_process)

    def target(self, tp_rank: int, pp_rank: int = 0) -> PinTarget:
        return PinTarget(tp_rank=tp_rank, pid=os.getpid(), endpoint=self.endpoint, token=self.token,
                         pp_rank=pp_rank)

    def sockets(self) -> list[zmq.Socket]:
        return [self._sock]

    def post_in_process(self, pins: list[SendFinish]) -> bool:
        """The scheduler shares our process: hand the pins to our loop (never blocks)."""
        return self._post(lambda: self._accept(pins, "in_process"), "pins in process")

    def on_readable(self) -> int:
        """Drain what arrived; returns how many messages were accepted. Never raises
        on bad input (the loop calls this for whatever a local process sends)."""
        accepted = 0
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return accepted
            except zmq.ZMQError as e:
                self._refuse("recv_failed", str(e))
                return accepted
            if len(frames) != 2:
                self._refuse("malformed", f"{len(frames)} frames, expected 2")
                continue
            token, payload = frames
            if len(token) != TOKEN_BYTES or not hmac.compare_digest(token, self.token):
                self._refuse("bad_token", f"a {len(token)}-byte token that is not this engine's")
                continue
            try:
                pins = decode_pins(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._refuse("malformed", str(e)[:200])
                continue
            accepted += 1
            self._accept(pins, "local_socket")

    def _accept(self, pins: list[SendFinish], via: str) -> None:
        self._stats[f"accepted_{via}"] += 1
        self._stats["pins"] += len(pins)
        self._on_pins(pins, via)

    def _refuse(self, code: str, detail: str) -> None:
        self._stats[code] += 1
        if self._stats[code] <= _LOG_FIRST_REFUSALS:
            log.warning("kvsm pin channel %s: refused a message (%s): %s%s", self.endpoint, code, detail,
                        " (further refusals of this kind are only counted)"
                        if self._stats[code] == _LOG_FIRST_REFUSALS else "")

    def stats(self) -> dict[str, int]:
        """accepted_in_process, accepted_local_socket (messages), pins, and each
        refusal's count (bad_token, malformed, recv_failed)."""
        return dict(self._stats)

    def close(self) -> None:
        _unregister_in_process(self.token)
        self._sock.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


# --------------------------------------------------------------- scheduler side

class PinChannelClient:
    """Scheduler side: sends each step's finishes to every local worker at once.

    ``send`` runs on the scheduler's thread and never blocks. In-process targets
    get a loop post. Socket targets get one non-blocking ``send`` on a PUSH
    socket that only this client uses (under a lock, for a caller on another
    thread): handing it to a loop thread first would cost a GIL switch
    interval (5 ms) on a busy engine core, measured in the storm test.
    Whatever no path took is returned, for the next step's metadata.
    """

    def __init__(self, targets: list[PinTarget], *, context: zmq.Context | None = None,
                 send_hwm: int = 100_000) -> None:
        self._direct: list[tuple[int, Callable[[list[SendFinish]], bool]]] = []
        self._remote: list[tuple[PinTarget, zmq.Socket]] = []
        self._lock = threading.Lock()
        ctx = context or zmq.Context.instance()
        for t in sorted(targets, key=lambda t: (t.pp_rank, t.tp_rank)):
            post = _in_process(t.token) if t.pid == os.getpid() else None
            if post is not None:
                self._direct.append((t.tp_rank, post))
                continue
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, send_hwm)
            sock.connect(t.endpoint)
            self._remote.append((t, sock))

    @property
    def via(self) -> str:
        return "local_socket" if self._remote else "in_process"

    @property
    def workers(self) -> int:
        return len(self._direct) + len(self._remote)

    def send(self, pins: list[SendFinish]) -> list[tuple[int, str]]:
        """Hand ``pins`` to every worker. Returns (rank, why) for each worker that
        could not be handed them (the caller falls back for those)."""
        failed: list[tuple[int, str]] = []
        for rank, post in self._direct:
            if not post(pins):
                failed.append((rank, "the worker's loop did not take the post (stopped or full)"))
        if self._remote:
            payload = encode_pins(pins)
            with self._lock:
                for t, sock in self._remote:
                    try:
                        sock.send_multipart([t.token, payload], zmq.NOBLOCK)
                    except zmq.ZMQError as e:  # Again: the worker stopped reading (HWM full); or closed
                        failed.append((t.tp_rank, f"{type(e).__name__}: {e}"))
        return failed

    def close(self) -> None:
        with self._lock:
            for _, sock in self._remote:
                sock.close(linger=0)
            self._remote = []
