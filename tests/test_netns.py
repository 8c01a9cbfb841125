"""The two-host harness itself (``kvsm_testing.netns``): the KV link carries TCP
between the hosts, each fault does what it says (and heals), and everything it
creates is gone afterwards, on success, on failure and after a process that
died without cleaning up.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_all
from kvsm_testing.netns import PREFIX, TwoHosts, netns_unavailable_reason

REASON = netns_unavailable_reason()
if REASON is not None:
    if require_all():
        pytest.fail(f"two-host harness tests cannot run: {REASON}, and KVSM_REQUIRE_ALL or CI is set",
                    pytrace=False)
    pytest.skip(f"needs network namespaces: {REASON}", allow_module_level=True)

PY = sys.executable
SERVER = "import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);" \
         "s.bind((sys.argv[1],7777));s.listen();print('up',flush=True)\nwhile True: s.accept()[0].close()"
CLIENT = "import socket,sys\ntry:\n socket.create_connection((sys.argv[1],7777),timeout=1.5).close();print('ok')\n" \
         "except OSError as e: print(type(e).__name__)"


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def connect(hosts: TwoHosts) -> str:
    """A TCP connection from the decode host to the prefill host's KV address."""
    out = hosts.decode.run(PY, "-c", CLIENT, hosts.prefill.kv_addr, check=False)
    return out.stdout.strip() or out.stderr.strip()[-200:]


def test_the_kv_link_the_faults_and_the_cleanup() -> None:
    with TwoHosts() as hosts:
        names = {hosts.prefill.netns, hosts.decode.netns}
        assert names <= namespaces()
        server = subprocess.Popen([*hosts.prefill.exec_prefix(), PY, "-c", SERVER, "0.0.0.0"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "up"
            assert connect(hosts) == "ok"
            hosts.partition()
            assert connect(hosts) == "TimeoutError"  # dropped silently: no refusal, no answer
            hosts.heal()
            assert connect(hosts) == "ok"
            hosts.drop("prefill")  # one direction: the SYN arrives, its answer is lost
            assert connect(hosts) == "TimeoutError"
            hosts.heal()
            hosts.link(False)
            assert connect(hosts) != "ok"
            hosts.link(True)
            hosts.rate_limit("10mbit")
            assert "tbf" in hosts.prefill.run("tc", "qdisc", "show", "dev", "kv0").stdout
            hosts.heal()
            assert "tbf" not in hosts.prefill.run("tc", "qdisc", "show", "dev", "kv0").stdout
            assert connect(hosts) == "ok"
            # The root namespace reaches the host on its client link.
            with socket.create_connection((hosts.prefill.client_addr, 7777), timeout=2):
                pass
        finally:
            server.kill()
            server.wait()
    assert not names & namespaces()


def test_a_failure_inside_still_removes_everything() -> None:
    names: set[str] = set()
    with pytest.raises(RuntimeError, match="boom"), TwoHosts() as hosts:
        names = {hosts.prefill.netns, hosts.decode.netns}
        raise RuntimeError("boom")
    assert names and not names & namespaces()


def test_namespaces_left_by_a_dead_run_are_removed_by_the_next(tmp_path: Path) -> None:
    """A process that made its hosts and died by SIGKILL leaves them behind; the
    next TwoHosts finds them by the dead pid in their name and removes them."""
    script = ("from kvsm_testing.netns import TwoHosts; import os, signal; h = TwoHosts(); "
              "print(h.prefill.netns, h.decode.netns, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, cwd=str(Path(__file__).parents[1]),
                         check=False)
    left = set(out.stdout.split())
    assert len(left) == 2 and all(n.startswith(f"{PREFIX}-") for n in left), out.stderr[-500:]
    assert left <= namespaces()
    with TwoHosts():
        assert not left & namespaces()
