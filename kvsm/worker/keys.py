"""The worker's watch over the deployment's side-channel keys (issue 31).

The key directory (``side_channel_keys``) is read at start and checked every
``side_channel_keys_reload_s`` on the loop thread: a rotation (a key added,
made current, removed; a Kubernetes Secret's update) reaches the handshake
server and client of a running engine without a restart. A directory that
became unusable (emptied, a broken file) keeps the keys in use: the side
channel never falls open. Each change and each unusable check is a record of
the event log and a count in the side-channel metric.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsm.config import KVSMConfig
from kvsm.handshake.keys import SideChannelKeys, SideChannelKeysError, directory_digest, load_keys
from kvsm.handshake.zap import rate_limited
from kvsm.runtime.loop import EventLoop, TimerHandle
from kvsm.worker.context import log

OPEN_WARNING = (
    "kvsm side channel of engine %s (%s): no side_channel_keys, so it %s. Add the deployment's keys: "
    "python -c 'import zmq.auth; zmq.auth.create_certificates(\"DIR\", \"current\")', then give every engine "
    "kv_connector_extra_config {\"side_channel_keys\": \"DIR\"} (docs: security)")


def open_side_channel_notice(cfg: KVSMConfig) -> str:
    """What an engine without keys says once at start."""
    if cfg.produces:
        what = ("answers any host that can reach its port with its NIXL agent metadata, "
                "and takes claims, heartbeats and abandons from it")
    else:
        what = "talks to any side channel a request's kv_transfer_params name, unauthenticated"
    return OPEN_WARNING % (cfg.engine_id, f"{cfg.side_channel_host}:{cfg.side_channel_port}", what)


class KeysWatch:
    """Loads the keys and re-checks them on a timer; ``apply`` hands a changed
    set to the server and the client (loop thread)."""

    def __init__(self, cfg: KVSMConfig, loop: EventLoop, apply: Callable[[SideChannelKeys], None],
                 note: Callable[..., None], count: Callable[[dict[str, int]], None]) -> None:
        assert cfg.side_channel_keys is not None
        self.directory = cfg.side_channel_keys
        self.interval_ns = int(cfg.side_channel_keys_reload_s * 1e9)
        self.keys = load_keys(self.directory)  # checked at config time already: a race only
        self._loop = loop
        self._apply = apply
        self._note = note
        self._count = count
        self._failures = 0
        self.timer: TimerHandle | None = None

    def start(self) -> None:
        log.info("kvsm side channel keys: %s", self.keys.describe())
        self._note("worker.keys", None, keys=self.keys.describe())
        self._arm()

    def stop(self) -> None:
        self._loop.cancel(self.timer)
        self.timer = None

    def _arm(self) -> None:
        self.timer = self._loop.call_later(self.interval_ns, self._check_on_timer, label="side channel keys")

    def _check_on_timer(self) -> None:
        self.check()

    def check(self) -> bool:
        """Reload if the directory changed; True if new keys were applied."""
        self.timer = None
        try:
            if directory_digest(self.directory) == self.keys.digest:
                return False
            keys = load_keys(self.directory)
            self._apply(keys)
        except (SideChannelKeysError, OSError) as e:
            self._failures += 1
            self._count({"keys_reload_failed": 1})
            if rate_limited(self._failures):
                log.error("kvsm side channel keys: keeping %s: the directory cannot be used now (%d time(s) "
                          "so far): %s", self.keys.describe(), self._failures, e)
            self._note("worker.keys_unusable", None, error=str(e)[:300], keeping=self.keys.describe())
            return False
        finally:
            if self.timer is None:
                self._arm()
        self.keys = keys
        self._count({"keys_reloaded": 1})
        log.warning("kvsm side channel keys changed: %s", keys.describe())
        self._note("worker.keys", None, keys=keys.describe())
        return True
