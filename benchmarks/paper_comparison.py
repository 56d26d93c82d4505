"""The paper comparison at reduced scale on the bundled real MNIST (DFCA Tables 1-2, Fig. 3c; FedSPD's setting).

    python benchmarks/paper_comparison.py            # full: 3 seeds, about 20-30 min on 2 free CPU cores
    python benchmarks/paper_comparison.py --quick    # smoke run: 1 seed, tiny scale, about a minute

Four tables, each cell mean +- std over the seeds, every row with bytes sent per client per round:
1. DFCA Table 1/2 analogue, rotated MNIST k=2 {0, 180} and k=4 {0, 90, 180, 270}: DFCA-GI, DFCA-LI (paper rule,
   and the robust variant when the config offers it), FedSPD, DFedAvgM, IFCA, local. Test accuracy, ARI,
   populated clusters.
2. Fig. 3c analogue: DFCA-GI and DFCA-LI accuracy against the Erdos-Renyi probability p (k=2).
3. Sequential against batch aggregation, with 0%, 10% and 30% of the messages lost (DFCA-GI, k=2).
4. FedSPD's setting (B.1.1): every client holds 10-90% of its data rotated by 90 degrees. FedSPD against
   DFCA-GI, IFCA, DFedAvgM and local; per-client accuracy (mean, std across clients, worst decile) and the
   error of FedSPD's mixture estimates u_is.

Runs go to `--jobs` worker processes (default 2), one torch thread each; specs and results cross the
process boundary as JSON lines. Writes results.json, tables.md and paper_comparison.png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import typing
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SEEDS = (0, 1, 2)
P_SWEEP = (0.05, 0.1, 0.15, 0.2, 0.3)
LOSSES = (0.0, 0.1, 0.3)
DFEDAVGM_MOMENTUM = 0.9


@dataclass(frozen=True)
class Scale:
    """One reduced-scale setting (the paper's MNIST uses N=240, MLP h=2048, 150 rounds)."""

    clients: int
    train_per_client: int
    test_per_client: int
    batch_size: int
    hidden: int
    rounds: int
    local_epochs: int = 5
    lr: float = 0.1
    p: float = 0.1
    p_sweep: tuple[float, ...] = P_SWEEP


FULL = {
    "k2": Scale(clients=100, train_per_client=80, test_per_client=20, batch_size=10, hidden=100, rounds=30),
    "k4": Scale(clients=240, train_per_client=66, test_per_client=16, batch_size=11, hidden=100, rounds=30),
}
QUICK = {
    "k2": Scale(clients=20, train_per_client=40, test_per_client=20, batch_size=10, hidden=32, rounds=4, p=0.3,
                p_sweep=(0.2, 0.3, 0.5)),
    "k4": Scale(clients=24, train_per_client=40, test_per_client=20, batch_size=10, hidden=32, rounds=4, p=0.3),
}
ROTATIONS = {2: [0, 180], 4: [0, 90, 180, 270]}


@dataclass
class Spec:
    """One simulator run: which table cell it feeds, and the config it runs."""

    table: str
    row: str
    column: str
    seed: int
    config: dict[str, Any]
    cost: float = 1.0


@dataclass
class Outcome:
    table: str
    row: str
    column: str
    seed: int
    metrics: dict[str, float] = field(default_factory=dict)


def robust_available() -> bool:
    from dfca.algorithms.dfca import DFCAConfig

    return "robust" in typing.get_args(DFCAConfig.model_fields["variant"].annotation)


def algorithm_rows(robust: bool) -> dict[str, dict[str, Any]]:
    """Config overrides of every Table 1 row."""
    rows: dict[str, dict[str, Any]] = {
        "DFCA-GI": {"algorithm": "dfca", "init": "global", "dfca": {"variant": "paper"}},
        "DFCA-LI": {"algorithm": "dfca", "init": "local", "dfca": {"variant": "paper"}},
    }
    if robust:
        full = {"variant": "robust", "traffic": "full"}  # the schedule docs/baselines.md measured
        rows["DFCA-GI robust"] = {"algorithm": "dfca", "init": "global", "dfca": full}
        rows["DFCA-LI robust"] = {"algorithm": "dfca", "init": "local", "dfca": full}
    rows["FedSPD"] = {"algorithm": "fedspd"}
    rows["DFedAvgM"] = {"algorithm": "dfedavgm", "train": {"momentum": DFEDAVGM_MOMENTUM}}
    rows["IFCA"] = {"algorithm": "ifca"}
    rows["local"] = {"algorithm": "local"}
    return rows


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def base_config(scale: Scale, k: int, seed: int, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "clusters": k,
        "rounds": scale.rounds,
        "seed": seed,
        "eval_every": scale.rounds,
        "aggregation": "sequential",
        "data": {"dataset": "mnist-bundled", "rotations": ROTATIONS[k], "clients": scale.clients,
                 "train_per_client": scale.train_per_client, "test_per_client": scale.test_per_client,
                 "permute_per_cluster": True, "test_fraction": 0.2},
        "model": {"kind": "mlp", "hidden": scale.hidden},
        "train": {"lr": scale.lr, "local_epochs": scale.local_epochs, "batch_size": scale.batch_size},
        "topology": {"kind": "erdos_renyi", "p": scale.p},
    }


def cost(scale: Scale) -> float:
    return scale.clients * scale.train_per_client * scale.rounds * scale.hidden / 1e6


def plan(scales: dict[str, Scale], seeds: Iterable[int], robust: bool, table1_settings: Iterable[str]) -> list[Spec]:
    rows = algorithm_rows(robust)
    specs: list[Spec] = []
    for seed in seeds:
        for setting, k in (("k2", 2), ("k4", 4)):
            if setting not in table1_settings:
                continue
            scale = scales[setting]
            for row, extra in rows.items():
                cfg = merge(base_config(scale, k, seed, f"t1-{setting}-{row}"), extra)
                specs.append(Spec("table1", row, f"k={k}", seed, cfg, cost(scale)))
        scale = scales["k2"]
        for p in scale.p_sweep:
            for row in ("DFCA-GI", "DFCA-LI"):
                if p == scale.p:
                    continue  # table 1's k=2 cell is this point
                cfg = merge(base_config(scale, 2, seed, f"fig3c-{row}-{p}"), rows[row] | {"topology": {"p": p}})
                specs.append(Spec("fig3c", row, f"p={p}", seed, cfg, cost(scale)))
        for aggregation in ("sequential", "batch"):
            for loss in LOSSES:
                if aggregation == "sequential" and loss == 0.0:
                    continue  # table 1's DFCA-GI k=2 cell
                cfg = merge(base_config(scale, 2, seed, f"t3-{aggregation}-{loss}"),
                            rows["DFCA-GI"] | {"aggregation": aggregation, "network": {"message_loss": loss}})
                specs.append(Spec("table3", aggregation, f"loss={int(loss * 100)}%", seed, cfg, cost(scale)))
        for row in ("FedSPD", "DFCA-GI", "IFCA", "DFedAvgM", "local"):
            mixture = {"data": {"rotations": [0, 90], "mixture": True}}
            cfg = merge(merge(base_config(scale, 2, seed, f"t4-{row}"), rows[row]), mixture)
            specs.append(Spec("table4", row, "mixture", seed, cfg, cost(scale)))
    return specs


def derived(specs: list[Spec], outcomes: list[Outcome], scales: dict[str, Scale]) -> list[Outcome]:
    """Cells that reuse a Table 1 run (p = scale.p in Fig. 3c; sequential, 0% loss in Table 3)."""
    extra: list[Outcome] = []
    p = scales["k2"].p
    for o in outcomes:
        if o.table == "table1" and o.column == "k=2" and o.row in ("DFCA-GI", "DFCA-LI"):
            extra.append(Outcome("fig3c", o.row, f"p={p}", o.seed, o.metrics))
        if o.table == "table1" and o.column == "k=2" and o.row == "DFCA-GI":
            extra.append(Outcome("table3", "sequential", "loss=0%", o.seed, o.metrics))
    return extra


# ---------------------------------------------------------------- worker side


def run_spec(spec: dict[str, Any], cache: dict[str, Any]) -> dict[str, float]:
    """Run one config in this process and return its metrics."""
    import torch

    from dfca.config import parse_config
    from dfca.core.soft_assignment import mixture_error
    from dfca.data import build_federated_data
    from dfca.simulator import simulate

    cfg = parse_config(spec["config"])
    key = json.dumps([cfg.data.model_dump(), cfg.seed, cfg.clusters], sort_keys=True)
    if key not in cache:
        cache.clear()
        cache[key] = build_federated_data(cfg)
    data = cache[key]
    start = time.perf_counter()
    result = simulate(cfg, data=data)
    s = result.summary
    per_client = result.algorithm.evaluate().test_accuracy
    worst = torch.quantile(per_client, 0.1).item()
    metrics = {
        "accuracy": s["test_accuracy"],
        "client_std": s["test_accuracy_std"],
        "worst_decile": worst,
        "ari": s["cluster_ari"],
        "populated": float(s["populated_clusters"]),
        "bytes": s["bytes_sent_per_client_per_round"],
        "seconds": time.perf_counter() - start,
    }
    shares = getattr(result.algorithm, "shares", None)
    if shares is not None and data.mixture is not None:
        metrics["mixture_error"] = mixture_error(shares, data.mixture)
    return metrics


def worker_main() -> None:
    """Read one JSON spec per stdin line, answer one JSON line of metrics per spec."""
    import torch

    torch.set_num_threads(1)
    cache: dict[str, Any] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        try:
            reply = {"id": spec["id"], "metrics": run_spec(spec, cache)}
        except Exception as err:  # noqa: BLE001 - reported back to the driver and shown in the tables
            reply = {"id": spec["id"], "error": f"{type(err).__name__}: {err}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------- driver side


def run_all(specs: list[Spec], jobs: int) -> list[Outcome]:
    """Share the specs among `jobs` worker processes (longest first, to the least loaded)."""
    order = sorted(range(len(specs)), key=lambda i: -specs[i].cost)
    queues: list[list[int]] = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for i in order:
        w = load.index(min(load))
        queues[w].append(i)
        load[w] += specs[i].cost
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
        for q in queues if q
    ]
    for proc, q in zip(procs, queues, strict=False):
        assert proc.stdin is not None
        for i in q:
            proc.stdin.write(json.dumps({"id": i, "config": specs[i].config}) + "\n")
        proc.stdin.close()
    outcomes: list[Outcome] = []
    done, total, start = 0, len(specs), time.perf_counter()
    streams = {proc.stdout: proc for proc in procs}
    import selectors

    selector = selectors.DefaultSelector()
    for stream in streams:
        selector.register(stream, selectors.EVENT_READ)
    open_streams = len(streams)
    while open_streams:
        for key, _ in selector.select():
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if not line:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            reply = json.loads(line)
            spec = specs[reply["id"]]
            done += 1
            if "error" in reply:
                print(f"[{done}/{total}] {spec.config['name']} seed {spec.seed}: ERROR {reply['error']}", flush=True)
                continue
            m = reply["metrics"]
            print(f"[{done}/{total}] {time.perf_counter() - start:6.0f}s {spec.config['name']} seed {spec.seed}: "
                  f"acc {m['accuracy']:.3f} ARI {m['ari']:.2f} ({m['seconds']:.0f}s)", flush=True)
            outcomes.append(Outcome(spec.table, spec.row, spec.column, spec.seed, m))
    for proc in procs:
        proc.wait()
    return outcomes


def cell(values: list[float], digits: int = 1, scale: float = 100.0) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def grouped(outcomes: list[Outcome], table: str) -> dict[tuple[str, str], list[dict[str, float]]]:
    out: dict[tuple[str, str], list[dict[str, float]]] = defaultdict(list)
    for o in outcomes:
        if o.table == table:
            out[(o.row, o.column)].append(o.metrics)
    return out


def metric(runs: list[dict[str, float]], name: str) -> list[float]:
    return [r[name] for r in runs if name in r]


def kib(runs: list[dict[str, float]]) -> str:
    values = metric(runs, "bytes")
    return f"{statistics.fmean(values) / 1024:,.0f}" if values else "-"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ordered_rows(cells: dict[tuple[str, str], Any], preferred: Iterable[str]) -> list[str]:
    present = {row for row, _ in cells}
    return [r for r in preferred if r in present] + sorted(present - set(preferred))


def tables(outcomes: list[Outcome], robust: bool) -> dict[str, str]:
    rows_order = list(algorithm_rows(robust))
    out: dict[str, str] = {}
    t1 = grouped(outcomes, "table1")
    body = []
    for row in ordered_rows(t1, rows_order):
        line = [row]
        for col in ("k=2", "k=4"):
            runs = t1.get((row, col), [])
            line += [cell(metric(runs, "accuracy")), cell(metric(runs, "ari"), 2, 1.0),
                     cell(metric(runs, "populated"), 1, 1.0), kib(runs)]
        body.append(line)
    out["table1"] = markdown(
        ["row", "k=2 acc %", "k=2 ARI", "k=2 populated", "k=2 KiB/client/round",
         "k=4 acc %", "k=4 ARI", "k=4 populated", "k=4 KiB/client/round"], body)
    f3 = grouped(outcomes, "fig3c")
    cols = sorted({c for _, c in f3}, key=lambda c: float(c.split("=")[1]))
    body = []
    for row in ordered_rows(f3, rows_order):
        body.append([row] + [cell(metric(f3.get((row, c), []), "accuracy")) for c in cols]
                    + [cell(metric(f3.get((row, c), []), "ari"), 2, 1.0) for c in cols])
    out["fig3c"] = markdown(["row"] + [f"acc % {c}" for c in cols] + [f"ARI {c}" for c in cols], body)
    t3 = grouped(outcomes, "table3")
    cols3 = [f"loss={int(loss * 100)}%" for loss in LOSSES]
    body = []
    for row in ordered_rows(t3, ["sequential", "batch"]):
        body.append([row] + [cell(metric(t3.get((row, c), []), "accuracy")) for c in cols3]
                    + [cell(metric(t3.get((row, c), []), "ari"), 2, 1.0) for c in cols3]
                    + [kib(t3.get((row, cols3[0]), []))])
    out["table3"] = markdown(["aggregation"] + [f"acc % {c}" for c in cols3] + [f"ARI {c}" for c in cols3]
                             + ["KiB/client/round (sent)"], body)
    t4 = grouped(outcomes, "table4")
    body = []
    for row in ordered_rows(t4, ["FedSPD", "DFCA-GI", "IFCA", "DFedAvgM", "local"]):
        runs = t4.get((row, "mixture"), [])
        body.append([row, cell(metric(runs, "accuracy")), cell(metric(runs, "client_std")),
                     cell(metric(runs, "worst_decile")), cell(metric(runs, "mixture_error"), 3, 1.0),
                     cell(metric(runs, "populated"), 1, 1.0), kib(runs)])
    out["table4"] = markdown(["row", "acc %", "std across clients %", "worst decile acc %",
                              "mixture MAE (u_is)", "populated", "KiB/client/round"], body)
    return out


TITLES = {
    "table1": "Table 1: rotated MNIST, test accuracy / ARI / populated clusters / traffic",
    "fig3c": "Table 2 (Fig. 3c): DFCA accuracy against ER probability p (k=2)",
    "table3": "Table 3: sequential vs batch aggregation under message loss (DFCA-GI, k=2)",
    "table4": "Table 4: FedSPD's mixture setting (10-90% rotated by 90 degrees, k=2)",
}


def settings_text(scales: dict[str, Scale], seeds: Iterable[int]) -> str:
    lines = [f"seeds {list(seeds)}; DFedAvgM momentum {DFEDAVGM_MOMENTUM}; "
             "data: bundled MNIST, 4,000 train / 1,000 test images, one permutation of the train images per cluster"]
    for name, s in scales.items():
        lines.append(f"{name}: {asdict(s)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, tiny scale")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (one torch thread each)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, quick 1)")
    parser.add_argument("--out", type=Path, default=Path("runs/paper_comparison"))
    parser.add_argument("--tables", default="table1,fig3c,table3,table4", help="comma-separated subset to run")
    parser.add_argument("--table1-settings", default="k2,k4", help="Table 1 columns to run (k2, k4)")
    parser.add_argument("--from-results", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="run nothing: re-render tables and plot from results.json files (a later file's "
                             "tables replace an earlier file's)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main()
        return
    if args.from_results:
        rerender(args.from_results, args.out)
        return
    scales = QUICK if args.quick else FULL
    seeds = SEEDS[: args.seeds or (1 if args.quick else len(SEEDS))]
    robust = robust_available()
    wanted = set(args.tables.split(","))
    specs = [s for s in plan(scales, seeds, robust, args.table1_settings.split(",")) if s.table in wanted]
    print(f"{len(specs)} runs on {args.jobs} workers; robust DFCA rows: {robust}\n{settings_text(scales, seeds)}",
          flush=True)
    start = time.perf_counter()
    outcomes = run_all(specs, args.jobs)
    outcomes += derived(specs, outcomes, scales)
    wall = time.perf_counter() - start
    footer = f"Settings: {settings_text(scales, seeds)}\nWall time: {wall / 60:.1f} min with {args.jobs} workers.\n"
    write_outputs(args.out, outcomes, robust, footer)
    (args.out / "results.json").write_text(json.dumps(
        {"settings": {k: asdict(v) for k, v in scales.items()}, "seeds": list(seeds), "wall_seconds": wall,
         "tables": sorted(wanted), "outcomes": [asdict(o) for o in outcomes]}, indent=1))


def write_outputs(out: Path, outcomes: list[Outcome], robust: bool, footer: str) -> None:
    from paper_comparison_plot import plot_comparison

    rendered = tables(outcomes, robust)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(f"### {TITLES[name]}\n\n{body}" for name, body in rendered.items())
    text += f"\n\n{footer}"
    (out / "tables.md").write_text(text)
    plot_comparison(outcomes, out / "paper_comparison.png", list(algorithm_rows(robust)))
    print(text)
    print(f"wrote {out}/tables.md, paper_comparison.png")


def rerender(paths: list[Path], out: Path) -> None:
    """Tables and plot from earlier results.json files; for each (table, column) the last file that has it wins."""
    by_cell: dict[tuple[str, str], list[Outcome]] = {}
    footer = []
    for path in paths:
        saved = json.loads(path.read_text())
        outcomes = [Outcome(**o) for o in saved["outcomes"]]
        for key in {(o.table, o.column) for o in outcomes}:
            by_cell[key] = [o for o in outcomes if (o.table, o.column) == key]
        columns = sorted({f"{o.table}:{o.column}" for o in outcomes})
        footer.append(f"{path}: settings {saved['settings']}, seeds {saved['seeds']}, cells {columns}, "
                      f"wall {saved['wall_seconds'] / 60:.1f} min")
    merged = [o for table in TITLES for key, cell in sorted(by_cell.items()) if key[0] == table for o in cell]
    robust = any("robust" in o.row for o in merged)
    write_outputs(out, merged, robust, "Rendered from:\n" + "\n".join(footer) + "\n")


if __name__ == "__main__":
    main()
