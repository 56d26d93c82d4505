"""The distributed runtime against its baselines, in one run, on a real RabbitMQ.

1. Seconds per round: the runtime (`--workers` worker processes, by default as many as `dfca up` starts: one per
   core, at most 3; started like `dfca up`) against the simulator,
   on the same config (rotated MNIST k=2, 24 clients, ER p=0.5, MLP). Steady state: round 1 (start
   barrier, consumer start-up) is left out of both; every round evaluates in both (the simulator also
   computes its consensus metrics). The simulator's figure is its best of two runs.
2. Model-exchange throughput: the same model payloads through the runtime's path (HostTransport over
   RabbitMQTransport: persistent, publisher-confirmed, manual acks, prefetch) against raw pika doing
   the same (BlockingConnection, confirm_delivery, persistent, manual acks, same prefetch). One publisher
   thread, one consumer thread, MB/s from the first publish to the last ack.

    python benchmarks/runtime_benchmark.py [--broker URL] [--rounds 12] [--messages 300] [--workers N]

On a machine shared with other work, `--private-broker --favoured` measures as a machine to itself would: a RabbitMQ
node of the run's own, and the run's processes (simulator, services, broker) scheduled ahead of the other sessions.

Goals: runtime round <= 2.5x the simulator's same work on 2 cores; exchange >= 70% of raw pika.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httpx
import pika
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # harness: drivers in lockstep

from favoured_run import favoured  # noqa: E402
from process_tree_trace import interpolated  # noqa: E402
from rabbitmq_node import RabbitMQNode  # noqa: E402
from resumable_runs import commit  # noqa: E402

import dfca  # noqa: E402
from dfca.algorithms import schedule_of  # noqa: E402
from dfca.cli.launcher import Stack, StackOptions, default_workers  # noqa: E402
from dfca.config import ExperimentConfig  # noqa: E402
from dfca.data import build_federated_data  # noqa: E402
from dfca.graph import build_graph, neighbours  # noqa: E402
from dfca.identity import sharding, topics  # noqa: E402
from dfca.models.build import build_model  # noqa: E402
from dfca.runtime.driver.driver_stats import PHASES  # noqa: E402
from dfca.runtime.driver.host_transport import HostTransport  # noqa: E402
from dfca.runtime.metrics.metrics_store import MetricsStore  # noqa: E402
from dfca.schedule import RoundSchedule  # noqa: E402
from dfca.settings import benchmark_broker_url  # noqa: E402
from dfca.simulator import simulate  # noqa: E402
from dfca.transport import InMemoryBroker, InMemoryTransport, RabbitMQTransport  # noqa: E402
from dfca.transport.rabbitmq import redact_url  # noqa: E402
from dfca.wire.codec import HEADER_KEYS, Envelope, TensorSpec, body_bytes, encode_message  # noqa: E402
from harness.lockstep import LockstepRun, client_driver, lockstep_round  # noqa: E402

TOKEN = "benchmark"
CPU_SAMPLE_S = 0.05  # how often CpuTrace reads the processes' CPU seconds
WORKERS = 3  # the runtime's workers where a caller names none (junk_flood's documented runs): 8 of 24 clients each
GOAL_RATIO = 2.5  # the goal on 2 cores: a runtime round at most this many times the simulator's same-work round


def demo_config(rounds: int) -> dict[str, Any]:
    """`dfca run`'s demo config with `rounds` training rounds."""
    demo = yaml.safe_load((Path(dfca.__file__).parent / "configs" / "demo.yaml").read_text())
    return {**demo, "rounds": rounds, "runtime": {**demo.get("runtime", {}), "round_timeout": 30.0}}


def bench_config(rounds: int) -> dict[str, Any]:
    return {
        "name": "bench", "clusters": 2, "rounds": rounds, "seed": 0, "aggregation": "sequential",
        "data": {"dataset": "mnist-bundled", "rotations": [0, 180], "clients": 24, "train_per_client": 80,
                 "test_per_client": 25},
        "model": {"kind": "mlp", "hidden": 64}, "train": {"lr": 0.25, "local_epochs": 3, "batch_size": 20},
        "topology": {"kind": "erdos_renyi", "p": 0.5}, "runtime": {"round_timeout": 30.0},
    }


# -- 1. seconds per round -------------------------------------------------------------------------------------
class SimulatorRound(NamedTuple):
    seconds: float  # per round, as the simulator runs: its consensus metrics (Disp_j, index consistency) included
    same_work: float  # per round, without those metrics: the work a runtime round does (evaluation included)
    accuracy: float  # final test accuracy
    cpu: float  # CPU seconds per round, every thread of this process, the consensus metrics included
    by_kind: dict[str, float]  # seconds per round of each kind (`round_kind`), without the consensus metrics


