"""`dfca up`: the whole stack as supervised OS processes on one machine.

Starts the topology service, the metrics service, optionally the aggregator, and N workers, each
as `python -m dfca.cli <service>` with its DFCA_* environment. Like Kubernetes, it restarts a
process that dies (backoff 1 s doubling to 30 s, reset after a minute of uptime); a restarted
worker resumes its clients from its checkpoints. SIGTERM or Ctrl-C stops every process with
SIGTERM (workers first), then SIGKILL after a grace period. Each service logs to
`<state dir>/logs/<name>.log` unless told to log to the terminal. `run_stack` writes the state file
(dfca.cli.stack_state) that the other commands read to find the stack and that `dfca down` stops it by.

Children run in their own sessions, so a terminal's Ctrl-C reaches only the launcher, which then
stops them in order. Workers get OMP_NUM_THREADS = cores // workers (at least 1), so N workers
on one machine do not oversubscribe its cores; by default there are no more workers than cores
(`default_workers`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from dfca.identity import principals, topics
from dfca.identity.principals import worker
from dfca.runtime.service.http_service import broker_reachable
from dfca.settings import DEFAULT_PORTS
from dfca.transport import TransportError
from dfca.transport.rabbitmq import RabbitMQTransport

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0
STOP_GRACE_S = 15.0
DELETE_QUEUE_TIMEOUT_S = 10.0  # a broker that does not answer one queue deletion in this long is not asked again
MOST_DEFAULT_WORKERS = 3  # workers by default on a machine of this many cores or more


def machine_cores() -> int:
    """The cores the workers share (1 where the platform does not say)."""
    return os.cpu_count() or 1


def default_workers() -> int:
    """Workers `dfca up` starts unless told: one per core, at most MOST_DEFAULT_WORKERS. A worker computes on its
    cores all round, so more workers than cores only take turns on them: on 2 cores, 3 workers made the 24-client
    benchmark's rounds 1.4x as long as 2 workers did, and used 1.5x the CPU a round (medians of five alternating
    pairs, `benchmarks/runtime_benchmark.py --workers 2|3`, docs/performance.md)."""
    return min(MOST_DEFAULT_WORKERS, machine_cores())


@dataclass
class StackOptions:
    workers: int = field(default_factory=default_workers)
    broker_url: str = "amqp://dfca:dfca@127.0.0.1:5672/dfca"
    host: str = "127.0.0.1"
    topology_port: int = DEFAULT_PORTS["topology"]
    metrics_port: int = DEFAULT_PORTS["metrics"]
    aggregator_port: int | None = None  # None: no aggregator
    worker_port_base: int = 8090  # worker i serves health on worker_port_base + i
    api_token: str = ""
    read_token: str = ""  # DFCA_READ_TOKEN: what workers and the aggregator read with; empty: made by the Stack
    state_dir: Path = Path(".dfca")  # checkpoints/, metrics.db, logs/ (with log_to_files)
    metrics_db_url: str | None = None
    data_root: str | None = None
    data_dirs: list[str] = field(default_factory=list)  # worker i's own data folder (DFCA_DATA_DIR); empty: none
    log_level: str = "INFO"
    log_to_files: bool = True  # each service's log in state_dir/logs/<name>.log; False: this process's stderr
    restart: bool = True
    # principal -> its own AMQP URL (dfca.identity.broker_users); None: `run_stack` creates them, or (only with
    # shared_broker_user) every process uses broker_url
    broker_users: dict[str, str] | None = None
    shared_broker_user: bool = False  # --insecure-shared-broker-user: every process as broker_url's user
    rabbitmqctl: str = "rabbitmqctl"  # how `run_stack` reaches the broker's node to create the users
    model_factories: str = ""  # DFCA_MODEL_FACTORIES: what model factories (model.kind: torch) the stack may import
    # worker ordinal -> the program that runs that worker instead of `dfca worker` (an instrumented build, say)
    worker_programs: dict[int, list[str]] = field(default_factory=dict)

    def broker_url_of(self, principal: str) -> str:
        """The URL a process connects with: its principal's own user where the deployment has them."""
        if self.broker_users is None:
            return self.broker_url
        if principal not in self.broker_users:
            raise ValueError(f"the broker users have no {principal!r}: create them for at least {self.workers} "
                             "workers (python -m dfca.identity.broker_users create --workers N --out FILE)")
        return self.broker_users[principal]

    @property
    def topology_url(self) -> str:
        return f"http://{self.host}:{self.topology_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"


