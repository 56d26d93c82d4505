"""The transport contract on InMemoryTransport, plus `connect_transport` for memory:// URLs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transport_contract import Connect, Names, TransportContract

from dfca.identity import topics
from dfca.identity.broker_setup import ensure_broker_topology
from dfca.transport import (
    InMemoryBroker,
    InMemoryTransport,
    Transport,
    TransportError,
    connect_transport,
    process_memory_broker,
)


class TestInMemoryTransport(TransportContract):
    @pytest.fixture
    def connect(self) -> Iterator[Connect]:
        broker = InMemoryBroker()
        opened: list[Transport] = []

        def make() -> Transport:
            opened.append(InMemoryTransport(broker, user="dfca-test"))
            return opened[-1]

        yield make
        for transport in opened:
            transport.close()

    @pytest.fixture
    def names(self) -> Names:
        return Names()


def test_memory_urls_share_one_broker_per_process() -> None:
    first, second = connect_transport("memory://"), connect_transport("memory://")
    other = connect_transport("memory://isolated")
    assert isinstance(first, InMemoryTransport)
    assert first.broker is second.broker is process_memory_broker()
    assert other.broker is process_memory_broker("isolated") and other.broker is not first.broker


def test_unknown_url_scheme_is_refused() -> None:
    with pytest.raises(TransportError):
        connect_transport("kafka://somewhere")


def test_ensure_broker_topology_declares_exchanges_and_dead_letter_queue() -> None:
    transport = InMemoryTransport()
    ensure_broker_topology(transport)
    ensure_broker_topology(transport)  # idempotent
    assert transport.broker.exchanges == topics.EXCHANGES
    transport.declare_queue("work", dead_letter_exchange=topics.DEAD_LETTER_EXCHANGE)
    transport.declare_exchange("in", "topic")
    transport.bind("work", "in", "#")
    transport.publish("in", "k", b"bad")
    message = transport.receive("work")
    assert message is not None
    transport.reject(message, requeue=False)
    dead = transport.receive(topics.DEAD_LETTER_QUEUE)
    assert dead is not None and dead.body == b"bad"
