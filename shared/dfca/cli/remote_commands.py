"""`dfca submit|status|stop|logs|results`: drive the distributed runtime's REST API from the command line.

Each reads the topology and metrics URLs and the API token from --topology, --metrics and --token, else from
DFCA_TOPOLOGY_URL, DFCA_METRICS_URL and DFCA_API_TOKEN, else the state file of a running `dfca up`
(dfca.cli.stack_state), else the addresses `dfca up` uses by default.

Only `results` of an old metrics service (which plots) imports the
algorithms, and so torch; `submit` leaves a config's validation to the service; all start in a fraction of a second.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from dfca.schedule import RoundSchedule

if TYPE_CHECKING:  # httpx, under the client, takes a while to import: `dfca --help` does without it
    from dfca.cli.runtime_client import RuntimeClient

console = Console(stderr=True)
TOPOLOGY = typer.Option(None, "--topology", help="topology service URL [env DFCA_TOPOLOGY_URL; else the running "
                        "`dfca up`'s stack.json; default :8080]")
METRICS = typer.Option(None, "--metrics", help="metrics service URL [env DFCA_METRICS_URL; else the running "
                       "`dfca up`'s stack.json; default :8081]")
TOKEN = typer.Option(None, "--token", help="API token [env DFCA_API_TOKEN; else the token file of the running "
                     "`dfca up`]")
JSON = typer.Option(False, "--json", help="print the records as JSON instead of tables")


def client_for(topology: str | None, metrics: str | None, token: str | None) -> RuntimeClient:
    from dfca.cli.runtime_client import Endpoints, RuntimeClient

    return RuntimeClient(Endpoints.resolve(topology, metrics, token))


def failing(action: Callable[[], int | None]) -> None:
    """Run a command's body; an API or config error is one red line and exit code 1 (2 for a bad config)."""
    from dfca.cli.runtime_client import ApiError
    from dfca.config_files import ConfigError
    from dfca.results.run_folder import OutFolderRefused

    try:
        code = action()
    except ApiError as err:
        if err.status == 422:  # the service refused the config: its errors name the fields
            console.print(f"[bold red]invalid config:[/] {err}")
            raise typer.Exit(2) from err
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(1) from err
    except OutFolderRefused as err:
        console.print(f"[bold red]error:[/] {err}")
        raise typer.Exit(1) from err
    except ConfigError as err:
        console.print(f"[bold red]invalid config:[/] {err}")
        raise typer.Exit(2) from err
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
            from dfca.config_files import apply_overrides, read_config_file

            data = apply_overrides(read_config_file(config), sets or [])  # the service validates it
            client = client_for(topology, metrics, token)
            experiment = client.create(data)
            if not start:
                print(experiment)
                return None
            started = client.start(experiment)
            cfg = client.experiment(experiment).get("config", {})
            console.print(f"[bold]{experiment}[/]: {cfg.get('algorithm')}, {cfg.get('data', {}).get('clients')} "
                          f"clients on {started.get('workers')} workers; follow it with `dfca logs {experiment}`")
            print(experiment)
            return watch(client, experiment, timeout) if wait else None

        failing(body)

    @app.command()
    def status(
        experiment: str = typer.Argument(None, help="an experiment id; without it, every experiment"),
        as_json: bool = JSON,
        topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN,
    ) -> None:
        """Every experiment's status, round, accuracy and ARI; or one experiment's record, workers and summary."""

        def body() -> None:
            client = client_for(topology, metrics, token)
            if experiment is not None:
                record = client.experiment(experiment)
                record.pop("config", None)
                summary = client.summary(experiment)
                if as_json:
                    print(json.dumps({"experiment": record, "summary": summary}, indent=2))
                    return
                out = Console()
                for table in experiment_tables(record, summary):
                    out.print(table)
                return
            records = client.experiments()
            summaries = {r["id"]: client.summary(r["id"]) or {} for r in records}
            if as_json:
                print(json.dumps({"deployment": client.deployment(), "experiments": [
                    {**{k: v for k, v in r.items() if k != "config"}, "summary": summaries[r["id"]]}
                    for r in records]}, indent=2))
                return
            console.print(deployment_line(client.deployment()))
            Console().print(experiments_table(records, summaries))

        failing(body)

    @app.command()
    def stop(experiment: str = typer.Argument(..., help="experiment id"),
             wait: float = typer.Option(30.0, "--wait", min=0.0,
                                        help="seconds to wait for the workers to stop it (0: only ask)"),
             topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN) -> None:
        """Stop an experiment; wait until it has stopped (exit 1 if it has not within --wait seconds)."""

        def body() -> int | None:
            from dfca.cli.runtime_client import TERMINAL

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
             follow: bool = typer.Option(True, "--follow/--no-follow",
                                         help="keep following a running experiment until it ends (a finished one "
                                              "prints its whole history either way)"),
             topology: str = TOPOLOGY, metrics: str = METRICS, token: str = TOKEN) -> None:
        """Print an experiment's history (every round, the workers' events, its status), then, while it runs, follow
        its events until it ends."""

        def body() -> int | None:
            from dfca.cli.runtime_client import TERMINAL

            client = client_for(topology, metrics, token)
            record = client.experiment(experiment)
            schedule = record_schedule(record)
            if not follow or record.get("status") in TERMINAL:
                print_history(client, experiment, schedule)
                return None
            try:
                for event, data in client.follow(experiment):
                    print(event_line(event, data, schedule))
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
            from dfca.results.run_folder import prepare_out

            client = client_for(topology, metrics, token)
            record = client.experiment(experiment)
            write_results(client, experiment, record, prepare_out(out, force))

        failing(body)


