"""The metrics service's storage: experiments, round reports, worker state changes and dead letters.

SQLAlchemy over SQLite by default (`sqlite:///dfca-metrics.db`), PostgreSQL by URL
(`postgresql+psycopg://...`). Reports are stored as they arrive; a round re-run by a restarted
worker is stored again under its new incarnation, and the views use the latest one. Events that arrive together
can be stored in one transaction (`MetricsStore.writes`): one commit, which on SQLite is most of what storing
an event costs.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Boolean,
    Float,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from dfca.config import ExperimentConfig
from dfca.runtime.metrics.dead_letters import ROWS_PER_EXPERIMENT, DeadLetter
from dfca.runtime.protocol.messages import ExperimentEvent, FinalModelsShare, RoundReport, WorkerEvent
from dfca.runtime.service.state_dirs import require_writable, sqlite_folder


class Base(DeclarativeBase):
    pass


class ExperimentRow(Base):
    __tablename__ = "experiments"
    id: Mapped[str] = mapped_column(String(80), primary_key=True)
    deployment: Mapped[str] = mapped_column(String(40))
    status: Mapped[str] = mapped_column(String(20))
    config: Mapped[str] = mapped_column(Text)
    failed_clients: Mapped[str] = mapped_column(Text, default="[]")
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)


class RoundReportRow(Base):
    __tablename__ = "round_reports"
    __table_args__ = (UniqueConstraint("experiment", "worker", "incarnation", "round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    experiment: Mapped[str] = mapped_column(String(80), index=True)
    worker: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[str] = mapped_column(String(16))
    round: Mapped[int] = mapped_column(Integer)
    clients: Mapped[str] = mapped_column(Text)
    complete: Mapped[bool] = mapped_column(Boolean)
    seconds: Mapped[float] = mapped_column(Float)
    lag_seconds: Mapped[float] = mapped_column(Float)
    bytes_published: Mapped[int] = mapped_column(Integer, default=0)
    evaluation: Mapped[str | None] = mapped_column(Text, nullable=True)
    stats: Mapped[str] = mapped_column(Text)
    dead_neighbours: Mapped[str] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)
    received_at: Mapped[float] = mapped_column(Float)


class WorkerEventRow(Base):
    __tablename__ = "worker_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    experiment: Mapped[str] = mapped_column(String(80), index=True)
    worker: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(20))
    round: Mapped[int] = mapped_column(Integer)
    resumed_from: Mapped[int | None] = mapped_column(Integer, nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")
    device: Mapped[str] = mapped_column(String(100), default="", server_default="")
    at: Mapped[float] = mapped_column(Float)


# Columns added after a store's first release: (table, column, SQL type and default), added to an older file on open.
ADDED_COLUMNS = (("worker_events", "device", "VARCHAR(100) NOT NULL DEFAULT ''"),
                 ("dead_letters", "publisher", "VARCHAR(100) NOT NULL DEFAULT ''"))


class FinalModelsRow(Base):
    """Each worker's latest share of an experiment's final models (`dfca.runtime.protocol.final_models`)."""

    __tablename__ = "final_models"
    __table_args__ = (UniqueConstraint("experiment", "worker"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    experiment: Mapped[str] = mapped_column(String(80), index=True)
    worker: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[str] = mapped_column(String(16))
    safetensors: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Float)


class DeadLetterRow(Base):
    """One dead letter, up to dead_letters.ROWS_PER_EXPERIMENT of an experiment."""

    __tablename__ = "dead_letters"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    experiment: Mapped[str] = mapped_column(String(80), index=True)
    exchange: Mapped[str] = mapped_column(String(80))
    routing_key: Mapped[str] = mapped_column(String(255))
    at: Mapped[float] = mapped_column(Float)
    publisher: Mapped[str] = mapped_column(String(100), default="")


class DeadLetterCountRow(Base):
    """How many dead letters counted against an experiment each publisher caused, stored as rows or not."""

    __tablename__ = "dead_letter_counts"
    experiment: Mapped[str] = mapped_column(String(80), primary_key=True)
    publisher: Mapped[str] = mapped_column(String(100), primary_key=True)
    count: Mapped[int] = mapped_column(Integer)


@dataclass(frozen=True)
class StoredReport:
    worker: int
    incarnation: str
    round: int
    clients: list[int]
    complete: bool
    seconds: float
    lag_seconds: float
    bytes_published: int
    evaluation: dict[str, list[Any]] | None
    stats: dict[str, Any]
    dead_neighbours: list[int]
    at: float


@dataclass(frozen=True)
class StoredExperiment:
    id: str
    status: str
    config: ExperimentConfig
    failed_clients: list[int]
    created_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float


class MetricsStore:
    def __init__(self, url: str) -> None:
        options: dict[str, Any] = {}
        folder = sqlite_folder(url)
        if folder is not None:  # a folder it cannot write: refuse now, not lose reports later
            require_writable(folder, "DFCA_METRICS_DB_URL")
        if url.startswith("sqlite"):
            options["connect_args"] = {"check_same_thread": False}
        self.engine = create_engine(url, **options)
        tables = inspect(self.engine)
        uncounted = tables.has_table(DeadLetterRow.__tablename__) and not tables.has_table(
            DeadLetterCountRow.__tablename__)  # a store from before dead letters were counted
        Base.metadata.create_all(self.engine)
        self._add_missing_columns()
        if uncounted:
            self._count_stored_dead_letters()
        self._write = threading.Lock()
        self._last_state: dict[tuple[str, int, str], str] = {}  # of committed worker events
        self._batch = threading.local()  # .session, .states: the calling thread's open `writes` transaction

    def _add_missing_columns(self) -> None:
        """A store written by an earlier version lacks the columns added since (`create_all` makes only missing
        tables): add them, so an upgraded metrics service reads its old database."""
        for table, column, declaration in ADDED_COLUMNS:
            if column not in {c["name"] for c in inspect(self.engine).get_columns(table)}:
                with self.engine.begin() as connection:
                    connection.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}"))

    def _count_stored_dead_letters(self) -> None:
        """A store written before dead letters were counted: its rows are the counts."""
        with self.engine.begin() as connection:
            connection.execute(text("INSERT INTO dead_letter_counts (experiment, publisher, count) SELECT experiment, "
                                    "publisher, COUNT(*) FROM dead_letters GROUP BY experiment, publisher"))

    # -- writes ---------------------------------------------------------------------------------------
    @contextmanager
    def writes(self) -> Iterator[None]:
        """The record_* calls of this thread inside go into one transaction, committed at the end: all of them
        stored, or (an exception) none."""
        states: dict[tuple[str, int, str], str] = {}
        with self._write, Session(self.engine) as session, session.begin():
            self._batch.session, self._batch.states = session, states
            try:
                yield
            finally:
                self._batch.session = None
        self._last_state.update(states)  # committed

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """The session a write goes into: the open `writes` transaction of this thread, else one of its own."""
        if (batch := getattr(self._batch, "session", None)) is not None:
            yield batch
            return
        with self._write, Session(self.engine) as session, session.begin():
            yield session

    def record_experiment(self, event: ExperimentEvent) -> None:
        with self._writing() as session:
            row = session.get(ExperimentRow, event.experiment)
            if row is None:
                row = ExperimentRow(id=event.experiment, deployment=event.deployment, created_at=event.at)
                session.add(row)
            row.status, row.config = event.status, event.config.model_dump_json()
            row.failed_clients, row.updated_at = json.dumps(event.failed_clients), event.at
            if event.status == "running" and row.started_at is None:
                row.started_at = event.at
            if event.status in ("completed", "failed", "stopped"):
                row.finished_at = event.at

    def record_round(self, report: RoundReport) -> None:
        with self._writing() as session:
            exists = session.scalar(select(RoundReportRow.id).where(  # (autoflushed: sees this batch's reports)
                RoundReportRow.experiment == report.experiment, RoundReportRow.worker == report.worker,
                RoundReportRow.incarnation == report.incarnation, RoundReportRow.round == report.round))
            if exists is not None:  # a redelivered report
                return
            session.add(RoundReportRow(
                experiment=report.experiment, worker=report.worker, incarnation=report.incarnation,
                round=report.round, clients=json.dumps(report.clients), complete=report.complete,
                seconds=report.seconds, lag_seconds=report.lag_seconds, bytes_published=report.bytes_published,
                evaluation=json.dumps(report.evaluation) if report.evaluation is not None else None,
                stats=json.dumps(report.stats), dead_neighbours=json.dumps(report.dead_neighbours),
                at=report.at, received_at=time.time(),
            ))

    def record_worker(self, event: WorkerEvent) -> None:
        """Store state changes only (heartbeats repeat the state)."""
        key = (event.experiment, event.worker, event.incarnation)
        batched = getattr(self._batch, "session", None) is not None
        states = self._batch.states if batched else self._last_state  # a batch's take effect once it commits
        if states.get(key, self._last_state.get(key)) == event.state:
            return
        with self._writing() as session:
            session.add(WorkerEventRow(
                experiment=event.experiment, worker=event.worker, incarnation=event.incarnation, state=event.state,
                round=event.round, resumed_from=event.resumed_from, detail=event.detail, device=event.device,
                at=event.at,
            ))
        states[key] = event.state

    def record_final_models(self, share: FinalModelsShare) -> None:
        """Keep a worker's share of the final models (a restarted worker's replaces its earlier one)."""
        with self._writing() as session:
            row = session.scalars(select(FinalModelsRow).where(FinalModelsRow.experiment == share.experiment,
                                                               FinalModelsRow.worker == share.worker)).first()
            if row is None:
                row = FinalModelsRow(experiment=share.experiment, worker=share.worker)
                session.add(row)
            row.incarnation, row.safetensors, row.sha256, row.at = (share.incarnation, share.safetensors,
                                                                    share.sha256, share.at)

    def final_model_shares(self, experiment: str) -> list[tuple[int, str, str]]:
        """(worker, base64 safetensors, sha256) of every worker's share, by worker."""
        with Session(self.engine) as session:
            rows = session.scalars(select(FinalModelsRow).where(FinalModelsRow.experiment == experiment)
                                   .order_by(FinalModelsRow.worker)).all()
            return [(r.worker, r.safetensors, r.sha256) for r in rows]

    def record_dead_letter(self, experiment: str, exchange: str, routing_key: str, publisher: str = "") -> None:
        self.record_dead_letters([DeadLetter(experiment, exchange, routing_key, publisher)])

    def record_dead_letters(self, letters: Iterable[tuple[str, ...]]) -> None:
        """Dead letters (runtime.metrics.dead_letters.DeadLetter: the experiment charged, exchange, routing key,
        publisher), in one transaction: each counted, and stored as a row while its experiment has fewer than
        ROWS_PER_EXPERIMENT."""
        now = time.time()
        given = [DeadLetter(*letter) for letter in letters]
        kept = [DeadLetter(d.experiment[:80], d.exchange[:80], d.routing_key[:255], d.publisher[:100]) for d in given]
        counts = Counter((letter.experiment, letter.publisher) for letter in kept)
        with self._writing() as session:
            for (experiment, publisher), n in counts.items():
                if (row := session.get(DeadLetterCountRow, (experiment, publisher))) is None:
                    session.add(DeadLetterCountRow(experiment=experiment, publisher=publisher, count=n))
                else:
                    row.count += n
            room: dict[str, int] = {}
            for letter in kept:
                if letter.experiment not in room:
                    room[letter.experiment] = ROWS_PER_EXPERIMENT - int(session.scalar(
                        select(func.count(DeadLetterRow.id)).where(DeadLetterRow.experiment == letter.experiment))
                        or 0)
                if room[letter.experiment] > 0:
                    room[letter.experiment] -= 1
                    session.add(DeadLetterRow(experiment=letter.experiment, exchange=letter.exchange,
                                              routing_key=letter.routing_key, publisher=letter.publisher, at=now))

    # -- reads ----------------------------------------------------------------------------------------
    def experiment(self, experiment: str) -> StoredExperiment | None:
        with Session(self.engine) as session:
            row = session.get(ExperimentRow, experiment)
            if row is None:
                return None
            return StoredExperiment(row.id, row.status, ExperimentConfig.model_validate_json(row.config),
                                    json.loads(row.failed_clients), row.created_at, row.started_at,
                                    row.finished_at, row.updated_at)

    def experiment_ids(self) -> list[str]:
        with Session(self.engine) as session:
            return list(session.scalars(select(ExperimentRow.id).order_by(ExperimentRow.created_at)))

    def reports(self, experiment: str, after_id: int = 0) -> list[StoredReport]:
        with Session(self.engine) as session:
            rows = session.scalars(select(RoundReportRow).where(
                RoundReportRow.experiment == experiment, RoundReportRow.id > after_id).order_by(RoundReportRow.id))
            return [StoredReport(r.worker, r.incarnation, r.round, json.loads(r.clients), r.complete, r.seconds,
                                 r.lag_seconds, r.bytes_published,
                                 json.loads(r.evaluation) if r.evaluation else None, json.loads(r.stats),
                                 json.loads(r.dead_neighbours), r.at) for r in rows]

    def last_report_id(self, experiment: str) -> int:
        with Session(self.engine) as session:
            return int(session.scalar(select(func.max(RoundReportRow.id)).where(
                RoundReportRow.experiment == experiment)) or 0)

    def worker_events(self, experiment: str) -> list[dict[str, Any]]:
        with Session(self.engine) as session:
            rows = session.scalars(select(WorkerEventRow).where(WorkerEventRow.experiment == experiment)
                                   .order_by(WorkerEventRow.id))
            return [{"worker": r.worker, "incarnation": r.incarnation, "state": r.state, "round": r.round,
                     "resumed_from": r.resumed_from, "detail": r.detail, "device": r.device, "at": r.at}
                    for r in rows]

    def dead_letters(self, experiment: str | None = None) -> int:
        """How many dead letters counted against `experiment` (None: all), stored as rows or not."""
        with Session(self.engine) as session:
            query = select(func.sum(DeadLetterCountRow.count))
            if experiment is not None:
                query = query.where(DeadLetterCountRow.experiment == experiment)
            return int(session.scalar(query) or 0)

    def dead_letter_counts(self) -> dict[str, int]:
        """Dead letters per experiment charged ("": charged to their publishers alone)."""
        with Session(self.engine) as session:
            rows = session.execute(select(DeadLetterCountRow.experiment, func.sum(DeadLetterCountRow.count))
                                   .group_by(DeadLetterCountRow.experiment))
            return {str(e): int(n) for e, n in rows}

    def dead_letter_publishers(self, experiment: str) -> dict[str, int]:
        """An experiment's dead letters by broker-proven publisher ("": not proven)."""
        with Session(self.engine) as session:
            rows = session.execute(select(DeadLetterCountRow.publisher, DeadLetterCountRow.count)
                                   .where(DeadLetterCountRow.experiment == experiment))
            return {str(p): int(n) for p, n in rows}

    def dead_letter_rows(self, experiment: str) -> int:
        """How many of an experiment's dead letters are stored one by one (at most ROWS_PER_EXPERIMENT)."""
        with Session(self.engine) as session:
            return int(session.scalar(select(func.count(DeadLetterRow.id))
                                      .where(DeadLetterRow.experiment == experiment)) or 0)
