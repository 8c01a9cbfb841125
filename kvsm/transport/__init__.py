"""Block transports: the NIXL agent wrapper and an in-memory twin for simulation."""

from kvsm.transport.base import TransferState, Transport, XferHandle

__all__ = ["Transport", "TransferState", "XferHandle"]
