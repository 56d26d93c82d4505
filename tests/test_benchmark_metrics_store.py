"""benchmarks/metrics_store.py measures what the metrics service does: every report stored once, whichever way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sqlalchemy

from dfca.config import ExperimentConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from metrics_store import WORKERS, config_checks, round_reports, store_reports  # noqa: E402
from runtime_benchmark import bench_config  # noqa: E402


@pytest.mark.parametrize("batch,commits", [(1, 12), (3, 4), (10, 2)])
def test_the_store_benchmark_stores_every_report_in_as_many_commits_as_it_says(
        tmp_path: Path, batch: int, commits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    config = ExperimentConfig.model_validate(bench_config(4))
    reports = round_reports(4)
    assert len(reports) == 4 * WORKERS and [r.round for r in reports[:4]] == [1, 1, 1, 2]
    counted: list[int] = []
    original = sqlalchemy.create_engine

    def counting_engine(*args: object, **kwargs: object) -> sqlalchemy.Engine:
        engine = original(*args, **kwargs)
        sqlalchemy.event.listen(engine, "commit", lambda _conn: counted.append(1))
        return engine

    monkeypatch.setattr("dfca.runtime.metrics.metrics_store.create_engine", counting_engine)
    figures = store_reports(tmp_path, reports, config, batch)  # asserts every report stored once
    assert figures["cpu_ms"] > 0 and figures["wall_ms"] > 0
    assert len(counted) == 2 + commits  # the tables, the experiment's event, then the reports'


def test_the_config_check_is_timed_both_ways(tmp_path: Path) -> None:
    config = ExperimentConfig.model_validate(bench_config(4))
    checks = config_checks(tmp_path, round_reports(4), config)
    assert set(checks) == {"from the store", "parsed once"}
    assert all(figures["cpu_ms"] > 0 for figures in checks.values())
