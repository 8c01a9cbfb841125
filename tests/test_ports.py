"""``kvsm_testing.ports``: free ports outside the kernel's ephemeral range, and a
range of its own for a test run beside another (``KVSM_TEST_PORTS``)."""

from __future__ import annotations

import pytest

from kvsm_testing import ports


def test_ports_are_handed_out_once_and_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSM_TEST_PORTS", raising=False)
    lo, _ = ports._ephemeral_range()
    got = [ports.free_port() for _ in range(20)] + ports.free_ports(3)
    assert len(set(got)) == len(got) and all(1024 <= p < lo for p in got), got
    base = ports.free_port_run(4)
    assert not {base, base + 1, base + 2, base + 3} & set(got)


def test_a_run_beside_another_keeps_to_its_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSM_TEST_PORTS", "26000-26099")
    got = [ports.free_port() for _ in range(30)]
    run = ports.free_port_run(3)
    assert all(26000 <= p <= 26099 for p in [*got, run, run + 2]), (got, run)


@pytest.mark.parametrize("value", ["26000", "a-b", "30000-29000", "80-90", "26000-70000"])
def test_a_bad_range_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVSM_TEST_PORTS", value)
    with pytest.raises(ValueError, match="KVSM_TEST_PORTS"):
        ports.free_port()
