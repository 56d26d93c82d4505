"""runtime.driver.hearing on its own: a graph and a set of blocked senders, no transport, broker or algorithm."""

from __future__ import annotations

from dfca.algorithms import Exchange
from dfca.algorithms.base import SERVER
from dfca.runtime.driver.hearing import Hearing

GRAPH = {0: [1, 2], 1: [0, 2, 3], 2: [0, 1], 3: [1]}
GOSSIP = Exchange("gossip")
UPLOAD = Exchange("upload", receiver="server")
DOWNLOAD = Exchange("download", sender="server", parts=2)


def worker_0(blocked: set[int] | None = None) -> Hearing:
    """Clients 0 and 2 hosted (rows 0 and 1)."""
    return Hearing([0, 2], "clients", 4, lambda: GRAPH, blocked if blocked is not None else set())


def test_a_clients_message_reaches_the_hosted_rows_whose_client_neighbours_it() -> None:
    hearing = worker_0()
    assert hearing.rows(1, GOSSIP) == [0, 1] and hearing.rows(0, GOSSIP) == [1] and hearing.rows(3, GOSSIP) == []
    assert hearing.rows(1, UPLOAD) == []  # the server's to receive
    assert hearing.rows(SERVER, DOWNLOAD) == [0, 1] and hearing.rows(1, DOWNLOAD) == []
    assert hearing.heard() == {1} and hearing.heard({0: [3], 2: [0]}) == {3}  # hosted senders are not heard


def test_each_row_waits_for_its_sources_but_the_dead() -> None:
    hearing = worker_0()
    assert hearing.due(GOSSIP, dead={2}) == [{1: 1}, {0: 1, 1: 1}]
    assert hearing.due(DOWNLOAD, dead=set()) == [{SERVER: 2}, {SERVER: 2}]
    assert hearing.due(UPLOAD, dead=set()) == [{}, {}]
    assert hearing.expected([GOSSIP, UPLOAD]) == {0, 1, 2}


def test_a_blocked_sender_is_heard_by_nobody_once_indexed_again() -> None:
    blocked: set[int] = set()
    hearing = worker_0(blocked)
    blocked.add(1)
    hearing.index()
    assert hearing.rows(1, GOSSIP) == [] and hearing.sources(0, GOSSIP) == {2}


def test_a_central_role_hears_every_client_not_blocked() -> None:
    server = Hearing([SERVER], "server", 4, lambda: {}, {3})
    assert server.rows(2, UPLOAD) == [0] and server.rows(3, UPLOAD) == [] and server.rows(4, UPLOAD) == []
    assert server.sources(0, UPLOAD) == {0, 1, 2}
