"""What the dashboard reads of the metrics service, without a browser: each client's assigned cluster matched to a
true one (so a perfect run draws every node's fill in its ring's colour), the run's config and round labels in the
overview, and the vendored ECharts served from the package with its licence, nothing loaded from elsewhere."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

from fastapi.testclient import TestClient

from dfca.algorithms import schedule_of
from dfca.config import ExperimentConfig
from dfca.core.label_matching import label_matching
from dfca.runtime.metrics.dashboard import clients_view
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.protocol.messages import ExperimentEvent, RoundReport
from dfca.transport import InMemoryTransport
from services.metrics.main import MetricsCollector, create_app

CFG = ExperimentConfig.model_validate({"name": "m", "clusters": 2, "rounds": 2,
                                       "data": {"dataset": "digits", "clients": 4}})
STATIC = files("dfca.runtime.metrics") / "dashboard_static"


def test_assigned_clusters_are_matched_to_the_true_cluster_they_overlap_most() -> None:
    assert label_matching([1, 1, 0, 0], [0, 0, 1, 1]) == {1: 0, 0: 1}
    assert label_matching([5, 5, 5, 2], [0, 0, 1, 1]) == {5: 0, 2: 1}
    assert label_matching([], []) == {}
    view = clients_view({"clients": [0, 1, 2, 3], "assigned": [1, 1, 0, 0], "true_cluster": [0, 0, 1, 1]})
    assert view["has_truth"] and view["matching"] == {"0": 1, "1": 0}
    assert view["matched_assigned"] == view["true_cluster"] == [0, 0, 1, 1]  # ARI 1 with swapped ids: all match
    view = clients_view({"clients": [0, 1, 2, 3], "assigned": [1, 1, 0, 1], "true_cluster": [0, 0, 1, 1]})
    assert view["matched_assigned"] == [0, 0, 1, 0]  # client 3 is in the wrong cluster: its fill differs


def test_an_assigned_cluster_left_over_gets_a_colour_of_its_own_and_without_truth_the_raw_one_is_kept() -> None:
    view = clients_view({"clients": [0, 1, 2], "assigned": [2, 0, 1], "true_cluster": [0, 0, 1]})
    assert sorted(view["matching"].values()) == [0, 1, 2]  # two matched, the third after the true clusters
    assert view["matched_assigned"][2] == 1
    view = clients_view({"clients": [0, 1], "assigned": [3, 1], "true_cluster": [-1, -1]})
    assert not view["has_truth"] and view["matched_assigned"] == [3, 1] and view["true_cluster"] == []
    assert clients_view({})["clients"] == []


def round_report(worker: int, round_: int) -> RoundReport:
    clients = [worker, worker + 2]
    evaluation = {"clients": clients, "assigned": [1, 0], "test_accuracy": [0.8, 0.9], "train_loss": [1.0, 0.5],
                  "true_cluster": [0, 1]}  # right clusters, numbered the other way round
    return RoundReport(deployment="d", experiment="m1", worker=worker, incarnation="a", round=round_,
                       clients=clients, complete=True, seconds=1.0, evaluation=evaluation, stats={},
                       bytes_published=100, at=1000.0 + round_)


def test_the_overview_carries_the_matching_the_config_and_round_labels(tmp_path: Path) -> None:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    collector = MetricsCollector(InMemoryTransport(), store, "d")
    collector.on_event(ExperimentEvent(deployment="d", experiment="m1", status="running", config=CFG, at=1000.0))
    for round_ in (1, 2):
        for worker in (0, 1):
            collector.on_event(round_report(worker, round_))
    with TestClient(create_app(store, "memory://")) as client:
        view = client.get("/ui/api/overview/m1").json()
        unknown = client.get("/ui/api/overview/nope").json()
    clients = view["clients"]
    assert clients["assigned"] == [1, 1, 0, 0] and clients["true_cluster"] == [0, 0, 1, 1]
    assert clients["matched_assigned"] == clients["true_cluster"] and clients["matching"] == {"0": 1, "1": 0}
    assert view["config"]["clusters"] == 2 and view["config"]["data"]["clients"] == 4
    seeding = schedule_of(CFG).seeding_rounds  # robust DFCA's seeding rounds come first
    assert seeding > 2 and view["schedule"] == {"seeding_rounds": seeding, "rounds": 2}
    assert [(h["phase"], h["phase_round"], h["phase_rounds"]) for h in view["history"]] == [
        ("seeding", 1, seeding), ("seeding", 2, seeding)]  # the page shows them as "seeding 1 of S"...
    assert view["summary"]["cluster_ari"] == 1.0
    assert unknown["known"] is False and unknown["clients"]["matched_assigned"] == []


def test_echarts_is_vendored_served_and_licensed_and_the_page_loads_nothing_from_elsewhere(tmp_path: Path) -> None:
    store = MetricsStore(f"sqlite:///{tmp_path / 'metrics.db'}")
    with TestClient(create_app(store, "memory://")) as client:
        script = client.get("/ui/static/echarts.min.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert script.content == (STATIC / "echarts.min.js").read_bytes() and b"echarts" in script.content[:2000]
        licence = client.get("/ui/static/echarts.LICENSE.txt")
        assert licence.status_code == 200 and "Apache License" in licence.text
        assert client.get("/ui/static/VENDORED.md").status_code == 200
        page = client.get("/ui").text
    assert '<script src="/ui/static/echarts.min.js">' in page
    vendored = (STATIC / "VENDORED.md").read_text()
    version = re.search(r"ECharts (\d+\.\d+\.\d+)", vendored)
    assert version and f"echarts@{version.group(1)}" in vendored and "Apache License 2.0" in vendored
    for name in ("index.html", "app.js", "style.css"):  # no CDN, no remote font: every URL is the service's own
        assert not re.search(r"(src|href)=\"(https?:)?//|url\((https?:)?//|import\(", (STATIC / name).read_text()), name
