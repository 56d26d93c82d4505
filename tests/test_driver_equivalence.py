"""Two drivers, one implementation per algorithm: the message drivers (in-memory transport, lockstep) end where
the simulator ends, for every algorithm, seeding and consensus included, on every device there is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from dfca.algorithms import CLIENTS, schedule_of
from dfca.config import KMEANS_ALGORITHMS, SERVER_CLUSTERING, ExperimentConfig
from dfca.graph import neighbours
from dfca.identity import topics
from dfca.results.evaluation import cluster_ari, populated_clusters
from dfca.runtime.control.experiments import RUNTIME_ALGORITHMS
from dfca.runtime.driver.driver_stats import PHASES
from dfca.simulator import Simulation, prepare, simulate
from dfca.transport import InMemoryBroker, InMemoryTransport, RabbitMQTransport
from harness.lockstep import LockstepRun, client_driver, lockstep_round, run_lockstep
from harness.ragged import cut, spread_sizes

W0 = "worker-0"  # the host word of every client when one worker hosts them all

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here"))]


def small_config(**overrides: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "name": "equiv", "algorithm": "dfca", "init": "global", "aggregation": "batch", "clusters": 2,
        "rounds": 3, "seed": 3,
        "data": {"dataset": "digits", "rotations": [0, 180], "clients": 10, "train_per_client": 30,
                 "test_per_client": 10},
        "model": {"kind": "mlp", "hidden": 16},
        "train": {"lr": 0.1, "local_epochs": 2, "batch_size": 10},
        "topology": {"kind": "erdos_renyi", "p": 0.4},
        # the drivers' arithmetic, exactly: a lossy payload's rounding amplifies the order of float sums (see
        # test_lossy_payloads_are_rounded_alike_on_both_drivers); robust DFCA gossips every round unless a test says
        "dfca": {"traffic": "full"},
        "runtime": {"payload_dtype": "float32"},
    }
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return ExperimentConfig.model_validate(base)


def config_for(algorithm: str) -> ExperimentConfig:
    """A small run of `algorithm`: rotated digits with mixtures (the k-means algorithms: blobs; the server-clustered
    ones: Dirichlet label skew; FedCRef: whole digit classes per client), seeding and gossip steps short."""
    if algorithm == "fedcref":  # every client holds 2-5 whole digit classes; tiny autoencoders
        return ExperimentConfig.model_validate({
            "name": "equiv", "algorithm": "fedcref", "rounds": 2, "seed": 3,
            "data": {"dataset": "digits", "clients": 6, "samples_per_category": 30},
            "fedcref": {"layers": [16, 8], "local_epochs": 2, "fedavg_rounds": 2, "batch_size": 16}})
    if algorithm in SERVER_CLUSTERING:
        return small_config(algorithm=algorithm, rounds=3, data={"partition": "dirichlet", "groups": 2})
    if algorithm in KMEANS_ALGORITHMS:
        return small_config(algorithm=algorithm, clusters=3, rounds=3, data={"dataset": "blobs",
                                                                             "train_per_client": 20})
    return small_config(algorithm=algorithm, rounds=3, data={"rotations": [0, 90], "mixture": True},
                        dfca={"traffic": "lean", "flood_rounds": 2, "seed_epochs": 1, "gossip_every": 2})


def transport_factory() -> Any:
    broker = InMemoryBroker()
    return lambda: InMemoryTransport(broker)


def assert_rows_match(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rows: list[int]) -> None:
    for name, tensor in actual.items():
        torch.testing.assert_close(tensor.cpu(), expected[name][rows].cpu(), rtol=1e-4, atol=1e-5)


SCHEMA_ALGORITHMS = get_args(ExperimentConfig.model_fields["algorithm"].annotation)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", SCHEMA_ALGORITHMS)
def test_every_algorithm_the_schema_accepts_runs_the_same_on_both_drivers(algorithm: str, device: str) -> None:
    """Registered (dfca.algorithms), accepted by the runtime, and two rounds on the message drivers end where the
    simulator ends, on each device this machine has: an algorithm added to the schema is held to this without a
    test of its own."""
    assert algorithm in CLIENTS and algorithm in RUNTIME_ALGORITHMS
    cfg = config_for(algorithm).model_copy(update={"device": device})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 3, device=device)
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0 and d.rounds_done == schedule_of(cfg).total_rounds
        for name, tensor in d.algorithm.state().items():
            if name.startswith("params."):
                torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", SCHEMA_ALGORITHMS)
def test_every_algorithm_runs_clients_of_unequal_size_the_same_on_both_drivers(algorithm: str, device: str) -> None:
    """Clients of unequal size (a quarter to all of the config's samples, one client far larger, so that the
    federation is bucketed by size where its clients hold enough for it): the message drivers, each host with its
    own part, end where the simulator ends."""
    cfg = config_for(algorithm).model_copy(update={"device": device})
    data = prepare(cfg).data.to("cpu")
    valid = (data.y_train >= 0).sum(1).tolist()  # FedCRef's clients hold their categories' samples, then -1
    sizes = [max(4, n // 4 + (n * i) // (3 * data.num_clients)) for i, n in enumerate(valid)]
    sizes[1] = valid[1]
    ragged = cut(data, sizes, spread_sizes(data.y_test.shape[1], data.num_clients, 3))
    assert ragged.is_ragged and (ragged.is_bucketed or algorithm == "fedcref")  # FedCRef pads its own 6 clients
    sim = simulate(cfg, data=ragged)
    run = run_lockstep(cfg, ragged, neighbours(prepare(cfg, ragged).graph), transport_factory(), 3, device=device)
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0 and d.rounds_done == schedule_of(cfg).total_rounds
        for name, tensor in d.algorithm.state().items():
            if name.startswith("params."):
                torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["dfca", "ifca", "dfedavgm", "fedspd"])
def test_fixed_local_steps_run_clients_of_unequal_size_the_same_on_both_drivers(algorithm: str, device: str) -> None:
    """train.local_steps on a bucketed federation: each host, training only its own clients, draws every client's
    steps as the simulator does, so the message drivers end where the simulator ends."""
    cfg = config_for(algorithm).model_copy(update={"device": device})
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"local_steps": 3})})
    data = prepare(cfg).data.to("cpu")
    n = data.y_train.shape[1]
    sizes = [max(4, n // 4 + (n * i) // (3 * data.num_clients)) for i in range(data.num_clients)]
    sizes[1] = n
    ragged = cut(data, sizes, spread_sizes(data.y_test.shape[1], data.num_clients, 3))
    assert ragged.is_bucketed
    sim = simulate(cfg, data=ragged)
    run = run_lockstep(cfg, ragged, neighbours(prepare(cfg, ragged).graph), transport_factory(), 3, device=device)
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0 and d.rounds_done == schedule_of(cfg).total_rounds
        for name, tensor in d.algorithm.state().items():
            if name.startswith("params."):
                torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-4, atol=1e-5)


# -- DFCA -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("init,aggregation,hosts", [("global", "batch", 3), ("local", "batch", 2),
                                                    ("global", "sequential", 1)])
def test_paper_rule_drivers_match_the_simulator(init: str, aggregation: str, hosts: int, device: str) -> None:
    cfg = small_config(init=init, aggregation=aggregation, dfca={"variant": "paper"}, device=device)
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), hosts, device=device)
    for d in run.drivers:
        assert d.stats.applied > 0 and not d.stats.rejected and d.stats.timeouts == 0
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)
    # every client applied exactly one model per neighbour per round
    assert sum(d.stats.applied for d in run.drivers) == cfg.rounds * int(ctx.adjacency.sum())


@pytest.mark.parametrize("init,hosts", [("global", 2), ("local", 3)])
def test_robust_drivers_match_the_simulator(init: str, hosts: int) -> None:
    """Ratio consensus over message-driven gossip steps equals the simulator's P^G (m theta) / P^G m."""
    cfg = small_config(init=init, rounds=4, dfca={"variant": "robust", "seeding": "none", "warmup_rounds": 2,
                                                  "warmup_gossip_steps": 3, "gossip_steps": 2})
    steps = [schedule_of(cfg).gossip_steps(t) for t in range(cfg.rounds)]
    assert steps == [3, 3, 2, 2]
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), hosts)
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0 and d.stats.stale_dropped == 0
        assert d.algorithm.consensus is None  # type: ignore[attr-defined]
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)
        assert set(d.stats.as_dict()["seconds"]) == set(PHASES)  # where the driver's time went, phase by phase
        assert all(d.stats.seconds[p] > 0 for p in ("train", "publish", "receive", "mix"))
    # one gossip message per neighbour and step, each applied once; one published per client and step
    assert sum(d.stats.applied for d in run.drivers) == sum(steps) * int(ctx.adjacency.sum())
    assert sum(d.stats.published for d in run.drivers) == sum(steps) * cfg.data.clients


