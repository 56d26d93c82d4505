#!/usr/bin/env python3
"""Set the number of dfca workers in k8s/: one StatefulSet of one pod per worker ordinal.

    python scripts/k8s_workers.py N [--k8s-dir k8s]

Rewrites the worker StatefulSets of k8s/worker.yaml as N copies of worker-0's (its name, ordinal label,
DFCA_WORKER_ORDINAL and broker Secret renumbered) and DFCA_WORKERS in k8s/config.yaml. Each worker has
its own StatefulSet because a StatefulSet's pods share one template: one StatefulSet of N pods would
hand every worker every worker's broker password. Then make the broker users for N workers
(docs/deployment.md, "Scaling the workers") and `kubectl apply -f k8s/`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

SEPARATOR = "---\n"
ORDINAL_LABEL = "dfca.dev/worker-ordinal"
_WORKERS_LINE = re.compile(r'^(\s*DFCA_WORKERS: )"[0-9]+"', re.M)
_ORDINAL_LABEL_LINE = re.compile(rf'^(\s*{re.escape(ORDINAL_LABEL)}: )"0"$', re.M)
_ORDINAL_ENV = re.compile(r'^(\s*- name: DFCA_WORKER_ORDINAL\n\s*value: )"0"$', re.M)
_WORKER_0 = re.compile(r"\bworker-0\b")


def documents(text: str) -> list[str]:
    """The file's YAML documents as text, each starting with its `---` line (the first may not)."""
    parts = re.split(r"(?m)^(?=---\n)", text)
    return [part for part in parts if part]


def is_worker_statefulset(document: str) -> bool:
    loaded = yaml.safe_load(document)
    return isinstance(loaded, dict) and loaded.get("kind") == "StatefulSet" and \
        loaded["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "worker"


def renumbered(template: str, ordinal: int) -> str:
    """worker-0's StatefulSet as worker `ordinal`'s."""
    text = _WORKER_0.sub(f"worker-{ordinal}", template)
    text = _ORDINAL_LABEL_LINE.sub(rf'\g<1>"{ordinal}"', text)
    return _ORDINAL_ENV.sub(rf'\g<1>"{ordinal}"', text)


def check(document: str, ordinal: int) -> None:
    loaded = yaml.safe_load(document)
    container = loaded["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    found = (loaded["metadata"]["name"], loaded["spec"]["template"]["metadata"]["labels"][ORDINAL_LABEL],
             loaded["spec"]["selector"]["matchLabels"][ORDINAL_LABEL], env["DFCA_WORKER_ORDINAL"]["value"],
             env["DFCA_BROKER_URL"]["valueFrom"]["secretKeyRef"]["name"], loaded["spec"]["replicas"])
    wanted = (f"worker-{ordinal}", str(ordinal), str(ordinal), str(ordinal), f"dfca-broker-worker-{ordinal}", 1)
    if found != wanted:
        raise ValueError(f"worker {ordinal}'s StatefulSet came out as {found}, not {wanted}: "
                         "is worker-0's StatefulSet in k8s/worker.yaml still the template this script expects?")


def worker_manifest(text: str, workers: int) -> str:
    """k8s/worker.yaml's text with `workers` worker StatefulSets."""
    docs = documents(text)
    positions = [i for i, doc in enumerate(docs) if is_worker_statefulset(doc)]
    if not positions or positions != list(range(positions[0], positions[-1] + 1)):
        raise ValueError("k8s/worker.yaml must hold its worker StatefulSets one after another")
    templates = [docs[i] for i in positions if yaml.safe_load(docs[i])["metadata"]["name"] == "worker-0"]
    if len(templates) != 1:
        raise ValueError("k8s/worker.yaml has no StatefulSet named worker-0 to copy")
    workers_docs = [renumbered(templates[0], ordinal) for ordinal in range(workers)]
    for ordinal, doc in enumerate(workers_docs):
        check(doc, ordinal)
    return "".join(docs[:positions[0]] + workers_docs + docs[positions[-1] + 1:])


def config_manifest(text: str, workers: int) -> str:
    updated, count = _WORKERS_LINE.subn(rf'\g<1>"{workers}"', text)
    if count != 1:
        raise ValueError("k8s/config.yaml must set DFCA_WORKERS once")
    return updated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workers", type=int, help="how many workers (1..1000)")
    parser.add_argument("--k8s-dir", type=Path, default=Path(__file__).resolve().parents[1] / "k8s")
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= 1000:
        parser.error("the number of workers must be 1..1000")
    worker_file, config_file = args.k8s_dir / "worker.yaml", args.k8s_dir / "config.yaml"
    try:
        worker_text = worker_manifest(worker_file.read_text(), args.workers)
        config_text = config_manifest(config_file.read_text(), args.workers)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as err:
        print(f"k8s_workers: {err}", file=sys.stderr)
        return 1
    worker_file.write_text(worker_text)
    config_file.write_text(config_text)
    print(f"{worker_file} and {config_file}: {args.workers} workers. Next: broker users for {args.workers} workers "
          "(docs/deployment.md, 'Scaling the workers'), then kubectl apply -f k8s/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
