"""Prometheus metrics of the metrics service, computed from the store at scrape time.

dfca_experiment_round, dfca_worker_round, dfca_messages_{published,applied,duplicate,stale_dropped,
not_neighbour,republished}_total, dfca_messages_rejected_total{reason}, dfca_messages_dead_lettered_total,
dfca_gossip_screened_total, dfca_client_bytes_sent_total (what the clients sent, each message counted once per
receiver with its headers and routing key: the simulator's `bytes_sent_per_client_per_round` x rounds x clients),
dfca_round_timeouts_total, dfca_message_lag_seconds, dfca_test_accuracy, dfca_cluster_ari,
dfca_cluster_accuracy{cluster}, dfca_experiment_status{status}, dfca_worker_phase_seconds_total{worker,phase} and
dfca_worker_phase_cpu_seconds_total{worker,phase} (where each worker's round loop spends its time and its CPU:
DriverStats' phases, and `loop` for the loop's thread in all); every one labelled by experiment.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.metrics.run_summary import history, latest_by_round, message_totals, worker_phase_totals

log = logging.getLogger(__name__)
MAX_EXPERIMENTS = 50  # the most recent ones are exported
STATUSES = ("created", "running", "stopping", "stopped", "completed", "failed")


class RuntimeCollector(Collector):
    def __init__(self, store: MetricsStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        label = ["experiment"]
        families = {
            "round": GaugeMetricFamily("dfca_experiment_round", "Rounds completed by the slowest worker", labels=label),
            "worker_round": GaugeMetricFamily("dfca_worker_round", "Rounds completed per worker",
                                              labels=[*label, "worker"]),
            "published": CounterMetricFamily("dfca_messages_published", "Model messages published", labels=label),
            "applied": CounterMetricFamily("dfca_messages_applied", "Neighbour models applied", labels=label),
            "duplicates": CounterMetricFamily("dfca_messages_duplicate", "Duplicate models ignored", labels=label),
            "stale_dropped": CounterMetricFamily("dfca_messages_stale_dropped", "Late models dropped", labels=label),
            "not_neighbour": CounterMetricFamily("dfca_messages_not_neighbour", "Models from non-neighbours ignored",
                                                 labels=label),
            "republished": CounterMetricFamily("dfca_messages_republished", "Models published again after a new "
                                               "connection to the broker (a restart lost them)", labels=label),
            "screened": CounterMetricFamily("dfca_gossip_screened", "Gossip estimates dropped by screened gossip "
                                            "(dfca.screen), per arrival and cluster", labels=label),
            "rejected": CounterMetricFamily("dfca_messages_rejected", "Malformed or spoofed models rejected",
                                            labels=[*label, "reason"]),
            "dead_lettered": CounterMetricFamily("dfca_messages_dead_lettered", "Messages seen on the dead-letter "
                                                 "exchange", labels=label),
            "bytes_sent": CounterMetricFamily("dfca_client_bytes_sent", "Bytes the clients sent (body, headers and "
                                              "routing key), each message once per receiver", labels=label),
            "timeouts": CounterMetricFamily("dfca_round_timeouts", "Rounds that ended on the round timeout",
                                            labels=label),
            "lag": GaugeMetricFamily("dfca_message_lag_seconds", "Mean publish-to-delivery lag, last round",
                                     labels=label),
            "accuracy": GaugeMetricFamily("dfca_test_accuracy", "Mean test accuracy, last evaluated round",
                                          labels=label),
            "ari": GaugeMetricFamily("dfca_cluster_ari", "Cluster ARI, last evaluated round", labels=label),
            "cluster_accuracy": GaugeMetricFamily("dfca_cluster_accuracy", "Mean test accuracy of each cluster's "
                                                  "clients, last evaluated round", labels=[*label, "cluster"]),
            "status": GaugeMetricFamily("dfca_experiment_status", "1 for the experiment's status",
                                        labels=[*label, "status"]),
            "phase_seconds": CounterMetricFamily("dfca_worker_phase_seconds", "Seconds each worker's round loop spent "
                                                 "in each phase (train, publish, receive, wait, mix, checkpoint)",
                                                 labels=[*label, "worker", "phase"]),
            "phase_cpu": CounterMetricFamily("dfca_worker_phase_cpu_seconds", "CPU seconds of each worker's round "
                                             "loop in each phase, and in all (loop)",
                                             labels=[*label, "worker", "phase"]),
        }
        dead = self.store.dead_letter_counts()
        for experiment_id in self.store.experiment_ids()[-MAX_EXPERIMENTS:]:
            try:
                self._add(families, experiment_id, dead)
            except Exception:  # one experiment's bad records must not take /metrics down for all of them
                log.exception("metrics of experiment %s could not be exported", experiment_id)
        yield from families.values()

    def _add(self, families: dict[str, Any], experiment_id: str, dead: dict[str, int]) -> None:
        experiment = self.store.experiment(experiment_id)
        if experiment is None:
            return
        for status in STATUSES:
            families["status"].add_metric([experiment_id, status], float(experiment.status == status))
        reports = self.store.reports(experiment_id)
        totals = message_totals(reports, dead.get(experiment_id, 0))
        for key in ("published", "applied", "duplicates", "stale_dropped", "not_neighbour", "timeouts",
                    "dead_lettered", "screened", "republished"):
            families[key].add_metric([experiment_id], float(totals[key]))
        for reason, count in totals["rejected"].items():
            families["rejected"].add_metric([experiment_id, reason], float(count))
        for key, family in (("seconds", "phase_seconds"), ("cpu_seconds", "phase_cpu")):
            for worker, phases in sorted(worker_phase_totals(reports, key).items()):
                for phase, seconds in phases.items():
                    families[family].add_metric([experiment_id, str(worker), phase], seconds)
        by_round = latest_by_round(reports)
        families["bytes_sent"].add_metric([experiment_id], float(sum(r.bytes_published for chosen in by_round.values()
                                                                     for r in chosen.values())))
        worker_round: dict[int, int] = {}
        for round_, by_worker in by_round.items():
            for w in by_worker:
                worker_round[w] = max(worker_round.get(w, 0), round_)
        for w, r in sorted(worker_round.items()):
            families["worker_round"].add_metric([experiment_id, str(w)], float(r))
        families["round"].add_metric([experiment_id], float(min(worker_round.values(), default=0)))
        records = history(experiment, reports)
        if records:
            families["lag"].add_metric([experiment_id], records[-1]["lag_seconds"])
        evaluated = [r for r in records if "test_accuracy" in r]
        if evaluated:
            last = evaluated[-1]
            families["accuracy"].add_metric([experiment_id], last["test_accuracy"])
            if "ari" in last:  # the true clusters are known
                families["ari"].add_metric([experiment_id], last["ari"])
            for j, acc in enumerate(last["cluster_accuracy"]):
                if acc is not None:
                    families["cluster_accuracy"].add_metric([experiment_id, str(j)], acc)