def test_robust_then_paper_rounds_match_the_simulator() -> None:
    """gossip_steps 0: the warm-up rounds use consensus, the later ones eq. 7 (sequential eq. 8 here)."""
    cfg = small_config(aggregation="sequential", rounds=3,
                       dfca={"variant": "robust", "seeding": "none", "warmup_rounds": 1, "warmup_gossip_steps": 2,
                             "gossip_steps": 0})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 2)
    for d in run.drivers:
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)
    edges = int(ctx.adjacency.sum())
    assert sum(d.stats.applied for d in run.drivers) == 2 * edges + 2 * edges


@pytest.mark.parametrize("init,aggregation,hosts,variant", [("global", "batch", 2, "robust"),
                                                            ("local", "sequential", 3, "paper")])
def test_seeding_drivers_match_the_simulator(init: str, aggregation: str, hosts: int, variant: str) -> None:
    """Farthest-first seeding (one candidate message per neighbour and round), then training: driver == simulator."""
    cfg = small_config(init=init, aggregation=aggregation, clusters=2, rounds=7,
                       dfca={"variant": variant, "seeding": "farthest", "flood_rounds": 3, "seed_epochs": 2,
                             "warmup_rounds": 1, "warmup_gossip_steps": 2, "gossip_steps": 0})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    assert schedule_of(cfg).seeding_rounds == 6  # k * flood_rounds seeding rounds, then training
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), hosts)
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0 and d.algorithm.seeds is None  # type: ignore[attr-defined]
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trim", [0.0, 0.25])
def test_screened_gossip_drivers_match_the_simulator(trim: float, device: str) -> None:
    """`dfca.screen` (core.screened_gossip): the simulator and three message drivers screen the same arrivals and end
    at the same models (the drivers get them one message at a time, the simulator all at once)."""
    cfg = small_config(rounds=3, dfca={"flood_rounds": 2, "seed_epochs": 2, "warmup_rounds": 1,
                                       "warmup_gossip_steps": 3, "gossip_steps": 2, "screen": True,
                                       "screen_radius": 1.5, "screen_trim": trim}, device=device)
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 3, device=device)
    assert sim.summary["screened"] > 0  # a tight radius: some honest estimates are dropped, on both drivers alike
    assert sum(d.stats.screened for d in run.drivers) == sim.summary["screened"]
    for d in run.drivers:
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)


