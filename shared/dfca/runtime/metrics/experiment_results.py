"""What the metrics service serves of a runtime experiment besides numbers: its final models and its plots, as
the files `dfca run` writes (`models/cluster_j.safetensors`, `models/assignments.json`, `accuracy.png`, ...)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from safetensors.torch import save as st_save

from dfca.algorithms import schedule_of
from dfca.runtime.metrics.metrics_store import MetricsStore
from dfca.runtime.metrics.run_summary import final_evaluation, history
from dfca.runtime.protocol.final_models import FinalModelsInvalid, decode_sums, merge_sums


class NoResults(LookupError):
    """The experiment has no such results (yet); the message says why."""


def model_files(store: MetricsStore, experiment: str) -> dict[str, bytes]:
    """`<name>.safetensors` per final model (the workers' shares merged) and `assignments.json`."""
    shares = store.final_model_shares(experiment)
    if not shares:
        raise NoResults(f"experiment {experiment!r} has no final models: its workers send them when they finish "
                        "the last round (a stopped, failed or running experiment has none)")
    try:
        merged = merge_sums(decode_sums(encoded, digest) for _, encoded, digest in shares)
    except FinalModelsInvalid as err:
        raise NoResults(f"experiment {experiment!r}: the workers' final models do not merge: {err}") from err
    files = {f"{name}.safetensors": st_save({n: t.contiguous() for n, t in params.items()})
             for name, params in sorted(merged.items())}
    final = final_evaluation(store.reports(experiment), set())
    assigned = dict(zip(final.get("clients", []), final.get("assigned", []), strict=True))
    files["assignments.json"] = (json.dumps({"assigned": [int(assigned[c]) for c in sorted(assigned)]}) + "\n").encode()
    return files


def plot_files(store: MetricsStore, experiment: str) -> dict[str, bytes]:
    """The plots `dfca run` draws (accuracy.png, ari.png, clusters.png, traffic.png, ...: `plot_history`), from the
    experiment's metrics history."""
    from dfca.results.outputs import plot_history  # matplotlib: only when plots are asked for

    stored = store.experiment(experiment)
    if stored is None:
        raise NoResults(f"no experiment {experiment!r}")
    records = history(stored, store.reports(experiment))  # every round: traffic.png draws the unevaluated ones too
    if not any("test_accuracy" in h or "gcd" in h for h in records):
        raise NoResults(f"experiment {experiment!r} has no evaluated rounds yet")
    with tempfile.TemporaryDirectory() as folder:
        paths = plot_history(Path(folder), records, stored.config.name, schedule_of(stored.config).seeding_rounds)
        return {p.name: p.read_bytes() for p in paths}
