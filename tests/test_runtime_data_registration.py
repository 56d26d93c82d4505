"""The topology service and workers that hold their own data, without a broker: registration over presence
announcements, experiments placed over the registered clients, and the refusals, each naming the worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dfca.config import ExperimentConfig, parse_config
from dfca.runtime.control.coordinator import ConfigRejected, Coordinator, InvalidTransition
from dfca.runtime.protocol.holdings import ClientFacts, DataHoldings
from dfca.runtime.protocol.messages import (
    MessageInvalid,
    PresenceEvent,
    RoundReport,
    StartCommand,
    decode_control,
    decode_event,
    encode,
)
from dfca.transport import InMemoryBroker, InMemoryTransport

DEPLOYMENT = "dsilo"


def holdings(folder: str, clients: dict[str, int | None], shape: tuple[int, ...] = (8,), classes: int = 3
             ) -> DataHoldings:
    return DataHoldings(folder=folder, input_shape=list(shape), num_classes=classes,
                        clients=[ClientFacts(id=c, train=30, test=10, cluster=k) for c, k in clients.items()])


A = holdings("/srv/a", {"north": 0, "east": 1, "west": 0})
B = holdings("/srv/b", {"south": 1, "centre": 0})


def config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"name": "silo", "clusters": 2, "rounds": 3, "seed": 1, "data": {"source": "workers"},
                           "model": {"kind": "mlp", "hidden": 8}, "topology": {"kind": "complete"},
                           "runtime": {"round_timeout": 2.0}}
    cfg.update(overrides)
    return cfg


@pytest.fixture
def broker() -> InMemoryBroker:
    return InMemoryBroker()


@pytest.fixture
def coordinator(broker: InMemoryBroker) -> Coordinator:
    coordinator = Coordinator(InMemoryTransport(broker), DEPLOYMENT, workers=None)
    coordinator.open()
    return coordinator


def announce(coordinator: Coordinator, ordinal: int, held: DataHoldings | None, workers: int = 2) -> None:
    coordinator.on_event(PresenceEvent(deployment=DEPLOYMENT, worker=ordinal, workers=workers, holdings=held))


def parsed(cfg: dict[str, Any]) -> ExperimentConfig:
    return parse_config(cfg)


def test_an_experiment_runs_over_the_registered_clients_and_tells_workers_where_each_is(
        coordinator: Coordinator, broker: InMemoryBroker) -> None:
    probe = InMemoryTransport(broker)
    probe.declare_queue("probe")
    probe.bind("probe", "dfca.control", "#")
    announce(coordinator, 0, A)
    announce(coordinator, 1, B)
    assert coordinator.deployment_view()["data"] == {"0": {"folder": "/srv/a", "clients": 3},
                                                     "1": {"folder": "/srv/b", "clients": 2}}
    record = coordinator.create(parsed(config()))
    assert record.config.data.clients == 5 and record.num_clients == 5
    assert record.placement is not None
    assert record.placement.client_ids == ["centre", "east", "north", "south", "west"]
    assert record.topology()["worker_clients"] == {"0": [1, 2, 4], "1": [0, 3]}
    assert record.placement.true_clusters == [0, 1, 0, 1, 0]
    assert len(record.edges) == 10  # the complete graph over the five registered clients
    coordinator.start(record.id)
    starts = []
    while (message := probe.receive("probe")) is not None:
        command = decode_control(message.body)
        if isinstance(command, StartCommand):
            starts.append(command)
    assert len(starts) == 1 and starts[0].placement == record.placement and starts[0].config.data.clients == 5


def test_no_registered_data_is_refused(coordinator: Coordinator) -> None:
    announce(coordinator, 0, None)
    with pytest.raises(ConfigRejected, match="no worker holding data has registered") as err:
        coordinator.create(parsed(config()))
    assert err.value.field == "data.source"


def test_a_client_held_twice_is_refused_and_no_experiment_leaves_it_out(coordinator: Coordinator) -> None:
    announce(coordinator, 0, A)
    announce(coordinator, 1, holdings("/srv/b", {"south": 1, "north": 0}))
    refused = coordinator.deployment_view()["data_refused"]
    assert list(refused) == ["1"] and "holds client 'north', which worker 0 (/srv/a) holds too" in refused["1"]
    with pytest.raises(ConfigRejected, match="worker 1 is refused"):
        coordinator.create(parsed(config()))


def test_data_that_does_not_fit_the_model_is_refused_naming_the_worker(coordinator: Coordinator) -> None:
    announce(coordinator, 0, A)
    announce(coordinator, 1, holdings("/srv/b", {"south": 1}, shape=(1, 4, 4)))
    with pytest.raises(ConfigRejected, match=r"worker 1 \(/srv/b\) holds samples of shape \(1, 4, 4\)"):
        coordinator.create(parsed(config()))
    announce(coordinator, 1, B)
    with pytest.raises(ConfigRejected, match="cnn needs images") as err:
        coordinator.create(parsed(config(model={"kind": "cnn"})))
    assert err.value.field == "model"
    with pytest.raises(ConfigRejected, match=r"worker 0 \(/srv/a\) has labels up to 2, .* 2 classes \(data.classes\)"):
        coordinator.create(parsed(config(data={"source": "workers", "classes": 2})))


def test_starting_refuses_while_a_placed_worker_is_away_or_holds_other_clients(coordinator: Coordinator) -> None:
    announce(coordinator, 0, A)
    announce(coordinator, 1, B)
    record = coordinator.create(parsed(config()))
    coordinator.presence.pop(1)  # worker 1 went away
    with pytest.raises(InvalidTransition, match="worker 1, which holds 2 of experiment .* is not up"):
        coordinator.start(record.id)
    announce(coordinator, 1, B)
    coordinator.start(record.id)
    announce(coordinator, 1, holdings("/srv/b2", {"south": 1, "elsewhere": 0}))  # restarted on another folder
    reason = coordinator.deployment_view()["data_refused"]["1"]
    assert f"worker 1 was restarted with other clients than experiment {record.id} placed on it" in reason
    assert "new 'elsewhere'" in reason and "missing 'centre'" in reason
    announce(coordinator, 1, B)  # back on its folder: accepted again
    assert coordinator.deployment_view()["data_refused"] == {}


def test_round_reports_carry_unknown_true_clusters_but_no_unknown_assignment() -> None:
    def report(assigned: int, truth: int) -> bytes:
        return encode(RoundReport.model_construct(
            deployment=DEPLOYMENT, experiment="e", worker=0, incarnation="i", round=1, clients=[0], complete=True,
            seconds=0.1, evaluation={"clients": [0], "assigned": [assigned], "true_cluster": [truth],
                                     "test_accuracy": [0.5], "train_loss": [1.0]},
            stats={}, lag_seconds=0.0, bytes_published=0, dead_neighbours=[], at=1.0, kind="round"))

    assert decode_event(report(0, -1)).evaluation["true_cluster"] == [-1]  # a client without clusters.json
    with pytest.raises(MessageInvalid, match="evaluation.assigned"):
        decode_event(report(-1, 0))


def test_a_restarted_topology_service_keeps_the_placement(broker: InMemoryBroker, tmp_path: Path) -> None:
    first = Coordinator(InMemoryTransport(broker), DEPLOYMENT, workers=None, state_dir=tmp_path)
    first.open()
    announce(first, 0, A)
    announce(first, 1, B)
    record = first.create(parsed(config()))
    first.close()
    again = Coordinator(InMemoryTransport(broker), DEPLOYMENT, workers=None, state_dir=tmp_path)
    restored = again.get(record.id)
    assert restored.placement == record.placement and restored.num_clients == 5
    assert restored.topology()["worker_clients"] == record.topology()["worker_clients"]