def simulator_round_seconds(cfg: dict[str, Any], repeats: int = 2) -> SimulatorRound:
    """The best of `repeats` runs (a shared machine is noisy; the best run is the baseline's favour). A runtime
    round evaluates its clients as the simulator's does but computes no consensus metrics (no worker sees every
    client's models), so `same_work`, the rounds less their `consensus_seconds`, is the baseline to compare with."""
    config = ExperimentConfig.model_validate(cfg)
    data = build_federated_data(config)  # both sides get their data ready before the clock starts
    best: SimulatorRound | None = None
    for _ in range(repeats):
        began = time.process_time()
        result = simulate(config, data=data)
        cpu = (time.process_time() - began) / len(result.history)
        same = [h["seconds"] - h.get("consensus_seconds", 0.0) for h in result.history[1:]]
        rounds = [(h["round"] - 1, s) for h, s in zip(result.history[1:], same, strict=True)]  # a record's: t + 1
        run = SimulatorRound(statistics.mean(h["seconds"] for h in result.history[1:]), statistics.mean(same),
                             result.summary["test_accuracy"], cpu, seconds_by_kind(schedule_of(config), rounds))
        if best is None or run.same_work < best.same_work:
            best = run
    assert best is not None
    return best


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch computes on one thread inside (as each of the runtime's workers does where they are at least as many
    as the cores, OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class DriversFloor(NamedTuple):
    cpu: float  # CPU seconds per round, round 0 left out
    phases: dict[str, float]  # DriverStats.seconds per round, summed over the drivers
    accuracy: float  # the clients' mean test accuracy at the end
    phases_cpu: dict[str, float]  # DriverStats.cpu_seconds per round, summed over the drivers


def drivers_floor(cfg: dict[str, Any], workers: int = WORKERS) -> DriversFloor:
    """What the runtime's message drivers cost on their own: `workers` drivers (client c on driver c % workers, as the
    workers split them) in one process and one thread, in lockstep over the in-memory transport, so no broker, AMQP
    client, checkpoint, service or waiting. The accuracy is the simulator's: the same run. What a runtime round costs
    beyond this is the transport's and the processes' around the drivers."""
    config = ExperimentConfig.model_validate(cfg)
    data = build_federated_data(config)
    graph = neighbours(build_graph(config.topology, config.data.clients, config.seed))
    broker = InMemoryBroker()
    drivers = [client_driver(config, "floor", group, data.subset(group), graph, InMemoryTransport(broker),
                             device=config.device, workers=workers)
               for group in sharding.assignment(config.data.clients, workers).values()]
    run = LockstepRun(drivers, None)
    rounds = schedule_of(config).total_rounds

    def summed() -> tuple[dict[str, float], dict[str, float]]:  # each phase's seconds and CPU seconds so far
        return ({p: sum(d.stats.seconds[p] for d in drivers) for p in PHASES},
                {p: sum(d.stats.cpu_seconds[p] for d in drivers) for p in PHASES})

    with one_thread():
        lockstep_round(run, 0)
        before, before_cpu = summed()
        began = time.process_time()
        for t in range(1, rounds):
            lockstep_round(run, t)
        cpu = (time.process_time() - began) / (rounds - 1)
    after, after_cpu = summed()
    accuracy = torch.cat([d.algorithm.evaluate().test_accuracy for d in drivers]).mean().item()
    return DriversFloor(cpu, {p: (after[p] - before[p]) / (rounds - 1) for p in PHASES}, accuracy,
                        {p: (after_cpu[p] - before_cpu[p]) / (rounds - 1) for p in PHASES})


class CoresBound(NamedTuple):
    least_round: float  # seconds: the runtime's CPU a round spread perfectly over the machine's cores
    least_ratio: float  # that against the simulator's same-work round: no latency cut gets a run below it
    budget: float  # CPU-s a round the goal allows the whole runtime (workers, services, broker) on these cores
    drivers_share: float  # the drivers alone's CPU a round, as a fraction of that budget (>= 1: out of reach)


def cores_bound(runtime_cpu: float, drivers_cpu: float, simulator_round: float, cores: int,
                goal: float = GOAL_RATIO) -> CoresBound:
    """What the machine's cores allow whatever the latency of an exchange: a round that uses `runtime_cpu` CPU-s
    on `cores` cores lasts at least runtime_cpu / cores; within `goal` x the simulator's `simulator_round` the whole
    runtime may use at most goal x simulator_round x cores CPU-s a round, which the message drivers alone
    (`drivers_cpu`, no broker, AMQP client or service) must fit in with room for the rest."""
    least = runtime_cpu / cores
    budget = goal * simulator_round * cores
    return CoresBound(least, least / simulator_round, budget, drivers_cpu / budget)


def round_kind(schedule: RoundSchedule, t: int) -> str:
    """seeding, gossip (a training round with consensus steps) or merge (a training round without)."""
    if schedule.phase(t) == "seeding":
        return "seeding"
    return "gossip" if schedule.gossip_steps(t) else "merge"


def seconds_by_kind(schedule: RoundSchedule, rounds: list[tuple[int, float]]) -> dict[str, float]:
    """Mean seconds of the rounds of each kind (`round_kind`); `rounds`: (the schedule's round, its seconds)."""
    spans: dict[str, list[float]] = {}
    for t, seconds in rounds:
        spans.setdefault(round_kind(schedule, t), []).append(seconds)
    return {kind: statistics.mean(seconds) for kind, seconds in spans.items()}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_pids(url: str | None = None) -> list[int]:
    """The RabbitMQ nodes' Erlang VMs on this machine (beam.smp); with `url`, only the one listening on its port where
    it is found (a shared machine runs other nodes for other work)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"beam.smp" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    if url is None:
        return pids
    listening = listening_sockets(urlsplit(url).port or (5671 if url.startswith("amqps:") else 5672))
    serving = [pid for pid in pids if holds_socket(pid, listening)]
    return serving or pids


def listening_sockets(port: int) -> set[str]:
    """The inodes of the TCP sockets listening on `port` (IPv4 and IPv6), as /proc/net/tcp* lists them."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(fields[9])
    return inodes


def holds_socket(pid: int, inodes: set[str]) -> bool:
    """Whether process `pid` holds one of the sockets `inodes`."""
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


def cpu_of(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in pids) for name, pids in groups.items()}


