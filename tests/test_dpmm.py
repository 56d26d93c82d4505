"""DPMM-CFL and FeSEM: the sampler against the exact posterior, the prior and the marginal by hand, FeSEM k=1 as
FedAvg, the label-skew partitions, cluster recovery, and what the config and the wire refuse."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from dfca.cli.main import app
from dfca.config import ConfigError, parse_config
from dfca.core.dpmm import DPMMSampler, NormalNormal, canonical, crp_log_prior
from dfca.data import build_federated_data
from dfca.simulator import simulate
from dfca.wire.codec import Envelope, PayloadRejected, TensorSpec, decode_message, encode_message


def partitions(n: int) -> Iterator[list[int]]:
    """Every set partition of n items, as canonical label lists."""
    if n == 0:
        yield []
        return
    for p in partitions(n - 1):
        for c in range(max(p, default=-1) + 2):
            yield [*p, c]


POINTS = np.array([[0.0, 0.1], [0.3, -0.2], [2.0, 2.1], [2.2, 1.7], [1.0, 1.1]])


def exact_posterior(x: np.ndarray, lik: NormalNormal, alpha: float) -> dict[tuple[int, ...], float]:
    parts = [tuple(p) for p in partitions(x.shape[0])]
    logp = np.array([lik.log_joint(x, list(p), alpha) for p in parts])
    p = np.exp(logp - logp.max())
    return dict(zip(parts, p / p.sum(), strict=True))


def test_crp_prior_matches_eq_11_by_hand_and_sums_to_one() -> None:
    # alpha^K prod (m_k - 1)! / prod_{i=1..M} (alpha + i - 1)
    assert math.exp(crp_log_prior([2, 1], 1.0)) == pytest.approx(1 * 1 / (1 * 2 * 3))
    assert math.exp(crp_log_prior([3], 0.5)) == pytest.approx(0.5 * 2 / (0.5 * 1.5 * 2.5))
    assert math.exp(crp_log_prior([2, 2, 1], 2.0)) == pytest.approx(8 * 1 * 1 / (2 * 3 * 4 * 5 * 6))
    for alpha in (0.3, 1.0, 4.0):
        total = 0.0
        for p in partitions(5):
            total += math.exp(crp_log_prior(list(Counter(p).values()), alpha))
        assert total == pytest.approx(1.0)


def test_normal_normal_marginal_is_the_joint_gaussian_density() -> None:
    """(13) in closed form against the density of N(0, s I + s0 11^T) per dimension."""
    s, s0 = 0.4, 1.7
    x = torch.tensor([[0.3, -1.0], [0.5, -0.7], [0.1, -1.3]], dtype=torch.float64)
    n = x.shape[0]
    cov = s * torch.eye(n, dtype=torch.float64) + s0 * torch.ones(n, n, dtype=torch.float64)
    dense = sum(float(torch.distributions.MultivariateNormal(torch.zeros(n, dtype=torch.float64), cov)
                      .log_prob(x[:, j])) for j in range(x.shape[1]))
    lik = NormalNormal(s, s0)
    xs = x.numpy()
    assert lik.log_marginal(n, xs.sum(0), float((xs**2).sum())) == pytest.approx(dense, rel=1e-10)


@pytest.mark.parametrize("move", ["split_merge", "gibbs"])
def test_the_chain_visits_partitions_as_often_as_the_exact_posterior(move: str) -> None:
    """52 partitions of 5 points, enumerated: visit frequencies of split-merge alone (the acceptance ratio (14)
    with Jain-Neal's proposal probabilities) and of Gibbs alone match p(c | x) in total variation."""
    lik, alpha = NormalNormal(0.5, 1.0), 1.0
    exact = exact_posterior(POINTS, lik, alpha)
    sampler = DPMMSampler(POINTS, alpha, lik, np.random.default_rng(7), launch_scans=2)
    labels, visits, steps = [0] * 5, Counter[tuple[int, ...]](), 6000 if move == "gibbs" else 16000
    for _ in range(steps):
        labels = sampler.split_merge(labels) if move == "split_merge" else sampler.gibbs_scan(labels)
        visits[tuple(canonical(labels))] += 1
    tv = 0.5 * sum(abs(visits[p] / steps - q) for p, q in exact.items())
    assert tv < 0.05, tv
    if move == "split_merge":  # both kinds of move were made, and accepted
        st = sampler.stats
        assert st.splits_accepted > 100 and st.merges_accepted > 100


def test_a_wrong_acceptance_ratio_is_caught() -> None:
    """The frequency test can fail: dropping the proposal probability from (14) moves the chain off the posterior."""
    lik, alpha = NormalNormal(0.5, 1.0), 1.0
    exact = exact_posterior(POINTS, lik, alpha)

    class NoProposalTerm(DPMMSampler):
        def _restricted_scan(self, side: dict[int, int], comps: list[Any], rows: list[int],
                             target: dict[int, int] | None) -> float:
            super()._restricted_scan(side, comps, rows, target)
            return 0.0

    sampler = NoProposalTerm(POINTS, alpha, lik, np.random.default_rng(7), launch_scans=2)
    labels, visits, steps = [0] * 5, Counter[tuple[int, ...]](), 16000
    for _ in range(steps):
        labels = sampler.split_merge(labels)
        visits[tuple(canonical(labels))] += 1
    assert 0.5 * sum(abs(visits[p] / steps - q) for p, q in exact.items()) > 0.1


def small(algorithm: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "algorithm": algorithm, "clusters": 3, "rounds": 6, "seed": 0,
        "data": {"partition": "dirichlet", "groups": 3, "clients": 30, "train_per_client": 50,
                 "test_per_client": 20},
        "model": {"kind": "mlp", "hidden": 64},
        "train": {"lr": 0.05, "local_epochs": 1, "batch_size": 10, "momentum": 0.9},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def test_dpmm_cfl_recovers_three_well_separated_dirichlet_groups() -> None:
    """3 Dirichlet groups, 30 clients: K = 3 and ARI >= 0.9 in at least 4 of 5 seeds."""
    found = []
    for seed in range(5):
        s = simulate(parse_config(small("dpmm_cfl", seed=seed))).summary
        found.append((s["inferred_clusters"], s["cluster_ari"]))
    assert sum(k == 3 and ari >= 0.9 for k, ari in found) >= 4, found


def test_dpmm_cfl_reports_k_f1_and_acceptance_every_round() -> None:
    r = simulate(parse_config(small("dpmm_cfl", rounds=4, data={"clients": 12, "groups": 2})))
    for h in r.history:
        assert {"inferred_clusters", "macro_f1", "split_acceptance", "merge_acceptance"} <= set(h)
    s = r.summary
    assert s["inferred_clusters"] == len(r.final_models) == int(r.assigned.max()) + 1
    assert s["macro_f1_last3"] == pytest.approx(np.mean([h["macro_f1"] for h in r.history[-3:]]))
    assert r.history[-1]["test_accuracy"] > r.history[0]["test_accuracy"] + 0.05  # the cluster models learn


def test_fesem_with_one_cluster_is_fedavg() -> None:
    """k = 1: every client is in the one cluster and the M-step is FedAvg, which is IFCA with k = 1."""
    cfg = small("fesem", clusters=1, rounds=3, data={"clients": 8, "groups": 2})
    fesem = simulate(parse_config(cfg))
    fedavg = simulate(parse_config({**cfg, "algorithm": "ifca"}))
    assert set(fesem.assigned.tolist()) == {0}
    for name, value in fedavg.final_models["cluster_0"].items():
        torch.testing.assert_close(fesem.final_models["cluster_0"][name], value, rtol=1e-5, atol=1e-6)


def test_fesem_finds_separated_groups_with_the_right_k() -> None:
    s = simulate(parse_config(small("fesem", seed=1))).summary
    assert s["populated_clusters"] == 3 and s["cluster_ari"] >= 0.9


def test_label_skew_partitions() -> None:
    dirichlet = build_federated_data(parse_config(small("dpmm_cfl", data={"groups": 4, "clients": 40})))
    assert dirichlet.true_cluster.bincount().tolist() == [10] * 4
    assert dirichlet.x_train.shape[:2] == (40, 50)
    split = build_federated_data(parse_config(small("fesem", data={"partition": "class_split", "groups": 4,
                                                                   "clients": 40})))
    for i in range(40):
        counts = split.y_train[i].bincount(minlength=10)
        assert sorted(counts[counts > 0].tolist()) == [25, 25]  # 2 classes, equal numbers
    for g in range(4):  # a group's clients draw from one subset of 3 classes
        members = (split.true_cluster == g).nonzero().flatten()
        assert 2 <= split.y_train[members].unique().numel() <= 3


@pytest.mark.parametrize("overrides,field", [
    ({"data": {"dataset": "femnist"}}, "data.partition"),
    ({"data": {"groups": 40}}, "data.groups"),
    ({"data": {"partition": "rotation", "groups": 3}}, "data.groups"),
    ({"dpmm": {"alpha": 0}}, "dpmm.alpha"),
    ({"dpmm": {"likelihood_var": -1.0}}, "dpmm.likelihood_var"),
    ({"dpmm": {"sampler": "slice"}}, "dpmm.sampler"),
])
def test_bad_dpmm_configs_are_refused_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.split(".")[-1]):
        parse_config(small("dpmm_cfl", **overrides))


def test_the_servers_ragged_models_are_checked_on_the_wire() -> None:
    """K_t models (1..N rows) pass; more rows than N, or a wrong inner shape, are rejected."""
    spec = {"m": TensorSpec((4, 3), ragged=True)}

    def roundtrip(t: torch.Tensor) -> Envelope:
        body, headers = encode_message(Envelope("e", -1, 0, "download", 0, 0, {"m": t}), spec)
        return decode_message("e.aggregator.server.0", body, headers, "e", lambda head: spec)

    assert roundtrip(torch.ones(2, 3)).tensors["m"].shape == (2, 3)
    for bad in (torch.ones(5, 3), torch.ones(2, 4), torch.ones(0, 3)):
        with pytest.raises(PayloadRejected, match="shape"):
            roundtrip(bad)


def test_dfca_run_writes_k_f1_and_acceptance_plots(tmp_path: Path) -> None:
    """`dfca run` on a DPMM-CFL config: its summary table, and plots of K_t, macro-F1 and the acceptance rates."""
    config = tmp_path / "dpmm.yaml"
    config.write_text(yaml.safe_dump(small("dpmm_cfl", rounds=3, data={"clients": 12, "groups": 2})))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "inferred_clusters" in result.output and "macro_f1_last3" in result.output
    for plot in ("accuracy.png", "macro_f1.png", "ari.png", "clusters.png", "split_acceptance.png",
                 "merge_acceptance.png"):
        assert (out / plot).stat().st_size > 0, plot
    summary = json.loads((out / "summary.json").read_text())
    assert summary["inferred_clusters"] == len(list((out / "models").glob("cluster_*.safetensors")))


def test_a_download_naming_a_cluster_it_does_not_carry_is_ignored() -> None:
    """The wire checks shapes; the clients check that c^t names only the K_t models the message carries."""
    from dfca.algorithms import Inbox
    from dfca.simulator import Simulation, prepare

    sim = Simulation(prepare(parse_config(small("dpmm_cfl", data={"clients": 6, "groups": 2}))))
    clients = sim.algorithm
    before = {n: v.clone() for n, v in clients.params.items()}  # type: ignore[attr-defined]
    models = {f"models.{n}": v[:1].unsqueeze(0) for n, v in before.items()}  # K_t = 1 model
    for bad in (7, -1):
        inbox = Inbox(torch.ones(6, 1, dtype=torch.bool), torch.tensor([-1]), torch.tensor([0]),
                      {**models, "assignment": torch.full((1, 6), bad), "chain": torch.zeros(1, 4)}, 0)
        assert clients.receive(clients.exchanges(0)[1], inbox) == 0
    for n, v in clients.params.items():  # type: ignore[attr-defined]
        assert torch.equal(v, before[n])
    good = Inbox(torch.ones(6, 1, dtype=torch.bool), torch.tensor([-1]), torch.tensor([0]),
                 {**models, "assignment": torch.zeros(1, 6, dtype=torch.long), "chain": torch.zeros(1, 4)}, 0)
    assert clients.receive(clients.exchanges(0)[1], good) == 6
