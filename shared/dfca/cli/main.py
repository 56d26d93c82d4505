"""The `dfca` command: `dfca run` (embedded simulator), `dfca up|down` and the service entry points.

Imports are lazy: `dfca --help`, `--version` and the commands that only talk to a running stack (status, logs,
stop, results, down) never import torch or the algorithms; each command imports what it runs inside itself.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID
    from rich.table import Table

    from dfca.config import ExperimentConfig
    from dfca.data import FederatedData
    from dfca.schedule import RoundSchedule

app = typer.Typer(add_completion=False, help="Decentralized clustered federated learning (DFCA and baselines).")
console = Console(stderr=True)
DEFAULT_CONFIG = Path(__file__).parents[1] / "configs" / "demo.yaml"
SET_HELP = "override one config field by its dotted path, e.g. --set train.lr=0.05 (repeatable; YAML values)"


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("dfca")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ours = "unknown (not installed)"
    try:  # the installed distribution's version: importing torch takes seconds
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"dfca {ours} (torch {torch}, python {'.'.join(map(str, __import__('sys').version_info[:3]))})"


def _show_version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", "-V", callback=_show_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Decentralized clustered federated learning (DFCA and baselines)."""


def _load(config: Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    from dfca.config import ConfigError, load_config

    try:
        return load_config(config or DEFAULT_CONFIG, overrides or [])
    except ConfigError as err:
        console.print(f"[bold red]invalid config:[/] {err}")
        raise typer.Exit(2) from err


def _check_model(cfg: ExperimentConfig, data: FederatedData | None = None) -> None:
    """A `kind: torch` model must come out of its factory fitting the data (dfca.models.factory), before any data
    is read (`data`: a folder federation's, read already); this is the user's own process, so the factory may be
    any module or file."""
    from dfca.models.factory import ModelFactoryError, check_config_model

    try:
        check_config_model(cfg, read=None if data is None else (data.input_shape, data.num_classes))
    except ModelFactoryError as err:
        console.print(f"[bold red]invalid config:[/] {err}")
        raise typer.Exit(2) from err


def _check_device(cfg: ExperimentConfig) -> None:
    """`device` must exist on this machine for `dfca run` (workers check DFCA_DEVICE or `device` themselves)."""
    from dfca.devices import DeviceUnavailable, resolve_device

    try:
        resolve_device(cfg.device)
    except DeviceUnavailable as err:
        console.print(f"[bold red]invalid config:[/] {err}")
        raise typer.Exit(2) from err


def results_table(summary: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title=f"{summary['name']}: {summary['algorithm']} ({summary['clients']} clients)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = ("test_accuracy", "cluster_ari", "cluster_acc", "populated_clusters", "rounds", "seconds_per_round",
            "wall_seconds")
    if "gcd" in summary:  # a k-means run clusters points: its own metrics first
        keys = ("gcd", "cv", "point_ari", "objective", "centralised_loss", "test_accuracy", "rounds",
                "seconds_per_round", "wall_seconds")
    if "inferred_clusters" in summary:  # DPMM-CFL, FeSEM: K, and the paper's last-3-round means
        keys = ("inferred_clusters", "test_accuracy", "macro_f1", "test_accuracy_last3", "macro_f1_last3",
                "cluster_ari", "rounds", "seconds_per_round", "wall_seconds")
    if "communities_found" in summary:  # FedCRef clusters every client's samples: the paper's Sec. 5.3 metrics
        keys = ("initial_acc", "final_acc", "communities_found", "true_categories", "wrong_associations",
                "isolated_clusters", "iterations", "seconds_per_round", "wall_seconds")
    if summary.get("seeding_rounds") and "rounds" in keys:  # training rounds, then the seeding rounds before them
        at = keys.index("rounds") + 1
        keys = (*keys[:at], "seeding_rounds", *keys[at:])
    if summary.get("padding_overhead", 1.0) > 1.0:  # clients of unequal size: rows stored per real row
        keys = (*keys, "samples_per_client", "padding_overhead")
    for key in (k for k in keys if k in summary):  # ARI only where the true clusters are known
        value = summary[key]
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    return table


@app.command()
def run(
    config: Path = typer.Argument(None, help="experiment YAML; without it, the bundled demo runs"),
    out: Path = typer.Option(None, "--out", "-o", show_default=False,
                             help="output folder, new or empty [default: runs/latest, replaced on every run]"),
    force: bool = typer.Option(False, "--force", help="clear a non-empty --out first"),
    sets: list[str] = typer.Option(None, "--set", help=SET_HELP),
    rounds: int = typer.Option(None, help="short for --set rounds=N"),
    seed: int = typer.Option(None, help="short for --set seed=N"),
) -> None:
    """Run an experiment in one process (every client vectorized, simulated network) and write its results."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from dfca.algorithms import schedule_of
    from dfca.cli.data_commands import folder_data
    from dfca.results.outputs import MetricsLog, plot_history, save_models, write_summary
    from dfca.results.run_folder import OutFolderRefused, prepare_out, written_files
    from dfca.simulator import simulate

    overrides = list(sets or []) + [f"{k}={v}" for k, v in (("rounds", rounds), ("seed", seed)) if v is not None]
    cfg = _load(config, overrides)
    _check_device(cfg)
    data = folder_data(cfg)
    _check_model(cfg, data)
    try:
        out = prepare_out(out, force)
    except OutFolderRefused as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(2) from err
    log = MetricsLog(out / "metrics.jsonl")
    console.print(f"[bold]{cfg.name}[/]: {cfg.algorithm}, {cfg.data.clients} clients, k={cfg.clusters}, "
                  f"{cfg.rounds} rounds{seeding_note(cfg)}{stop_note(cfg)}, {cfg.topology.kind} graph -> {out}")
    schedule = schedule_of(cfg)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console) as progress:
        bars = phase_bars(progress, schedule)

        def on_round(record: dict[str, Any]) -> None:
            log.write(record)
            for warning in record.get("warnings", []):
                progress.console.print(f"[yellow]warning:[/] {warning}")
            phase = record.get("phase", "training")
            if phase == "training" and "seeding" in bars:  # the seeding phase is over, evaluated last or not
                progress.update(bars["seeding"], completed=schedule.seeding_rounds)
            progress.update(bars[phase], completed=record.get("phase_round", record["round"]),
                            status=round_status(record))

        try:
            result = simulate(cfg, data=data, on_round=on_round)
        except (ValueError, FileNotFoundError) as err:
            console.print(f"[bold red]error:[/] {err}")
            raise typer.Exit(1) from err
        finally:
            log.close()
        last = result.history[-1] if result.history else {}
        if last.get("phase") == "training":  # a run that stopped itself early ends a full bar
            ran = int(last.get("phase_round", 0))
            progress.update(bars["training"], total=ran, completed=ran)
    write_summary(out, result.summary, cfg)
    save_models(out, result.final_models, result.assigned.tolist())
    plot_history(out, result.history, cfg.name, schedule.seeding_rounds)
    Console().print(results_table(result.summary))
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    console.print(f"wrote {out}/: " + ", ".join(written_files(out)), soft_wrap=True)


@app.command("validate")
def validate(config: Path = typer.Argument(..., help="experiment YAML"),
             sets: list[str] = typer.Option(None, "--set", help=SET_HELP)) -> None:
    """Check a config file (with any --set overrides) against the schema, that its `device` is here, and that a
    `model.kind: torch` factory makes a module that fits the data; a folder federation's files are read and checked."""
    from dfca.cli.data_commands import folder_data
    from dfca.devices import resolve_device

    cfg = _load(config, sets)
    _check_device(cfg)
    data = folder_data(cfg)
    _check_model(cfg, data)
    read = f", {data.num_clients} clients read from {cfg.data.path}" if data is not None else ""
    console.print(f"[green]ok[/]: {cfg.name} ({cfg.algorithm}, device {resolve_device(cfg.device)}{read})",
                  highlight=False)


def _service(name: str) -> None:
    logging.basicConfig(level=logging.INFO)
    try:
        module = importlib.import_module(f"services.{name}.main")
    except ModuleNotFoundError as err:
        console.print(f"[bold red]service {name!r} is not installed:[/] {err}")
        raise typer.Exit(1) from err
    module.main()


@app.command()
def worker(
    data: Path = typer.Option(None, "--data", help="this worker's own data folder (default DFCA_DATA_DIR): it hosts "
                              "exactly its clients in experiments with data.source: workers"),
) -> None:
    """Run a client worker (hosts 1..M clients; reads DFCA_* env vars)."""
    import os

    if data is not None:
        os.environ["DFCA_DATA_DIR"] = str(data.resolve())
    _service("worker")


@app.command()
def topology() -> None:
    """Run the topology control plane (REST on DFCA_HOST:DFCA_PORT, default 127.0.0.1:8080)."""
    _service("topology")


@app.command()
def metrics() -> None:
    """Run the metrics collector (REST on DFCA_HOST:DFCA_PORT, default 127.0.0.1:8081)."""
    _service("metrics")


@app.command()
def aggregator() -> None:
    """Run the optional central aggregator (central roles: IFCA's server)."""
    _service("aggregator")


@app.command()
def up(
    workers: int = typer.Option(None, "--workers", "-n", min=1, show_default=False,
                                help="worker processes (default: one per --data folder, else one per core, at "
                                "most 3)"),
    broker: str = typer.Option(None, "--broker", help="AMQP URL; default DFCA_BROKER_URL or the local RabbitMQ"),
    host: str = typer.Option("127.0.0.1", help="address every service binds to"),
    topology_port: int = typer.Option(8080, help="topology REST API port"),
    metrics_port: int = typer.Option(8081, help="metrics REST API port"),
    aggregator: bool = typer.Option(False, "--aggregator/--no-aggregator", help="also run the aggregator (8083)"),
    worker_port_base: int = typer.Option(8090, help="worker i serves /livez and /readyz on this port + i"),
    state_dir: Path = typer.Option(Path(".dfca"), help="checkpoints, metrics database, logs, the API token and "
                                   "the state file (stack.json) go here"),
    log_to_files: bool = typer.Option(True, "--log-files/--log-to-terminal",
                                      help="services log to STATE_DIR/logs/<service>.log; --log-to-terminal: "
                                           "their JSON log lines go to this terminal instead"),
    broker_users: Path = typer.Option(None, "--broker-users", help="the principals' broker users, made beforehand: "
                                      "the URLs `python -m dfca.identity.broker_users create` wrote (default "
                                      "DFCA_BROKER_USERS; none: `dfca up` creates them, STATE_DIR/broker-users.json)"),
    rabbitmqctl: str = typer.Option(None, "--rabbitmqctl", help="how to reach the broker's node to create the "
                                    "users [default: rabbitmqctl as root, else 'sudo -n rabbitmqctl']"),
    insecure_shared_broker_user: bool = typer.Option(
        False, "--insecure-shared-broker-user", help="every process connects as --broker's user, with no broker "
        "users of their own: any worker's credentials can then forge control commands and other workers' models "
        "(local development only; every service warns)"),
    data: list[Path] = typer.Option([], "--data", help="worker i's own data folder, once per worker in order "
                                    "(DFCA_DATA_DIR): for experiments with data.source: workers"),
) -> None:
    """Run the whole stack locally (topology, metrics, N workers) as OS processes; Ctrl-C or `dfca down` stops it.

    Each process connects as its own broker user, created at start; without DFCA_API_TOKEN and DFCA_READ_TOKEN it
    makes both tokens, and every read of either API needs one. Prints where the APIs, the dashboard, the logs and the
    tokens are once every process is ready, and writes STATE_DIR/stack.json (and ~/.dfca/stack.json), which
    `dfca submit|status|stop|logs|results|down` read."""
    import os

    from dfca.cli.launcher import StackOptions, default_workers, machine_cores, run_stack
    from dfca.identity.broker_users import read_urls
    from dfca.settings import DEFAULT_BROKER_URL

    workers = workers or len(data) or default_workers()
    options = StackOptions(
        workers=workers, broker_url=broker or os.environ.get("DFCA_BROKER_URL") or DEFAULT_BROKER_URL, host=host,
        topology_port=topology_port, metrics_port=metrics_port, aggregator_port=8083 if aggregator else None,
        worker_port_base=worker_port_base,
        api_token=os.environ.get("DFCA_API_TOKEN", ""), read_token=os.environ.get("DFCA_READ_TOKEN", ""),
        state_dir=state_dir,
        metrics_db_url=os.environ.get("DFCA_METRICS_DB_URL"), data_root=os.environ.get("DFCA_DATA_ROOT"),
        log_level=os.environ.get("DFCA_LOG_LEVEL", "INFO"), log_to_files=log_to_files,
        model_factories=os.environ.get("DFCA_MODEL_FACTORIES", ""),
        shared_broker_user=insecure_shared_broker_user,
        rabbitmqctl=rabbitmqctl or ("rabbitmqctl" if os.geteuid() == 0 else "sudo -n rabbitmqctl"),
        data_dirs=[str(d.resolve()) for d in data],
    )
    if data and len(data) != workers:
        typer.echo(f"dfca up: --data names {len(data)} folders for {workers} workers: give each worker one", err=True)
        raise typer.Exit(2)
    users_file = broker_users or (Path(os.environ["DFCA_BROKER_USERS"]) if os.environ.get("DFCA_BROKER_USERS")
                                  else None)
    if users_file is not None and insecure_shared_broker_user:
        typer.echo("dfca up: --broker-users and --insecure-shared-broker-user contradict each other", err=True)
        raise typer.Exit(2)
    if users_file is not None:
        try:
            options.broker_users = read_urls(users_file)
            for ordinal in range(workers):
                options.broker_url_of(f"worker-{ordinal}")
        except ValueError as err:
            typer.echo(f"dfca up: {err}", err=True)
            raise typer.Exit(2) from None
    if workers > (cores := machine_cores()):
        typer.echo(f"dfca up: {workers} workers on {cores} cores take turns on them: a round takes longer than on "
                   f"--workers {cores} (docs/performance.md, \"One worker per core\")", err=True)
    raise typer.Exit(run_stack(options))


@app.command()
def down(
    state_dir: Path = typer.Option(None, "--state-dir", help="the STATE_DIR `dfca up` ran with [default: .dfca, "
                                   "then ~/.dfca]"),
    timeout: float = typer.Option(60.0, "--timeout", min=1.0, help="seconds to wait before killing what is left"),
) -> None:
    """Stop the stack `dfca up` runs (found by its state file): every process exits, the state file goes."""
    from dfca.cli import stack_state

    if state_dir is not None:
        found = stack_state.read(state_dir / stack_state.FILE_NAME)
        state, stale = (found, []) if found is not None and found.running else (None, [found] if found else [])
    else:
        state, stale = stack_state.find()
    for old in stale:  # the stack is gone: its file only misleads
        old.path.unlink(missing_ok=True)
        typer.echo(f"dfca down: removed {old.path}, left by a stack that is gone (pid {old.pid})", err=True)
    if state is None:
        where = state_dir / stack_state.FILE_NAME if state_dir is not None else " or ".join(
            str(p) for p in stack_state.candidates())
        typer.echo(f"dfca down: no running stack found (no live `dfca up` in {where})", err=True)
        raise typer.Exit(1)
    typer.echo(f"dfca down: stopping the stack of pid {state.pid} ({state.topology_url}; read {state.path})",
               err=True)
    clean = stack_state.stop(state, timeout)
    stack_state.remove([state.path, stack_state.home_file()], state.pid)
    if clean:
        typer.echo("dfca down: stopped; every process exited", err=True)
        return
    typer.echo(f"dfca down: still running after {timeout:g} s; killed what was left", err=True)
    raise typer.Exit(1)


def round_status(record: dict[str, Any]) -> str:
    if "gcd" in record:  # k-means: how far the nodes are from the centralised solution and from each other
        return f"GCD {record['gcd']:.2e} CV {record['cv']:.2e}"
    if "communities_found" in record:
        return (f"ACC {record['test_accuracy']:.3f} |G| {record['communities_found']:.0f} "
                f"|I| {record['isolated_clusters']:.0f}")
    if "inferred_clusters" in record:
        return f"K {record['inferred_clusters']:.0f} acc {record['test_accuracy']:.3f} F1 {record['macro_f1']:.3f}"
    ari = f" ARI {record['ari']:.2f}" if "ari" in record else ""  # none where the true clusters are unknown
    return f"acc {record['test_accuracy']:.3f}{ari}"


def phase_bars(progress: Progress, schedule: RoundSchedule) -> dict[str, TaskID]:
    """The run's progress bars by phase, counted as people count rounds (`RoundSchedule.phase_round`): `seeding`
    S/S for robust DFCA's seeding rounds, then `rounds` R/R for the training rounds."""
    bars = {}
    if schedule.seeding_rounds:
        bars["seeding"] = progress.add_task("seeding", total=schedule.seeding_rounds, status="")
    bars["training"] = progress.add_task("rounds", total=schedule.cfg.rounds, status="")
    return bars


def stop_note(cfg: ExperimentConfig) -> str:
    return cfg.algorithm_class.rounds_note(cfg)


def seeding_note(cfg: ExperimentConfig) -> str:
    from dfca.algorithms import schedule_of

    seeding = schedule_of(cfg).seeding_rounds
    return f" after {seeding} rounds of farthest-first seeding (dfca.seeding)" if seeding else ""


from dfca.cli.data_commands import register as _register_data_commands  # noqa: E402
from dfca.cli.remote_commands import register as _register_remote_commands  # noqa: E402

_register_remote_commands(app)
_register_data_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