class CpuTrace:
    """The CPU seconds each group of processes has used, sampled every CPU_SAMPLE_S from `start` to `stop`, so that
    what they used between two moments of the run (`between`: the first round's end and the last's, as the
    seconds per round are measured) leaves out start-up: imports, data, the first round."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time(), cpu_of(self.groups)))
            if self._stop.wait(CPU_SAMPLE_S):
                self.samples.append((time.time(), cpu_of(self.groups)))
                return

    def at(self, when: float) -> dict[str, float]:
        """Each group's CPU seconds at time `when`, interpolated between the samples around it."""
        return interpolated(self.samples, when)

    def between(self, began: float, ended: float) -> dict[str, float]:
        first, last = self.at(began), self.at(ended)
        return {name: last[name] - first[name] for name in first}


def runtime_round_seconds(cfg: dict[str, Any], broker: str, state_dir: Path,
                          broker_users: dict[str, str] | None = None,
                          during: Callable[[str], Callable[[], None]] | None = None) -> tuple[float, float]:
    """(steady-state seconds per round, final accuracy) of one runtime run; `broker_users`: each process its own
    broker user; `during(experiment)` starts something alongside the run and returns how to stop it."""
    profile = runtime_profile(cfg, broker, state_dir, broker_users, during)
    return profile.seconds, profile.accuracy


class RuntimeProfile(NamedTuple):
    seconds: float  # steady-state seconds per round
    accuracy: float  # the run's final test accuracy (the metrics service's summary)
    phases: dict[str, float]  # each phase's seconds per round (DriverStats.seconds, PHASES), mean over the workers
    cpu: dict[str, float]  # CPU seconds per round of the workers, the other services together, the broker
    by_kind: dict[str, float]  # seconds per round of each kind (`round_kind`: seeding, merge, gossip)
    phases_cpu: dict[str, float]  # each phase's CPU seconds per round in the workers' round loops, summed over the
    #                               workers (DriverStats.cpu_seconds; `loop`: the round loops' threads in all)
    services: dict[str, float]  # CPU seconds per round of each other service (topology, metrics)
    deliveries: dict[str, float]  # per worker and round, mean over the workers: `delivered` (the broker's deliveries
    #                               to the worker's queue), `applied` ((receiver, message) pairs folded), `needed` (the
    #                               distinct messages of senders hosted elsewhere that the worker's clients hear)


def runtime_profile(cfg: dict[str, Any], broker: str, state_dir: Path, broker_users: dict[str, str] | None = None,
                    during: Callable[[str], Callable[[], None]] | None = None, workers: int = WORKERS
                    ) -> RuntimeProfile:
    """One runtime run (`runtime_run`), every figure over the same steady-state rounds: from the first round's end
    to the last's."""
    cpu: list[CpuTrace] = []
    summary, reports = runtime_run(cfg, broker, state_dir, broker_users, during, cpu, workers)
    done_at: dict[int, float] = {}
    first: dict[int, Any] = {}
    last: dict[int, Any] = {}
    for report in reports:  # a round is done when its last worker reports it
        done_at[report.round] = max(done_at.get(report.round, 0.0), report.at)
        if report.round >= last.get(report.worker, report).round:
            last[report.worker] = report
        if report.round <= first.get(report.worker, report).round:
            first[report.worker] = report
    rounds = sorted(done_at)

    def per_round(key: str, phase: str, worker: int) -> float:  # a worker's cumulative stat, per steady round
        a, b = first[worker], last[worker]
        return (b.stats.get(key, {}).get(phase, 0.0) - a.stats.get(key, {}).get(phase, 0.0)) / (b.round - a.round)

    def count_per_round(key: str, worker: int) -> float:  # a worker's cumulative count, per steady round
        a, b = first[worker], last[worker]
        return (b.stats.get(key, 0) - a.stats.get(key, 0)) / (b.round - a.round)

    phases = {p: statistics.mean(per_round("seconds", p, w) for w in last) for p in PHASES}
    deliveries = {key: statistics.mean(count_per_round(key, w) for w in last) for key in ("delivered", "applied")}
    deliveries["needed"] = needed_deliveries(cfg, {w: count_per_round("published", w) for w in last})
    phases_cpu = {p: sum(per_round("cpu_seconds", p, w) for w in last) for p in (*PHASES, "loop")}
    groups = {name: seconds / (len(rounds) - 1)
              for name, seconds in cpu[0].between(done_at[rounds[0]], done_at[rounds[-1]]).items()}
    services = {name.removeprefix("service "): v for name, v in groups.items() if name.startswith("service ")}
    cpu_per_round = {"workers": groups["workers"], "services": sum(services.values()), "broker": groups["broker"]}
    by_phase = seconds_by_kind(schedule_of(ExperimentConfig.model_validate(cfg)),  # a report's round r: the
                               [(r - 1, done_at[r] - done_at[before])  # schedule's round r - 1
                                for before, r in zip(rounds, rounds[1:], strict=False)])
    return RuntimeProfile((done_at[rounds[-1]] - done_at[rounds[0]]) / (len(rounds) - 1), summary["test_accuracy"],
                          phases, cpu_per_round, by_phase, phases_cpu, services, deliveries)


