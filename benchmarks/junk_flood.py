"""A junk flood from one compromised worker's credentials, against the honest run, in one run of this script.

Three runs of runtime_benchmark's config (rotated MNIST k=2, 24 clients, 3 workers, ER p=0.5) on the local
RabbitMQ, each on a fresh stack:
1. honest, every process its own broker user (dfca.identity.broker_users);
2. the same while worker 1's credentials publish junk under worker 1's own clients' keys from the start, for
   `--flood-seconds` (or the whole run if shorter), as fast as one publisher with confirms can (the broker
   lets it through; receivers see the proven publisher and cut those clients off after BLOCK_AFTER_INVALID
   malformed messages each);
3. the same flood under the shared development user (no publisher proof: nobody can be cut off).

    python benchmarks/junk_flood.py [--broker URL] [--rabbitmqctl "rabbitmqctl"] [--rounds 8] [--flood-seconds 60]

It makes the principals' users on the broker with `rabbitmqctl` (new passwords each time) and writes the
table to docs/junk_flood.md with the commit and the machine's load. Goal: a flood neither stops a
run nor more than doubles its round time.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from resumable_runs import commit
from runtime_benchmark import bench_config, runtime_run

from dfca.identity import topics
from dfca.identity.broker_users import principal_url, principals_of, rabbitmqctl_commands
from dfca.identity.sharding import clients_of
from dfca.settings import benchmark_broker_url
from dfca.transport import RabbitMQTransport

REPO = Path(__file__).resolve().parents[1]


def make_users(broker: str, rabbitmqctl: str) -> dict[str, str]:
    """Each principal's URL on `broker`, its user made (or re-passworded) with rabbitmqctl."""
    parts = urlsplit(broker)
    urls = {}
    for principal in principals_of(3):
        password = os.urandom(12).hex()
        for command in rabbitmqctl_commands(principal, password):
            done = subprocess.run([*shlex.split(rabbitmqctl), *command], capture_output=True, text=True, check=False)
            if done.returncode != 0 and command[0] != "add_user":
                sys.exit(f"rabbitmqctl {' '.join(command[:2])} failed: {done.stderr.strip()[-300:]}")
        urls[principal] = principal_url(principal, password, parts.hostname or "127.0.0.1", parts.port or 5672)
    return urls


def flood(url: str, counter: list[int], seconds: float) -> Callable[[str], Callable[[], None]]:
    """Start publishing junk under worker 1's clients' keys when the experiment starts; stop when asked."""

    def start(experiment: str) -> Callable[[], None]:
        stop = threading.Event()
        keys = [topics.model_key(experiment, "worker-1", c, 0) for c in clients_of(1, 3, 24)]

        def run() -> None:
            with RabbitMQTransport(url, name="flood") as transport:
                end = time.monotonic() + seconds
                while not stop.is_set() and time.monotonic() < end:
                    for key in keys:
                        transport.publish(topics.MODELS_EXCHANGE, key, b"junk")
                        counter[0] += 1

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def halt() -> None:
            stop.set()
            thread.join(30)

        return halt

    return start


def steady_seconds(reports: list[Any]) -> float:
    done_at: dict[int, float] = {}
    for report in reports:  # a round is done when its last worker reports it
        done_at[report.round] = max(done_at.get(report.round, 0.0), report.at)
    rounds = sorted(done_at)
    return (done_at[rounds[-1]] - done_at[rounds[0]]) / (len(rounds) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=benchmark_broker_url())
    parser.add_argument("--rabbitmqctl", default="rabbitmqctl")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--flood-seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "junk_flood.md")
    args = parser.parse_args()
    load_before = os.getloadavg()
    users = make_users(args.broker, args.rabbitmqctl)
    cfg = bench_config(args.rounds)
    runs = [("honest, one broker user per principal", users, None),
            ("flooded by worker 1, one broker user per principal", users, users["worker-1"]),
            ("flooded, shared broker user (no publisher proof)", None, args.broker)]
    rows = []
    for label, broker_users, flood_url in runs:
        sent = [0]
        with tempfile.TemporaryDirectory() as tmp:
            began = time.monotonic()
            summary, reports = runtime_run(cfg, args.broker, Path(tmp), broker_users,
                                           flood(flood_url, sent, args.flood_seconds) if flood_url else None)
            wall = time.monotonic() - began
        messages = summary.get("messages", {})
        rows.append((label, steady_seconds(reports), summary.get("status"), summary.get("test_accuracy", 0.0),
                     summary.get("cluster_ari", 0.0), sent[0], messages.get("rejected_total", 0),
                     messages.get("blocked", 0), wall))
        print(f"{label}: {rows[-1][1]:.2f} s/round, {rows[-1][2]}, junk sent {sent[0]}", flush=True)
    base = rows[0][1]
    lines = [
        "# A junk flood from one worker's credentials",
        "",
        f"`python benchmarks/junk_flood.py --rounds {args.rounds}` at commit {commit()}, "
        f"load average {load_before[0]:.2f} before the runs, {os.cpu_count()} cores, local RabbitMQ. Config: "
        "benchmarks/runtime_benchmark.py's `bench_config` (rotated MNIST k=2, 24 clients, ER p=0.5, 3 workers, "
        f"{args.rounds} training rounds after robust DFCA's seeding). The flood starts with the run and lasts "
        f"{args.flood_seconds:g} s at most. Seconds per round: steady state (the first reported round left out).",
        "",
        "| run | s/round | vs honest | status | accuracy | ARI | junk sent | rejected | blocked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, seconds, status, acc, ari, sent, rejected, blocked, _wall in rows:
        lines.append(f"| {label} | {seconds:.2f} | {seconds / base:.2f}x | {status} | {acc:.3f} | {ari:.2f} | "
                     f"{sent} | {rejected} | {blocked} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
