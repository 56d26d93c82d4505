"""Flower's Simulation Engine (Ray backend) on the peers workload: FedAvg, every client every round.

    python benchmarks/peers/run_flwr.py --data WORKLOAD.npz    (with the flwr venv's python)

`flwr.simulation.run_simulation` with one virtual SuperNode per client; the ServerApp runs the legacy
`flwr.server.strategy.FedAvg` (fraction_fit 1.0, no federated evaluation: fraction_evaluate 0) and the ClientApp
a NumPyClient that trains the shared torch MLP (peer_common.local_sgd). Ray gets `threads` CPUs and each client
one, so `threads` Ray actors train in parallel, with one torch thread each.

Round r's seconds run from the strategy's central evaluation after round r - 1 to the one after round r
(`evaluate_fn` is called at round 0 and after every round; it only notes the time, except after the last
round, where it measures the final global model on every client's test samples, after the time is taken).
Prints one JSON line.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context, NDArrays, Scalar, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.simulation import run_simulation
from peer_common import (
    accuracy,
    client_seed,
    load,
    local_sgd,
    mlp,
    peak_rss_mib,
    setup_torch,
    start,
    versions,
)


def get_weights(model: torch.nn.Module) -> NDArrays:
    return [v.detach().cpu().numpy().copy() for v in model.state_dict().values()]


def set_weights(model: torch.nn.Module, weights: NDArrays) -> None:
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in zip(model.state_dict(), weights,
                                                                             strict=True)})


class MLPClient(NumPyClient):
    def __init__(self, path: str, client: int) -> None:
        self.w, self.client = load(path), client
        self.model = mlp(int(self.w.meta["seed"]), int(self.w.meta["hidden"]))

    def fit(self, parameters: NDArrays, config: dict[str, Scalar]) -> tuple[NDArrays, int, dict[str, Scalar]]:
        set_weights(self.model, parameters)
        x, y = self.w.train_of(self.client)
        local_sgd(self.model, x, y, self.w.meta, client_seed(int(self.w.meta["seed"]), int(config["round"]),
                                                            self.client))
        return get_weights(self.model), int(x.shape[0]), {}


def client_app(path: str) -> ClientApp:
    def client_fn(context: Context) -> Any:
        setup_torch(1)  # one torch thread per Ray actor; Ray runs `threads` actors at once
        return MLPClient(path, int(context.node_config["partition-id"])).to_client()

    return ClientApp(client_fn=client_fn)


def server_app(path: str, marks: list[float], final: dict[str, float]) -> ServerApp:
    w = load(path)
    model = mlp(int(w.meta["seed"]), int(w.meta["hidden"]))

    def evaluate(server_round: int, parameters: NDArrays, config: dict[str, Scalar]) -> None:
        marks.append(time.perf_counter())
        if server_round == w.rounds:
            set_weights(model, parameters)
            final["test_accuracy"] = accuracy(model, *w.test_set())

    def server_fn(context: Context) -> ServerAppComponents:
        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=w.clients,
                          min_evaluate_clients=0, min_available_clients=w.clients, evaluate_fn=evaluate,
                          on_fit_config_fn=lambda r: {"round": r},
                          initial_parameters=ndarrays_to_parameters(get_weights(model)))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=w.rounds))

    return ServerApp(server_fn=server_fn)


def main() -> None:
    out, w, args = start(__doc__)
    threads = int(w.meta["threads"])
    setup_torch(threads)
    marks: list[float] = []
    final: dict[str, float] = {}
    run_simulation(server_app=server_app(args.data, marks, final), client_app=client_app(args.data),
                   num_supernodes=w.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": threads, "num_gpus": 0}})
    if len(marks) != w.rounds + 1 or "test_accuracy" not in final:
        raise RuntimeError(f"the simulation did not finish: {len(marks) - 1} of {w.rounds} rounds evaluated")
    out.emit({"framework": "flwr", "versions": versions("flwr", "ray", "torch", "numpy"),
              "round_seconds": list(np.diff(marks)), "test_accuracy": final["test_accuracy"],
              "clients": w.clients, "rounds": w.rounds,
              "notes": [f"Ray: {threads} CPUs, 1 per client, so {threads} actors with 1 torch thread each"],
              **peak_rss_mib()})


if __name__ == "__main__":
    main()
