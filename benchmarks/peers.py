"""One federated workload in this project's simulator and in three other FL frameworks, side by side.

    python benchmarks/peers.py --setup [--venvs DIR] [--only flwr,pfl,p2pfl]   # once: one venv per peer
    python benchmarks/peers.py [--venvs DIR] [--only ifca,dfedavgm,flwr,pfl,p2pfl,torch] [--clients 100] [--rounds 10]
                               [--threads 2] [--out runs/peers/peers.md]

The workload (FedAvg-style): an MLP 784-200-10 (ReLU) on the bundled rotated MNIST (rotation 0, dfca's loader),
`--clients` clients with `--train-per-client` training samples each, `--epochs` local epochs of plain SGD
(batch `--batch`, lr `--lr`, no momentum), every client in every round, `--rounds` rounds; then the final
model's accuracy on the same test samples (`--test-per-client` per client) in every framework. The data are
built once here, with dfca.data.build_federated_data, and saved to one .npz that every run loads.

Runs, each its own process (benchmarks/peers/run_*.py; a peer's with its own venv's python, since the peers pin
conflicting protobuf/typer/numpy versions):
  ifca      this project's simulator, IFCA with one cluster (= FedAvg)
  dfedavgm  this project's simulator, DFedAvgM on a complete graph, momentum 0 (= decentralized FedAvg)
  flwr      Flower 1.42 Simulation Engine (Ray), legacy FedAvg strategy, one virtual SuperNode per client
  pfl       Apple pfl-research 0.6 SimulatedBackend, FederatedAveraging over all users every central iteration
  p2pfl     p2pfl 0.4.4 nodes in one process over its in-memory protocol, FedAvg, all nodes connected
  torch     a reference, not a peer: the same FedAvg as a plain torch loop over clients (the autograd step every
            peer trains with, nothing else), so a run's figures say what the machine gave per-client work then

Measured, per run: client updates per second (clients x rounds / the rounds' seconds summed); seconds per round,
the mean over rounds 2..R (round 1's warm-up left out; with one round, round 1); the total wall time of the
process (start-up, data loading and the final evaluation included); peak memory: the RSS of the process and all
its descendants summed (sampled every 0.2 s from /proc; pages shared between processes, e.g. the torch libraries
of Ray's workers, count once per process) and the largest single process's peak (VmHWM; not ru_maxrss, which
Linux seeds at fork with the parent's RSS); the final test accuracy; and each run's seconds per round over dfca
IFCA's and DFedAvgM's. The load average before and after each run, the frameworks' versions and the git commit
go into the raw rows (runs.jsonl, appended, next to --out; the stderr of each run goes to logs/ there).

Threads: every run gets the same CPU budget, `--threads` (default 2, one per core of the benchmark machine):
torch.set_num_threads(threads) and OMP/MKL_NUM_THREADS=threads in dfca, pfl and p2pfl (single process each);
Flower cannot train in its driver process, so Ray gets num_cpus=threads and each client 1 CPU: `threads` actors,
each with one torch thread. Every process flushes denormals, as dfca's simulate does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from resumable_runs import commit
from rich.console import Console
from rich.table import Table

from dfca.config import ExperimentConfig
from dfca.data import build_federated_data

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "peers"
TORCH = "torch==2.13.0"  # installed first into every venv (here: a local CPU wheel)
PEER_PACKAGES = {
    "flwr": ["flwr[simulation]==1.42.0"],
    "pfl": ["pfl[pytorch]==0.6.0"],
    # p2pfl imports opendp unconditionally ([dp]); its pins numpy<2 and datasets==2.15.0 need an older pyarrow and
    # huggingface_hub than pip picks. Its PyTorch learner needs lightning and torchmetrics, which come without the
    # [torch] extra: that pins torchvision<0.18 (torch 2.2), and no torchvision wheel here loads with the CPU torch
    # wheel (run_p2pfl.py stubs the import p2pfl makes but does not use).
    "p2pfl": ["p2pfl[dp]==0.4.4", "lightning>=2.4,<3", "torchmetrics>=1.3.1,<2", "pyarrow<21", "huggingface_hub<1"],
}
SAMPLE_SECONDS = 0.2


@dataclass(frozen=True)
class Run:
    name: str
    label: str
    script: str
    args: tuple[str, ...] = ()
    venv: str | None = None  # None: this project's python


RUNS = {
    "ifca": Run("ifca", "dfca simulator, IFCA k=1", "run_dfca.py", ("--algorithm", "ifca")),
    "dfedavgm": Run("dfedavgm", "dfca simulator, DFedAvgM complete graph", "run_dfca.py",
                    ("--algorithm", "dfedavgm")),
    "flwr": Run("flwr", "Flower simulation (Ray), FedAvg", "run_flwr.py", venv="flwr"),
    "pfl": Run("pfl", "pfl-research SimulatedBackend, FedAvg", "run_pfl.py", venv="pfl"),
    "p2pfl": Run("p2pfl", "p2pfl in-memory nodes, FedAvg, all connected", "run_p2pfl.py", venv="p2pfl"),
    "torch": Run("torch", "reference: plain torch loop over clients, FedAvg (no framework)", "run_torch.py"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="create the peers' venvs under --venvs and exit")
    p.add_argument("--venvs", type=Path, default=HERE / ".peers", help="folder with one venv per peer")
    p.add_argument("--only", default=",".join(RUNS), help=f"comma-separated runs of {', '.join(RUNS)}")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--train-per-client", type=int, default=80)
    p.add_argument("--test-per-client", type=int, default=10)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads every run may use (see the docstring)")
    p.add_argument("--p2pfl-clients", type=int, default=None,
                   help="run p2pfl with the first this many clients only (it starts a node per client)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a run is stopped")
    p.add_argument("--out", type=Path, default=Path("runs/peers/peers.md"))
    args = p.parse_args()
    unknown = set(selected(args.only)) - set(RUNS)
    if unknown:
        p.error(f"--only: unknown runs {sorted(unknown)}; choose from {', '.join(RUNS)}")
    return args


def selected(only: str) -> list[str]:
    return [name.strip() for name in only.split(",") if name.strip()]


def venv_python(venvs: Path, peer: str) -> Path:
    return venvs / peer / "bin" / "python"


def setup(venvs: Path, peers: list[str]) -> None:
    """One venv per peer: torch first (so the peer's requirements keep it), then the peer's packages."""
    for peer in peers:
        target = venvs / peer
        print(f"== {peer}: {target}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        pip = [str(venv_python(venvs, peer)), "-m", "pip", "install"]
        subprocess.run([*pip, TORCH], check=True)
        subprocess.run([*pip, TORCH, *PEER_PACKAGES[peer]], check=True)


def config(args: argparse.Namespace) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "name": "peers", "algorithm": "ifca", "clusters": 1, "rounds": args.rounds, "seed": args.seed,
        "eval_every": args.rounds,
        "data": {"dataset": "mnist-bundled", "rotations": [0], "clients": args.clients,
                 "train_per_client": args.train_per_client, "test_per_client": args.test_per_client},
        "model": {"kind": "mlp", "hidden": args.hidden},
        "train": {"lr": args.lr, "local_epochs": args.epochs, "batch_size": args.batch},
        "topology": {"kind": "complete"},
    })


class Captured(logging.Handler):
    """The warnings dfca's data loader logs (e.g. shards that overlap because the pool is too small)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def save_workload(cfg: ExperimentConfig, args: argparse.Namespace, folder: Path,
                  clients: int | None = None) -> Path:
    """The federated data of `cfg` (the first `clients` clients) as one .npz, with the training settings."""
    data = build_federated_data(cfg)
    n = clients or data.num_clients
    meta = {"rounds": cfg.rounds, "local_epochs": cfg.train.local_epochs, "batch_size": cfg.train.batch_size,
            "lr": cfg.train.lr, "seed": cfg.seed, "threads": args.threads, "hidden": cfg.model.hidden}
    path = folder / f"workload-{n}.npz"
    np.savez(path, x_train=data.x_train[:n].reshape(n, data.x_train.shape[1], -1).numpy(),
             y_train=data.y_train[:n].numpy(), x_test=data.x_test[:n].reshape(n, data.x_test.shape[1], -1).numpy(),
             y_test=data.y_test[:n].numpy(), meta=np.array(json.dumps(meta)))
    return path