def needed_deliveries(cfg: dict[str, Any], published: dict[int, float]) -> float:
    """The distinct messages a worker needs a round, mean over the workers: each sender hosted on another worker that
    one of its clients neighbours sends it every message it publishes (`published`: each worker's messages a round,
    spread evenly over its clients)."""
    config = ExperimentConfig.model_validate(cfg)
    graph = neighbours(build_graph(config.topology, config.data.clients, config.seed))
    workers = len(published)
    hosted = sharding.assignment(config.data.clients, workers)
    per_sender = {c: published[w] / len(clients) for w, clients in hosted.items() for c in clients}
    needed = []
    for clients in hosted.values():
        heard = {m for c in clients for m in graph.get(c, ())} - set(clients)
        needed.append(sum(per_sender[m] for m in heard))
    return statistics.mean(needed)


def runtime_run(cfg: dict[str, Any], broker: str, state_dir: Path, broker_users: dict[str, str] | None = None,
                during: Callable[[str], Callable[[], None]] | None = None, cpu: list[CpuTrace] | None = None,
                workers: int = WORKERS) -> tuple[dict[str, Any], list[Any]]:
    """One run on a fresh stack of `workers` workers: (the metrics service's summary, the stored round reports).
    `cpu`, if given, receives a CpuTrace of the run, from the experiment's start to its end, of the workers, the other
    services (topology, metrics) and the RabbitMQ node serving `broker` (broker_pids)."""
    options = StackOptions(workers=workers, broker_url=broker, topology_port=free_port(), metrics_port=free_port(),
                           worker_port_base=free_port_block(workers), api_token=TOKEN, state_dir=state_dir,
                           log_to_files=True, log_level="WARNING", broker_users=broker_users)
    stack = Stack(options)
    stop = threading.Event()
    stack.start()
    try:
        stack.wait_ready(timeout=180)
        stack.supervise(stop)
        api = httpx.Client(base_url=options.topology_url, headers={"Authorization": f"Bearer {TOKEN}"},
                           timeout=30)
        experiment = api.post("/experiments", json=cfg).raise_for_status().json()["id"]
        groups = {"workers": [p.pid for p in stack.services.values() if p.service == "worker" and p.pid],
                  **{f"service {p.service}": [p.pid] for p in stack.services.values() if p.service != "worker"
                     and p.pid},
                  "broker": broker_pids(broker)}
        trace = CpuTrace(groups)
        trace.start()
        api.post(f"/experiments/{experiment}:start").raise_for_status()
        halt = during(experiment) if during is not None else (lambda: None)
        try:
            deadline = time.monotonic() + 900
            while api.get(f"/experiments/{experiment}").json()["status"] == "running":
                if time.monotonic() > deadline:
                    raise TimeoutError("the runtime run did not finish")
                time.sleep(0.5)
        finally:
            halt()
            trace.stop()
        if cpu is not None:
            cpu.append(trace)
        time.sleep(1.0)
        summary = httpx.get(f"{options.metrics_url}/experiments/{experiment}/summary", timeout=30,
                            headers={"Authorization": f"Bearer {TOKEN}"}).json()
        reports = MetricsStore(f"sqlite:///{(state_dir / 'metrics.db').resolve()}").reports(experiment)
    finally:
        stop.set()
        stack.stop()
        stack.delete_service_queues()  # each run is a new deployment (new ports)
    return summary, reports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(size: int) -> int:
    """A port p with p .. p + size - 1 all free (worker i serves on p + i)."""
    while True:
        base = free_port()
        try:
            with contextlib.ExitStack() as held:
                for i in range(size):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue


# -- 2. model-exchange throughput -------------------------------------------------------------------------------
def model_payload(hidden: int) -> tuple[bytes, dict[str, str]]:
    model = build_model("mlp", (1, 28, 28), hidden, 10)
    params = {name: torch.randn(shape) for name, shape in model.shapes().items()}
    return encode_message(Envelope("bench", 1, 0, "models", 0, 0, params),
                          {name: TensorSpec(shape) for name, shape in model.shapes().items()})


