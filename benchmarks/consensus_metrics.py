"""What the simulator's consensus metrics cost an evaluated round: the index consistency in each of its forms.

Every evaluated simulator round computes Disp_j and the index consistency of up to 200 sampled edges
(`simulator.round_record`); a runtime round computes neither. This times `evaluation.index_consistency` on edges
sampled as the simulator samples them, for models shaped as each case's MLP (k=2), in each form (`edges`: one edge
at a time from views; `gram`: one Gram matrix of the edges' clients' models; `blocks`: gathered edges, a GPU's
form), says which form `auto` takes, and times `disagreement` beside them; each the best of `--repeats`. The
models are random: the metric's cost does not depend on their values. The forms must agree, or the run fails.

    python benchmarks/consensus_metrics.py [--cases runtime,demo,100,300,1000] [--device cpu] [--out FILE]

Cases: `runtime` (benchmarks/runtime_benchmark.py's 24 clients, ER p=0.5, h=64), `demo` (shared/dfca/configs/
demo.yaml: 40 clients, ER p=0.5, h=200), and N (N clients, ER with 10 neighbours on average, h=200).
Appends one line per case, with the commit and the machine's load, to --out.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from resumable_runs import RESULTS, append_stamped

from dfca.config import TopologyConfig
from dfca.graph import adjacency_matrix, build_graph
from dfca.results.evaluation import auto_form, disagreement, index_consistency
from dfca.simulator import sampled_edges

FORMS = ("edges", "gram", "blocks")
K = 2


def case(name: str) -> tuple[int, float, int]:
    """(clients, ER edge probability, hidden units) of a named case."""
    if name == "runtime":
        return 24, 0.5, 64
    if name == "demo":
        return 40, 0.5, 200
    clients = int(name)
    return clients, min(1.0, 10 / max(clients - 1, 1)), 200


def mlp_params(clients: int, hidden: int, device: str) -> dict[str, torch.Tensor]:
    """Random [N, k, ...] parameters shaped as the MLP 784-hidden-10 the cases train."""
    g = torch.Generator().manual_seed(0)
    shapes = {"w1": (784, hidden), "b1": (hidden,), "w2": (hidden, 10), "b2": (10,)}
    return {n: torch.randn(clients, K, *s, generator=g).to(device) for n, s in shapes.items()}


def best_seconds(call: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(repeats):
        began = time.perf_counter()
        value = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return best, value


def measure(name: str, device: str, repeats: int) -> dict[str, Any]:
    clients, p, hidden = case(name)
    graph = build_graph(TopologyConfig(kind="erdos_renyi", p=p), clients, seed=0)
    edges = sampled_edges(adjacency_matrix(graph, clients).to(device), torch.Generator().manual_seed(2))
    params = mlp_params(clients, hidden, device)
    src, dst = torch.nonzero(torch.triu(edges, diagonal=1), as_tuple=True)
    per_client = [t.view(clients, K, -1) for t in params.values()]
    auto = auto_form(K, per_client, src, dst)
    row: dict[str, Any] = {"case": name, "clients": clients, "hidden": hidden, "edges": int(src.numel()),
                           "device": device, "auto": auto, "seconds": {}}
    values = {}
    for form in FORMS:
        row["seconds"][form], values[form] = best_seconds(lambda f=form: index_consistency(params, edges, f), repeats)
    if len(set(values.values())) != 1:
        raise AssertionError(f"the forms disagree on {name}: {values}")
    row["index_consistency"] = values["edges"]
    row["disagreement_seconds"], _ = best_seconds(lambda: disagreement(params), repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="runtime,demo,100,300,1000")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(RESULTS) / "consensus_metrics_runs.jsonl")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = [measure(name, args.device, args.repeats) for name in args.cases.split(",")]
    stamp = append_stamped(args.out, rows, load_before, threads=torch.get_num_threads())
    print(f"index consistency of the simulator's sampled edges (k={K}), seconds, best of {args.repeats}; "
          f"{args.device}, {stamp['threads']} threads:\n")
    print("| case | clients | h | edges | edges form | gram | blocks | auto takes | edges form ÷ auto | Disp_j |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["seconds"]
        print(f"| {r['case']} | {r['clients']} | {r['hidden']} | {r['edges']} | {s['edges']:.4f} | {s['gram']:.4f} | "
              f"{s['blocks']:.4f} | {r['auto']} | {s['edges'] / s[r['auto']]:.1f}x | {r['disagreement_seconds']:.4f} |")
    print(f"\nappended to {args.out} (commit {stamp['commit']}, load {load_before:.2f} -> {stamp['load_after']:.2f})")


if __name__ == "__main__":
    main()