@pytest.mark.parametrize("aggregation", ["batch", "sequential"])
def test_screened_one_hop_merges_match_the_simulator(aggregation: str) -> None:
    """The default schedule's one-hop merges are screened too (core.screened_gossip.screened_arrivals): with a tight
    radius some honest models are dropped, the same ones whether they arrive all at once or one at a time."""
    cfg = small_config(rounds=4, aggregation=aggregation,
                       dfca={"flood_rounds": 2, "seed_epochs": 2, "warmup_rounds": 0, "gossip_every": 2,
                             "gossip_steps": 2, "screen": True, "screen_radius": 1.2})
    assert schedule_of(cfg).gossip_steps(schedule_of(cfg).seeding_rounds) == 0  # the first training round merges
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 3)
    assert sim.summary["screened"] > 0
    assert sum(d.stats.screened for d in run.drivers) == sim.summary["screened"]
    for d in run.drivers:
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("payload", ["int8", "float16"])
def test_lossy_payloads_are_rounded_alike_on_both_drivers(payload: str, device: str) -> None:
    """The default's 8-bit payloads (and float16): the simulator delivers what the message drivers decode, seeds
    relayed between hosts included, so seeding and one round of gossip end at the same models. (Over more rounds
    the two drift apart by a rounding step here and there: float sums in another order land on the other side of
    a rounding boundary.)"""
    cfg = small_config(rounds=1, dfca={"traffic": "lean", "flood_rounds": 2, "seed_epochs": 1, "gossip_steps": 1},
                       runtime={"payload_dtype": payload}, device=device)
    assert schedule_of(cfg).gossip_steps(schedule_of(cfg).seeding_rounds) == 1
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 3, device=device)
    exact = simulate(small_config(rounds=1, dfca={"traffic": "lean", "flood_rounds": 2, "seed_epochs": 1,
                                                  "gossip_steps": 1}, device=device), data=ctx.data)
    rounding = max(float((sim.algorithm.params[n] - v).abs().max()) for n, v in exact.algorithm.params.items())
    assert rounding > 1e-4  # the payload's rounding shows in the models
    for d in run.drivers:
        assert not d.stats.rejected and d.stats.timeouts == 0
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)


