"""Free TCP ports on loopback for the servers a test starts (APIs, workers' HTTP, private RabbitMQ nodes).

A port from bind(("127.0.0.1", 0)) lies in the kernel's ephemeral range, the range outgoing connections take their
source ports from. Between the test's pick and the server's own bind, a connection some process opens (a worker's
AMQP client, an HTTP client) can take that very port, and the server fails with "address already in use". So the
ports here come from below that range, where no connection's source port is ever put, and not from ranges other
services on a shared machine hold; each is handed out once per process."""

from __future__ import annotations

import random
import socket
from pathlib import Path

OTHER_STACKS = ((8080, 8093), (28000, 30001))  # ports other stacks on a shared machine may hold
LOWEST = 20000
_given: set[int] = set()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def usable(port: int) -> bool:
    """Not another stack's, and not handed out before (the range's bounds are the draw's: `free_port_block`)."""
    return not any(lo <= port < hi for lo, hi in OTHER_STACKS) and port not in _given


def port_free(port: int) -> bool:
    """Nothing holds `port` on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port no process holds, below the ephemeral range, not handed out before in this process."""
    return free_port_block(1)


def free_port_block(size: int) -> int:
    """The first of `size` consecutive such ports."""
    top = ephemeral_start() - size  # the highest first port of a block below the range
    for _ in range(500):
        base = random.randrange(LOWEST, top + 1)
        block = range(base, base + size)
        if all(usable(p) for p in block) and all(port_free(p) for p in block):
            _given.update(block)
            return base
    raise RuntimeError(f"no {size} free consecutive ports between {LOWEST} and {top + size}")
