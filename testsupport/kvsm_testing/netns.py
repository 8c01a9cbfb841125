"""Two hosts on one machine: network namespaces joined by veth pairs, and the
network faults the two-host tests inject between them.

Layout (``TwoHosts``), each host a namespace of its own::

      root namespace (the test, the client)
        | cl0 (client link)              | cl0 (client link)
      prefill host  == fr0 (front) ==  decode host (+ router)
                    == kv0 (KV)    ==

* **KV network** (``kv0``): kvsm's side channel and NIXL/UCX's reads, the way
  production runs KV traffic on a back-end fabric of its own. Every fault is
  injected here.
* **Front network** (``fr0``): the router's HTTP legs to the prefill server.
* **Client links** (``cl0``): the test process, in the root namespace, reaches
  each host's HTTP port (the router on the decode host, the servers' /health
  and /metrics). The namespaces have no route to anything else.

Interface names are the same in both hosts (``kv0``, ``fr0``, ``cl0``), so
``UCX_NET_DEVICES=kv0`` means the KV link on either side. The addresses come
from one free /24 of 10.0.0.0/8 that no interface of the machine uses.

Everything created is removed by ``close`` (the context manager's exit, also
on failure); namespaces left behind by a process that died (kill -9 of a test
run) are removed by the next ``TwoHosts`` created, found by the pid in their
name. Faults are nftables rules (silent drops: the packets vanish, as behind a
failed switch), link state (``ip link set down``: carrier loss) and ``tbf``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["Host", "NetnsUnavailable", "TwoHosts", "netns_unavailable_reason"]

PREFIX = "kvsm"
KV_IF, FRONT_IF, CLIENT_IF = "kv0", "fr0", "cl0"
_TABLE = "kvsm_fault"


class NetnsUnavailable(RuntimeError):
    """This machine cannot create the namespaces (not root, no iproute2/nft)."""


# Generous: on a CPU-starved machine (a CI runner whose busy-polling processes
# take every core) a link change that takes the kernel's rtnl lock has been seen
# to take over 30 s.
COMMAND_TIMEOUT_S = 120.0


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_unavailable_reason() -> str | None:
    """Why two-host tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 and nftables are needed)"
    name = f"{PREFIX}-{os.getpid()}-probe"
    proc = _run("ip", "netns", "add", name, check=False)
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete ``kvsm-<pid>-*`` namespaces whose creating process is gone."""
    proc = _run("ip", "netns", "list", check=False)
    removed = []
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def _kill_namespace_processes(name: str) -> None:
    proc = _run("ip", "netns", "pids", name, check=False)
    for pid in proc.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    nets = []
    for line in out.split("\n"):
        fields = line.split()
        if "inet" in fields:
            nets.append(ipaddress.IPv4Interface(fields[fields.index("inet") + 1]).network)
    return nets


def _free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    used = _used_networks()
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /24 in 10.100.0.0-10.249.255.0")


@dataclass(frozen=True)
class Host:
    """One namespace: its name and its addresses on each network."""

    netns: str
    kv_addr: str
    front_addr: str
    client_addr: str  # where the root namespace reaches it

    def exec_prefix(self) -> list[str]:
        """Prefix a command with this to run it inside the host."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*self.exec_prefix(), *cmd, check=check)

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ip`` inside the host via ``ip -n``: no fork into the namespace, no /sys
        remount (a link change through ``ip netns exec`` took over 30 s on a starved CI runner)."""
        return _run("ip", "-n", self.netns, *args, check=check)


class TwoHosts:
    """A prefill host and a decode host (see the module docstring); use as a
    context manager, or call ``close`` yourself."""

    def __init__(self, tag: str | None = None) -> None:
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        remove_stale_namespaces()
        rng = random.Random()
        tag = tag or f"{rng.randrange(16 ** 4):04x}"
        base = f"{PREFIX}-{os.getpid()}-{tag}"
        net = _free_subnet(rng)
        a = [str(net.network_address + i) for i in range(16)]
        self.prefill = Host(f"{base}-p", kv_addr=a[1], front_addr=a[5], client_addr=a[14])
        self.decode = Host(f"{base}-d", kv_addr=a[2], front_addr=a[6], client_addr=a[10])
        self._root_ifs = (f"kvc{tag}p", f"kvc{tag}d")
        self._closed = False
        try:
            self._build(a)
        except BaseException:
            self.close()
            raise

    def _build(self, a: list[str]) -> None:
        p, d = self.prefill.netns, self.decode.netns
        for ns in (p, d):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for ifname, pa, da in ((KV_IF, a[1], a[2]), (FRONT_IF, a[5], a[6])):
            _run("ip", "link", "add", ifname, "netns", p, "type", "veth", "peer", "name", ifname, "netns", d)
            _run("ip", "-n", p, "addr", "add", f"{pa}/30", "dev", ifname)
            _run("ip", "-n", d, "addr", "add", f"{da}/30", "dev", ifname)
            _run("ip", "-n", p, "link", "set", ifname, "up")
            _run("ip", "-n", d, "link", "set", ifname, "up")
        root_p, root_d = self._root_ifs
        for root_if, ns, root_addr, ns_addr in ((root_d, d, a[9], a[10]), (root_p, p, a[13], a[14])):
            _run("ip", "link", "add", root_if, "type", "veth", "peer", "name", CLIENT_IF, "netns", ns)
            _run("ip", "addr", "add", f"{root_addr}/30", "dev", root_if)
            _run("ip", "-n", ns, "addr", "add", f"{ns_addr}/30", "dev", CLIENT_IF)
            _run("ip", "link", "set", root_if, "up")
            _run("ip", "-n", ns, "link", "set", CLIENT_IF, "up")
        for ns in (p, d):
            _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", _TABLE)
            for chain, hook in (("in", "input"), ("out", "output")):
                _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", _TABLE, chain,
                     f"{{ type filter hook {hook} priority 0; }}")

    # -- faults on the KV network -----------------------------------------------------

    def _host(self, which: str) -> Host:
        return {"prefill": self.prefill, "decode": self.decode}[which]

    def drop(self, frm: str) -> None:
        """Drop, silently, every KV-network packet ``frm`` ("prefill" | "decode")
        sends: one direction lost."""
        host = self._host(frm)
        host.run("nft", "add", "rule", "inet", _TABLE, "out", "oifname", KV_IF, "drop")

    def drop_data(self, frm: str) -> None:
        """Drop every KV-network packet ``frm`` sends that carries more than a TCP
        header with options (over 80 bytes of IP): what it says is lost, its bare
        acknowledgements pass, so a read it is being sent goes on to the end."""
        host = self._host(frm)
        host.run("nft", "add", "rule", "inet", _TABLE, "out", "oifname", KV_IF, "ip", "length", "gt", "80", "drop")

    def partition(self) -> None:
        """Both directions of the KV network dropped silently."""
        for host in (self.prefill, self.decode):
            host.run("nft", "add", "rule", "inet", _TABLE, "out", "oifname", KV_IF, "drop")
            host.run("nft", "add", "rule", "inet", _TABLE, "in", "iifname", KV_IF, "drop")

    def link(self, up: bool) -> None:
        """The KV link's carrier up or down (``ip link set``), on both ends."""
        for host in (self.prefill, self.decode):
            host.ip("link", "set", KV_IF, "up" if up else "down")

    def rate_limit(self, rate: str, *, burst: str = "64kb", latency: str = "100ms") -> None:
        """Cap the KV link at ``rate`` (tc ``tbf`` syntax, e.g. "200mbit") both ways."""
        for host in (self.prefill, self.decode):
            host.run("tc", "qdisc", "replace", "dev", KV_IF, "root", "tbf", "rate", rate, "burst", burst,
                     "latency", latency)

    def heal(self) -> None:
        """Remove every fault: rules flushed, the link up, no rate limit."""
        for host in (self.prefill, self.decode):
            for chain in ("in", "out"):
                host.run("nft", "flush", "chain", "inet", _TABLE, chain, check=False)
            host.run("tc", "qdisc", "del", "dev", KV_IF, "root", check=False)
            host.ip("link", "set", KV_IF, "up", check=False)

    def rules(self) -> str:
        """The nftables rules in force on both hosts (for failure messages)."""
        return "\n".join(h.run("nft", "list", "table", "inet", _TABLE, check=False).stdout
                         for h in (self.prefill, self.decode))

    # -- the end ---------------------------------------------------------------------

    def close(self) -> None:
        """Kill what still runs inside either host and delete both namespaces
        (their veth ends go with them, and so do the root namespace's)."""
        if self._closed:
            return
        self._closed = True
        for host in (self.prefill, self.decode):
            _kill_namespace_processes(host.netns)
            _run("ip", "netns", "del", host.netns, check=False)
        for root_if in self._root_ifs:
            _run("ip", "link", "del", root_if, check=False)

    def __enter__(self) -> TwoHosts:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

