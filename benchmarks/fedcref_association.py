"""How eq. (2) associates clusters before any federation: the calibration behind `fedcref.scale`.

    python benchmarks/fedcref_association.py [--seed 1] [--clients 20] [--theta 0.2]

FedCRef's first iteration on the benchmark's setting (bundled MNIST, N = 20, K_i in [2, 5]): every cluster of the
simulated initial clustering at dirtiness 0, 0.3 and 0.5 gets its autoencoder (the defaults of `fedcref:`: 10
epochs, Adam 1e-3, batch 32). Then every pair of clusters of different clients is tested in both directions with
`core.cluster_refinement.reconstructs` under each `scale`. The table gives the share of pairs associated among
pairs with the same majority category (should be high) and with different ones (should be about 0: each false
edge can merge two communities), at alpha 0.5, 0.75 (the paper's) and 0.9.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from dfca.config import parse_config
from dfca.core import autoencoder as ae
from dfca.core.cluster_refinement import dirty_labels, reconstructs
from dfca.data import build_federated_data

SCALES = ("relative", "errors", "differences")
ALPHAS = (0.5, 0.75, 0.9)


def clusters(seed: int, clients: int, dirtiness: float) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray]:
    """Every client's initial clusters: (samples of each, its majority category, its client)."""
    cfg = parse_config({"algorithm": "fedcref", "seed": seed, "data": {"clients": clients}})
    d = build_federated_data(cfg)
    out, category, owner = [], [], []
    for i in range(clients):
        ok = d.y_train[i] >= 0
        truth, x = d.y_train[i][ok], d.x_train[i][ok].flatten(1)
        labels = torch.from_numpy(dirty_labels(truth.numpy(), dirtiness, np.random.default_rng([seed, i])))
        for q in range(int(labels.max()) + 1):
            members = labels == q
            out.append(x[members])
            category.append(int(torch.mode(truth[members]).values))
            owner.append(i)
    return out, np.array(category), np.array(owner)


def shares(seed: int, clients: int, dirtiness: float, theta: float) -> dict[tuple[str, float], tuple[float, float]]:
    samples, category, owner = clusters(seed, clients, dirtiness)
    counts = [len(s) for s in samples]
    x = torch.zeros(len(samples), max(counts), samples[0].shape[1])
    for r, s in enumerate(samples):
        x[r, : len(s)] = s
    defaults = parse_config({"algorithm": "fedcref"}).fedcref
    start = ae.init(len(samples), x.shape[-1], defaults.layers, seed)
    models = ae.train(start, x, counts, list(range(len(samples))), defaults.local_epochs, defaults.lr,
                      defaults.batch_size)
    every = [ae.errors(models, s) for s in samples]  # [R models, n_a] on cluster a
    own = [every[a][a] for a in range(len(samples))]
    same = (category[:, None] == category[None]) & (owner[:, None] != owner[None])
    other = (category[:, None] != category[None]) & (owner[:, None] != owner[None])
    out = {}
    for scale in SCALES:
        for alpha in ALPHAS:
            one_way = np.stack([reconstructs(own[a].unsqueeze(0), every[a], torch.ones_like(every[a], dtype=torch.bool),
                                             alpha, theta, scale).numpy() for a in range(len(samples))])
            both = one_way & one_way.T
            out[(scale, alpha)] = (float(both[same].mean()), float(both[other].mean()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--theta", type=float, default=0.2)
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    print(f"load {os.getloadavg()[0]:.2f}; theta {args.theta}; share of pairs associated: same category / different")
    print("| dirtiness | scale | " + " | ".join(f"alpha {a}" for a in ALPHAS) + " |")
    print("|---|---|" + "---|" * len(ALPHAS))
    for dirtiness in (0.0, 0.3, 0.5):
        table = shares(args.seed, args.clients, dirtiness, args.theta)
        for scale in SCALES:
            cells = " | ".join(f"{table[(scale, a)][0]:.2f} / {table[(scale, a)][1]:.4f}" for a in ALPHAS)
            print(f"| {dirtiness} | {scale} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
