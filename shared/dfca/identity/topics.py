"""Exchange names, routing keys and queue names: the one place that defines them.

Algorithm messages go to the topic exchange `dfca.models` with the routing key
`<experiment_id>.<host>.<sender_client_id>.<cluster_id>`: `host` is the principal that hosts the sender
(`worker-<i>`, or `aggregator` with `server` in place of the client id for a central role; see
`dfca.identity.principals`), so a broker topic permission can let a worker publish only its own clients' keys.
A worker has one queue per experiment (`dfca.<experiment_id>.<host>.inbox`, named after the worker so that
its permissions cover only its own queues), bound to `<experiment_id>.*.<neighbour_id>.*` for every current
neighbour of any client it hosts that is hosted elsewhere (and to `<experiment_id>.aggregator.server.*` when its
algorithm has a server; `inbox_binding_keys`), so routing is keyed by sender and cluster id: the broker delivers
each message to a worker once, and the worker's message driver hands it to every hosted client that neighbours its
sender. Under per-principal broker users the topology service declares and binds the workers' queues (a worker
may only consume them: dfca.identity.broker_users).

Control commands (`dfca.control`) and events (`dfca.metrics`) are keyed `<deployment>.<experiment_id>.<kind>`
(presence: `<deployment>.presence`), and each service's queue is bound to `<deployment>.#` only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import NamedTuple

from dfca.identity import principals
from dfca.transport.base import QueueLimits

MODELS_EXCHANGE = "dfca.models"
CONTROL_EXCHANGE = "dfca.control"
METRICS_EXCHANGE = "dfca.metrics"
DEAD_LETTER_EXCHANGE = "dfca.dlx"
DEAD_LETTER_QUEUE = "dfca.dead-letter"

# Every queue is bounded (QueueLimits: past the bound the oldest message is dropped, dead-lettered where the
# queue has a dead-letter exchange), so a flood cannot fill the broker.
# A worker's queue of models (and the central role's): a backlog of many rounds of a restarted worker's
# neighbours fits; it is deleted 6 hours after its last consumer went away, so the queues of a finished
# experiment do not stay.
MODEL_QUEUE_LIMITS = QueueLimits(max_length=200_000, max_bytes=16 << 30, expires_s=6 * 3600)
# The services' and workers' control and event queues. Each is bound to every key of its exchange, so one that
# outlived its deployment (a test's or a benchmark's stack, a renamed service) would collect every later
# deployment's events on a shared broker for ever: it is deleted 6 hours after its last consumer went away
# (a restarted service finds it again well before that).
SERVICE_QUEUE_LIMITS = QueueLimits(max_length=100_000, max_bytes=512 << 20, expires_s=6 * 3600)
# The dead-letter queue keeps the last rejected messages for inspection, for an hour.
DEAD_LETTER_LIMITS = QueueLimits(max_length=10_000, max_bytes=256 << 20, message_ttl_s=3600)
# A deployment's copy of the dead letters (the metrics service's tap), gone with its deployment as above.
DEAD_LETTER_TAP_LIMITS = QueueLimits(max_length=10_000, max_bytes=256 << 20, message_ttl_s=3600, expires_s=6 * 3600)

EXCHANGES: dict[str, str] = {
    MODELS_EXCHANGE: "topic",
    CONTROL_EXCHANGE: "topic",
    METRICS_EXCHANGE: "topic",
    DEAD_LETTER_EXCHANGE: "fanout",
}

_WORD = re.compile(r"^[A-Za-z0-9_-]+$")


def check_word(value: str, what: str) -> str:
    """Routing-key words must not contain '.', '*' or '#'."""
    if not _WORD.match(value):
        raise ValueError(f"{what} {value!r} may only contain letters, digits, '_' and '-'")
    return value


EXPERIMENT_SUFFIX = 10  # hex digits after an experiment id's slug


def experiment_id(name: str, suffix: str) -> str:
    """An experiment's id: its name made a routing-key word (at most 24 characters), a dash, `suffix`."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:24] or "experiment"
    return f"{slug}-{suffix}"


SERVER_SENDER = -1  # the sender id of a central role (IFCA's server); routing key word "server"
SERVER_WORD = "server"


class ModelKey(NamedTuple):
    experiment: str
    host: str  # the principal hosting the sender
    sender: int
    part: int


def model_key(experiment: str, host: str, sender: int, part: int) -> str:
    """Routing key of a message that `sender` (a client, or SERVER_SENDER), hosted by principal `host`,
    sends for cluster `part`."""
    word = SERVER_WORD if sender == SERVER_SENDER else str(int(sender))
    return f"{check_word(experiment, 'experiment id')}.{check_word(host, 'host')}.{word}.{int(part)}"


def parse_model_key(key: str) -> ModelKey:
    """Inverse of `model_key`; raises ValueError on a malformed key."""
    parts = key.split(".")
    if len(parts) != 4:
        raise ValueError(f"model routing key {key!r} must have 4 words")
    experiment, host, word, part = parts
    if not principals.is_principal(host):
        raise ValueError(f"model routing key {key!r}: {host!r} is not a host")
    if word == SERVER_WORD:
        return ModelKey(experiment, host, SERVER_SENDER, int(part))
    sender = int(word)
    if sender < 0:
        raise ValueError(f"model routing key {key!r}: a client id is not negative")
    return ModelKey(experiment, host, sender, int(part))