def write_results(client: RuntimeClient, experiment: str, record: dict[str, Any], out: Path) -> None:
    from dfca.cli.runtime_client import ApiError
    from dfca.results.run_folder import written_files

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
        from dfca.algorithms import schedule_of  # which draws no plots: the algorithms (and torch) draw them here
        from dfca.config import ExperimentConfig
        from dfca.results.outputs import plot_history

        cfg = ExperimentConfig.model_validate(record["config"])
        plot_history(out, evaluated, cfg.name, schedule_of(cfg).seeding_rounds)
    if not models:
        console.print(f"[yellow]note:[/] {experiment} has no final models ({record['status']}): workers send them "
                      "when their clients finish the last round")
    console.print(f"wrote {out}/: " + ", ".join(written_files(out)), soft_wrap=True)


def watch(client: RuntimeClient, experiment: str, timeout: float | None = None) -> int:
    """A progress bar over the experiment's rounds until it ends, then its summary table: 0 when it completed,
    1 when it failed or was stopped, 124 when `timeout` seconds passed first, 130 on Ctrl-C (it keeps running)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dfca.cli.runtime_client import TERMINAL, WaitTimedOut

    total = int(client.experiment(experiment).get("rounds") or 0) or None
    deadline = None if timeout is None else time.monotonic() + timeout
    final = "running"
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task(experiment, total=total, status="")
            for event, data in client.follow(experiment, deadline=deadline):
                if event == "progress" and "phase_round" in data:  # counted in its phase: seeding, then rounds
                    phase = "seeding" if data["phase"] == "seeding" else "rounds"
                    progress.update(task, description=f"{experiment} {phase}", total=data["phase_rounds"],
                                    completed=data["phase_round"], status=data.get("status", ""))
                elif event == "progress":
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


def summary_table(experiment: str, status: str, summary: dict[str, Any], title: str | None = None) -> Table:
    table = Table(title=title or f"{experiment}: {status}")
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


class RecordSchedule(RoundSchedule):
    """The round numbering of an experiment the topology service describes, without its algorithm: the same
    `RoundSchedule.label` that `dfca.algorithms.schedule_of(cfg)` gives, with the seeding rounds read from the
    record (its total rounds less the config's training rounds), so `dfca logs` needs neither torch nor the
    algorithms and counts rounds as the rest of the product does."""

    def __init__(self, rounds: int, seeding: int) -> None:
        self.seeding = max(0, seeding)
        super().__init__(SimpleNamespace(rounds=rounds))  # type: ignore[arg-type]

    def preparation_rounds(self) -> int:
        return self.seeding


def record_schedule(record: dict[str, Any]) -> RoundSchedule | None:
    """The schedule of a topology record (GET /experiments/ID), or None when it does not say its rounds."""
    try:
        if "seeding_rounds" in record:  # every record says it; the list leaves the config out
            seeding = int(record["seeding_rounds"])
            return RecordSchedule(int(record["rounds"]) - seeding, seeding)
        rounds = int(record["config"]["rounds"])
        return RecordSchedule(rounds, int(record["rounds"]) - rounds)
    except (KeyError, TypeError, ValueError):
        return None


def round_progress(record: dict[str, Any]) -> str:
    """How far a run is, counted as the rest of the product counts rounds: `seeding 3/8`, then `4/10`."""
    done = int(record.get("round") or 0)
    schedule = record_schedule(record)
    if schedule is None:
        return f"{done}/{record.get('rounds', '?')}"
    if done < 1:
        return f"0/{schedule.cfg.rounds}"
    phase, number, total = schedule.phase_round(min(done, schedule.total_rounds) - 1)
    return f"seeding {number}/{total}" if phase == "seeding" else f"{number}/{total}"


def round_label(completed: int, schedule: RoundSchedule | None) -> str:
    """Round `completed` (1-based, as reports count them) as `seeding 3 of 8` or `round 4 of 10`."""
    if schedule is None or not 1 <= completed <= schedule.total_rounds:
        return f"round {completed}"
    return schedule.label(completed - 1)


def print_history(client: RuntimeClient, experiment: str, schedule: RoundSchedule | None) -> None:
    """Everything the metrics service holds of an experiment: every round, the workers' events, the status and
    the summary."""
    history = client.history(experiment)
    for record in history["history"]:
        print(round_line(record, schedule))
    for event in history.get("worker_events", []):
        print(f"worker {event['worker']}: {event['state']} at {round_label(int(event['round']), schedule)}")
    print(f"status: {history.get('status', '?')}")
    summary = client.summary(experiment)
    if summary:
        print(event_line("summary", summary, schedule))


def experiments_table(records: list[dict[str, Any]], summaries: dict[str, dict[str, Any]],
                      width: int | None = None) -> Table:
    """Every experiment, one line each, within `width` columns (the terminal's): long names and algorithms are cut
    short with an ellipsis, ids, statuses and numbers never."""
    from rich import box

    width = width or Console().width

    rows = [(record["id"], record.get("name", ""), record.get("algorithm", ""), record["status"],
             round_progress(record),
             short((summaries.get(record["id"]) or {}).get("test_accuracy")),
             short((summaries.get(record["id"]) or {}).get("cluster_ari"))) for record in records]

    def widest(i: int, header: str) -> int:
        return max([len(header), *(len(row[i]) for row in rows)])

    fixed = sum(widest(i, h) for i, h in ((0, "id"), (3, "status"), (4, "round"), (5, "acc"), (6, "ARI")))
    room = max(8, width - fixed - 2 * 6 - 1)  # what is left for name and algorithm, two spaces between columns
    algo = min(widest(2, "algo"), max(4, room // 3))
    name = min(widest(1, "name"), max(4, room - algo - 2))
    table = Table(title="experiments", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    table.add_column("id", no_wrap=True, min_width=widest(0, "id"))
    table.add_column("name", no_wrap=True, width=name)
    table.add_column("algo", no_wrap=True, width=algo)
    for i, header in ((3, "status"), (4, "round"), (5, "acc"), (6, "ARI")):
        table.add_column(header, justify="left" if i == 3 else "right", no_wrap=True, min_width=widest(i, header))
    for row in rows:
        table.add_row(row[0], cut(row[1], name), cut(row[2], algo), *row[3:])
    return table


def cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


def experiment_tables(record: dict[str, Any], summary: dict[str, Any] | None) -> list[Table]:
    """One experiment: its record, its workers, and its summary's metrics (each table fits 80 columns)."""
    about = Table(title=f"{record.get('id', '?')}: {record.get('status', '?')}", show_header=False)
    about.add_column("field", no_wrap=True)
    about.add_column("value", overflow="fold")
    failed = record.get("failed_clients") or []
    for key, value in (("name", record.get("name")), ("algorithm", record.get("algorithm")),
                       ("status", record.get("status")), ("round", round_progress(record)),
                       ("clients", record.get("clients")), ("workers", record.get("workers")),
                       ("started", clock(record.get("started_at"))), ("finished", clock(record.get("finished_at"))),
                       ("failed clients", ", ".join(map(str, failed)) if failed else "none")):
        about.add_row(key, "-" if value is None else str(value))
    tables = [about]
    states = record.get("worker_states") or {}
    if states:
        workers = Table(title="workers")
        for column in ("worker", "state", "round", "device", "seen", "restarts"):
            workers.add_column(column, no_wrap=True, justify="right" if column in ("round", "seen") else "left",
                               overflow="ellipsis", max_width=14 if column == "device" else None)
        for worker, view in sorted(states.items(), key=lambda item: int(item[0])):
            seen = view.get("seconds_since_seen")
            workers.add_row(str(worker), str(view.get("state", "?")), str(view.get("round", 0)),
                            view.get("device") or "-", "-" if seen is None else f"{seen:.0f} s ago",
                            str(max(0, int(view.get("incarnations") or 0) - 1)))
        tables.append(workers)
    if summary:
        tables.append(summary_table(str(record.get("id", "?")), str(record.get("status", "?")), summary,
                                    title="summary"))
    return tables


def clock(at: Any) -> str | None:
    if not isinstance(at, (int, float)):
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def short(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def round_line(record: dict[str, Any], schedule: RoundSchedule | None = None) -> str:
    line = f"{round_label(int(record['round']), schedule)}: workers {record.get('workers_reported', '?')}"
    if "test_accuracy" in record:
        line += f", accuracy {record['test_accuracy']:.4f}"
        line += f", ARI {record['ari']:.3f}" if "ari" in record else ""
    return line + f", {record.get('seconds', 0.0):.2f} s"


def event_line(event: str, data: dict[str, Any], schedule: RoundSchedule | None = None) -> str:
    if event == "progress":
        return f"{round_label(int(data['round']), schedule)}: worker {data['worker']} ({data['seconds']:.2f} s" + \
            ("" if data.get("complete", True) else ", some neighbours timed out") + ")"
    if event == "status":
        failed = data.get("failed_clients") or []
        return f"status: {data['status']}" + (f" (failed clients {failed})" if failed else "")
    if event == "summary":
        ari = f"ARI {number(data['cluster_ari'])}, " if "cluster_ari" in data else ""
        return f"summary: accuracy {number(data.get('test_accuracy'))}, {ari}rounds {data.get('rounds_completed')}"
    return f"{event}: {json.dumps(data)}"
