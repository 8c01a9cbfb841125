"""One side-channel port per engine: rank 0 relays the other ranks' requests.

An engine listens on one port (``VLLM_NIXL_SIDE_CHANNEL_PORT`` + its data
parallel index, as upstream), whatever its tensor and pipeline parallel sizes:
rank 0's (tensor rank 0 of stage 0) ``HandshakeServer`` binds it. A request
names the worker it is for (``tp_rank``, ``pp_rank``); one for worker k is
passed, as received, to worker k's own server,
which listens on a private endpoint of this host (``internal_endpoint``:
``ipc://`` in a 0700 directory, or ``inproc://`` for engines sharing one
process), and rank k's reply is passed back to the client unchanged. Every
rank answers for itself (its pins and leases are its own), so a claim means
the same as with a port per rank; the relay adds one local hop.

A relayed request rank k does not answer within ``timeout_ns`` (the process
died, or has not bound yet) is answered ``rank_unavailable`` by rank 0, so the
client hears of it; the relay holds at most ``max_pending`` requests, beyond
which it refuses new ones (``busy``) rather than grow.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import zmq

from kvsm.handshake.address import INPROC_PREFIX

DEFAULT_RELAY_TIMEOUT_NS = 2_000_000_000
MAX_PENDING = 4096


def runtime_dir() -> str:
    """Where the ranks' private endpoints live: ``$KVSM_RUNTIME_DIR``, else a 0700
    directory of this user under the system's temporary directory."""
    path = os.environ.get("KVSM_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"kvsm-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def internal_endpoint(host: str, port: int, engine_id: str, rank: int, pp_rank: int = 0) -> str:
    """The private endpoint worker (``rank``, ``pp_rank``) of the engine on
    ``host:port`` listens on (the same string in every worker: rank 0 connects,
    worker k binds)."""
    worker = f"tp{rank}" + (f"-pp{pp_rank}" if pp_rank else "")
    if host.startswith(INPROC_PREFIX):
        return f"inproc://{host[len(INPROC_PREFIX):]}-{port}-{worker}"
    tag = hashlib.sha256(f"{engine_id}@{host}:{port}".encode()).hexdigest()[:12]
    return f"ipc://{runtime_dir()}/sc-{port}-{tag}-{worker}"


Worker = tuple[int, int]  # (tp_rank, pp_rank)


def worker_name(tp_rank: int, pp_rank: int = 0) -> str:
    """``tp_rank 1``, or ``tp_rank 1 pp_rank 2`` for a later pipeline stage: which
    worker behind the engine's one port a message is for, in words."""
    return f"tp_rank {tp_rank}" + (f" pp_rank {pp_rank}" if pp_rank else "")


@dataclass(slots=True)
class _Pending:
    envelope: list[bytes]
    nonce: int
    worker: Worker
    deadline_ns: int


class RankRelay:
    """Rank 0's DEALER to each other worker's server, and the requests in flight.
    ``endpoints``: by (tp_rank, pp_rank), or by a tp_rank of stage 0."""

    def __init__(self, ctx: zmq.Context, endpoints: Mapping[int | Worker, str], *,
                 timeout_ns: int = DEFAULT_RELAY_TIMEOUT_NS, max_pending: int = MAX_PENDING) -> None:
        self.timeout_ns = timeout_ns
        self.max_pending = max_pending
        self.endpoints: dict[Worker, str] = {k if isinstance(k, tuple) else (k, 0): v for k, v in endpoints.items()}
        self._socks: dict[Worker, zmq.Socket] = {}
        self._rank_of: dict[zmq.Socket, Worker] = {}
        self._pending: dict[bytes, _Pending] = {}
        self._ids = itertools.count(1)
        for rank, endpoint in self.endpoints.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, max_pending)
            sock.connect(endpoint)  # (connects whenever the rank binds; queued until then)
            self._socks[rank] = sock
            self._rank_of[sock] = rank

    def sockets(self) -> list[zmq.Socket]:
        return list(self._socks.values())

    def owns(self, sock: zmq.Socket) -> bool:
        return sock in self._rank_of

    def forward(self, worker: Worker, envelope: list[bytes], payload: bytes, nonce: int, now_ns: int) -> str:
        """Pass a request on to ``worker``; "" if on its way, else why not (an error code)."""
        sock = self._socks.get(worker)
        if sock is None:
            return "unknown_rank"
        if len(self._pending) >= self.max_pending:
            return "busy"
        corr = next(self._ids).to_bytes(8, "big")
        try:
            sock.send_multipart([corr, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            return "rank_unavailable"
        self._pending[corr] = _Pending(envelope, nonce, worker, now_ns + self.timeout_ns)
        return ""

    def replies(self, sock: zmq.Socket, limit: int = 1024) -> list[tuple[list[bytes], bytes]]:
        """Replies waiting on ``sock``, each with the envelope of the client it is for."""
        out: list[tuple[list[bytes], bytes]] = []
        while len(out) < limit:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                continue  # not what a rank's server sends: nothing to route it by
            pending = self._pending.pop(frames[0], None)
            if pending is not None:  # (else: it timed out and was answered already)
                out.append((pending.envelope, frames[1]))
        return out

    def next_deadline_ns(self) -> int | None:
        return min((p.deadline_ns for p in self._pending.values()), default=None)

    def expire(self, now_ns: int) -> list[tuple[list[bytes], int, Worker]]:
        """Requests whose worker did not answer in time: (envelope, nonce, worker) each."""
        late = [corr for corr, p in self._pending.items() if p.deadline_ns <= now_ns]
        out = []
        for corr in late:
            p = self._pending.pop(corr)
            out.append((p.envelope, p.nonce, p.worker))
        return out

    def pending_count(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._rank_of.clear()
        self._pending.clear()

