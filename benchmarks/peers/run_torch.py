"""The floor of a per-client framework on the peers workload: FedAvg as a plain torch loop, no framework.

    python benchmarks/peers/run_torch.py --data WORKLOAD.npz

Every round, every client in turn loads the global MLP's weights, runs the workload's local SGD on its own
samples (peer_common.local_sgd: the same autograd step, shuffle and seeds as Flower's clients), and the global
model becomes the mean of the clients' weights weighted by their sample counts (FedAvg). Nothing else: no
messages, no serialisation, no scheduling. Flower, pfl-research and p2pfl all train one client at a time with
this step, so this run is what they would cost with zero overhead on the machine as it is during the run; it
lets a reader compare sittings (this machine's speed swings with its neighbours' load). Round r's seconds are
those of the loop over clients and the average. Prints one JSON line.
"""

from __future__ import annotations

import time

import torch
from peer_common import accuracy, client_seed, local_sgd, mlp, peak_rss_mib, setup_torch, start, versions


def main() -> None:
    out, w, _ = start(__doc__)
    m = w.meta
    setup_torch(int(m["threads"]))
    model = mlp(int(m["seed"]), int(m["hidden"]))
    global_weights = {k: v.clone() for k, v in model.state_dict().items()}
    seconds: list[float] = []
    for round_ in range(1, w.rounds + 1):
        t0 = time.perf_counter()
        summed = {k: torch.zeros_like(v) for k, v in global_weights.items()}
        samples = 0
        for client in range(w.clients):
            model.load_state_dict(global_weights)
            x, y = w.train_of(client)
            local_sgd(model, x, y, m, client_seed(int(m["seed"]), round_, client))
            for k, v in model.state_dict().items():
                summed[k].add_(v, alpha=float(x.shape[0]))
            samples += int(x.shape[0])
        global_weights = {k: v / samples for k, v in summed.items()}
        seconds.append(time.perf_counter() - t0)
    model.load_state_dict(global_weights)
    out.emit({"framework": "torch", "versions": versions("torch", "numpy"), "round_seconds": seconds,
              "test_accuracy": accuracy(model, *w.test_set()), "clients": w.clients, "rounds": len(seconds),
              "notes": ["reference, not a framework: the per-client autograd loop and a weighted mean"],
              **peak_rss_mib()})


if __name__ == "__main__":
    main()
