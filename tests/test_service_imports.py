"""A service process starts without scikit-learn, SciPy or pandas: they took 2.5-3 s of a worker's 7 s start here
(a killed worker pod's comeback), and only some algorithms and the simulator's summaries use them, when they do."""

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


def test_what_uses_them_still_imports_them_when_it_runs() -> None:
    """The metrics that need them import them on their first call."""
    code = ("import sys, torch; from dfca.evaluation import cluster_ari, cluster_accuracy; "
            "a = torch.tensor([0, 0, 1, 1]); t = torch.tensor([1, 1, 0, 0]); "
            "print(cluster_ari(a, t), cluster_accuracy(a, t), 'sklearn' in sys.modules, 'scipy' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1.0", "1.0", "True", "True"]
