"""The topology service's record of one experiment, and the pure rules that move it along.

Status: created -> running -> completed | failed, or -> stopping -> stopped on a stop request
(created -> stopped directly). While running:
- start barrier: `go` is sent once every worker reported `ready`/`resumed`, or `BARRIER_TIMEOUT_S`
  after the start, whichever comes first;
- a worker is presumed dead when nothing (heartbeat, round report) came from it for
  `dead_after(cfg)` seconds while others were heard (after a broker outage, when nobody was
  heard, every worker gets a fresh grace period); it is live again when it speaks;
- the experiment completes when every worker with clients has finished or is presumed dead (or
  failed); the clients of dead and failed workers are reported as failed. No worker finished: failed.
- a stop that comes after every worker with clients finished the last round (one racing the run's end:
  workers that report `stopped` at the last round did finish it) leaves the run `completed`, not `stopped`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from dfca.algorithms import schedule_of
from dfca.config import ALGORITHMS, ExperimentConfig
from dfca.identity.sharding import assignment
from dfca.runtime.protocol.holdings import Placement
from dfca.runtime.protocol.messages import TERMINAL_STATUSES, ExperimentStatus, RoundReport, WorkerEvent

BARRIER_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
HEARTBEAT_S = 2.0
RUNTIME_ALGORITHMS = frozenset(ALGORITHMS)  # every algorithm runs on the message driver; ifca needs the aggregator


DONE_STATES = ("finished", "failed", "stopped")  # a worker's last word on a run


def dead_after(cfg: ExperimentConfig) -> float:
    """Seconds of silence after which a worker is presumed dead."""
    return max(3.0 * cfg.runtime.round_timeout, 10.0, 5 * HEARTBEAT_S)


@dataclass
class WorkerView:
    state: str = "pending"
    round: int = 0
    last_seen: float = 0.0  # local clock, when the last event arrived
    last_at: float = 0.0  # the worker's clock, when it made its last event
    incarnation: str = ""
    incarnations: int = 0
    retired: set[str] = field(default_factory=set)
    resumed_from: int | None = None
    detail: str = ""
    device: str = ""  # where its clients compute, once it has placed them

    def public(self, now: float) -> dict[str, Any]:
        return {"state": self.state, "round": self.round, "seconds_since_seen": round(now - self.last_seen, 3)
                if self.last_seen else None, "incarnations": self.incarnations, "resumed_from": self.resumed_from,
                "detail": self.detail, "device": self.device}


class EdgeChangeInvalid(ValueError):
    """An edge change naming clients outside the experiment, or a self loop."""


class EventRefused(ValueError):
    """An event that contradicts its experiment (its consumer dead-letters it)."""


def check_round(experiment: str, config: ExperimentConfig, event: RoundReport | WorkerEvent) -> None:
    """EventRefused for an event of a round beyond the run's (seeding rounds included)."""
    if event.round > (total := schedule_of(config).total_rounds):
        raise EventRefused(f"experiment {experiment}: worker {event.worker} reports round {event.round} of {total}")


def check_event(record: ExperimentRecord, event: RoundReport | WorkerEvent) -> None:
    """EventRefused for an event no worker of this run can send: its worker ordinal or round beyond the run's."""
    if event.worker >= record.workers:
        raise EventRefused(f"experiment {record.id}: worker {event.worker} of {record.workers}")
    check_round(record.id, record.config, event)


