"""The distributed runtime beside Flower's Deployment Engine, on one FedAvg workload, process for process.

    python benchmarks/peers_runtime.py --setup-flwr [--flwr-venv DIR]   # once: the flwr venv (flwr 1.42.0, torch)
    python benchmarks/peers_runtime.py [--flwr-venv DIR] [--rounds 10] [--runs dfca-ifca,flwr-3x8,...]
                                       [--out docs/results/peers_runtime_runs.jsonl]

The flwr venv is found by --flwr-venv, else $DFCA_FLWR_VENV, else /work/venvs/flwr; it is a benchmark dependency
only (`python -m venv DIR && DIR/bin/pip install torch==2.13.0 flwr==1.42.0`, which --setup-flwr runs).

Workload: benchmarks/runtime_benchmark.py's 24 clients (bundled MNIST rotated 0 and 180 degrees, 80 training and 25
test samples each), MLP 784-64-10, 3 local epochs of plain SGD, batch 20, lr 0.25, every client every round, built
once by dfca's loader (the workers build the same data from the config; Flower's nodes read it from one .npz).
Evaluation: only the final model, on every client's test samples.

Runs (each on its own processes, every process with one thread: OMP_NUM_THREADS=MKL_NUM_THREADS=1):
  dfca-ifca       the runtime, `dfca up --aggregator` with 3 workers x 8 clients: IFCA with k=1 (= FedAvg; the
                  aggregator is the server), on a private RabbitMQ node started for the run
  dfca-dfedavgm   the same stack without the aggregator: DFedAvgM on a complete graph, momentum 0
  flwr-3x8        Flower 1.42 Deployment Engine: a SuperLink and 3 SuperNodes; each node's ClientApp trains its 8
                  clients (client c on node c % 3, as on dfca's workers) per round and replies with 8 models
  flwr-3x8-fast   the same with Flower's 3-s polls at 0.01 s (peers/flwr_fast_polls/sitecustomize.py says which)
  flwr-24x1       Flower's own layout: 24 SuperNodes with one client each
  flwr-24x1-fast  the same, its 3-s polls at 0.01 s

Per run: seconds per round over rounds 2..R (from round 1's end to round R's); CPU seconds per round in that span
of every process tree of the deployment, children included (Flower's ClientApp and ServerApp processes; the
runtime's workers, topology, metrics, aggregator and RabbitMQ node); the peak RSS of all of them summed; bytes per
round through the hub (TCP bytes on the RabbitMQ node's AMQP port; on the SuperLink's one HTTP port, which serves
its Fleet, ServerApp and Control APIs; a ClientApp's talk with its own SuperNode is not counted);
the final test accuracy. Rows are appended to --out with the commit, the date and the load before and after.
Target: the runtime >= 10x faster per round than Flower's Deployment Engine in the same layout (3 x 8).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flwr_deployment
import httpx
from peers import save_workload
from process_tree_trace import TreeTrace
from resumable_runs import commit
from runtime_benchmark import bench_config, free_port, free_port_block

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the private RabbitMQ node

from rabbitmq_node import RabbitMQNode  # noqa: E402

from dfca.cli.launcher import Stack, StackOptions  # noqa: E402
from dfca.config import ExperimentConfig  # noqa: E402
from dfca.identity import sharding  # noqa: E402
from dfca.runtime.metrics.metrics_store import MetricsStore  # noqa: E402

TOKEN = "benchmark"
WORKERS = 3
TARGET = 10.0  # the runtime's round at least this many times shorter than Flower's in the same layout
ACCURACY_TOLERANCE = 0.03  # the final accuracies agree within this (different initialisations and sample orders)
RUNS = ("dfca-ifca", "dfca-dfedavgm", "flwr-3x8", "flwr-3x8-fast", "flwr-24x1", "flwr-24x1-fast")
LABELS = {
    "dfca-ifca": "dfca runtime, IFCA k=1 (aggregator), 3 workers x 8 clients",
    "dfca-dfedavgm": "dfca runtime, DFedAvgM complete graph, 3 workers x 8 clients",
    "flwr-3x8": "Flower Deployment Engine, FedAvg, 3 SuperNodes x 8 clients",
    "flwr-3x8-fast": "the same, its 3-s polls at 0.01 s",
    "flwr-24x1": "Flower Deployment Engine, FedAvg, 24 SuperNodes x 1 client",
    "flwr-24x1-fast": "the same, its 3-s polls at 0.01 s",
}


def workload_config(algorithm: str, rounds: int) -> dict[str, Any]:
    """runtime_benchmark's 24 clients and training as one-cluster FedAvg: IFCA k=1 or DFedAvgM on a complete graph;
    evaluation of the final models only."""
    cfg = bench_config(rounds)
    cfg.update(name=f"peers-runtime-{algorithm}", algorithm=algorithm, clusters=1, eval_every=rounds,
               topology={"kind": "complete"}, runtime={"round_timeout": 120.0})
    cfg["train"] = {**cfg["train"], "momentum": 0.0}
    return cfg


def per_round(trace: TreeTrace, began: float, ended: float, rounds: int) -> dict[str, float]:
    return {name: value / rounds for name, value in trace.between(began, ended).items()}


def dfca_run(algorithm: str, rounds: int, broker: RabbitMQNode, state_dir: Path) -> dict[str, Any]:
    """One run on a fresh stack (3 workers, topology, metrics, and the aggregator for IFCA), every service with one
    thread, on the private broker."""
    cfg = workload_config(algorithm, rounds)
    options = StackOptions(workers=WORKERS, broker_url=broker.url, topology_port=free_port(),
                           metrics_port=free_port(), aggregator_port=free_port() if algorithm == "ifca" else None,
                           worker_port_base=free_port_block(WORKERS), api_token=TOKEN, state_dir=state_dir,
                           log_to_files=True, log_level="WARNING")
    stack = Stack(options)
    for process in stack.services.values():  # one thread a process, whatever the machine's cores
        process.env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    stop = threading.Event()
    stack.start()
    try:
        stack.wait_ready(timeout=180)
        stack.supervise(stop)
        api = httpx.Client(base_url=options.topology_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        experiment = api.post("/experiments", json=cfg).raise_for_status().json()["id"]
        assert broker.process is not None
        trace = TreeTrace({"workers": [p.pid for p in stack.services.values() if p.service == "worker" and p.pid],
                           "services": [p.pid for p in stack.services.values() if p.service != "worker" and p.pid],
                           "broker": [broker.process.pid]}, {broker.port}).start()
        api.post(f"/experiments/{experiment}:start").raise_for_status()
        try:
            deadline = time.monotonic() + 1800
            while (status := api.get(f"/experiments/{experiment}").json()["status"]) == "running":
                if time.monotonic() > deadline:
                    raise TimeoutError("the runtime run did not finish")
                time.sleep(0.2)
        finally:
            trace.stop()
        if status != "completed":
            raise RuntimeError(f"the runtime run ended {status}")
        time.sleep(1.0)
        summary = httpx.get(f"{options.metrics_url}/experiments/{experiment}/summary", timeout=30,
                            headers={"Authorization": f"Bearer {TOKEN}"}).json()
        reports = MetricsStore(f"sqlite:///{(state_dir / 'metrics.db').resolve()}").reports(experiment)
    finally:
        stop.set()
        stack.stop()
        stack.delete_service_queues()
    done_at: dict[int, float] = {}
    for report in reports:  # a round is done when its last worker reports it
        done_at[report.round] = max(done_at.get(report.round, 0.0), report.at)
    first, last = min(done_at), max(done_at)
    return measured(trace, done_at[first], done_at[last], last - first, float(summary["test_accuracy"]),
                    {"layout": f"{WORKERS} workers x {cfg['data']['clients'] // WORKERS} clients",
                     "config": cfg})


def measured(trace: TreeTrace, began: float, ended: float, rounds: int, accuracy: float,
             more: dict[str, Any]) -> dict[str, Any]:
    cpu = per_round(trace, began, ended, rounds)
    tcp = cpu.pop("tcp_bytes")
    return {"round_seconds": (ended - began) / rounds, "timed_rounds": rounds,
            "cpu_seconds_per_round": sum(cpu.values()), "cpu_seconds_per_round_by_tree": cpu,
            "peak_rss_mib": trace.peak_rss["all"] / 2**20,
            "peak_rss_mib_by_tree": {k: v / 2**20 for k, v in trace.peak_rss.items() if k != "all"},
            "bytes_per_round": tcp, "test_accuracy": accuracy, **more}


def flwr_run(venv: Path, nodes: int, fast: bool, rounds: int, data: Path, home: Path, timeout: float
             ) -> dict[str, Any]:
    clients = [sharding.clients_of(n, nodes, 24) for n in range(nodes)]
    ports = {"superlink": free_port(), "supernodes": free_port_block(nodes)}
    with flwr_deployment.running(venv, home, clients, fast, ports) as deployment:
        result, trace = flwr_deployment.measured_run(deployment, data, rounds, timeout)
    marks = result["round_marks"]  # the start, then every round's end
    return measured(trace, marks[1], marks[-1], len(marks) - 2, float(result["test_accuracy"]),
                    {"layout": f"{nodes} SuperNodes x {24 // nodes} clients", "flwr_version": result["flwr_version"],
                     "payload_bytes_per_round": (result["payload_bytes_sent"] + result["payload_bytes_received"])
                     / rounds, "polls": {"grid_and_supernode_3s_polls": flwr_deployment.POLL_S,
                               "superexec_task_poll": flwr_deployment.SUPEREXEC_POLL_S or 1.0} if fast else "stock"})


def setup_flwr(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "torch==2.13.0", "flwr==1.42.0"], check=True)


def table(rows: list[dict[str, Any]]) -> str:
    base = {r["run"]: r for r in rows}
    ifca = base.get("dfca-ifca")
    lines = ["| run | layout | s/round (rounds 2..R) | CPU-s/round, all processes | peak RSS, all processes | "
             "bytes/round through the hub | test accuracy | s/round / dfca IFCA's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['round_seconds'] / ifca['round_seconds']:.1f}x" if ifca else ""
        lines.append(f"| {LABELS[r['run']]} | {r['layout']} | {r['round_seconds']:.3f} | "
                     f"{r['cpu_seconds_per_round']:.3f} | {r['peak_rss_mib']:,.0f} MiB | "
                     f"{r['bytes_per_round'] / 1e6:.2f} MB | {r['test_accuracy']:.4f} | {ratio} |")
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    base = {r["run"]: r for r in rows}
    out = []
    accuracies = [r["test_accuracy"] for r in rows]
    spread = max(accuracies) - min(accuracies)
    out.append(f"accuracies agree within {ACCURACY_TOLERANCE}: {'yes' if spread <= ACCURACY_TOLERANCE else 'NO'} "
               f"(spread {spread:.4f})")
    for dfca in ("dfca-ifca", "dfca-dfedavgm"):
        for flwr in ("flwr-3x8", "flwr-3x8-fast"):
            if dfca in base and flwr in base:
                ratio = base[flwr]["round_seconds"] / base[dfca]["round_seconds"]
                cpu = base[flwr]["cpu_seconds_per_round"] / base[dfca]["cpu_seconds_per_round"]
                out.append(f"{dfca} against {flwr} (same layout): {ratio:.1f}x faster per round "
                           f"(target >= {TARGET:.0f}x: {'met' if ratio >= TARGET else 'NOT met'}), "
                           f"{cpu:.1f}x fewer CPU-s per round")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup-flwr", action="store_true", help="create the flwr venv at --flwr-venv and exit")
    parser.add_argument("--flwr-venv", type=Path,
                        default=Path(os.environ.get("DFCA_FLWR_VENV", "/work/venvs/flwr")))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--rounds", type=int, default=10, help="training rounds (rounds 2..R are timed)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one Flower run may take")
    parser.add_argument("--superexec-poll", type=float, default=None,
                        help="the -fast runs: FLWR_SUPEREXEC_TASK_POLL_INTERVAL (seconds, 0.01..60; default: "
                             "Flower's 1 s, see flwr_deployment.SUPEREXEC_POLL_S)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' files (logs, Flower's homes, broker data) in this folder")
    parser.add_argument("--out", type=Path, default=Path("docs/results/peers_runtime_runs.jsonl"))
    args = parser.parse_args()
    if args.setup_flwr:
        setup_flwr(args.flwr_venv)
        return
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if unknown := set(runs) - set(RUNS):
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
    if args.rounds < 3:
        parser.error("--rounds: at least 3 (round 1 is left out of the timing)")
    if any(r.startswith("flwr") for r in runs) and not (args.flwr_venv / "bin" / "flower-superlink").exists():
        parser.error(f"--flwr-venv: no Flower at {args.flwr_venv} (python benchmarks/peers_runtime.py --setup-flwr "
                     "--flwr-venv DIR, or set DFCA_FLWR_VENV)")
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    flwr_deployment.SUPEREXEC_POLL_S = args.superexec_poll
    common = {"commit": commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "host": socket.gethostname(), "cores": os.cpu_count(), "rounds": args.rounds,
              "command": "python benchmarks/peers_runtime.py " + " ".join(sys.argv[1:])}
    rows: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peers-runtime-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        data = save_workload(ExperimentConfig.model_validate(workload_config("ifca", args.rounds)),
                             SimpleNamespace(threads=1), folder)
        broker = RabbitMQNode.start_new(folder / "rabbitmq") if any(r.startswith("dfca") for r in runs) else None
        try:
            for run in runs:
                load_before = os.getloadavg()
                print(f"== {run}: {LABELS[run]} (load {load_before[0]:.2f})", flush=True)
                if run.startswith("dfca"):
                    assert broker is not None
                    row = dfca_run(run.removeprefix("dfca-"), args.rounds, broker, folder / run)
                else:
                    nodes = 3 if "3x8" in run else 24
                    row = flwr_run(args.flwr_venv, nodes, run.endswith("fast"), args.rounds, data, folder / run,
                                   args.timeout)
                row = {"run": run, "label": LABELS[run], **row, **common, "load_before": load_before,
                       "load_after": os.getloadavg()}
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
                print(f"   {row['round_seconds']:.3f} s/round, {row['cpu_seconds_per_round']:.3f} CPU-s/round, "
                      f"accuracy {row['test_accuracy']:.4f}", flush=True)
        finally:
            if broker is not None:
                broker.stop()
    print()
    print(table(rows))
    print()
    for line in verdicts(rows):
        print(line)
    print(f"\nappended to {args.out} (commit {common['commit']}, {common['date']}, load "
          f"{rows[0]['load_before'][0]:.2f} -> {rows[-1]['load_after'][0]:.2f}; `uptime`: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True, check=False).stdout.strip()})")


if __name__ == "__main__":
    main()