def test_seeding_gives_every_client_the_same_seeds_of_distinct_clusters() -> None:
    """After k floods every client holds the same k models, each fitting one true cluster (farthest-first)."""
    cfg = small_config(rounds=1, dfca={"seeding": "farthest", "flood_rounds": 3, "seed_epochs": 40})
    schedule = schedule_of(cfg)
    assert schedule.seeding_rounds == 6 and schedule.total_rounds == 7  # the seeding comes before training
    ctx = prepare(cfg)
    sim = Simulation(ctx)
    for t in range(schedule.seeding_rounds):
        sim.run_round(t)
    algo = sim.algorithm
    for name, tensor in algo.params.items():  # type: ignore[attr-defined]
        assert torch.equal(tensor, tensor[:1].expand_as(tensor)), name  # identical at every client
        assert not torch.equal(tensor[0, 0], tensor[0, 1])
    assigned = algo.evaluate().assigned
    assert cluster_ari(assigned, ctx.data.true_cluster) == 1.0 and populated_clusters(assigned) == 2


# -- the baselines --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hosts", [1, 3])
def test_ifca_clients_and_server_match_the_simulator(hosts: int) -> None:
    cfg = small_config(algorithm="ifca", rounds=4, train={"momentum": 0.5})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    expected = sim.simulation.server.models  # type: ignore[union-attr]
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), hosts)
    server = run.server
    assert server is not None and server.rounds_done == cfg.rounds
    assert server.stats.applied == cfg.rounds * cfg.data.clients and server.stats.timeouts == 0
    for name, tensor in server.algorithm.models.items():  # type: ignore[attr-defined]
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-5)
    for d in run.drivers:
        assert d.algorithm.model_round == cfg.rounds  # type: ignore[attr-defined]
        assert d.stats.published == cfg.rounds * len(d.ids) and d.stats.timeouts == 0
        for name, tensor in d.algorithm.params.items():  # type: ignore[attr-defined]
            torch.testing.assert_close(tensor, expected[name].expand_as(tensor), rtol=1e-4, atol=1e-5)
        assert d.report()["assigned"] == sim.assigned[d.ids].tolist()


@pytest.mark.parametrize("aggregation,hosts", [("batch", 3), ("sequential", 2)])
def test_dfedavgm_drivers_match_the_simulator(aggregation: str, hosts: int) -> None:
    cfg = small_config(algorithm="dfedavgm", init="local", aggregation=aggregation, train={"momentum": 0.9})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), hosts)
    for d in run.drivers:
        assert d.stats.timeouts == 0 and not d.stats.rejected
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)  # type: ignore[attr-defined]
    assert sum(d.stats.applied for d in run.drivers) == cfg.rounds * int(ctx.adjacency.sum())


@pytest.mark.parametrize("aggregation,hosts", [("batch", 3), ("sequential", 2)])
def test_fedspd_drivers_match_the_simulator(aggregation: str, hosts: int) -> None:
    cfg = small_config(algorithm="fedspd", aggregation=aggregation, clusters=2,
                       data={"rotations": [0, 90], "mixture": True}, fedspd={"final_epochs": 2})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    algo: Any = sim.algorithm
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), hosts)
    for d in run.drivers:
        a: Any = d.algorithm
        assert d.stats.timeouts == 0
        assert_rows_match(a.params, algo.params, d.ids)
        torch.testing.assert_close(a.shares, algo.shares[d.ids])
        assert a.personal is not None
        assert_rows_match(a.personal, algo.personal, d.ids)
        report = d.report()
        assert len(report["mixture"]) == len(d.ids) and len(report["true_mixture"]) == len(d.ids)
    # each client sent one model per round; receivers applied only those of the cluster they trained too
    published = sum(d.stats.published for d in run.drivers)
    applied = sum(d.stats.applied for d in run.drivers)
    assert published == cfg.rounds * cfg.data.clients and 0 < applied < cfg.rounds * int(ctx.adjacency.sum())


