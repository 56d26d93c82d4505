"""One bad participant: forged seed candidates and consensus pairs (harness.forgery) against robust DFCA's defences.

Seeding always refuses what a receiver can check (core.seeding.refused_candidates, responds_to_input); screened
gossip (`dfca.screen`, core.screened_gossip) bounds what a neighbour's (num, den) pair can do. The lockstep tests run
three message drivers in memory with host 1 compromised (harness.forged_lockstep.run_with_forger); the RabbitMQ run
with a compromised worker's own credentials is in test_broker_least_privilege.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dfca.algorithms import schedule_of
from dfca.config import ExperimentConfig
from dfca.core.aggregation import fold_models
from dfca.core.consensus import StepConsensus
from dfca.core.ratio import ratio_estimate
from dfca.core.screened_gossip import MergeFolds, Screen, budgeted, screened_arrivals, screened_mix
from dfca.core.seeding import (
    FIRST_HAND,
    UNRANKED,
    OriginCopies,
    RelayHops,
    first_slot_scores,
    refused_candidates,
    responds_to_input,
)
from dfca.data import build_federated_data
from dfca.graph import build_graph, neighbours
from dfca.settings import ENV_VARS
from harness.forged_lockstep import forged_run, honest_scores, run_with_forger
from harness.forgery import Attack, top_draw


# -- seeding: what a receiver can check --------------------------------------------------------------------------------
def test_a_seed_score_is_refused_when_no_honest_client_could_have_sent_it() -> None:
    drawn = first_slot_scores(7, [0, 1, 2])
    score = torch.tensor([float(drawn[0]), 0.999, float(drawn[2]), -1.0, 0.5], dtype=torch.float64)
    origin = torch.tensor([0, 1, 2, 1, 9])
    # slot 0: the draw of its origin, recomputed; a negative score; an origin that is not a client of the run
    assert refused_candidates(score, origin, 0, 7, 3).tolist() == [False, True, False, True, True]
    # later slots (a loss on the origin's own data): any finite score >= 0 of a client of the run
    assert refused_candidates(score, origin, 1, 7, 3).tolist() == [False, False, False, True, True]
    assert refused_candidates(torch.tensor([math.inf], dtype=torch.float64), torch.tensor([0]), 1, 7, 3).item()


def test_a_model_that_ignores_its_input_cannot_seed_a_cluster() -> None:
    inputs = torch.randn(3, 5, 4)
    weights = torch.randn(3, 4, 2)
    weights[1] = 0.0  # the all-zero model of the seed hijack
    logits = inputs @ weights
    logits[2, 0, 0] = math.nan
    assert responds_to_input(logits).tolist() == [True, False, False]


def test_the_relay_liar_claims_the_true_top_draw() -> None:
    origin, draw = top_draw(3, 10)
    assert draw == float(first_slot_scores(3, range(10)).max()) and not refused_candidates(
        torch.tensor([draw], dtype=torch.float64), torch.tensor([origin]), 0, 3, 10).item()


def test_a_relay_ranks_by_how_near_its_sender_is_to_the_origin() -> None:
    graph = {0: [1], 1: [0, 2], 2: [1, 3], 3: [2]}  # a path 0 - 1 - 2 - 3
    senders, origins = torch.tensor([0, 1, 2, 3, 3]), torch.tensor([0, 0, 0, 0, 2])
    hops = RelayHops(graph)
    assert hops.hops(senders, origins, limit=3).tolist() == [0, 1, 2, 3, 1]
    assert hops.hops(senders, origins, limit=2).tolist() == [0, 1, 2, UNRANKED, 1]  # beyond the limit
    assert hops.hops(senders, origins, 3, torch.tensor([True, True, False, True, False])).tolist() == [0, 1, 0, 3, 0]


def test_a_host_keeps_the_nearest_copy_of_an_origin_then_the_most_senders_then_the_lowest_sender() -> None:
    def model(value: float) -> dict[str, torch.Tensor]:
        return {"w": torch.full((2,), value)}

    copies = OriginCopies()
    copies.add(model(1.0), 3, 7)  # a relay from 2 hops away
    copies.add(model(2.0), 3, 8)
    copies.add(model(2.0), 3, 9)  # the same content from another sender at that rank
    assert float(copies.kept()["w"][0]) == 2.0
    copies.add(model(1.0), 2, 5)  # the first content, nearer the origin: it ranks better whatever the votes
    assert float(copies.kept()["w"][0]) == 1.0
    copies.add(model(3.0), 2, 4)  # one sender each at the best rank: the lowest sender's
    assert float(copies.kept()["w"][0]) == 3.0
    copies.add(model(1.0), FIRST_HAND, 0)  # the origin's own
    assert float(copies.kept()["w"][0]) == 1.0 and len(copies.copies) == 3  # copies told apart by their values


def test_a_relay_of_the_true_top_draw_with_a_model_of_its_own_does_not_replace_the_origins_model() -> None:
    """Slot 0 of seeding, host 1 of 3 compromised (`relay`: the true top draw, a model of its own, from every one of
    its clients in every round): relays sent before the origin's candidate could have reached their sender are
    refused, and every honest host keeps the origin's own model, which a client of it heard first-hand or most of its
    clients' nearer neighbours relayed: each honest client installs the seed the run without the liar installs."""
    cfg = small_config(screen=True)
    seed = next(s for s in range(50) if top_draw(s, cfg.data.clients)[0] % 3 != 1)  # an origin the liar does not host
    cfg = cfg.model_copy(update={"seed": seed})
    data = build_federated_data(cfg)
    graph = neighbours(build_graph(cfg.topology, data.num_clients, cfg.seed))
    rounds = schedule_of(cfg).seeding(0).rounds_per_slot  # slot 0's rounds
    installed = []
    for attack in (Attack(), Attack("relay", "none")):
        run = forged_run(cfg, data, graph, attack, rounds)
        installed.append([{n: v[:, 0].clone() for n, v in d.algorithm.params.items()}
                          for h, d in enumerate(run.drivers) if h != 1])
        early = sum(d.algorithm.refused["seed_early"] for h, d in enumerate(run.drivers) if h != 1)
        assert (early > 0) == (attack.seed == "relay"), early
    for honest_host, attacked_host in zip(*installed, strict=True):
        for name, tensor in honest_host.items():
            torch.testing.assert_close(attacked_host[name], tensor, rtol=0, atol=0)


