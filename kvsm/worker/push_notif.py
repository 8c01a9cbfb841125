"""Push mode's NIXL notifications, from a prefill worker to a decode worker.

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

from typing import NamedTuple

from kvsm.transport.base import Transport

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
