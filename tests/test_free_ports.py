"""The tests' free ports: below the ephemeral range that outgoing connections take source ports from, clear of
the other stacks' ports, each handed out once, and free when handed out."""

from __future__ import annotations

import socket

import free_ports
import pytest


def test_ports_handed_out_are_free_distinct_and_no_connections_source_port() -> None:
    start = free_ports.ephemeral_start()
    ports = [free_ports.free_port() for _ in range(40)]
    base = free_ports.free_port_block(5)
    block = list(range(base, base + 5))
    assert len(set(ports + block)) == 45
    for port in ports + block:
        assert free_ports.LOWEST <= port < start
        assert not any(lo <= port < hi for lo, hi in free_ports.OTHER_STACKS)
        with socket.socket() as s:  # nothing holds it: a server binds it
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(free_ports, "LOWEST", taken)  # the only port to choose from: the held one
        monkeypatch.setattr(free_ports, "ephemeral_start", lambda: taken + 1)
        with pytest.raises(RuntimeError, match="no 1 free consecutive ports"):
            free_ports.free_port()
