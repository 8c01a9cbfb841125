"""``kvsm_testing.ports``: free ports outside the kernel's ephemeral range, each
handed out once."""

from __future__ import annotations

from kvsm_testing import ports


def test_ports_are_handed_out_once_and_bind() -> None:
    lo, _ = ports._ephemeral_range()
    got = [ports.free_port() for _ in range(20)] + ports.free_ports(3)
    assert len(set(got)) == len(got) and all(1024 <= p < lo for p in got), got
    base = ports.free_port_run(4)
    assert not {base, base + 1, base + 2, base + 3} & set(got)
