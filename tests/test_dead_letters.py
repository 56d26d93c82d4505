"""Dead letters in the metrics service: charged to the experiment their broker-proven publisher may speak for, counted
every one, stored one by one up to a cap per experiment (runtime.metrics.dead_letters, metrics_store)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy

from dfca.identity import topics
from dfca.runtime.metrics.dead_letters import ROWS_PER_EXPERIMENT, UNATTRIBUTED, DeadLetter, charged_experiment
from dfca.runtime.metrics.metrics_store import MetricsStore

MODELS, CONTROL, EVENTS = topics.MODELS_EXCHANGE, topics.CONTROL_EXCHANGE, topics.METRICS_EXCHANGE


def test_a_dead_letter_counts_against_the_experiment_only_where_its_publisher_may_speak_for_the_key() -> None:
    own = topics.model_key("victim", "worker-1", 4, 0)
    claimed = topics.model_key("victim", "worker-0", 3, 0)
    assert charged_experiment(MODELS, own, "dfca-worker-1") == "victim"  # its own client's model, in that run
    assert charged_experiment(MODELS, claimed, "dfca-worker-1") == UNATTRIBUTED  # another worker's client
    assert charged_experiment(MODELS, "not-a-key", "dfca-worker-1") == UNATTRIBUTED
    stop = topics.control_key("d0", "victim", "stop")
    assert charged_experiment(CONTROL, stop, "dfca-worker-1") == UNATTRIBUTED
    assert charged_experiment(CONTROL, stop, "dfca-topology") == "victim"
    assert charged_experiment(EVENTS, topics.metrics_key("d0", "victim", "round"), "dfca-worker-2") == "victim"
    assert charged_experiment(EVENTS, topics.metrics_key("d0", "victim", "round"), "dfca-metrics") == UNATTRIBUTED
    # a shared user proves nobody: the key's experiment, as it names it
    assert charged_experiment(MODELS, claimed, "dfca") == "victim"
    assert charged_experiment(MODELS, claimed, "") == "victim"


def test_dead_letters_are_all_counted_but_stored_up_to_a_cap_per_experiment(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    store = MetricsStore(url)
    claimed = topics.model_key("victim", "worker-0", 3, 0)
    flood = [DeadLetter(charged_experiment(MODELS, claimed, "dfca-worker-1"), MODELS, claimed, "dfca-worker-1")
             for _ in range(ROWS_PER_EXPERIMENT + 500)]
    store.record_dead_letters(flood[:700])
    store.record_dead_letters(flood[700:])
    honest = topics.model_key("victim", "worker-0", 3, 1)
    store.record_dead_letters([("victim", MODELS, honest, "dfca-worker-0")] * 3)
    store.record_dead_letter("other", MODELS, topics.model_key("other", "worker-0", 0, 0))
    assert store.dead_letters("victim") == 3 and store.dead_letter_publishers("victim") == {"dfca-worker-0": 3}
    assert store.dead_letters(UNATTRIBUTED) == ROWS_PER_EXPERIMENT + 500
    assert store.dead_letter_rows(UNATTRIBUTED) == ROWS_PER_EXPERIMENT  # the flood's rows stop at the cap
    assert store.dead_letter_counts() == {"victim": 3, UNATTRIBUTED: ROWS_PER_EXPERIMENT + 500, "other": 1}
    assert store.dead_letters() == ROWS_PER_EXPERIMENT + 504
    assert MetricsStore(url).dead_letters("victim") == 3  # counts persist


def test_a_store_from_before_dead_letters_were_counted_counts_its_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sqlalchemy.text("CREATE TABLE dead_letters (id INTEGER PRIMARY KEY, experiment "
                                           "VARCHAR(80), exchange VARCHAR(80), routing_key VARCHAR(255), at FLOAT)"))
        for _ in range(4):
            connection.execute(sqlalchemy.text("INSERT INTO dead_letters (experiment, exchange, routing_key, at) "
                                               "VALUES ('m1', 'dfca.models', 'm1.worker-0.3.0', 1.0)"))
    store = MetricsStore(url)
    assert store.dead_letters("m1") == 4 and store.dead_letter_publishers("m1") == {"": 4}
    store.record_dead_letter("m1", MODELS, "m1.worker-0.3.0")
    assert store.dead_letters("m1") == 5 and store.dead_letter_rows("m1") == 5