def test_local_drivers_match_the_simulator_and_send_nothing() -> None:
    cfg = small_config(algorithm="local", init="local", train={"momentum": 0.9})
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 2)
    for d in run.drivers:
        assert d.stats.published == 0 and d.stats.applied == 0
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)  # type: ignore[attr-defined]


# -- checkpoints --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["dfca", "ifca", "dfedavgm", "fedspd"])
def test_a_driver_restored_from_its_checkpoint_carries_on_identically(algorithm: str, tmp_path: Path) -> None:
    cfg = small_config(algorithm=algorithm, rounds=2, data={"rotations": [0, 90], "mixture": True})
    ctx = prepare(cfg)
    graph = neighbours(ctx.graph)
    run = run_lockstep(cfg, ctx.data, graph, transport_factory(), 1)
    driver = run.drivers[0]
    path = tmp_path / "driver.safetensors"
    driver.save_checkpoint(path)
    clients = driver.ids
    again = client_driver(cfg, "lockstep", clients, ctx.data.subset(clients), graph, InMemoryTransport())
    assert again.load_checkpoint(path) == schedule_of(cfg).total_rounds - 1
    assert again.report() == driver.report()
    if algorithm == "ifca":
        assert again.algorithm.model_round == driver.algorithm.model_round == cfg.rounds  # type: ignore[attr-defined]


def test_a_checkpoint_taken_mid_seeding_resumes_to_the_same_seeds(tmp_path: Path) -> None:
    """Stop inside a seeding slot, restore every driver from its checkpoint, finish: the uninterrupted result."""
    cfg = small_config(rounds=2, dfca={"seeding": "farthest", "flood_rounds": 3, "seed_epochs": 2,
                                       "warmup_rounds": 1, "warmup_gossip_steps": 2})
    ctx = prepare(cfg)
    graph = neighbours(ctx.graph)
    sim = simulate(cfg, data=ctx.data)
    groups = [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]

    def drivers() -> LockstepRun:  # on a fresh broker each time: the restart starts from the checkpoints alone
        factory = transport_factory()
        return LockstepRun([client_driver(cfg, "mid", g, ctx.data.subset(g), graph, factory(), workers=2)
                            for g in groups], None)

    first = drivers()
    for t in range(4):  # slot 0 (rounds 0-2) and the first round of slot 1
        lockstep_round(first, t)
    paths = [tmp_path / f"{i}.safetensors" for i in range(2)]
    for d, path in zip(first.drivers, paths, strict=True):
        d.save_checkpoint(path)
    again = drivers()
    for d, path in zip(again.drivers, paths, strict=True):
        assert d.load_checkpoint(path) == 3
    for t in range(4, schedule_of(cfg).total_rounds):
        lockstep_round(again, t)
    for d in again.drivers:
        assert_rows_match(d.algorithm.params, sim.algorithm.params, d.ids)


# -- over RabbitMQ ------------------------------------------------------------------------------------------
@pytest.mark.rabbitmq
@pytest.mark.parametrize("algorithm", SCHEMA_ALGORITHMS)
def test_every_algorithm_over_rabbitmq_ends_where_the_simulator_ends(algorithm: str, rabbitmq_url: str,
                                                                     unique_id: str) -> None:
    """The same lockstep drivers over a real broker (durable queues, confirms, manual acks): the simulator's result,
    seeding and consensus included."""
    cfg = config_for(algorithm)
    ctx = prepare(cfg)
    sim = simulate(cfg, data=ctx.data)
    connections: list[RabbitMQTransport] = []

    def connect() -> RabbitMQTransport:
        connections.append(RabbitMQTransport(rabbitmq_url, name=f"test-{unique_id}"))
        return connections[-1]

    try:
        run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), connect, 2, experiment=unique_id)
        for d in run.drivers:
            assert not d.stats.rejected and d.stats.timeouts == 0
            for name, tensor in d.algorithm.state().items():
                if name.startswith("params."):
                    torch.testing.assert_close(tensor, sim.algorithm.state()[name][d.ids], rtol=1e-4, atol=1e-5)
        assert (sum(d.stats.published for d in run.everyone) > 0) == (algorithm != "local")  # it went over the broker
    finally:
        cleanup = connections[0] if connections else None
        workers = [topics.worker_queue(unique_id, f"worker-{h}") for h in range(2)]
        for queue in [topics.server_queue(unique_id), *workers]:
            if cleanup is not None:
                cleanup.delete_queue(queue)
        for c in connections:
            c.close()
