"""`dfca submit|status|stop|logs|results`: drive the distributed runtime's REST API from the command line.

Each reads the topology and metrics URLs and the API token from --topology, --metrics and --token, else from
DFCA_TOPOLOGY_URL, DFCA_METRICS_URL and DFCA_API_TOKEN, else the addresses `dfca up` uses.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dfca.cli.runtime_client import TERMINAL, ApiError, Endpoints, RuntimeClient, WaitTimedOut
from dfca.config import ConfigError, load_config
from dfca.results.run_folder import OutFolderRefused, prepare_out, written_files

console = Console(stderr=True)
TOPOLOGY = typer.Option(None, "--topology", help="topology service URL [env DFCA_TOPOLOGY_URL; default :8080]")
METRICS = typer.Option(None, "--metrics", help="metrics service URL [env DFCA_METRICS_URL; default :8081]")
TOKEN = typer.Option(None, "--token", help="API token [env DFCA_API_TOKEN]")


def client_for(topology: str | None, metrics: str | None, token: str | None) -> RuntimeClient:
    return RuntimeClient(Endpoints.resolve(topology, metrics, token))


def failing(action: Callable[[], int | None]) -> None:
    """Run a command's body; an API or config error is one red line and exit code 1 (2 for a bad config)."""
    try:
        code = action()
    except ConfigError as err:
        console.print(f"[bold red]invalid config:[/] {err}")
        raise typer.Exit(2) from err
    except (ApiError, OutFolderRefused) as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(1) from err
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Add the runtime commands to the `dfca` app."""

    @app.command()
    def submit(
        config: Path = typer.Argument(..., help="experiment YAML (the same schema as `dfca run`)"),
        sets: list[str] = typer.Option(None, "--set", help="override one field, e.g. --set train.lr=0.05"),
        wait: bool = typer.Option(False, "--wait", help="follow the run with a progress bar until it ends"),
        start: bool = typer.Option(True, "--start/--no-start", help="start it after creating it"),
        timeout: float = typer.Option(None, "--timeout", min=0.0,
                                      help="with --wait: give up waiting after this many seconds (exit 124; the "
                                           "experiment keeps running) [default: as long as the run goes]"),
        topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN,
    ) -> None:
        """Validate a config, create it on the runtime and start it; print its id.

        With --wait, follow it to the end and exit 0 when it completed, 1 when it failed or was stopped."""

        def body() -> int | None:
            cfg = load_config(config, sets or [])
            client = client_for(topology, metrics, token)
            experiment = client.create(cfg.model_dump(mode="json"))
            if not start:
                print(experiment)
                return None
            started = client.start(experiment)
            console.print(f"[bold]{experiment}[/]: {cfg.algorithm}, {cfg.data.clients} clients on "
                          f"{started.get('workers')} workers; follow it with `dfca logs {experiment}`")
            print(experiment)
            return watch(client, experiment, timeout) if wait else None

        failing(body)

    @app.command()
    def status(
        experiment: str = typer.Argument(None, help="an experiment id; without it, every experiment"),
        topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN,
    ) -> None:
        """Every experiment's status, round, accuracy and ARI; or one experiment's record and summary."""

        def body() -> None:
            client = client_for(topology, metrics, token)
            if experiment is not None:
                record = client.experiment(experiment)
                record.pop("config", None)
                print(json.dumps({"experiment": record, "summary": client.summary(experiment)}, indent=2))
                return
            print(deployment_line(client.deployment()))
            table = Table(title="experiments")
            for column in ("id", "name", "algorithm", "status", "round", "accuracy", "ARI"):
                table.add_column(column, justify="right" if column in ("round", "accuracy", "ARI") else "left",
                                 overflow="fold", no_wrap=column == "id")
            for record in client.experiments():
                summary = client.summary(record["id"]) or {}
                table.add_row(record["id"], record.get("name", ""), record.get("algorithm", ""), record["status"],
                              f"{record.get('round', 0)}/{record.get('rounds', '?')}",
                              number(summary.get("test_accuracy")), number(summary.get("cluster_ari")))
            Console().print(table)

        failing(body)

    @app.command()
    def stop(experiment: str = typer.Argument(..., help="experiment id"),
             wait: float = typer.Option(30.0, "--wait", min=0.0,
                                        help="seconds to wait for the workers to stop it (0: only ask)"),
             topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN) -> None:
        """Stop an experiment; wait until it has stopped (exit 1 if it has not within --wait seconds)."""

        def body() -> int | None:
            client = client_for(topology, metrics, token)
            state = client.stop(experiment)["status"]
            deadline = time.monotonic() + wait
            while state not in TERMINAL and time.monotonic() < deadline:
                time.sleep(0.5)
                state = client.experiment(experiment)["status"]
            console.print(f"{experiment}: {state}")
            if state not in TERMINAL and wait > 0:
                console.print(f"[yellow]{experiment} has not stopped after {wait:g} s;[/] `dfca status "
                              f"{experiment}` shows when it does")
                return 1
            return None

        failing(body)

    @app.command()
    def logs(experiment: str = typer.Argument(..., help="experiment id"),
             follow: bool = typer.Option(True, "--follow/--no-follow", help="keep following until the run ends"),
             topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN) -> None:
        """Print an experiment's events (rounds, status changes, the summary), following them until the run ends."""

        def body() -> int | None:
            client = client_for(topology, metrics, token)
            if not follow:
                history = client.history(experiment)
                for record in history["history"]:
                    print(round_line(record))
                for event in history["worker_events"]:
                    print(f"worker {event['worker']}: {event['state']} at round {event['round']}")
                print(f"status: {history['status']}")
                return None
            try:
                for event, data in client.follow(experiment):
                    print(event_line(event, data))
            except KeyboardInterrupt:
                console.print(f"stopped following; {experiment} keeps running")
                return 130
            return None

        failing(body)

    @app.command()
    def results(experiment: str = typer.Argument(..., help="experiment id"),
                out: Path = typer.Option(..., "--out", "-o", help="folder to write, new or empty"),
                force: bool = typer.Option(False, "--force", help="clear a non-empty --out first"),
                topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN) -> None:
        """Download an experiment's summary, metrics, config, final models and plots, as `dfca run` writes them."""

        def body() -> None:
            client = client_for(topology, metrics, token)
            record = client.experiment(experiment)
            write_results(client, experiment, record, prepare_out(out, force))

        failing(body)


