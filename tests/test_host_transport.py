"""A worker's HostTransport keeps models in the broker's memory only, and publishes those of its last rounds again
once its connection was opened anew (the broker may have restarted and lost them)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dfca.identity import topics
from dfca.runtime.driver import host_transport
from dfca.runtime.driver.host_transport import REPUBLISHED_HEADER, RETAINED_ROUNDS, HostTransport
from dfca.transport import InMemoryBroker, InMemoryTransport
from dfca.transport.base import Outgoing

EXPERIMENT = "kept"


class Reconnecting(InMemoryTransport):
    """An in-memory connection that records how each batch was published, and whose `connections` a test raises
    as a reconnection to a restarted broker would."""

    def __init__(self, broker: InMemoryBroker) -> None:
        super().__init__(broker)
        self.batches: list[tuple[bool, list[Outgoing]]] = []
        self.connections = 1

    def publish_pipelined(self, messages: Sequence[Outgoing], persistent: bool = True) -> None:
        self.batches.append((persistent, list(messages)))
        super().publish_pipelined(messages, persistent)


def models(round_: int, senders: Sequence[int] = (0, 1), size: int = 100) -> list[Outgoing]:
    return [(topics.MODELS_EXCHANGE, topics.model_key(EXPERIMENT, "worker-0", s, 0), bytes([round_, s]) * (size // 2),
             {"round": str(round_), "sender": str(s)}) for s in senders]


def listening(broker: InMemoryBroker) -> tuple[InMemoryTransport, str]:
    """A neighbour's queue that gets every model of the experiment."""
    neighbour = InMemoryTransport(broker)
    queue = topics.worker_queue(EXPERIMENT, "worker-1")
    neighbour.declare_exchange(topics.MODELS_EXCHANGE)
    neighbour.declare_exchange(topics.CONTROL_EXCHANGE)
    neighbour.declare_queue(queue)
    neighbour.bind(queue, topics.MODELS_EXCHANGE, topics.experiment_binding(EXPERIMENT))
    return neighbour, queue


def own_queue(host: HostTransport) -> str:
    """The host's own queue, which hears nobody here: receiving from it is how its round loop waits."""
    queue = topics.worker_queue(EXPERIMENT, "worker-0")
    host.declare_exchange(topics.MODELS_EXCHANGE)
    host.declare_queue(queue)
    return queue


def drain(transport: InMemoryTransport, queue: str) -> list[tuple[bytes, dict[str, str]]]:
    got = []
    while (message := transport.receive(queue)) is not None:
        transport.ack(message)
        got.append((message.body, dict(message.headers)))
    return got


def test_models_of_the_last_rounds_are_published_again_once_after_a_new_connection() -> None:
    broker = InMemoryBroker()
    inner = Reconnecting(broker)
    host = HostTransport(inner)
    neighbour, queue = listening(broker)
    own = own_queue(host)
    for t in range(4):
        host.publish_pipelined(models(t))
    host.publish_pipelined([(topics.CONTROL_EXCHANGE, "control.key", b"stop", None)])
    assert [persistent for persistent, _ in inner.batches] == [False] * 4 + [True]  # models in memory only
    sent = drain(neighbour, queue)
    assert len(sent) == 8

    assert host.receive(own) is None and host.republished == 0  # nothing lost: nothing sent again
    inner.connections = 2  # the broker restarted: what it held in memory is gone
    host.receive(own)
    persistent, again = inner.batches[-1]
    kept = [(body, headers) for body, headers in sent if int(headers["round"]) >= 4 - RETAINED_ROUNDS]
    assert not persistent and host.republished == len(kept) == 2 * RETAINED_ROUNDS
    got = sorted(drain(neighbour, queue), key=lambda m: m[0])
    kept.sort(key=lambda m: m[0])
    assert [body for body, _ in got] == [body for body, _ in kept]  # the same bodies and send times, marked
    assert all(headers == {**first, REPUBLISHED_HEADER: "2"}
               for (_, headers), (_, first) in zip(got, kept, strict=True))
    host.receive(own)
    assert host.republished == len(kept) and drain(neighbour, queue) == []  # once per new connection


def test_a_round_past_the_kept_bytes_is_published_persistent_and_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_transport, "RETAINED_BYTES", 250)
    broker = InMemoryBroker()
    inner = Reconnecting(broker)
    host = HostTransport(inner)
    own = own_queue(host)
    for t in range(3):
        host.publish_pipelined(models(t))  # 200 bytes a round
    # round 1 would take the kept bytes to 400: persistent; round 2 lets round 0 go and fits again
    assert [persistent for persistent, _ in inner.batches] == [False, True, False]
    inner.connections = 2
    host.receive(own)
    _, again = inner.batches[-1]
    assert [headers["round"] for _, _, _, headers in again] == ["2", "2"]  # type: ignore[index]