# -- screened gossip: the kernel ------------------------------------------------------------------------------------
def test_a_forged_weight_counts_no_more_than_one_honest_client() -> None:
    den = torch.tensor([[1e6, 1e6, 1e6], [0.5, 0.0, 0.0], [math.nan, -3.0, 0.2]])
    kept, scale = budgeted(den, budget=1.0)
    assert torch.allclose(kept[0], torch.full((3,), 1 / 3)) and torch.equal(kept[1], den[1])
    assert torch.allclose(kept[2], torch.tensor([0.0, 0.0, 0.2]))
    assert torch.allclose(scale[0], kept[0] / den[0]) and torch.equal(scale[1], torch.tensor([1.0, 0.0, 0.0]))


def screen_of(anchor: dict[str, torch.Tensor], radius: float, trim: float = 0.0) -> Screen:
    """A screen of rows training cluster 0 whose own training barely moved them (the scale is their arrivals')."""
    m = next(iter(anchor.values())).shape[0]
    return Screen(anchor, torch.full((m,), 1e-6), torch.zeros(m, dtype=torch.long), 1.0, trim, radius=radius)


@pytest.mark.parametrize("trim", [0.0, 0.25])
def test_screened_gossip_drops_far_estimates_and_is_ratio_consensus_without_them(trim: float) -> None:
    torch.manual_seed(0)
    anchor = {"w": torch.zeros(1, 1, 8)}
    own = {"w": torch.randn(1, 1, 8) * 0.1}
    honest = torch.randn(4, 1, 8) * 0.1  # estimates near the anchor, weight 1 each
    liar = torch.full((1, 1, 8), 50.0)  # one estimate far away, with a forged weight
    arrived_num = {"w": torch.cat([honest, liar * 1e6])}
    arrived_den = torch.tensor([[1.0]] * 4 + [[1e6]])
    delivered = torch.ones(1, 5, dtype=torch.bool)
    num, den, dropped = screened_mix({"w": own["w"].clone()}, torch.ones(1, 1), delivered, arrived_num, arrived_den,
                                     screen_of(anchor, radius=3.0, trim=trim))
    assert dropped == 1
    result = ratio_estimate(num["w"], den, own["w"])
    if trim == 0:  # exactly the mean of the own and the honest copies: the liar counts as (0, 0)
        assert torch.allclose(result, torch.cat([own["w"], honest]).mean(0, keepdim=True), atol=1e-6)
    assert result.abs().max() < 0.5  # the liar at 50 moved nothing
    # without the screen ratio consensus follows the liar's weight
    plain = StepConsensus({"w": own["w"].clone()}, torch.ones(1, 1))
    plain.receive(delivered, {"num.w": arrived_num["w"], "den": arrived_den})
    plain.step()
    assert ratio_estimate(plain.num["w"], plain.den, own["w"]).min() > 40