def neighbour_binding(experiment: str, neighbour: int) -> str:
    """Binding key that delivers every cluster's model from one neighbour (whoever claims to host it: the
    broker's topic permissions and the receiver's publisher check decide whether the claim holds)."""
    return f"{check_word(experiment, 'experiment id')}.*.{int(neighbour)}.*"


def experiment_binding(experiment: str) -> str:
    return f"{check_word(experiment, 'experiment id')}.#"


def worker_queue(experiment: str, host: str) -> str:
    """The queue of the models that reach the clients hosted by principal `host` (`principals.host_of`)."""
    return f"dfca.{check_word(experiment, 'experiment id')}.{check_word(host, 'host')}.inbox"


def inbox_binding_keys(experiment: str, heard: Iterable[int], hears_server: bool) -> list[str]:
    """The keys a worker's queue (`worker_queue`) is bound to: every sender hosted elsewhere that one of its clients
    neighbours (`heard`), and the aggregator's when the algorithm's clients hear a server."""
    keys = [neighbour_binding(experiment, m) for m in sorted(heard)]
    return [*keys, server_binding(experiment)] if hears_server else keys


def server_queue(experiment: str) -> str:
    """Queue of an experiment's central role in the aggregator (IFCA's server)."""
    return f"dfca.{check_word(experiment, 'experiment id')}.server"


def server_binding(experiment: str) -> str:
    """Binding key that delivers every cluster's model from the aggregator (IFCA's server)."""
    return f"{check_word(experiment, 'experiment id')}.{principals.AGGREGATOR}.{SERVER_WORD}.*"


# Control commands and events are keyed by their deployment first, and a service's queue is bound to its own
# deployment's keys only (`deployment_keys`): on a broker that several stacks share, or that outlived many (every test
# and benchmark run makes one), a queue receives nothing of another deployment. (Bound to every key, as before, each
# left-over queue of a stack that was gone received a copy of every event of every later stack until it expired:
# the 456 such queues on this project's broker, ~150 on each exchange, cost it 0.13 CPU-s a round of the runtime
# benchmark, twice what it spent on the run itself; docs/performance.md.)


def control_key(deployment: str, experiment: str, event: str) -> str:
    return (f"{check_word(deployment, 'deployment')}.{check_word(experiment, 'experiment id')}."
            f"{check_word(event, 'event')}")


def presence_key(deployment: str) -> str:
    """Routing key of a deployment's presence events (workers, the aggregator) on dfca.metrics."""
    return f"{check_word(deployment, 'deployment')}.presence"


def metrics_key(deployment: str, experiment: str, kind: str) -> str:
    return (f"{check_word(deployment, 'deployment')}.{check_word(experiment, 'experiment id')}."
            f"{check_word(kind, 'metric kind')}")


def experiment_of_key(exchange: str, routing_key: str) -> str:
    """The experiment a routing key names (its first word on dfca.models, its second on dfca.control and
    dfca.metrics after the deployment); the first word of a key that does not say."""
    words = routing_key.split(".")
    return words[1] if exchange in (CONTROL_EXCHANGE, METRICS_EXCHANGE) and len(words) > 2 else words[0]


def deployment_keys(deployment: str) -> str:
    """Binding key: every command or event of one deployment, whatever experiment and kind."""
    return f"{check_word(deployment, 'deployment')}.#"


# -- the runtime services' own consumer queues ------------------------------------------------
# Names carry a deployment tag derived from the topology service's URL, so two stacks on one
# broker (tests, staging) neither compete for one queue nor act on each other's documents,
# while a restarted service finds its queue again.


def deployment_tag(topology_url: str) -> str:
    """A short, stable, routing-safe id of one deployment (one topology service)."""
    return "d" + hashlib.sha256(topology_url.rstrip("/").encode()).hexdigest()[:10]


def worker_control_queue(deployment: str, ordinal: int) -> str:
    return f"dfca.control.{check_word(deployment, 'deployment')}.{principals.worker(ordinal)}"


def aggregator_control_queue(deployment: str) -> str:
    return f"dfca.control.{check_word(deployment, 'deployment')}.aggregator"


def events_queue(deployment: str, service: str) -> str:
    """A service's queue of `dfca.metrics` events (topology and metrics each have one)."""
    return f"dfca.events.{check_word(deployment, 'deployment')}.{check_word(service, 'service')}"


def dead_letter_tap_queue(deployment: str) -> str:
    """The metrics service's copy of every dead-lettered message (the DLX is a fanout)."""
    return f"dfca.dead-letter.{check_word(deployment, 'deployment')}.tap"


def service_queues(deployment: str, workers: int) -> list[str]:
    """Every queue a deployment's services declare for themselves (the experiments' worker inboxes are the topology
    service's to delete, when an experiment ends)."""
    return [events_queue(deployment, "topology"), events_queue(deployment, "metrics"),
            dead_letter_tap_queue(deployment), aggregator_control_queue(deployment),
            *(worker_control_queue(deployment, i) for i in range(workers))]


ALL_KEYS = "#"  # binding key: everything; service queues were bound so before `deployment_keys` (unbound at start-up)