@dataclass
class ServiceProcess:
    name: str
    service: str
    env: dict[str, str]
    port: int
    restart: bool = True
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = BACKOFF_FIRST_S
    next_start: float = 0.0
    log_file: IO[bytes] | None = None
    exits: list[int] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


REST_SERVICES = ("topology", "metrics")  # the services that check the API token, and so hold it


def service_env(options: StackOptions, service: str, port: int, ordinal: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFCA_")}
    env.update({
        "DFCA_BROKER_URL": options.broker_url_of(service if ordinal is None else worker(ordinal)),
        "DFCA_READ_TOKEN": options.read_token,
        "DFCA_TOPOLOGY_URL": options.topology_url,
        "DFCA_METRICS_URL": options.metrics_url,
        "DFCA_METRICS_DB_URL": options.metrics_db_url or f"sqlite:///{(options.state_dir / 'metrics.db').resolve()}",
        "DFCA_HOST": options.host,
        "DFCA_PORT": str(port),
        "DFCA_WORKERS": str(options.workers),
        "DFCA_CHECKPOINT_DIR": str((options.state_dir / "checkpoints").resolve()),
        "DFCA_LOG_LEVEL": options.log_level,
        "DFCA_MODEL_FACTORIES": options.model_factories,
    })
    if options.data_root:
        env["DFCA_DATA_ROOT"] = options.data_root
    if service in REST_SERVICES:  # workers and the aggregator only read the REST API: no API token for them
        env["DFCA_API_TOKEN"] = options.api_token
    if ordinal is not None:
        env["DFCA_WORKER_ORDINAL"] = str(ordinal)
        if ordinal < len(options.data_dirs):
            env["DFCA_DATA_DIR"] = str(Path(options.data_dirs[ordinal]).resolve())
        env["OMP_NUM_THREADS"] = str(max(1, machine_cores() // options.workers))
    return env


class Stack:
    """The processes of one local deployment; `poll()` restarts the ones that died."""

    def __init__(self, options: StackOptions) -> None:
        if options.api_token and not options.read_token:  # workers read with it: any token set guards every read
            options.read_token = secrets.token_urlsafe(24)
        self.options = options
        self.services: dict[str, ServiceProcess] = {}
        self.lock = threading.RLock()
        self.stopped = False
        plan: list[tuple[str, str, int, int | None]] = [
            ("topology", "topology", options.topology_port, None),
            ("metrics", "metrics", options.metrics_port, None),
        ]
        if options.aggregator_port is not None:
            plan.append(("aggregator", "aggregator", options.aggregator_port, None))
        plan += [(f"worker-{i}", "worker", options.worker_port_base + i, i) for i in range(options.workers)]
        for name, service, port, ordinal in plan:
            self.services[name] = ServiceProcess(name, service, service_env(options, service, port, ordinal), port,
                                                 restart=options.restart)

    # -- processes -------------------------------------------------------------------------------------
    def start(self) -> None:
        (self.options.state_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        for proc in self.services.values():
            self._spawn(proc)

    def program_of(self, proc: ServiceProcess) -> list[str]:
        ordinal = proc.env.get("DFCA_WORKER_ORDINAL")
        if proc.service == "worker" and ordinal is not None and int(ordinal) in self.options.worker_programs:
            return self.options.worker_programs[int(ordinal)]
        return [sys.executable, "-m", "dfca.cli", proc.service]

    def _spawn(self, proc: ServiceProcess) -> None:
        output: IO[bytes] | None = None
        if self.options.log_to_files:
            folder = self.options.state_dir / "logs"
            folder.mkdir(parents=True, exist_ok=True)
            if proc.log_file is None:
                proc.log_file = (folder / f"{proc.name}.log").open("ab")
            output = proc.log_file
        proc.process = subprocess.Popen(
            self.program_of(proc), env=proc.env, stdin=subprocess.DEVNULL,
            stdout=output, stderr=output, start_new_session=True,
        )
        proc.started_at = time.monotonic()
        log.info("started %s (pid %d)", proc.name, proc.process.pid)

    def poll(self) -> None:
        """Restart processes that died (with backoff)."""
        now = time.monotonic()
        with self.lock:
            if self.stopped:
                return
            for proc in self.services.values():
                if proc.process is None:
                    if proc.restart and now >= proc.next_start:
                        self._spawn(proc)
                    continue
                code = proc.process.poll()
                if code is None:
                    if now - proc.started_at > HEALTHY_AFTER_S:
                        proc.backoff = BACKOFF_FIRST_S
                    continue
                proc.exits.append(code)
                proc.process = None
                if not proc.restart:
                    log.warning("%s exited with %d; not restarting it", proc.name, code)
                    continue
                proc.next_start = now + proc.backoff
                log.warning("%s exited with %d; restarting in %.0f s", proc.name, code, proc.backoff)
                proc.backoff = min(proc.backoff * 2, BACKOFF_MAX_S)
                proc.restarts += 1

    def kill(self, name: str, sig: int = signal.SIGKILL, restart: bool | None = None) -> None:
        """Send `sig` to one service (fault injection); `restart=False` keeps it down for good."""
        with self.lock:
            proc = self.services[name]
            if restart is not None:
                proc.restart = restart
            if proc.process is not None and proc.process.poll() is None:
                proc.process.send_signal(sig)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM workers, then the services; SIGKILL whatever is left after `grace` seconds."""
        with self.lock:
            self.stopped = True
            order = [p for p in self.services.values() if p.service == "worker"] + \
                    [p for p in self.services.values() if p.service != "worker"]
            for phase in ([p for p in order if p.service == "worker"], [p for p in order if p.service != "worker"]):
                for proc in phase:
                    if proc.running:
                        assert proc.process is not None
                        proc.process.terminate()
                deadline = time.monotonic() + grace
                for proc in phase:
                    if proc.process is None:
                        continue
                    try:
                        proc.process.wait(max(deadline - time.monotonic(), 0.1))
                    except subprocess.TimeoutExpired:
                        log.warning("%s did not stop within %.0f s; killing it", proc.name, grace)
                        proc.process.kill()
                        proc.process.wait(5)
            for proc in self.services.values():
                if proc.log_file is not None:
                    proc.log_file.close()
                    proc.log_file = None

    def delete_service_queues(self) -> None:
        """After `stop`: delete the queues this deployment's services declared, for a stack that never starts again
        under the same topology URL (tests and benchmarks pick free ports: each stack is a new deployment, whose
        durable queues would otherwise stay on the broker for 6 hours, SERVICE_QUEUE_LIMITS). `dfca up` keeps
        them: restarted on the same URL, its services find their queues again. A broker that cannot be reached, or
        does not answer a deletion within DELETE_QUEUE_TIMEOUT_S, is not waited for: the queues expire."""
        try:
            transport = RabbitMQTransport(self.options.broker_url, name="dfca-launcher",
                                          publish_timeout=DELETE_QUEUE_TIMEOUT_S)
        except TransportError as err:
            log.warning("cannot reach the broker to delete this deployment's service queues (%s); they are left to "
                        "expire (SERVICE_QUEUE_LIMITS)", err)
            return
        try:
            for name in topics.service_queues(topics.deployment_tag(self.options.topology_url), self.options.workers):
                began = time.monotonic()
                try:
                    transport.delete_queue(name)
                except TransportError as err:
                    log.debug("could not delete %s: %s", name, err)
                    if time.monotonic() - began >= DELETE_QUEUE_TIMEOUT_S:  # no answer: the rest would wait as long
                        log.warning("the broker did not answer deleting %s; this deployment's other service queues "
                                    "are left to expire (SERVICE_QUEUE_LIMITS)", name)
                        return
        finally:
            transport.close()

    def supervise(self, stop: threading.Event, every: float = 0.5) -> threading.Thread:
        """Restart dead processes from a background thread until `stop` is set."""

        def loop() -> None:
            while not stop.wait(every):
                self.poll()

        thread = threading.Thread(target=loop, name="stack-supervisor", daemon=True)
        thread.start()
        return thread

    # -- health ----------------------------------------------------------------------------------------
    def ready(self, name: str) -> bool:
        proc = self.services[name]
        try:
            return httpx.get(f"http://{self.options.host}:{proc.port}/readyz", timeout=3.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 120.0, names: list[str] | None = None,
                   stop: threading.Event | None = None) -> None:
        """Wait until every service (or `names`) answers /readyz with 200; raise TimeoutError otherwise. A worker's
        and the aggregator's /readyz pass only once the topology service knows them
        (dfca.runtime.service.registration), so
        once this returns for the whole stack, any experiment can start, IFCA's included."""
        waiting = list(names or self.services)
        deadline = time.monotonic() + timeout
        while waiting and not (stop is not None and stop.is_set()):
            self.poll()
            waiting = [n for n in waiting if not self.ready(n)]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout:.0f} s: {', '.join(waiting)}")
            time.sleep(0.5)

    def pids(self) -> list[int]:
        with self.lock:
            return [p.pid for p in self.services.values() if p.running and p.pid is not None]

    def state(self, token_file: Path | None) -> dict[str, object]:
        """What the state file says about this stack (dfca.cli.stack_state)."""
        options = self.options
        return {"pid": os.getpid(), "topology_url": options.topology_url, "metrics_url": options.metrics_url,
                "state_dir": str(options.state_dir.resolve()),
                "logs": str((options.state_dir / "logs").resolve()) if options.log_to_files else "",
                "token_file": str(token_file.resolve()) if token_file is not None else "",
                "pids": self.pids(), "started_at": time.time()}

    def status_block(self, token_file: Path | None, state_files: list[Path]) -> str:
        """What `dfca up` prints under the ready line: where everything is, the tokens it made, how to stop it."""
        options = self.options
        logs = (f"{(options.state_dir / 'logs').resolve()}/<service>.log" if options.log_to_files
                else "this terminal (--log-to-terminal)")
        dashboard = f"{options.metrics_url}/ui"
        if token_file is not None:
            token = f"API token {options.api_token} (in {token_file.resolve()}; the dfca commands read it from there)"
            dashboard += f"#token={options.api_token}"
        else:
            token = "API token from DFCA_API_TOKEN"
        reads = f"read token {options.read_token} (workers read with it); every read needs a token"
        users = ("ONE SHARED BROKER USER for every process (--insecure-shared-broker-user): a worker's credentials "
                 "can forge any message" if options.broker_users is None
                 else f"one per principal ({len(options.broker_users)} users)")
        lines = [
            f"  topology   {options.topology_url}",
            f"  metrics    {options.metrics_url}",
            f"  dashboard  {dashboard}",
            f"  logs       {logs}",
            f"  tokens     {token}",
            f"             {reads}",
            f"  broker     {users}",
        ]
        if state_files:
            lines.append(f"  state      {', '.join(str(p.absolute()) for p in state_files)}")
        lines.append("  stop       Ctrl-C here, or `dfca down` from another terminal")
        return "\n".join(lines)

    def ready_line(self) -> str:
        """What `dfca up` prints once every process is ready."""
        options = self.options
        aggregator = f", aggregator :{options.aggregator_port}" if options.aggregator_port is not None else ""
        return (f"dfca up: ready: topology {options.topology_url}, metrics {options.metrics_url}, "
                f"{options.workers} workers{aggregator}, every one known to the topology service; Ctrl-C stops "
                "everything")


def prepare_credentials(options: StackOptions) -> tuple[Path | None, str | None]:
    """The tokens and broker users `dfca up` needs, made where none were given (dfca.cli.stack_credentials). Returns
    the API token file it wrote (None: DFCA_API_TOKEN) and, where the stack cannot start, why."""
    from dfca.cli import stack_credentials as credentials

    address = credentials.BrokerAddress.of(options.broker_url)
    if not address.listening():
        return None, (f"no RabbitMQ answers at {address.host}:{address.port}; start one (scripts/start_rabbitmq.sh) "
                      "or pass --broker URL")
    if options.shared_broker_user:
        log.warning("every process connects as the shared broker user %r (--insecure-shared-broker-user): "
                    "receivers cannot tell publishers apart", credentials.user_of_url(options.broker_url))
    elif options.broker_users is None:
        try:
            options.broker_users = credentials.create_broker_users(
                shlex.split(options.rabbitmqctl), address, options.workers, options.state_dir)
        except credentials.CredentialsError as err:
            return None, (f"cannot create the stack's broker users: {err}. Give users made beforehand "
                          "(--broker-users FILE), point --rabbitmqctl at the broker's node, or (local development "
                          "only) pass --insecure-shared-broker-user")
    probe = options.broker_url_of(principals.TOPOLOGY)
    if not broker_reachable(probe):
        return None, f"RabbitMQ at {address.host}:{address.port} refuses {credentials.user_of_url(probe)!r}"
    token_file: Path | None = None
    if not options.api_token:
        options.api_token = credentials.new_token()
        token_file = credentials.token_file(options.state_dir, credentials.API_TOKEN_FILE, options.api_token)
    if not options.read_token:
        options.read_token = credentials.new_token()
        credentials.token_file(options.state_dir, credentials.READ_TOKEN_FILE, options.read_token)
    return token_file, None


def run_stack(options: StackOptions) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code for `dfca up`."""
    from dfca.cli import stack_state

    running = stack_state.read(options.state_dir / stack_state.FILE_NAME)
    if running is not None and running.running and running.pid != os.getpid():
        print(f"dfca up: a stack (pid {running.pid}) already runs from {options.state_dir}; stop it with "
              "`dfca down` or pick another --state-dir", file=sys.stderr)
        return 1
    token_file, refusal = prepare_credentials(options)
    if refusal is not None:
        print(f"dfca up: {refusal}", file=sys.stderr)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    stack = Stack(options)
    state_files: list[Path] = []
    try:
        stack.start()
        state_files = stack_state.write(options.state_dir, stack.state(token_file))
        try:
            stack.wait_ready(stop=stop)
            if not stop.is_set():
                state_files = stack_state.write(options.state_dir, stack.state(token_file))  # the pids now
                print(stack.ready_line(), file=sys.stderr, flush=True)
                print(stack.status_block(token_file, state_files), file=sys.stderr, flush=True)
        except TimeoutError as err:
            where = f" ({options.state_dir.resolve() / 'logs'})" if options.log_to_files else ""
            print(f"dfca up: {err} (their logs{where} say why; the stack keeps trying)", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            stack.poll()
    finally:
        print("dfca up: stopping", file=sys.stderr, flush=True)
        stack.stop()
        stack_state.remove(state_files, os.getpid())
        if token_file is not None:
            token_file.unlink(missing_ok=True)
        (options.state_dir / "read-token").unlink(missing_ok=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("dfca up: stopped; every process exited", file=sys.stderr, flush=True)
    return 0