def test_an_estimate_against_the_receivers_own_training_step_is_dropped() -> None:
    """`reverse`: last round's model moved backwards along the training step, behind the receiver's own estimate
    along its own step (and farther than two steps from it): a gossip estimate of its own cluster is dropped, as is a
    merge's model; the honest ones, along it, kept."""
    torch.manual_seed(0)
    step = torch.full((1, 8), 0.1)
    screen = Screen({"w": torch.zeros(1, 1, 8)}, torch.full((1,), 0.3), torch.zeros(1, dtype=torch.long), 1.0,
                    0.0, {"w": step})
    honest = step.unsqueeze(1) + torch.randn(3, 1, 8) * 0.02
    arrived = torch.cat([honest, -2.5 * step.unsqueeze(1)])
    num, den, dropped = screened_mix({"w": step.unsqueeze(1).clone()}, torch.ones(1, 1),
                                     torch.ones(1, 4, dtype=torch.bool), {"w": arrived}, torch.ones(4, 1), screen)
    assert dropped == 1
    assert torch.allclose(ratio_estimate(num["w"], den, step.unsqueeze(1)),
                          torch.cat([step.unsqueeze(1), honest]).mean(0, keepdim=True), atol=1e-6)
    # one-hop merges: the same direction test against the row's trained model, and the radius
    models = {"w": torch.cat([arrived[:, 0], torch.full((1, 8), 50.0)])}
    kept, _ = screened_arrivals(torch.ones(1, 5, dtype=torch.bool), torch.zeros(5, dtype=torch.long), models, screen)
    assert kept.tolist() == [[True, True, True, False, False]]


@pytest.mark.parametrize("batches", [[[0, 1, 2, 3, 4]], [[0], [1], [2], [3], [4]], [[4, 1], [0, 3, 2]]])
def test_a_merge_end_drops_the_far_and_the_worse_on_data_whatever_the_batching(batches: list[list[int]]) -> None:
    """A one-hop merge folds its arrivals as they come; at its end each row's scale is the median of its arrivals'
    distances, and an arrival far beyond it is dropped, as is one of its own cluster much worse on its data than its
    peers; the rows that lost one are folded again from where the merge opened. The result does not depend on how
    the arrivals were batched."""
    trained = torch.tensor([[0.1, 0.1], [0.2, 0.2]])
    honest = torch.tensor([[0.12, 0.1], [0.1, 0.08], [0.14, 0.12]])
    far = torch.tensor([[1.5, -1.5]])  # ten times the others' distance: within the loose bound it was folded under
    worse = torch.tensor([[0.14, 0.19]])  # near, but its loss is far above its peers'
    models = {"w": torch.cat([honest, far, worse])}
    part = torch.zeros(5, dtype=torch.long)
    delivered = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]])

    def loss(rows: torch.Tensor, estimates: dict[str, torch.Tensor]) -> torch.Tensor:
        w = estimates["w"].reshape(rows.shape[0], -1)
        return 1 + 10 * (w[:, 1] - w[:, 0]).clamp_min(0)  # the honest ones 1, the worse one 1.5

    screen = Screen({"w": trained.unsqueeze(1) - 0.05}, torch.full((2,), 0.05), torch.zeros(2, dtype=torch.long), 1.0,
                    0.0, {"w": torch.full((2, 2), 0.05)}, loss=loss, loss_limit=torch.full((2,), 10.0))
    params = {"w": trained.unsqueeze(1).clone()}
    weight = torch.ones(2, 1)
    folds = MergeFolds(screen.anchor, {"w": trained.clone()}, weight.clone())
    for cols in batches:
        index = torch.tensor(cols)
        arrivals = delivered.index_select(1, index)
        batch = {"w": models["w"].index_select(0, index)}
        distance = (batch["w"].unsqueeze(0) - trained.unsqueeze(1)).norm(dim=2)  # [M, S]
        fold_models(params, weight, arrivals, part.index_select(0, index), batch)
        folds.add(arrivals, part.index_select(0, index), batch, distance)
    assert folds.settle(params, weight, screen) == 2
    assert torch.allclose(params["w"][0, 0], (trained[0] + honest.sum(0)) / 4, atol=1e-6)
    assert torch.allclose(params["w"][1, 0], (trained[1] + honest.sum(0)) / 4, atol=1e-6)  # nothing dropped here
    assert weight[:, 0].tolist() == [4.0, 4.0]


