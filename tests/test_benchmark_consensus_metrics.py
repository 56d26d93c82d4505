"""benchmarks/consensus_metrics.py: every form of the index consistency timed on the simulator's sampled edges, the
forms agreeing, and `auto`'s choice recorded as the metric takes it."""

from __future__ import annotations

from pathlib import Path

from benchmark_runs import run_benchmark


def test_the_benchmark_times_every_form_on_sampled_edges_and_records_autos_choice(tmp_path: Path) -> None:
    rows, printed = run_benchmark("consensus_metrics.py", "--cases", "runtime,100", "--repeats", "1",
                                  out=tmp_path / "runs.jsonl")
    assert [r["case"] for r in rows] == ["runtime", "100"]
    runtime, sparse = rows
    assert (runtime["clients"], runtime["hidden"], sparse["clients"]) == (24, 64, 100)
    assert 0 < runtime["edges"] <= 200 and 0 < sparse["edges"] <= 200  # the simulator's sample: at most 200
    assert runtime["auto"] == "gram" and sparse["auto"] == "edges"  # dense and small; sparse
    for r in rows:
        assert set(r["seconds"]) == {"edges", "gram", "blocks"} and all(v > 0 for v in r["seconds"].values())
        assert r["disagreement_seconds"] > 0 and r["commit"]  # (the forms' agreement: the benchmark fails if not)
    assert "| runtime | 24 | 64 |" in printed
