"""A worker whose clients send forgeries: the product's worker service, its clients' algorithm wrapped in
harness.forgery.Forger. For the tests that run a compromised worker in a real stack (runtime_fixtures.running_stack's
`forge`); the product's worker has no way to forge.

    python tests/harness/forging_worker.py ATTACK

ATTACK as harness.forgery.Attack.parse reads it ('seed=inflate,gossip=inflate'), with the worker's DFCA_* environment.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `harness`

from dfca.algorithms import Algorithm, HostContext  # noqa: E402
from dfca.runtime.worker import client_runner  # noqa: E402
from harness.forgery import Attack, Forger  # noqa: E402
from services.worker.main import main  # noqa: E402

log = logging.getLogger("dfca.forging_worker")


def forging(attack: Attack) -> None:
    """Every runner of this process builds its clients' algorithm, then wraps it in a Forger."""
    honest = client_runner.clients_of

    def forged_clients_of(ctx: HostContext) -> Algorithm:
        log.warning("worker FORGES its clients' messages (%s): clients %s", attack.label, ctx.rows.tolist())
        return cast(Algorithm, Forger(honest(ctx), attack, ctx.cfg.seed))

    client_runner.clients_of = forged_clients_of  # type: ignore[assignment]


if __name__ == "__main__":
    forging(Attack.parse(sys.argv[1]))
    main()