@pytest.mark.parametrize("batches", [[[0, 1, 2, 3, 4, 5]], [[0, 1], [2, 3, 4], [5]]])
def test_a_merge_end_takes_back_what_it_drops_as_if_only_the_kept_had_arrived(batches: list[list[int]]) -> None:
    """The arrivals a merge's end drops are taken back out of the running averages: the copies end as if only the
    kept ones had been folded from where the merge opened, with their weights; a copy whose own weight was 0 (an
    untrained cluster under the `fresh` rule) and that lost everything goes back to its anchor."""
    torch.manual_seed(3)
    m, k, s = 3, 2, 6
    anchor = {"w": torch.randn(m, k, 4, 2), "b": torch.randn(m, k, 3)}
    own = torch.tensor([0, 1, 0])
    trained = {n: v[torch.arange(m), own] + 0.1 * torch.randn_like(v[:, 0]) for n, v in anchor.items()}
    opening = torch.nn.functional.one_hot(own, k).float() * torch.tensor([[80.0], [60.0], [90.0]])  # fresh, n_i
    models = {n: torch.randn(s, *v.shape[2:]) for n, v in anchor.items()}
    part = torch.tensor([0, 1, 0, 1, 1, 0])
    samples = torch.tensor([70.0, 50.0, 80.0, 65.0, 75.0, 40.0])
    delivered = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 1]]).float() * samples
    lost = torch.tensor([[0, 1, 0, 0, 1, 1], [0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]]).bool()  # row 0's cluster 1: all

    def opened() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        params = {n: v.clone() for n, v in anchor.items()}
        for n, v in params.items():
            v[torch.arange(m), own] = trained[n]
        return params, opening.clone()

    params, weight = opened()
    folds = MergeFolds(anchor, trained, opening.clone())
    batched = []
    for cols in batches:
        index = torch.tensor(cols)
        batch = {n: v.index_select(0, index) for n, v in models.items()}
        fold_models(params, weight, delivered.index_select(1, index), part.index_select(0, index), batch)
        batched.append(batch)
    folds.unfold(params, weight, delivered * lost, torch.cat([part[c] for c in batches]), batched, own)
    expected, expected_weight = opened()
    fold_models(expected, expected_weight, delivered * ~lost, part, models)
    for n in params:
        assert torch.allclose(params[n], expected[n], atol=1e-5), n
    assert torch.allclose(weight, expected_weight)
    assert weight[0, 1] == 0 and torch.equal(params["w"][0, 1], anchor["w"][0, 1])  # every arrival lost: the anchor


