"""`dfca data export CONFIG OUT_DIR` and `dfca data inspect DIR`: a federation as files, and a folder at a glance.

Imports are lazy, as in dfca.cli.main: `dfca --help` imports neither torch nor the data loaders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from dfca.config import ExperimentConfig
    from dfca.data import FederatedData, FolderReport

data_app = typer.Typer(add_completion=False, help="Federations as files: export a built-in one, inspect a folder.",
                       no_args_is_help=True)
console = Console(stderr=True)
EXPERIMENT_FILE = "experiment.yaml"  # what `dfca data export` writes next to the clients: the config that runs them
SHOWN_CLIENTS = 40  # inspect's table shows this many clients, then a count of the rest (--json has them all)


def folder_data(cfg: ExperimentConfig) -> FederatedData | None:
    """A `data.source: folder` config's federation, read and checked (None for other sources); every problem is
    printed, naming file and client, and exits 2 before anything runs."""
    if cfg.data.source != "folder":
        return None
    from dfca.data import FolderDataError, build_federated_data

    try:
        return build_federated_data(cfg)
    except (FolderDataError, ValueError) as err:
        console.print(f"[bold red]invalid data:[/] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from err


@data_app.command("export")
def export(
    config: Path = typer.Argument(..., help="experiment YAML of a built-in federation (data.source builtin)"),
    out_dir: Path = typer.Argument(..., help="new or empty folder to write the clients into"),
    sets: list[str] = typer.Option(None, "--set", help="override one config field, e.g. --set data.clients=20"),
) -> None:
    """Write the config's federation as a folder federation: OUT_DIR/client-000/train.npz and test.npz per client,
    clusters.json, and experiment.yaml (the same experiment reading the folder)."""
    import yaml
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from dfca.cli.main import _load
    from dfca.config import ConfigError, parse_config, with_folder_clients
    from dfca.data import build_federated_data
    from dfca.data.folder_export import check_out_folder, write_folder_federation

    cfg = _load(config, sets)
    if cfg.data.source != "builtin":
        console.print(f"[bold red]invalid config:[/] data.source: export writes a built-in federation; this one is "
                      f"{cfg.data.source} already")
        raise typer.Exit(2)
    try:
        check_out_folder(out_dir)
    except FileExistsError as err:
        console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from err
    data = build_federated_data(cfg)
    with Progress(TextColumn("writing clients"), BarColumn(), MofNCompleteColumn(), console=console) as progress:
        bar = progress.add_task("clients", total=data.num_clients)
        names = write_folder_federation(data, out_dir, lambda done: progress.update(bar, completed=done))
    clusters = ", clusters.json" if data.has_true_clusters else ""
    wrote = f"wrote {len(names)} clients ({names[0]} .. {names[-1]}){clusters}"
    experiment = experiment_yaml(cfg, out_dir, data.num_classes)
    try:
        parse_config(with_folder_clients(yaml.safe_load(experiment)))
    except ConfigError as err:  # an algorithm that needs its built-in split (FedCRef's categories)
        console.print(f"{wrote} to {out_dir}/; no {EXPERIMENT_FILE}: {cfg.algorithm} does not run from a folder "
                      f"({err})", highlight=False, soft_wrap=True)
        return
    (out_dir / EXPERIMENT_FILE).write_text(experiment)
    console.print(f"{wrote} and {EXPERIMENT_FILE} to {out_dir}/; run them with: dfca run {out_dir / EXPERIMENT_FILE}",
                  highlight=False, soft_wrap=True)


def experiment_yaml(cfg: ExperimentConfig, out_dir: Path, classes: int) -> str:
    """The config, its data section replaced by the folder (classes pinned: a client set may miss the top class)."""
    import yaml

    document: dict[str, Any] = cfg.model_dump(mode="json")
    document["data"] = {"source": "folder", "path": str(out_dir.resolve()), "classes": classes,
                        "clients": cfg.data.clients}
    return yaml.safe_dump(document, sort_keys=False)


@data_app.command("inspect")
def inspect(
    path: Path = typer.Argument(..., help="a folder federation (DIR/<client-id>/...) or its .csv/.parquet table"),
    classes: int = typer.Option(None, "--classes", min=2, help="the number of classes C (default: largest label + 1)"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Show a folder federation: clients, samples per client, labels, input shape, and every problem found (exit 1
    when there is one)."""
    from dfca.data import inspect_folder

    report = inspect_folder(path, classes=classes)
    if as_json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print_report(report)
    if not report.ok:
        raise typer.Exit(1)


def print_report(report: FolderReport) -> None:
    from rich.table import Table

    out = Console()
    if report.client_ids:
        s = report.samples()
        shape = "x".join(map(str, report.input_shape)) if report.input_shape else "?"
        out.print(f"[bold]{report.path}[/] ({report.layout}): {report.client_count} clients, samples per client "
                  f"min {s['min']}, median {s['median']:g}, max {s['max']}; input {shape}, {report.num_classes} "
                  f"classes; true clusters: {'clusters.json' if report.true_clusters else 'unknown (no ARI)'}",
                  highlight=False)
        table = Table(show_edge=False)
        for column in ("client", "train", "test", "cluster", "label counts"):
            table.add_column(column, justify="left" if column in ("client", "label counts") else "right")
        for c in report.clients[:SHOWN_CLIENTS]:
            cluster = "" if report.true_clusters is None else str(report.true_clusters.get(c.name, ""))
            table.add_row(c.name, str(c.train), f"{c.test}{' (held out)' if c.test_held_out else ''}", cluster,
                          " ".join(map(str, c.label_counts)))
        out.print(table)
        if len(report.clients) > SHOWN_CLIENTS:
            out.print(f"... and {len(report.clients) - SHOWN_CLIENTS} more clients (--json lists them all)")
    if report.ok:
        out.print("[green]no problems found[/]")
        return
    out.print(f"[bold red]{len(report.problems)} problem(s):[/]")
    for problem in report.problems:
        out.print(f"  {problem}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
