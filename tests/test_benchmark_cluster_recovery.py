"""benchmarks/cluster_recovery.py: its configs are the ones it claims, and its table counts seeds right."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from rich.console import Console

from dfca.algorithms import schedule_of

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark() -> ModuleType:
    if str(ROOT / "benchmarks") not in sys.path:  # the benchmark imports its sibling resumable_runs
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("cluster_recovery", ROOT / "benchmarks" / "cluster_recovery.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cluster_recovery"] = module
    spec.loader.exec_module(module)
    return module


def test_columns_are_the_default_the_paper_rule_and_ifca() -> None:
    bench = load_benchmark()
    setting = bench.SETTINGS[2]  # k=4 N=32 ER p=0.2
    robust = bench.config(setting, bench.COLUMNS["robust GI"], 0, 30, 200)
    default = bench.config(setting, {"algorithm": "dfca", "init": "global"}, 0, 30, 200)
    paper = bench.config(setting, bench.COLUMNS["paper GI"], 0, 30, 200)
    ifca = bench.config(setting, bench.COLUMNS["IFCA"], 0, 30, 200)
    assert robust.dfca.seeding_rule == default.dfca.seeding_rule == "farthest"  # the column is the default
    assert robust.dfca.variant == default.dfca.variant == "robust"
    assert paper.dfca.seeding_rule == "none" and schedule_of(paper).seeding_rounds == 0
    assert ifca.algorithm == "ifca" and schedule_of(ifca).seeding_rounds == 0
    assert robust.rounds == paper.rounds == ifca.rounds == 30  # equal training rounds; seeding on top
    schedule = schedule_of(robust)
    assert schedule.total_rounds == 30 + schedule.seeding_rounds and schedule.seeding_rounds > 0
    # each cluster its own permutation of the 4,000 training images: 8 clients per cluster, 200 each (the cap)
    assert robust.data.permute_per_cluster and robust.data.train_per_client == 200
    big = bench.config(bench.SETTINGS[6], bench.COLUMNS["paper GI"], 0, 30, 200)  # N=240, k=4: 60 per cluster
    assert big.data.train_per_client == 4000 // 60


def test_table_counts_seeds_that_recovered(tmp_path: Path) -> None:
    bench = load_benchmark()
    label = bench.SETTINGS[0]["label"]
    runs = [{"setting": label, "column": "robust GI", "seed": s, "rounds": 30, "ari": ari, "acc": 0.9}
            for s, ari in enumerate([1.0, 1.0, 0.96, 0.5, 1.0])]
    runs += [{"setting": label, "column": "IFCA", "seed": 0, "rounds": 30, "ari": 1.0, "acc": 0.91}]
    (tmp_path / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in runs))
    bench.render(bench.load_runs(tmp_path / "runs.jsonl"), bench.SETTINGS, ["robust GI", "paper GI", "IFCA"],
                 tmp_path, Console(quiet=True))
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0] == "| setting | robust GI | paper GI | IFCA |"
    assert table[2] == f"| {label} | 0.89 / 0.50 (4/5), 90.0% | - | 1.00 / 1.00 (1/1), 91.0% |"
    assert (tmp_path / "cluster_recovery.png").stat().st_size > 0
