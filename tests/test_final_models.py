"""A runtime experiment's final models: the workers' shares, merged, are the models `dfca run` saves."""

from __future__ import annotations

import pytest
import torch
from test_driver_equivalence import config_for, small_config, transport_factory

from dfca.graph import neighbours
from dfca.runtime.protocol.final_models import FinalModelsInvalid, decode_sums, encode_sums, merge_sums
from dfca.simulator import prepare, simulate
from harness.lockstep import run_lockstep


@pytest.mark.parametrize("cfg", [small_config(rounds=2, dfca={"variant": "paper"}), config_for("dfedavgm"),
                                 config_for("fedspd")], ids=["dfca", "dfedavgm", "fedspd"])
def test_merged_worker_shares_are_the_simulators_final_models(cfg) -> None:  # type: ignore[no-untyped-def]
    ctx = prepare(cfg)
    expected = simulate(cfg, data=ctx.data).final_models
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 3)
    shares = [decode_sums(*encode_sums(d.algorithm.final_model_sums())) for d in run.drivers]  # over the wire
    merged = merge_sums(shares)
    assert merged.keys() == expected.keys() and merged
    for name, params in expected.items():
        for n, t in params.items():
            torch.testing.assert_close(merged[name][n], t, rtol=1e-4, atol=1e-5)


def test_a_cluster_nobody_is_assigned_to_is_the_mean_over_every_client() -> None:
    params = {"w": torch.arange(12, dtype=torch.float32).view(3, 2, 2)}  # 3 clients, k=2, one weight of size 2
    from dfca.algorithms.base import cluster_means, cluster_sums

    assigned = torch.tensor([0, 0, 0])
    shares = [cluster_sums({"w": params["w"][:2]}, assigned[:2], 2), cluster_sums({"w": params["w"][2:]},
                                                                                  assigned[2:], 2)]
    merged = merge_sums(shares)
    expected = cluster_means(params, assigned, 2)
    for name in expected:
        torch.testing.assert_close(merged[name]["w"], expected[name]["w"])


def test_a_damaged_share_is_refused() -> None:
    encoded, digest = encode_sums({"m": ({"w": torch.ones(2)}, 1)})
    with pytest.raises(FinalModelsInvalid, match="sha256"):
        decode_sums(encoded, "0" * 64)
    with pytest.raises(FinalModelsInvalid, match="different tensors"):
        merge_sums([{"m": ({"w": torch.ones(2)}, 1)}, {"m": ({"v": torch.ones(2)}, 1)}])
