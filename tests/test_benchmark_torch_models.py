"""benchmarks/torch_models.py: the paper's CNN batched against a per-client torch loop, and the built-in MLP against
the same MLP as an nn.Module, each way checked to end at the same models, timed and recorded."""

from __future__ import annotations

from pathlib import Path

from benchmark_runs import run_benchmark


def test_the_benchmark_times_every_way_of_both_cases_and_records_them(tmp_path: Path) -> None:
    rows, printed = run_benchmark("torch_models.py", "--clients", "3", "--train", "12", "--batch", "4",
                                  "--mlp-epochs", "1", "--hidden", "16", "--repeats", "1", out=tmp_path / "runs.jsonl")
    cnn, mlp = rows
    assert (cnn["case"], mlp["case"], cnn["clients"], cnn["device"]) == ("cnn", "mlp", 3, "cpu") and cnn["commit"]
    assert set(cnn["ways"]) == {"batched", "per-client loop"}
    assert set(mlp["ways"]) == {"hand-written MLP", "batched module", "per-client loop"}
    for row in rows:
        assert row["max_difference"] <= 1e-4  # the same models every way (the script refuses otherwise)
        assert all(way["seconds"] > 0 and len(way["seconds_all"]) == 1 for way in row["ways"].values())
    assert cnn["ways"]["batched"]["gflops"] > 0 and cnn["matmul_gflops"] > 0
    assert "cnn: batched is" in printed and "mlp: the module takes" in printed
