"""Push mode's NIXL notifications, from a prefill worker to a decode worker,
and the writes stopped before their end that are still on their way.

The decode worker writes the notification its write carries (``landed``): the
prefill worker passes it on untouched (NIXL delivers it with the write's last
byte). When the write does not complete, the prefill worker sends the same
notification behind a mark saying how it ended: ``failed`` (the transfer ended
in error: nothing of it is in flight) or ``cancelled`` (cancelled while in
flight, at its deadline or as its blocks were freed: bytes already on the wire
may still land, so the decode worker waits for the deadline). A read's
notification never starts with ``MARK`` (a request id is printable).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvsm.transport.base import TransferState, Transport, XferHandle

MARK = b"\x1ekvsm-push\x1f"
_SEP = "\x1f"
LANDED, FAILED, CANCELLED = "landed", "failed", "cancelled"
HOW = (LANDED, FAILED, CANCELLED)


class WriteNotif(NamedTuple):
    """A decode request (``req``), which of its writes (``link``), and how it ended."""

    req: str
    link: int
    how: str


def landed_notif(req: str, link: int) -> bytes:
    """The notification a decode worker asks its write to carry."""
    return MARK + f"landed{_SEP}{req}{_SEP}{link}".encode()


def ended_notif(notif: bytes, how: str) -> bytes:
    """The prefill worker's word that the write whose notification is ``notif`` did not
    complete (``how``: failed or cancelled)."""
    if how not in HOW[1:]:
        raise ValueError(f"a write ends failed or cancelled, not {how!r}")
    return MARK + how.encode() + _SEP.encode() + notif


def is_write_notif(msg: bytes) -> bool:
    return msg.startswith(MARK)


def parse_write_notif(msg: bytes) -> WriteNotif:
    """``WriteNotif`` of a push notification; ValueError when it is malformed."""
    if not msg.startswith(MARK):
        raise ValueError("not a push notification")
    body = msg[len(MARK):]
    how = "landed"
    for ending in HOW[1:]:
        head = ending.encode() + _SEP.encode()
        if body.startswith(head + MARK):
            how, body = ending, body[len(head) + len(MARK):]
            break
    kind, _, rest = body.decode().partition(_SEP)
    req, _, link = rest.rpartition(_SEP)
    if kind != "landed" or not req or not link.isdigit() or len(link) > 4:
        raise ValueError(f"malformed push notification {msg[:80]!r}")
    return WriteNotif(req, int(link), how)


def cut_off(transport: Transport, agent: str) -> None:
    """A write was still in flight at its deadline (cancelled, its decode rank
    told): remove that rank's agent, so that nothing of the write is left queued
    for it. UCX keeps what it queued for a connection and sends it once the
    connection comes back: after a partition healed, a write cancelled at its
    deadline landed 10 s later, with its notification, in blocks the decode
    engine had long given back; with the agent removed, only the ``cancelled``
    notification came (tests/test_two_hosts.py). Every other write to that agent
    fails with it (the same link missed its deadline); its next ask loads it
    again."""
    transport.remove_peer(agent)


def tell(transport: Transport, agent: str, notif: bytes, how: str) -> None:
    """Send the decode rank the word that its write ended ``how`` (failed, cancelled)."""
    try:
        transport.send_notif(agent, ended_notif(notif, how))
    except ConnectionError:
        pass  # its agent is gone: so is the decode rank's process


@dataclass(slots=True)
class _Draining:
    agent: str
    notif: bytes
    handles: list[XferHandle]
    final: XferHandle | None  # the write carrying the landed notification, if posted
    deadline_ns: int


def _release(transport: Transport, d: _Draining, handles: list[XferHandle]) -> None:
    """Release ``handles`` and the write carrying the notification, each once."""
    for h in {id(h): h for h in [*handles, *([d.final] if d.final is not None else [])]}.values():
        transport.release(h, force=True)


class Drains:
    """Writes stopped before their deadline (the request given up on either side,
    its blocks freed, another of its writes failed) whose bytes are still on the
    way. Cancelling them would tell the decode rank only that bytes may still land
    (``cancelled``): it would keep its blocks until the deadline, seconds away.
    Left to finish instead (a layer's or a request's write: milliseconds), the
    rank hears ``failed`` (nothing in flight) as soon as the poll finds them over,
    and gives its blocks back then; or, the write carrying its notification over,
    nothing more (it landed). At the deadline, what is still in flight is cancelled
    and cut off, as for any write. (Reading blocks the prefill engine freed
    meanwhile harms nothing here: the bytes go to blocks their decode rank will
    not use.)"""

    def __init__(self, transport: Callable[[], Transport | None], now_ns: Callable[[], int]) -> None:
        self._transport = transport
        self._now_ns = now_ns
        self._draining: list[_Draining] = []

    def __len__(self) -> int:
        return len(self._draining)

    def stop(self, agent: str, notif: bytes, handles: list[XferHandle], final: XferHandle | None,
             deadline_ns: int, *, at_deadline: bool = False, given_up: bool = False) -> bool:
        """Stop the writes ``handles`` (``final`` among them, if posted) to one decode
        rank and tell it how they ended, now or once over; True when some were in flight.

        The write carrying the landed notification is left to finish only when the
        decode rank gave up (``given_up``: it will not use the bytes): otherwise the
        blocks it reads may be freed under it, and its notification would still say
        landed, so it is cancelled at once (``cancelled``: the rank waits out its
        deadline)."""
        transport = self._transport()
        if transport is None:
            return False
        d = _Draining(agent, notif, [h for h in handles if transport.check(h) is TransferState.PENDING], final,
                      deadline_ns)
        if not d.handles:
            self._over(transport, d, handles)
        elif at_deadline or self._now_ns() >= deadline_ns:
            self._cancel(transport, d, handles)
        elif final is not None and final in d.handles and not given_up:
            self._cancel(transport, d, handles, cut=False)
        else:
            for h in handles:
                if h not in d.handles and h is not final:
                    transport.release(h, force=True)
            self._draining.append(d)
        return bool(d.handles)

    def poll(self) -> None:
        transport = self._transport()
        if transport is None or not self._draining:
            return
        now = self._now_ns()
        for d in list(self._draining):
            if all(transport.check(h) is not TransferState.PENDING for h in d.handles):
                self._over(transport, d, d.handles)
            elif now >= d.deadline_ns:
                self._cancel(transport, d, d.handles)
            else:
                continue
            self._draining.remove(d)

    @staticmethod
    def _over(transport: Transport, d: _Draining, handles: list[XferHandle]) -> None:
        """Nothing in flight: the decode rank hears ``failed``, unless its landed
        notification went with a write that completed."""
        landed = d.final is not None and transport.check(d.final) is TransferState.DONE
        _release(transport, d, handles)
        if not landed:
            tell(transport, d.agent, d.notif, FAILED)

    @staticmethod
    def _cancel(transport: Transport, d: _Draining, handles: list[XferHandle], cut: bool = True) -> None:
        """Cancel what is in flight: bytes may still land (``cancelled``); at the
        deadline (``cut``), its decode rank's agent goes too (``cut_off``)."""
        _release(transport, d, handles)
        tell(transport, d.agent, d.notif, CANCELLED)
        if cut:
            cut_off(transport, d.agent)
