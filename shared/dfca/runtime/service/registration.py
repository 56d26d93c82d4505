"""Whether the topology service knows a process: what a worker's and the aggregator's /readyz wait for.

Workers and the aggregator announce themselves on the bus every HEARTBEAT_S (PresenceEvent). The topology service
starts an algorithm with a central role only while it knows an aggregator, and counts the workers it has heard
from. A process that merely reaches the broker may not be known yet (its first announcement can precede the
topology service's event queue, or wait behind a busy machine), so a process is ready only once the topology
service lists it under GET /deployment: a deployment whose every /readyz passes can start any experiment at once.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import httpx

log = logging.getLogger(__name__)

Role = Literal["worker", "aggregator"]
READY_TIMEOUT_S = 2.0  # with the broker's handshake (3 s), within a 5-s readiness probe


def known_to_topology(http: httpx.Client, topology_url: str | None, role: Role, ordinal: int = 0) -> bool:
    """True when the topology service at `topology_url` lists this worker (`ordinal`) or an aggregator; with no
    topology URL (a process on an in-memory bus, in tests) there is nobody to know it, and it counts as known."""
    if not topology_url:
        return True
    view = deployment_view(http, topology_url)
    if view is None:
        return False
    if role == "aggregator":
        return bool(view.get("aggregator"))
    return ordinal in view.get("workers_present", [])


def deployment_view(http: httpx.Client, topology_url: str) -> dict[str, Any] | None:
    """The topology service's GET /deployment, or None when it cannot be asked."""
    try:
        response = http.get(f"{topology_url.rstrip('/')}/deployment", timeout=READY_TIMEOUT_S)
    except httpx.HTTPError as err:
        log.debug("the topology service cannot be asked about the deployment: %s", err)
        return None
    return dict(response.json()) if response.is_success else None


def data_refusal(http: httpx.Client, topology_url: str | None, ordinal: int) -> str | None:
    """Why the topology service refused the data worker `ordinal` registered, or None."""
    view = deployment_view(http, topology_url) if topology_url else None
    return None if view is None else view.get("data_refused", {}).get(str(ordinal))
