"""benchmarks/screen_cost_figure.py end to end: it draws each loss-free goal-grid setting's latest lean 10-round run of
screen_cost.py, at the setting's mean degree, and leaves out what is not such a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(setting: str, date: str, ratio: float, **changes: object) -> dict[str, object]:
    return {"setting": setting, "traffic": "lean", "rounds": 10, "seed": 0, "commit": f"c{ratio}", "date": date,
            "ratio": ratio, "gossip": {"ratio": ratio + 0.5}, "merge": {"ratio": ratio - 0.1}, **changes}


def test_the_figure_takes_each_settings_latest_lean_run_at_its_degree(tmp_path: Path) -> None:
    rows = [
        run("k=2 N=100 ER p=0.15", "2026-11-29 04:00 UTC", 2.5),
        run("k=2 N=100 ER p=0.15", "2026-11-29 05:00 UTC", 2.1),  # the latest: drawn
        run("k=2 N=100 ER p=0.15", "2026-11-29 06:00 UTC", 9.0, traffic="full"),  # not lean: left out
        run("k=4 N=32 ER p=0.2", "2026-11-29 05:00 UTC", 1.1),
        run("k=4 N=32 ER p=0.2, 10% loss, sequential", "2026-11-29 05:00 UTC", 1.2),  # lossy settings: left out
    ]
    runs, out = tmp_path / "runs.jsonl", tmp_path / "figure.png"
    runs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run([sys.executable, "benchmarks/screen_cost_figure.py", "--runs", str(runs), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("k=")]
    assert len(lines) == 2  # by degree: the 32 clients' graph (about 6 neighbours) first, then the 100 clients' (15)
    assert lines[0].startswith("k=4 N=32 ER p=0.2: degree 5.9, all 1.10x, gossip 1.60x, merges 1.00x (c1.1")
    assert lines[1].startswith("k=2 N=100 ER p=0.15: degree 15.0, all 2.10x, gossip 2.60x, merges 2.00x (c2.1")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_with_no_such_run_it_says_so_and_draws_nothing(tmp_path: Path) -> None:
    runs, out = tmp_path / "runs.jsonl", tmp_path / "figure.png"
    runs.write_text(json.dumps(run("k=2 N=30 BA m=2", "2026-11-29 05:00 UTC", 1.3, rounds=5)) + "\n")
    done = subprocess.run([sys.executable, "benchmarks/screen_cost_figure.py", "--runs", str(runs), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "no lean 10-round runs" in done.stderr
    assert not out.exists()
