"""Which experiment a dead letter counts against, and how many of an experiment's dead letters are kept as rows.

A dead letter's routing key names an experiment, but anyone who may publish a key may name any experiment in it.
Where the deployment has per-principal broker users the broker proves who published each message (its validated
`user_id`, kept when the message is dead-lettered: `Message.publisher`), and a dead letter counts against the
experiment its key names only when that publisher may speak for the key: a model's key names its sender's host,
which must be the publisher; a control command comes from the topology service; an event from a worker, the
aggregator or the topology service. Any other dead letter is charged to its publisher alone (experiment ""), so no
principal can run up another experiment's count. Under a shared broker user nobody is proven, and the key's
experiment is charged as it names it.

The metrics service stores at most ROWS_PER_EXPERIMENT dead letters of each experiment (and of "") as rows, and
counts every one (runtime.metrics.metrics_store): a flood cannot grow the store without bound.
"""

from __future__ import annotations

from typing import NamedTuple

from dfca.identity import principals, topics

ROWS_PER_EXPERIMENT = 1_000  # dead letters stored one by one per experiment; the rest are only counted
UNATTRIBUTED = ""  # the experiment of a dead letter charged to its publisher alone


class DeadLetter(NamedTuple):
    experiment: str  # the experiment it counts against (`charged_experiment`), or UNATTRIBUTED
    exchange: str  # the exchange it was first published to
    routing_key: str
    publisher: str = ""  # its broker-proven publisher (a broker user), "" if none was stamped


def charged_experiment(exchange: str, routing_key: str, publisher: str) -> str:
    """The experiment a dead letter published by broker user `publisher` on `exchange` with `routing_key` counts
    against: the one its key names where the publisher may speak for the key (or where publishers are not proven),
    else UNATTRIBUTED."""
    named = topics.experiment_of_key(exchange, routing_key)
    principal = principals.principal_of_user(publisher)
    if principal is None:  # a shared user, or no user_id: nothing is proven
        return named
    if exchange == topics.MODELS_EXCHANGE:
        try:
            host = topics.parse_model_key(routing_key).host
        except ValueError:
            return UNATTRIBUTED
        return named if host == principal else UNATTRIBUTED
    if exchange == topics.CONTROL_EXCHANGE:
        return named if principal == principals.TOPOLOGY else UNATTRIBUTED
    if exchange == topics.METRICS_EXCHANGE:
        return named if principal != principals.METRICS else UNATTRIBUTED
    return UNATTRIBUTED
