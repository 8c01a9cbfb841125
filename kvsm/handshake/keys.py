"""The deployment's side-channel keys: CURVE key pairs read from a directory.

The directory (``kv_connector_extra_config["side_channel_keys"]``) holds key
pairs in pyzmq's ``zmq.auth`` certificate format, as
``zmq.auth.create_certificates(DIR, NAME)`` writes them (``NAME.key_secret``;
the public-only ``NAME.key`` beside it is not read). Every engine given the
same directory trusts the others: a peer is let in only if it proves that it
holds the secret of one of these pairs (CurveZMQ's vouch), and a client
talks only to a server that proves the same.

One pair is the one this engine uses (to serve, and to present as a client):
``current.key_secret``, or the only pair there is. Every other pair is only
accepted: a rotation puts ``next.key_secret`` beside the current one, then
makes it current, then removes the old one (docs: security).

Only public keys ever reach a log or a metric, as the first 8 characters of
their Z85 text (``key_id``).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import zmq
import zmq.auth
import zmq.utils.z85

KEY_SUFFIX = ".key_secret"
CURRENT = "current"
ZAP_DOMAIN = b"kvsm-side-channel"


class SideChannelKeysError(ValueError):
    """The key directory cannot be used; the message names the directory and what is wrong."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """One CURVE key pair, named after its file (``current``, ``next``...)."""

    name: str
    public: bytes  # Z85, 40 bytes
    secret: bytes = field(repr=False)

    @property
    def key_id(self) -> str:
        """The first 8 characters of the public key: safe to log."""
        return self.public[:8].decode()

    def __str__(self) -> str:
        return f"{self.name} ({self.key_id})"


@dataclass(frozen=True, slots=True)
class SideChannelKeys:
    """Every pair of the directory, the one in use first, and a digest of the
    files they came from (to notice a change)."""

    directory: str
    pairs: tuple[KeyPair, ...]
    digest: str

    @property
    def own(self) -> KeyPair:
        return self.pairs[0]

    @property
    def publics(self) -> tuple[bytes, ...]:
        """Z85 public keys, the one in use first: the server keys a client tries, in order."""
        return tuple(p.public for p in self.pairs)

    def name_of(self, public_z85: bytes) -> str | None:
        return next((p.name for p in self.pairs if p.public == public_z85), None)

    def describe(self) -> str:
        accepting = ", ".join(str(p) for p in self.pairs)
        return f"{self.directory}: using {self.own}, accepting {accepting}"


def _key_files(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise SideChannelKeysError(f"side_channel_keys: cannot read the directory {directory!r}: {e}") from e
    return sorted(n for n in names if n.endswith(KEY_SUFFIX) and not n.startswith("."))


def directory_digest(directory: str) -> str:
    """A digest of the key files' names and contents: it changes when a key is
    added, removed or replaced (a Kubernetes Secret's update swaps symlinks)."""
    h = hashlib.sha256()
    for name in _key_files(directory):
        h.update(name.encode() + b"\0")
        try:
            with open(os.path.join(directory, name), "rb") as f:
                h.update(f.read(64 * 1024))
        except OSError as e:
            h.update(f"unreadable: {e}".encode())
        h.update(b"\0")
    return h.hexdigest()


def load_keys(directory: str) -> SideChannelKeys:
    """Read every ``*.key_secret`` pair of ``directory``. Raises
    :class:`SideChannelKeysError` naming the directory, the file and what is wrong."""
    if not zmq.has("curve"):
        raise SideChannelKeysError("side_channel_keys: this libzmq was built without CURVE support")
    directory = os.path.abspath(directory)
    digest = directory_digest(directory)
    pairs: list[KeyPair] = []
    for filename in _key_files(directory):
        path = os.path.join(directory, filename)
        try:
            public, secret = zmq.auth.load_certificate(path)
        except Exception as e:
            raise SideChannelKeysError(f"side_channel_keys: {path} is not a zmq.auth certificate: {e}") from e
        if not secret or len(public) != 40 or len(secret) != 40:
            raise SideChannelKeysError(f"side_channel_keys: {path} holds no secret key (write it with "
                                       f"zmq.auth.create_certificates)")
        try:
            derived = zmq.curve_public(secret)
        except Exception as e:
            raise SideChannelKeysError(f"side_channel_keys: {path}: its secret key is not a CURVE key: {e}") from e
        if derived != public:
            raise SideChannelKeysError(f"side_channel_keys: {path}: its public key does not belong to its secret key")
        pairs.append(KeyPair(filename[: -len(KEY_SUFFIX)], public, secret))
    if not pairs:
        raise SideChannelKeysError(
            f"side_channel_keys: {directory} holds no *{KEY_SUFFIX} file; make one with "
            f"python -c 'import zmq.auth; zmq.auth.create_certificates(\"{directory}\", \"{CURRENT}\")'")
    current = [p for p in pairs if p.name == CURRENT]
    if not current and len(pairs) > 1:
        raise SideChannelKeysError(
            f"side_channel_keys: {directory} holds {len(pairs)} keys ({', '.join(p.name for p in pairs)}) and "
            f"none named {CURRENT}{KEY_SUFFIX}: name the one this engine uses {CURRENT}")
    own = current[0] if current else pairs[0]
    return SideChannelKeys(directory, (own, *(p for p in pairs if p is not own)), digest)


def z85_to_raw(public_z85: bytes) -> bytes:
    """The 32-byte form ZAP hands over."""
    return zmq.utils.z85.decode(public_z85)