def test_the_trimmed_mean_cuts_the_ends_of_each_coordinate() -> None:
    anchor = {"w": torch.zeros(1, 1, 1)}
    values = torch.tensor([0.0, 1.0, 2.0, 3.0, 100.0]).reshape(5, 1, 1)  # the own copy is 5.0
    num, den, _ = screened_mix({"w": torch.full((1, 1, 1), 5.0)}, torch.ones(1, 1), torch.ones(1, 5, dtype=torch.bool),
                               {"w": values}, torch.ones(5, 1), screen_of(anchor, radius=1e9, trim=0.2))
    # six values 0, 1, 2, 3, 5, 100: one cut from each end -> mean of 1, 2, 3, 5
    assert ratio_estimate(num["w"], den, torch.zeros(1, 1, 1)).item() == pytest.approx(2.75)


# -- a compromised host among honest ones, in lockstep ----------------------------------------------------------------
def small_config(**dfca: Any) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "name": "byzantine", "algorithm": "dfca", "clusters": 2, "rounds": 10, "seed": 0,
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 18, "train_per_client": 80,
                 "test_per_client": 20},
        "model": {"kind": "mlp", "hidden": 64}, "train": {"lr": 0.2, "local_epochs": 3, "batch_size": 20},
        "topology": {"kind": "erdos_renyi", "p": 0.5},
        "dfca": {"warmup_rounds": 4, "warmup_gossip_steps": 6, "flood_rounds": 2, **dfca}})


def scores(cfg: ExperimentConfig, attack: Attack) -> dict[str, float]:
    data = build_federated_data(cfg)
    graph = neighbours(build_graph(cfg.topology, data.num_clients, cfg.seed))
    return honest_scores(run_with_forger(cfg, data, graph, attack, timeout=0.2), forger=1)


@pytest.fixture(scope="module")
def honest() -> dict[str, float]:
    return scores(small_config(screen=True), Attack())


@pytest.mark.slow
def test_the_seed_and_consensus_hijacks_capture_plain_consensus_but_not_the_screen(honest: dict[str, float]) -> None:
    """Host 1 of 3 sends the seed hijack (an all-zero model with an inflated score) and consensus hijack (a
    huge weight on the zero model). Seeding refuses the candidates either way; plain ratio consensus is captured;
    screened gossip keeps the honest clients within 3 points of the honest run and their clusters recovered."""
    attack = Attack("inflate", "inflate")
    assert honest["cluster_ari"] == 1.0 and honest["test_accuracy"] > 0.8, honest
    captured = scores(small_config(screen=False), attack)
    assert captured["test_accuracy"] < 0.3, captured  # without the screen one liar decides the mean
    screened = scores(small_config(screen=True), attack)
    assert screened["rejected"] > 0 and screened["screened"] > 0, screened  # candidates refused, pairs dropped
    assert screened["test_accuracy"] >= honest["test_accuracy"] - 0.03, (screened, honest)
    assert screened["cluster_ari"] >= 0.9, screened


@pytest.mark.slow
def test_a_copy_of_an_installed_seed_cannot_seed_another_cluster(honest: dict[str, float]) -> None:
    """Host 1 claims every later seeding slot with an unverifiable score and a copy of seed 0 (`duplicate`): each
    receiver sees that the candidate predicts what seed 0 predicts on its own samples and refuses it, so the slot
    goes to the honest farthest client and the clusters are recovered."""
    attacked = scores(small_config(screen=True), Attack("duplicate", "none"))
    assert attacked["rejected"] > 0, attacked
    assert attacked["cluster_ari"] == 1.0 and attacked["test_accuracy"] >= honest["test_accuracy"] - 0.03, attacked


def test_the_product_ships_no_forger_and_no_setting_makes_a_worker_forge() -> None:
    """The forging tool is the tests' (tests/harness/): no file of the product (the library, the services, the image,
    compose, k8s) imports it or reads a setting that makes a worker forge, and the services' settings name none."""
    root = Path(__file__).resolve().parents[1]
    product = [*(root / "shared").rglob("*.py"), *(root / "services").rglob("*.py"), *(root / "k8s").glob("*.yaml"),
               root / "Dockerfile", root / "docker-compose.yml"]
    assert len(product) > 100
    offenders = [str(p.relative_to(root)) for p in product if re.search(r"\bharness\b|\bForger\b|FORGE", p.read_text())]
    assert not offenders, offenders
    assert not [name for name in ENV_VARS if "FORGE" in name]