def descendants(root: int) -> set[int]:
    """`root` and every process below it (Linux /proc)."""
    parent: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = read_proc(Path(entry.path, "stat"))
            if stat:
                parent[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    tree, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree}
        tree |= frontier
    return tree


def read_proc(path: Path) -> str:
    """A /proc file's text, or "" when its process ended meanwhile."""
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def tree_memory(root: int) -> tuple[float, float]:
    """(RSS of the tree summed, the largest VmHWM in it), MiB."""
    rss, hwm = 0, 0
    for pid in descendants(root):
        for line in read_proc(Path(f"/proc/{pid}/status")).splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = max(hwm, int(line.split()[1]))
    return rss / 1024, hwm / 1024


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def execute(cmd: list[str], env: dict[str, str], log: Path, timeout: float, cwd: Path) -> dict[str, Any]:
    """Run `cmd` in its own session, in `cwd` (frameworks write logs/, lightning_logs/ ... there): its exit code,
    stdout, wall seconds and memory, sampled while it runs."""
    stdout: list[str] = []
    t0 = time.perf_counter()
    peak, hwm, killed = 0.0, 0.0, False
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, text=True, cwd=cwd,
                                start_new_session=True)
        reader = threading.Thread(target=lambda: stdout.extend(proc.stdout or []))
        reader.start()
        while proc.poll() is None:
            rss, most = tree_memory(proc.pid)
            peak, hwm = max(peak, rss), max(hwm, most)
            if not killed and time.perf_counter() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
            time.sleep(SAMPLE_SECONDS)
        reader.join()
    return {"rc": proc.returncode, "stdout": stdout, "wall_seconds": time.perf_counter() - t0, "killed": killed,
            "peak_rss_tree_mib": peak, "max_proc_rss_mib": hwm}


