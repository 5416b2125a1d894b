"""The trainer store's port (`reference_impl.engine.process.free_port`): rank 0 binds it
while the scenario's engines start, so it must be one the OS never hands to a process that asks for any
free port (those come from the ephemeral range)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from reference_impl.engine import process
from reference_impl.engine.process import free_port


def test_the_port_is_free_and_below_the_hosts_ephemeral_range() -> None:
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < low and not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: the probe closed its socket


def test_a_port_in_use_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "RESERVED_PORTS", (29000, 29002))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 29000))
        assert free_port() == 29001


def test_an_ephemeral_range_that_leaves_no_room_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "_ephemeral_low", lambda: 20000)
    with pytest.raises(OSError, match="ephemeral port range starts at 20000"):
        free_port()