@dataclass
class ExperimentRecord:
    id: str
    config: ExperimentConfig
    workers: int
    edges: list[tuple[int, int]]
    status: ExperimentStatus = "created"
    topology_version: int = 0
    effective_round: int = 0
    go: bool = False
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    stop_requested_at: float | None = None
    failed_clients: list[int] = field(default_factory=list)
    worker_views: dict[int, WorkerView] = field(default_factory=dict)
    saved_round: int = 0  # `round` when the record was last saved: what a restarted service shows for a finished run
    placement: Placement | None = None  # `data.source: workers`: which registered worker holds which client

    @classmethod
    def new(cls, experiment: str, cfg: ExperimentConfig, graph: nx.Graph, workers: int,
            placement: Placement | None = None) -> ExperimentRecord:
        edges = sorted((min(int(u), int(v)), max(int(u), int(v))) for u, v in graph.edges() if u != v)
        return cls(experiment, cfg, workers, edges, placement=placement)

    # -- views ------------------------------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return self.config.data.clients

    def neighbours(self) -> dict[int, list[int]]:
        out: dict[int, set[int]] = {c: set() for c in range(self.num_clients)}
        for u, v in self.edges:
            out[u].add(v)
            out[v].add(u)
        return {c: sorted(m) for c, m in out.items()}

    def assignment(self) -> dict[int, list[int]]:
        if self.placement is not None:
            return {w: self.placement.clients_of(w) for w in range(self.workers)}
        return assignment(self.num_clients, self.workers)

    def host(self, client: int) -> int:
        """The ordinal of the worker hosting `client`."""
        return self.placement.hosts[client] if self.placement is not None else client % self.workers

    def hosting_workers(self) -> list[int]:
        return [w for w, clients in self.assignment().items() if clients]

    @property
    def round(self) -> int:
        """Rounds completed by every live worker (the slowest one's progress)."""
        if not self.worker_views:  # restored from disk after the run: nothing heard since
            return self.saved_round
        live = [self.worker_views[w].round for w in self.hosting_workers()
                if self.worker_views.get(w) and self.worker_views[w].state not in ("dead", "failed")]
        return min(live, default=0)

    def public(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        schedule = schedule_of(self.config)
        return {
            "id": self.id, "name": self.config.name, "algorithm": self.config.algorithm, "status": self.status,
            "round": self.round, "rounds": schedule.total_rounds, "seeding_rounds": schedule.seeding_rounds,
            "clients": self.num_clients,
            "workers": self.workers,
            "go": self.go, "topology_version": self.topology_version, "created_at": self.created_at,
            "started_at": self.started_at, "finished_at": self.finished_at, "failed_clients": self.failed_clients,
            "worker_states": {str(w): v.public(now) for w, v in sorted(self.worker_views.items())},
            "config": self.config.model_dump(mode="json"),
        }

    def topology(self) -> dict[str, Any]:
        return {
            "id": self.id, "version": self.topology_version, "effective_round": self.effective_round,
            "clients": self.num_clients, "workers": self.workers, "edges": [list(e) for e in self.edges],
            "neighbours": {str(c): m for c, m in self.neighbours().items()},
            "worker_clients": {str(w): c for w, c in self.assignment().items()},
            "placement": None if self.placement is None else self.placement.model_dump(mode="json"),
        }

    # -- transitions ------------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        self.status, self.started_at = "running", now
        self.worker_views = {w: WorkerView(last_seen=now) for w in self.hosting_workers()}

    def observe(self, event: RoundReport | WorkerEvent, now: float) -> None:
        """A worker spoke: note its round and state (events of one incarnation apply in the order made). An event
        no worker of this run can send (a worker ordinal or a round beyond the run's) raises EventRefused."""
        check_event(self, event)
        view = self.worker_views.setdefault(event.worker, WorkerView())
        if event.incarnation in view.retired or (event.incarnation == view.incarnation and event.at < view.last_at):
            return
        if event.incarnation != view.incarnation:  # a restarted worker: its predecessor is gone for good
            if view.incarnation:
                view.retired.add(view.incarnation)
            view.incarnation, view.incarnations = event.incarnation, view.incarnations + 1
        view.last_seen, view.last_at, view.round = now, event.at, event.round
        if isinstance(event, RoundReport):
            if view.state in ("pending", "preparing", "ready", "dead"):
                view.state = "running"
            return
        view.state = "ready" if event.state in ("ready", "resumed") else event.state
        view.detail = event.detail
        view.device = event.device or view.device
        if event.resumed_from is not None:
            view.resumed_from = event.resumed_from

    def barrier_passed(self, now: float) -> bool:
        """True when `go` should be sent now."""
        if self.status != "running" or self.go:
            return False
        views = [self.worker_views.get(w) for w in self.hosting_workers()]
        all_ready = all(v is not None and v.state in ("ready", "finished", "failed") for v in views)
        return all_ready or (self.started_at is not None and now - self.started_at > BARRIER_TIMEOUT_S)

    def mark_dead(self, now: float, grace_since: float = 0.0) -> list[int]:
        """Presume workers dead that were silent for `dead_after` seconds since `grace_since` (when the
        topology service last started hearing events again, after an outage of its own or the broker's)."""
        limit = dead_after(self.config)
        newly = []
        for w, view in self.worker_views.items():
            silent = now - max(view.last_seen, grace_since)
            if view.state in ("pending", "preparing", "ready", "running") and self.go and silent > limit:
                view.state = "dead"
                newly.append(w)
        return newly

    def finished_last_round(self, view: WorkerView) -> bool:
        """Whether a worker is done with every round: it said `finished`, or a stop reached it after the last."""
        return view.state == "finished" or (view.state == "stopped" and
                                            view.round >= schedule_of(self.config).total_rounds)

    def completed_before_stop(self) -> bool:
        """Every worker with clients finished the last round (or is dead or failed, at least one finished): what a
        stop that arrived late finds, and must not turn into `stopped`."""
        if not self.go:
            return False
        views = [self.worker_views.get(w) for w in self.hosting_workers()]
        if any(v is None for v in views):
            return False
        done = [v for v in views if v is not None and self.finished_last_round(v)]
        return bool(done) and all(v is not None and (self.finished_last_round(v) or v.state in ("dead", "failed"))
                                  for v in views)

    def settle(self, now: float) -> ExperimentStatus | None:
        """The terminal status the experiment reached, if it reached one."""
        if self.status == "stopping":
            if self.completed_before_stop():
                return "completed"
            views = self.worker_views.values()
            if all(v.state in ("stopped", "finished", "failed", "dead") for v in views) or (
                    self.stop_requested_at is not None and now - self.stop_requested_at > STOP_TIMEOUT_S):
                return "stopped"
            return None
        if self.status != "running" or not self.go:
            return None
        views = [self.worker_views[w] for w in self.hosting_workers() if w in self.worker_views]
        if len(views) < len(self.hosting_workers()) or any(v.state not in ("finished", "dead", "failed")
                                                            for v in views):
            return None
        return "completed" if any(v.state == "finished" for v in views) else "failed"

    def finish(self, status: ExperimentStatus, now: float) -> None:
        self.status, self.finished_at = status, now
        lost = [w for w, v in self.worker_views.items() if v.state in ("dead", "failed")]
        plan = self.assignment()
        self.failed_clients = sorted(c for w in lost for c in plan.get(w, []))

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def change_edges(self, add: Iterable[tuple[int, int]], remove: Iterable[tuple[int, int]]) -> None:
        edges = set(self.edges)
        for u, v in [*add, *remove]:
            if u == v or not (0 <= u < self.num_clients and 0 <= v < self.num_clients):
                raise EdgeChangeInvalid(f"edge ({u}, {v}): clients must differ and lie in 0..{self.num_clients - 1}")
        edges -= {(min(u, v), max(u, v)) for u, v in remove}
        edges |= {(min(u, v), max(u, v)) for u, v in add}
        self.edges = sorted(edges)
        self.topology_version += 1

    # -- persistence ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "config": self.config.model_dump(mode="json"), "workers": self.workers,
            "edges": [list(e) for e in self.edges], "status": self.status, "topology_version": self.topology_version,
            "effective_round": self.effective_round, "go": self.go, "created_at": self.created_at,
            "started_at": self.started_at, "finished_at": self.finished_at, "failed_clients": self.failed_clients,
            "round": self.round,
            "placement": None if self.placement is None else self.placement.model_dump(mode="json"),
            # a worker done with the run never speaks again: a restarted topology service must not presume it dead
            "done_workers": {str(w): v.state for w, v in self.worker_views.items() if v.state in DONE_STATES},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExperimentRecord:
        record = cls(
            data["id"], ExperimentConfig.model_validate(data["config"]), int(data["workers"]),
            [(int(u), int(v)) for u, v in data["edges"]], status=data["status"],
            topology_version=int(data["topology_version"]), effective_round=int(data["effective_round"]),
            go=bool(data["go"]), created_at=float(data["created_at"]), started_at=data["started_at"],
            finished_at=data["finished_at"], failed_clients=list(data["failed_clients"]),
            saved_round=int(data.get("round", 0)),
            placement=None if data.get("placement") is None else Placement.model_validate(data["placement"]),
        )
        now = time.time()  # a restarted topology service gives every worker a fresh grace period
        record.worker_views = {w: WorkerView(state="running" if record.go else "pending", last_seen=now)
                               for w in record.hosting_workers()} if record.status in ("running", "stopping") else {}
        for w, state in data.get("done_workers", {}).items():
            if int(w) in record.worker_views and state in DONE_STATES:
                record.worker_views[int(w)].state = state
        return record