def result_of(stdout: list[str]) -> dict[str, Any] | None:
    for line in reversed(stdout):
        if line.startswith("{"):
            return json.loads(line)
    return None


def run_one(run: Run, data: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    python = Path(sys.executable) if run.venv is None else venv_python(args.venvs, run.venv)
    row: dict[str, Any] = {"run": run.name, "label": run.label, "ok": False, "threads": args.threads,
                           "commit": commit(), "time": datetime.datetime.now().isoformat(timespec="seconds")}
    if not python.exists():
        return {**row, "error": f"no venv python at {python}: run benchmarks/peers.py --setup --venvs "
                                f"{args.venvs}"}
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    log = logs / f"{run.name}.log"
    row["loadavg_before"] = os.getloadavg()
    print(f"[{run.name}] {run.label}: running (log: {log})", flush=True)
    workdir = data.parent / run.name
    workdir.mkdir(exist_ok=True)
    proc = execute([str(python), str(SCRIPTS / run.script), "--data", str(data), *run.args], env, log.resolve(),
                   args.timeout, workdir)
    row["loadavg_after"] = os.getloadavg()
    row.update({k: proc[k] for k in ("rc", "wall_seconds", "peak_rss_tree_mib", "max_proc_rss_mib")})
    result = result_of(proc["stdout"])
    if proc["rc"] != 0 or result is None:
        why = (f"stopped after {args.timeout:.0f} s (--timeout)" if proc["killed"]
               else f"killed by signal {-proc['rc']}" if proc["rc"] < 0 else last_line(log))
        return {**row, "error": f"exit {proc['rc']}: {why}"}
    row["max_proc_rss_mib"] = max(row["max_proc_rss_mib"], result["peak_rss_self_mib"])  # its last moments too
    return {**row, **figures(result), "ok": True}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    seconds = [float(s) for s in result["round_seconds"]]
    steady = seconds[1:] or seconds
    if len(seconds) == 1:
        result["notes"].append("one round: s/round is round 1's, warm-up included")
    return {**result, "train_seconds": sum(seconds), "seconds_per_round": statistics.mean(steady),
            "updates_per_second": result["clients"] * len(seconds) / sum(seconds)}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {r["run"]: r["seconds_per_round"] for r in rows if r["ok"] and r["run"] in RATIO_TO}
    for row in rows:
        for name in RATIO_TO:
            if row["ok"] and name in base:
                row[f"ratio_{name}"] = row["seconds_per_round"] / base[name]


RATIO_TO = ("ifca", "dfedavgm", "torch")  # each run's s/round over these runs' (when they ran)
COLUMNS = ["run", "clients x rounds", "updates/s", "s/round (2..R)", "wall s", "RSS tree MiB", "max proc MiB",
           "test acc", "x IFCA", "x DFedAvgM", "x torch loop", "status"]


def cells(row: dict[str, Any]) -> list[str]:
    def num(key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    shape = f"{row['clients']} x {row['rounds']}" if row["ok"] else "-"
    return [row["run"], shape, num("updates_per_second", ".1f"), num("seconds_per_round", ".3f"),
            num("wall_seconds", ".1f"), num("peak_rss_tree_mib", ".0f"), num("max_proc_rss_mib", ".0f"),
            num("test_accuracy", ".4f"), num("ratio_ifca", ".2f"), num("ratio_dfedavgm", ".2f"),
            num("ratio_torch", ".2f"),
            "ok" if row["ok"] else f"FAILED: {row['error']}"]


def notes(rows: list[dict[str, Any]], data_notes: list[str]) -> list[str]:
    """One line per run (what it is, its notes), then the data loader's warnings."""
    lines = [f"{r['run']}: {'; '.join([r['label'], *r.get('notes', [])])}" for r in rows]
    return lines + [f"data: {n}" for n in data_notes]


def print_table(rows: list[dict[str, Any]], data_notes: list[str]) -> None:
    table = Table(title="Peers: one FedAvg workload, seconds per round and memory")
    for c in COLUMNS:
        table.add_column(c, overflow="fold")
    for row in rows:
        table.add_row(*cells(row))
    console = Console(width=max(160, shutil.get_terminal_size().columns))
    console.print(table)
    for line in notes(rows, data_notes):
        console.print(f"- {line}", highlight=False, markup=False)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, data_notes: list[str]) -> str:
    vers = sorted({f"{k} {v}" for r in rows for k, v in r.get("versions", {}).items()})
    lines = [
        "# Peers: one federated workload in dfca and three FL frameworks", "",
        f"`python benchmarks/peers.py {' '.join(sys.argv[1:])}` at commit {commit()}, "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}, {platform.node()} ({os.cpu_count()} CPUs), "
        f"--threads {args.threads}.", "",
        f"Workload: MLP 784-{args.hidden}-10 (ReLU), bundled MNIST (rotation 0), {args.clients} clients x "
        f"{args.train_per_client} training samples, {args.epochs} local epochs, batch {args.batch}, SGD lr "
        f"{args.lr} (no momentum), all clients every round, {args.rounds} rounds; test accuracy on "
        f"{args.clients} x {args.test_per_client} test samples.", "",
        "s/round: mean over rounds 2..R (round 1 left out); updates/s: clients x rounds over the rounds' "
        "seconds; wall: the whole process; RSS tree: the process and its descendants summed (sampled every "
        f"{SAMPLE_SECONDS} s); max proc: the largest single process's peak (VmHWM); x IFCA / x DFedAvgM / "
        "x torch loop: s/round over that run's (the torch loop: the per-client autograd loop with no framework, "
        "this run's floor for a framework that trains one client at a time).", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(c.replace("|", "/") for c in cells(r)) + " |" for r in rows), "",
        *(f"- {line}" for line in notes(rows, data_notes)), "",
        f"Versions: {', '.join(vers)}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    names = selected(args.only)
    if args.setup:
        setup(args.venvs, [n for n in names if RUNS[n].venv is not None])
        return
    out_dir = args.out.parent
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    captured = Captured()
    logging.getLogger("dfca").addHandler(captured)
    cfg = config(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dfca-peers-") as tmp:
        full = save_workload(cfg, args, Path(tmp))
        for name in names:
            data = full
            if name == "p2pfl" and args.p2pfl_clients and args.p2pfl_clients < args.clients:
                data = save_workload(cfg, args, Path(tmp), args.p2pfl_clients)
            rows.append(run_one(RUNS[name], data, args, logs))
            if name == "p2pfl" and data != full and rows[-1]["ok"]:
                rows[-1]["notes"].append(f"only {args.p2pfl_clients} of {args.clients} clients (--p2pfl-clients)")
    add_ratios(rows)
    print_table(rows, captured.messages)
    args.out.write_text(markdown(rows, args, captured.messages))
    with (out_dir / "runs.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps({**row, "data_notes": captured.messages}) + "\n")
    print(f"wrote {args.out} and {out_dir / 'runs.jsonl'}")


if __name__ == "__main__":
    main()