def declare_queue(url: str, queue: str, key: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.exchange_declare(topics.MODELS_EXCHANGE, "topic", durable=True)
    channel.queue_declare(queue, durable=True)
    channel.queue_purge(queue)
    channel.queue_bind(queue, topics.MODELS_EXCHANGE, key)
    connection.close()


def delete_queue(url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_delete(queue)
    connection.close()


def runtime_exchange(url: str, body: bytes, headers: dict[str, str], n: int, prefetch: int) -> float:
    """Seconds to move n messages through HostTransport over RabbitMQTransport (publish, receive, ack)."""
    experiment = f"bench{uuid.uuid4().hex[:8]}"
    queue, key = topics.worker_queue(experiment, "worker-0"), topics.model_key(experiment, "worker-0", 1, 0)
    declare_queue(url, queue, key)
    publisher = HostTransport(RabbitMQTransport(url, prefetch=prefetch, name="bench-pub"))
    consumer = HostTransport(RabbitMQTransport(url, prefetch=prefetch, name="bench-sub"))
    consumer.receive(queue, 0.0)  # start the consumer before the clock
    done = threading.Event()

    def consume() -> None:
        got = 0
        while got < n:
            message = consumer.receive(queue, 1.0)
            if message is not None:
                consumer.ack(message)
                consumer.flush_acks()
                got += 1
        done.set()

    thread = threading.Thread(target=consume)
    began = time.perf_counter()
    thread.start()
    for _ in range(n):
        publisher.publish(topics.MODELS_EXCHANGE, key, body, headers)
    done.wait()
    elapsed = time.perf_counter() - began
    thread.join()
    publisher.close()
    consumer.close()
    delete_queue(url, queue)
    return elapsed


def raw_pika_exchange(url: str, body: bytes, headers: dict[str, str], n: int, prefetch: int) -> float:
    """Seconds to move n messages with plain pika: confirmed persistent publishes, manual acks."""
    queue, key = f"bench.raw.{uuid.uuid4().hex[:8]}", f"benchraw{uuid.uuid4().hex[:8]}.1.0"
    declare_queue(url, queue, key)
    ready, done = threading.Event(), threading.Event()

    def consume() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(url))
        channel = connection.channel()
        channel.basic_qos(prefetch_count=prefetch)
        got = 0

        def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
            nonlocal got
            ch.basic_ack(method.delivery_tag)
            got += 1
            if got >= n:
                ch.stop_consuming()

        channel.basic_consume(queue, on_message, auto_ack=False)
        ready.set()
        channel.start_consuming()
        connection.close()
        done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    ready.wait()
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    properties = pika.BasicProperties(delivery_mode=2, headers=headers)
    began = time.perf_counter()
    for _ in range(n):
        channel.basic_publish(topics.MODELS_EXCHANGE, key, body, properties)
    done.wait()
    elapsed = time.perf_counter() - began
    connection.close()
    thread.join()
    delete_queue(url, queue)
    return elapsed


def exchange_rates(url: str, hidden: int, n: int, repeats: int = 3) -> tuple[float, float, int]:
    body, headers = model_payload(hidden)
    megabytes = n * len(body) / 1e6
    runtime = min(runtime_exchange(url, body, headers, n, 64) for _ in range(repeats))
    raw = min(raw_pika_exchange(url, body, headers, n, 64) for _ in range(repeats))
    return megabytes / runtime, megabytes / raw, len(body)


def gossip_body_bytes(hidden: int, k: int = 2) -> int:
    """The body of a gossip message of the benchmark's config (k models' numerators and the weights, 8-bit)."""
    model = build_model("mlp", (1, 28, 28), hidden, 10)
    spec = {f"num.{name}": TensorSpec((k, *shape)) for name, shape in model.shapes().items()}
    spec["den"] = TensorSpec((k,), "float32")
    return body_bytes(spec, {name: s.shape for name, s in spec.items()}, torch.int8)


def exchange_cpu(url: str, messages: int, size: int, receivers: int = 2, repeats: int = 10) -> tuple[float, float]:
    """(CPU seconds of this process, of the RabbitMQ node serving `url`) per exchange: `messages` bodies of `size`
    bytes published together through RabbitMQTransport (persistent, confirmed), each delivered to `receivers` queues,
    received and acknowledged there, as a round's exchange moves them; the mean of `repeats` exchanges."""
    experiment = f"cpu{uuid.uuid4().hex[:8]}"
    publisher = RabbitMQTransport(url, name="bench-cpu-pub")
    consumers = [RabbitMQTransport(url, name=f"bench-cpu-sub{i}") for i in range(receivers)]
    queues = [f"bench.{experiment}.{i}" for i in range(receivers)]
    key = topics.model_key(experiment, "worker-0", 1, 0)
    for consumer, queue in zip(consumers, queues, strict=True):
        consumer.declare_exchange(topics.MODELS_EXCHANGE)
        consumer.declare_queue(queue)
        consumer.bind(queue, topics.MODELS_EXCHANGE, key)
        consumer.receive(queue, 0.0)  # the consumer started before the clock
    body, headers = os.urandom(size), {name: "x" * 8 for name in HEADER_KEYS}
    nodes = broker_pids(url)
    process, broker = cpu_seconds(os.getpid()), sum(cpu_seconds(pid) for pid in nodes)
    for _ in range(repeats):
        publisher.publish_pipelined([(topics.MODELS_EXCHANGE, key, body, headers)] * messages)
        for consumer, queue in zip(consumers, queues, strict=True):
            arrived = []
            while len(arrived) < messages:
                if (message := consumer.receive(queue, 30.0)) is None:
                    raise TimeoutError("an exchange's message did not arrive")
                arrived.append(message)
            consumer.ack_many(arrived)
        publisher.await_confirms()
    process = (cpu_seconds(os.getpid()) - process) / repeats
    broker = (sum(cpu_seconds(pid) for pid in nodes) - broker) / repeats
    for consumer, queue in zip(consumers, queues, strict=True):
        consumer.delete_queue(queue)
        consumer.close()
    publisher.close()
    return process, broker


def exchange_cpu_by_grouping(url: str, hidden: int, clients: int = 24, workers: int = 3, pairs: int = 3
                             ) -> dict[str, dict[str, float]]:
    """What one exchange of the benchmark's config costs the transport, its `clients` gossip messages each to the
    other workers' queues (`workers` - 1), as the runtime sends them (one message per client) and as one message per
    worker would (the same bytes in `workers` messages): medians of `pairs` alternating measurements."""
    size = gossip_body_bytes(hidden)
    runs: dict[str, list[tuple[float, float]]] = {"per client": [], "per worker": []}
    for _ in range(pairs):
        runs["per client"].append(exchange_cpu(url, clients, size, workers - 1))
        runs["per worker"].append(exchange_cpu(url, workers, size * clients // workers, workers - 1))
    return {grouping: {"messages": clients if grouping == "per client" else workers, "body_bytes": size,
                       "client_cpu_s": statistics.median(r[0] for r in measured),
                       "broker_cpu_s": statistics.median(r[1] for r in measured)}
            for grouping, measured in runs.items()}


@contextlib.contextmanager
def left_over_queues(url: str, count: int, binding: str) -> Iterator[None]:
    """`count` service queues of other deployments, as stacks that are gone leave on a shared broker (every test and
    benchmark run makes a stack): half event queues on dfca.metrics, half control queues on dfca.control, no
    consumer. `binding`: "deployment", each bound to its own deployment's keys as this version binds them
    (topics.deployment_keys), or "all", to every key as versions before it did. Deleted afterwards."""
    if count == 0:
        yield
        return
    names = []
    with contextlib.closing(pika.BlockingConnection(pika.URLParameters(url))) as connection:
        channel = connection.channel()
        for i in range(count):
            deployment = f"dleftover{i:04d}"
            exchange, queue = ((topics.METRICS_EXCHANGE, topics.events_queue(deployment, "metrics")) if i % 2 == 0
                               else (topics.CONTROL_EXCHANGE, topics.worker_control_queue(deployment, 0)))
            channel.queue_declare(queue, durable=True, arguments={"x-expires": 3600 * 1000})
            channel.queue_bind(queue, exchange, topics.deployment_keys(deployment) if binding == "deployment"
                               else topics.ALL_KEYS)
            names.append(queue)
    # the connection is closed during the run: a blocking connection left idle misses its heartbeats, the broker
    # drops it after a minute, and closing it afterwards raised (a 300-round run lost its figures so)
    try:
        yield
    finally:
        with contextlib.closing(pika.BlockingConnection(pika.URLParameters(url))) as connection:
            channel = connection.channel()
            for queue in names:
                channel.queue_delete(queue)


def idle_service_queues() -> dict[str, int] | None:
    """The service queues (events, control, dead-letter taps) on this machine's broker that no consumer reads, by how
    they are bound on dfca.metrics or dfca.control ("all": to every key; "deployment": to their own deployment's),
    from rabbitmqctl; None where it cannot be asked. Left-over queues of gone stacks cost the broker what is routed
    to them."""
    def table(*command: str) -> list[list[str]] | None:
        try:
            done = subprocess.run(["rabbitmqctl", "-q", *command], capture_output=True, text=True, timeout=60,
                                  check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return [line.split("\t") for line in done.stdout.splitlines()[1:] if line]

    queues, bindings = table("list_queues", "-p", "dfca", "name", "consumers"), table(
        "list_bindings", "-p", "dfca", "destination_name", "routing_key")
    if queues is None or bindings is None:
        return None
    idle = {q[0] for q in queues if len(q) == 2 and q[1] == "0" and q[0].split(".")[1:2] in (["events"], ["control"],
                                                                                               ["dead-letter"])}
    everything = {b[0] for b in bindings if len(b) == 2 and b[0] in idle and b[1] == topics.ALL_KEYS}
    return {"all": len(everything), "deployment": len(idle - everything)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=benchmark_broker_url())
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="worker processes of the runtime (and message drivers alone), the clients split over them "
                             "(default: as `dfca up` starts them here, one per core, at most 3)")
    parser.add_argument("--skip-rounds", action="store_true", help="only the exchange benchmark")
    parser.add_argument("--skip-exchange", action="store_true", help="only the seconds per round")
    parser.add_argument("--traffic", choices=["lean", "full"], default="lean", help="dfca.traffic of the run")
    parser.add_argument("--screen", choices=["on", "off"], default="on",
                        help="dfca.screen of the run (screened gossip, on by default)")
    parser.add_argument("--demo", action="store_true", help="the demo config (shared/dfca/configs/demo.yaml) instead")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="the config's device: where the simulator, the drivers alone and the workers compute")
    parser.add_argument("--left-over-queues", type=int, default=0,
                        help="first declare this many service queues of other deployments (stacks that are gone), "
                             "to measure what they cost the broker (left_over_queues)")
    parser.add_argument("--left-over-binding", choices=["deployment", "all"], default="deployment",
                        help="how the left-over queues are bound: to their deployment's keys (this version) or to "
                             "every key (versions before deployment keys)")
    parser.add_argument("--out", type=Path, default=Path("docs/results/runtime_benchmark_runs.jsonl"),
                        help="JSON lines file the figures are appended to (with the commit and the machine's load)")
    parser.add_argument("--private-broker", action="store_true",
                        help="a RabbitMQ node of the run's own (tests/rabbitmq_node.py) instead of --broker")
    parser.add_argument("--favoured", action="store_true",
                        help="the run's processes scheduled ahead of the machine's other sessions (favoured_run), as "
                             "on a machine to itself; with --private-broker, the broker too")
    args = parser.parse_args()
    with contextlib.ExitStack() as held:
        favour = held.enter_context(favoured()) if args.favoured else False
        if args.private_broker:
            args.broker = held.enter_context(
                RabbitMQNode.start_new(Path(held.enter_context(tempfile.TemporaryDirectory())))).url
        measure(args, favour)


def measure(args: argparse.Namespace, favour: bool) -> None:
    """main's figures: printed, and appended to args.out as one JSON line."""

    rows: list[tuple[str, str, str, str, str]] = []
    phases: dict[str, float] = {}
    record: dict[str, Any] = {"commit": commit(), "load_before": os.getloadavg()[0], "cores": os.cpu_count(),
                              "args": vars(args) | {"out": str(args.out), "broker": redact_url(args.broker)},
                              "favoured": favour}
    if args.device == "cuda":
        record["gpu"] = torch.cuda.get_device_name()
    if not args.skip_rounds:
        cfg = demo_config(args.rounds) if args.demo else bench_config(args.rounds)
        cfg["dfca"] = {**cfg.get("dfca", {}), "traffic": args.traffic, "screen": args.screen == "on"}
        cfg["device"] = args.device
        clients = ExperimentConfig.model_validate(cfg).data.clients
        sim = simulator_round_seconds(cfg)
        sim_s, sim_acc, sim_cpu, sim_by_phase = sim.same_work, sim.accuracy, sim.cpu, sim.by_kind
        with (tempfile.TemporaryDirectory() as tmp,
              left_over_queues(args.broker, args.left_over_queues, args.left_over_binding)):
            record["idle_service_queues"] = idle_service_queues()
            profile = runtime_profile(cfg, args.broker, Path(tmp), workers=args.workers)
        run_s, run_acc, phases, cpu, by_phase = (profile.seconds, profile.accuracy, profile.phases, profile.cpu,
                                                 profile.by_kind)
        record["deliveries_per_worker_round"] = profile.deliveries
        alone = drivers_floor(cfg, args.workers)
        with one_thread():
            sim1 = simulator_round_seconds(cfg, repeats=1)
        sim1_s, sim1_cpu = sim1.same_work, sim1.cpu - (sim1.seconds - sim1.same_work)  # one thread: CPU ~ wall
        rows.append((f"seconds per round ({clients} clients, {args.workers} workers, traffic {args.traffic})",
                     f"{run_s:.3f}", f"{sim_s:.3f} (simulator, same work)", f"{run_s / sim_s:.2f}x",
                     f"<= {GOAL_RATIO}x"))
        rows.append(("  against the simulator's round with its consensus metrics", f"{run_s:.3f}",
                     f"{sim.seconds:.3f}", f"{run_s / sim.seconds:.2f}x", ""))
        rows.append(("final test accuracy", f"{run_acc:.4f}", f"{sim_acc:.4f} (simulator)", "", ""))
        for phase in sorted(by_phase.keys() & sim_by_phase.keys()):
            rows.append((f"  of which {phase} rounds", f"{by_phase[phase]:.3f}", f"{sim_by_phase[phase]:.3f}",
                         f"{by_phase[phase] / sim_by_phase[phase]:.2f}x", ""))
        record.update(clients=clients, runtime_round_seconds=run_s, simulator_round_seconds=sim.seconds,
                      ratio=run_s / sim.seconds, simulator_round_seconds_same_work=sim_s,
                      ratio_same_work=run_s / sim_s, runtime_accuracy=run_acc, simulator_accuracy=sim_acc,
                      phases=phases,
                      phases_cpu=profile.phases_cpu, cpu_seconds_per_round={"simulator": sim_cpu, **cpu},
                      services_cpu_seconds_per_round=profile.services,
                      drivers_floor={"cpu_seconds_per_round": alone.cpu, "phases": alone.phases,
                                     "accuracy": alone.accuracy, "phases_cpu": alone.phases_cpu,
                                     "simulator_one_thread": {"round_seconds": sim1_s,
                                                              "cpu_seconds_per_round": sim1_cpu}},
                      seconds_by_schedule_phase={"runtime": by_phase, "simulator": sim_by_phase})
        record["cores_bound"] = cores_bound(sum(cpu.values()), alone.cpu, sim_s, os.cpu_count() or 1)._asdict()
    for hidden in () if args.skip_exchange else (64, 200):
        runtime_rate, raw_rate, size = exchange_rates(args.broker, hidden, args.messages)
        rows.append((f"model exchange MB/s ({size / 1e3:.0f} kB payloads)", f"{runtime_rate:.1f}",
                     f"{raw_rate:.1f} (raw pika)", f"{runtime_rate / raw_rate:.0%}", ">= 70%"))
        record[f"exchange_h{hidden}"] = {"payload_bytes": size, "runtime_mb_s": runtime_rate, "raw_pika_mb_s": raw_rate}
    if not args.skip_exchange:
        grouped = exchange_cpu_by_grouping(args.broker, 200 if args.demo else 64)
        record["exchange_cpu_by_grouping"] = grouped
        each, batched = grouped["per client"], grouped["per worker"]
        for what, name in (("this process (publisher and consumers)", "client_cpu_s"),
                           ("the RabbitMQ node", "broker_cpu_s")):
            rows.append((f"CPU-s an exchange, {what}: {each['messages']} messages of {each['body_bytes'] / 1e3:.0f} kB "
                         f"to 2 queues", f"{each[name]:.4f}",
                         f"{batched[name]:.4f} (the same bytes in {batched['messages']} messages)",
                         f"{each[name] / batched[name]:.2f}x", ""))
    record["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(record) + "\n")

    widths = [max(len(r[i]) for r in [*rows, ("metric", "runtime", "baseline", "ratio", "goal")])
              for i in range(5)]
    header = ("metric", "runtime", "baseline", "ratio", "goal")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
    if phases:
        total = sum(phases.values())
        print(f"\nwhere a worker's round goes (seconds per round, mean over the {args.workers} workers):\n")
        print("| phase | seconds | share |\n|---|---|---|")
        for phase, seconds in phases.items():
            print(f"| {phase} | {seconds:.3f} | {seconds / total:.0%} |")
        print(f"| all | {total:.3f} | |")
        print("\nCPU seconds per round (user + system; the simulator: every round, the first included; the runtime: "
              "from the first round's end to the last's, as its seconds per round): the simulator (its consensus "
              "metrics included) "
              f"{sim_cpu:.3f}; the runtime's workers {cpu['workers']:.3f}, its other services "
              f"{cpu['services']:.3f} ("
              + ", ".join(f"{name} {v:.3f}" for name, v in record["services_cpu_seconds_per_round"].items())
              + f"), the RabbitMQ node serving the run {cpu['broker']:.3f}, together "
              f"{sum(cpu.values()):.3f} = {sum(cpu.values()) / sim_cpu:.2f}x the simulator's, on "
              f"{os.cpu_count()} cores")
    floor, loops = record.get("drivers_floor"), record.get("phases_cpu")
    if (deliveries := record.get("deliveries_per_worker_round")) is not None:
        print(f"\nper worker and round (mean over the {args.workers} workers): {deliveries['delivered']:.1f} "
              f"deliveries from the broker for {deliveries['needed']:.1f} distinct messages its clients need from "
              "other workers; "
              f"{deliveries['applied']:.1f} (receiver, message) pairs folded")
    if floor is not None and loops is not None:
        print(f"\nwhere the CPU goes (CPU-s per round, summed over the {args.workers} workers; the drivers alone: "
              f"the same {args.workers} drivers in one thread, below):\n")
        print("| phase | runtime's round loops | drivers alone | ratio |\n|---|---|---|---|")
        for phase in PHASES:
            alone = floor["phases_cpu"][phase]
            print(f"| {phase} | {loops[phase]:.4f} | {alone:.4f} | "
                  f"{f'{loops[phase] / alone:.2f}x' if alone > 1e-4 else ''} |")
        phased = sum(loops[p] for p in PHASES)
        print(f"| the round loops beyond the phases (round reports, controls) | {loops['loop'] - phased:.4f} | | |")
        print(f"| the workers' other threads (AMQP I/O, checkpoint writer, HTTP, heartbeats) | "
              f"{record['cpu_seconds_per_round']['workers'] - loops['loop']:.4f} | | |")
        print(f"| the workers in all | {record['cpu_seconds_per_round']['workers']:.4f} | "
              f"{floor['cpu_seconds_per_round']:.4f} | "
              f"{record['cpu_seconds_per_round']['workers'] / floor['cpu_seconds_per_round']:.2f}x |")
    if (bound := record.get("cores_bound")) is not None:
        print(f"\nwhat {record['cores']} cores allow: the runtime's {sum(cpu.values()):.3f} CPU-s a round spread "
              f"perfectly over them take {bound['least_round']:.3f} s, {bound['least_ratio']:.2f}x the simulator's "
              f"same-work round, whatever an exchange's latency; {GOAL_RATIO}x allows the whole runtime "
              f"{bound['budget']:.3f} CPU-s a round, and the drivers alone use {bound['drivers_share']:.0%} of that"
              + (" (out of reach unless the drivers alone get cheaper than that)" if bound["drivers_share"] >= 1
                 else ""))
    if floor is not None:
        one = floor["simulator_one_thread"]
        print(f"\nthe drivers alone ({args.workers} message drivers in one process and thread, lockstep, in-memory "
              f"transport: no broker, AMQP client, checkpoint or service): {floor['cpu_seconds_per_round']:.3f} "
              "CPU-s per round = "
              f"{floor['cpu_seconds_per_round'] / one['cpu_seconds_per_round']:.2f}x the simulator's on one thread, "
              "without its consensus metrics "
              f"({one['cpu_seconds_per_round']:.3f} CPU-s; {one['round_seconds']:.3f} s per round); phases: "
              + ", ".join(f"{p} {v:.3f}" for p, v in floor["phases"].items() if v)
              + f"; final test accuracy {floor['accuracy']:.4f} (the simulator's {record['simulator_accuracy']:.4f})")
    if (idle := record.get("idle_service_queues")) is not None:
        print(f"\nthe broker held {idle['all'] + idle['deployment']} service queues no consumer reads when the run "
              f"began ({idle['all']} bound to every key, which get a copy of every event and command)")
    print(f"\nappended to {args.out} (commit {record['commit']}, load {record['load_before']:.2f} -> "
          f"{record['load_after']:.2f})")


if __name__ == "__main__":
    main()