def write_results(client: RuntimeClient, experiment: str, record: dict[str, Any], out: Path) -> None:
    from dfca.algorithms import schedule_of
    from dfca.config import ExperimentConfig
    from dfca.results.outputs import plot_history

    summary = client.summary(experiment)
    if summary is None:
        raise ApiError(f"the metrics service has no record of {experiment} yet")
    history = client.history(experiment)["history"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(record["config"], indent=2) + "\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    models = client.files(experiment, "models")
    if models:
        (out / "models").mkdir()
        for name, content in models.items():
            (out / "models" / name).write_bytes(content)
    plots = client.files(experiment, "plots")
    if plots is not None:
        for name, content in plots.items():
            (out / name).write_bytes(content)
    elif evaluated := [h for h in history if "test_accuracy" in h or "gcd" in h]:  # an older metrics service
        cfg = ExperimentConfig.model_validate(record["config"])
        plot_history(out, evaluated, cfg.name, schedule_of(cfg).seeding_rounds)
    if not models:
        console.print(f"[yellow]note:[/] {experiment} has no final models ({record['status']}): workers send them "
                      "when their clients finish the last round")
    console.print(f"wrote {out}/: " + ", ".join(written_files(out)), soft_wrap=True)


def watch(client: RuntimeClient, experiment: str, timeout: float | None = None) -> int:
    """A progress bar over the experiment's rounds until it ends, then its summary table: 0 when it completed,
    1 when it failed or was stopped, 124 when `timeout` seconds passed first, 130 on Ctrl-C (it keeps running)."""
    total = int(client.experiment(experiment).get("rounds") or 0) or None
    deadline = None if timeout is None else time.monotonic() + timeout
    final = "running"
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task(experiment, total=total, status="")
            for event, data in client.follow(experiment, deadline=deadline):
                if event == "progress":
                    progress.update(task, completed=data["round"], status=data.get("status", ""))
                elif event == "status":
                    final = data["status"]
                    progress.update(task, status=final)
                elif event == "summary":
                    final = data.get("status", final)
                    if final == "completed":
                        progress.update(task, completed=total)
    except KeyboardInterrupt:
        console.print(f"stopped watching; {experiment} keeps running (`dfca stop {experiment}` stops it)")
        return 130
    except WaitTimedOut:
        console.print(f"[yellow]gave up waiting after {timeout:g} s;[/] {experiment} keeps running "
                      f"(`dfca logs {experiment}` follows it, `dfca stop {experiment}` stops it)")
        return 124
    summary = client.summary(experiment) or {}
    if final not in TERMINAL:
        final = client.experiment(experiment)["status"]
    Console().print(summary_table(experiment, final, summary))
    return 0 if final == "completed" else 1


def deployment_line(view: dict[str, Any]) -> str:
    """The processes the topology service knows: what an experiment can start on now."""
    present = view.get("workers_present", [])
    expected = view.get("workers")
    workers = (f"{len(present)} of {expected} workers known" if expected is not None else
               f"{len(present)} workers known")
    listed = f" ({', '.join(str(w) for w in present)})" if present else ""
    aggregator = ("an aggregator known" if view.get("aggregator") else
                  "no aggregator (algorithms with a central role are refused)")
    return f"deployment {view.get('deployment', '?')}: {workers}{listed}, {aggregator}"


def summary_table(experiment: str, status: str, summary: dict[str, Any]) -> Table:
    table = Table(title=f"{experiment}: {status}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("test_accuracy", "cluster_ari", "cluster_acc", "populated_clusters", "rounds_completed",
                "seconds_per_round", "bytes_sent_per_client_per_round", "wall_seconds", "failed_clients"):
        if key in summary:
            table.add_row(key, number(summary[key]))
    return table


def number(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def round_line(record: dict[str, Any]) -> str:
    line = f"round {record['round']}: workers {record.get('workers_reported', '?')}"
    if "test_accuracy" in record:
        line += f", accuracy {record['test_accuracy']:.4f}, ARI {record.get('ari', float('nan')):.3f}"
    return line + f", {record.get('seconds', 0.0):.2f} s"


def event_line(event: str, data: dict[str, Any]) -> str:
    if event == "progress":
        return f"round {data['round']}: worker {data['worker']} ({data['seconds']:.2f} s" + \
            ("" if data.get("complete", True) else ", some neighbours timed out") + ")"
    if event == "status":
        failed = data.get("failed_clients") or []
        return f"status: {data['status']}" + (f" (failed clients {failed})" if failed else "")
    if event == "summary":
        return (f"summary: accuracy {number(data.get('test_accuracy'))}, ARI {number(data.get('cluster_ari'))}, "
                f"rounds {data.get('rounds_completed')}")
    return f"{event}: {json.dumps(data)}"
