"""benchmarks/runtime_screen_cost.py end to end, one short pair on the shared broker: both runtime runs finish and
learn what the simulator learns, and the record holds each side's figures and their ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_runs import run_benchmark


@pytest.mark.rabbitmq
@pytest.mark.slow
def test_one_pair_runs_the_runtime_screened_and_unscreened_and_records_both(rabbitmq_url: str, tmp_path: Path
                                                                            ) -> None:
    rows, printed = run_benchmark("runtime_screen_cost.py", "--pairs", "1", "--rounds", "6", "--broker", rabbitmq_url,
                                  out=tmp_path / "rows.jsonl")
    (row,) = rows
    (pair,) = row["pairs"]
    for side in ("on", "off"):
        figures = pair[side]
        assert figures["runtime_s"] > 0 and figures["runtime_cpu"] > 0 and figures["simulator_s"] > 0
        # the same run on both drivers: the runtime's accuracy is the simulator's to float rounding, which may flip
        # a few of the 600 test predictions (a screen's drop at its threshold too)
        assert figures["runtime_accuracy"] == pytest.approx(figures["simulator_accuracy"], abs=6 / 600)
        assert figures["runtime_accuracy"] > 0.6  # two rotations of MNIST after 6 rounds; chance is 0.1
    assert pair["ratios"]["runtime_s"] == pytest.approx(pair["on"]["runtime_s"] / pair["off"]["runtime_s"])
    assert row["median"] == pair["ratios"] and row["commit"] and row["rounds"] == 6
    assert "| 1 |" in printed and "median, screened over unscreened" in printed
