"""`bytes_sent_per_client_per_round` means one thing in both drivers: the bytes a client sent (wire.message_bytes:
body, headers, routing key), each message counted once per receiver, averaged over the run's rounds (seeding
included). The message driver counts the messages it publishes; the simulator counts the messages it would send;
they agree to 2%."""

from __future__ import annotations

import pytest
from test_driver_equivalence import config_for, small_config, transport_factory

from dfca.algorithms import schedule_of
from dfca.graph import neighbours
from dfca.simulator import prepare, simulate
from harness.lockstep import run_lockstep


def both_drivers(cfg):  # type: ignore[no-untyped-def]
    ctx = prepare(cfg)
    simulated = simulate(cfg, data=ctx.data).summary["bytes_sent_per_client_per_round"]
    run = run_lockstep(cfg, ctx.data, neighbours(ctx.graph), transport_factory(), 2)
    sent = sum(d.take_bytes_sent() for d in run.drivers)
    return simulated, sent / cfg.data.clients / schedule_of(cfg).total_rounds


@pytest.mark.parametrize("cfg", [
    small_config(dfca={"variant": "paper"}),  # one model a round to each neighbour
    small_config(rounds=2, dfca={"flood_rounds": 2, "seed_epochs": 1, "warmup_rounds": 1,
                                 "warmup_gossip_steps": 2}),  # seeding floods, then k models per gossip step
    config_for("ifca"),  # uploads to the server only: the server's k models down are not a client's traffic
], ids=["dfca-paper", "dfca-robust", "ifca"])
def test_the_simulator_and_the_message_driver_count_the_same_bytes(cfg) -> None:  # type: ignore[no-untyped-def]
    simulated, published = both_drivers(cfg)
    assert published > 0
    assert simulated == pytest.approx(published, rel=0.02)


def test_paper_rule_bytes_are_one_model_per_neighbour_per_round() -> None:
    cfg = small_config(dfca={"variant": "paper"})
    ctx = prepare(cfg)
    result = simulate(cfg, data=ctx.data)
    model_bytes = 4 * ctx.model.num_params()  # float32 on the wire, plus a safetensors header of < 400 bytes
    # and the message's headers and routing key, about 250 more
    mean_degree = float(ctx.adjacency.sum()) / cfg.data.clients
    sent = result.summary["bytes_sent_per_client_per_round"]
    assert model_bytes * mean_degree < sent < (model_bytes + 650) * mean_degree
