"""Who is who on the broker: one broker user per service and per worker ordinal.

A deployment either shares one broker user among all its processes (local development, the tests) or
gives each *principal* its own: `dfca-topology`, `dfca-metrics`, `dfca-aggregator` and `dfca-worker-<i>`
(`dfca.identity.broker_users` creates them with generated passwords and the least privileges each needs). Every
publisher stamps its messages with the AMQP `user_id` of its connection and RabbitMQ refuses a message
whose `user_id` is not the publisher's own user, so a delivered message's `publisher` is proven by the
broker, not by a header.

A receiver connected as a principal checks that proof (`PublisherCheck`): a worker takes control
documents only from the topology service and a neighbour's model only from the worker that hosts that
neighbour; topology and metrics take a worker's events only from that worker. A receiver connected as a
shared user cannot tell publishers apart and accepts every publisher (the deployment has no sender proof).
"""

from __future__ import annotations

import re

TOPOLOGY = "topology"
METRICS = "metrics"
AGGREGATOR = "aggregator"
SERVICES = (TOPOLOGY, METRICS, AGGREGATOR)
USER_PREFIX = "dfca-"
_WORKER = re.compile(r"^worker-(0|[1-9][0-9]{0,5})$")


def worker(ordinal: int) -> str:
    """The principal of worker `ordinal` (its StatefulSet ordinal); also the host word of its routing keys."""
    if int(ordinal) < 0:
        raise ValueError(f"worker ordinal {ordinal} is negative")
    return f"worker-{int(ordinal)}"


def host_of(client: int, workers: int) -> str:
    """The principal hosting `client`: client c lives on worker c % workers (dfca.identity.sharding)."""
    return worker(int(client) % int(workers))


def is_principal(name: str) -> bool:
    return name in SERVICES or bool(_WORKER.match(name))


def user_of(principal: str) -> str:
    """The broker user of a principal."""
    if not is_principal(principal):
        raise ValueError(f"{principal!r} is not a principal (topology, metrics, aggregator or worker-<i>)")
    return USER_PREFIX + principal


def principal_of_user(user: str) -> str | None:
    """The principal a broker user stands for; None for a shared user."""
    name = user.removeprefix(USER_PREFIX)
    return name if user.startswith(USER_PREFIX) and is_principal(name) else None


class PublisherCheck:
    """Whether a delivered message came from the principal it must come from, as the broker proved it."""

    def __init__(self, own_user: str) -> None:
        self.strict = principal_of_user(own_user) is not None

    def allows(self, publisher: str, principal: str) -> bool:
        return not self.strict or publisher == user_of(principal)
