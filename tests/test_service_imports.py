"""A service process starts without scikit-learn, SciPy or pandas: they took 2.5-3 s of a worker's 7 s start here
(a killed worker pod's comeback), and no service, simulated run or clustering metric needs them (the ARI and the
matched accuracy are dfca.core.label_matching's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("sklearn", "scipy", "pandas")


@pytest.mark.parametrize("service", ["worker", "topology", "metrics", "aggregator"])
def test_a_service_imports_no_scientific_stack_it_does_not_use(service: str) -> None:
    code = (f"import sys, services.{service}.main; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ""


def test_a_simulated_run_and_its_clustering_metrics_import_none_of_them() -> None:
    """The ARI and the matched accuracy (dfca.core.label_matching) need neither: importing them made a run's first
    round 2.6 s of the demo's 9.7 s, and stalled a metrics service's first report."""
    code = ("import sys, torch; from dfca.config import ExperimentConfig; from dfca.simulator import simulate; "
            "from dfca.results.evaluation import cluster_ari, cluster_accuracy; "
            "a = torch.tensor([0, 0, 1, 1]); t = torch.tensor([1, 1, 0, 0]); "
            "cfg = ExperimentConfig.model_validate({'name': 't', 'clusters': 2, 'rounds': 2, 'data': "
            "{'dataset': 'mnist-bundled', 'rotations': [0, 180], 'clients': 8, 'train_per_client': 20, "
            "'test_per_client': 5}}); "
            "r = simulate(cfg); "
            "print(cluster_ari(a, t), cluster_accuracy(a, t), 'ari' in r.history[-1], "
            f"','.join(m for m in {HEAVY!r} if m in sys.modules) or '-')")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1.0", "1.0", "True", "-"]
