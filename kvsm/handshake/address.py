"""Where a side channel listens: the ZMQ endpoint of a (host, port) pair.

Over TCP between engines, and over ``inproc`` when every engine lives in one
process (the simulation): a host written ``inproc:NAME`` names an in-process
endpoint, so the same configuration keys (side-channel host and port, and the
``remote_host``/``remote_port`` of ``kv_transfer_params``) reach it unchanged.
"""

from __future__ import annotations

INPROC_PREFIX = "inproc:"
"""A side-channel host starting with this names an in-process endpoint."""


def peer_address(host: str, port: int | str) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed, as ZMQ wants them; for a
    host ``inproc:NAME``, ``inproc://NAME-port`` (what HandshakeServer binds)."""
    if host.startswith(INPROC_PREFIX):
        return f"inproc://{host[len(INPROC_PREFIX):]}-{port}"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"
