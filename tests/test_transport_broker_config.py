"""broker/ files agree with dfca.identity.topics and with what the transport and scripts expect."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dfca.identity import topics
from dfca.identity.broker_setup import broker_definitions, password_matches, rabbitmq_password_hash

BROKER = Path(__file__).resolve().parents[1] / "broker"


def definitions() -> dict:
    return json.loads((BROKER / "definitions.json").read_text())


def test_definitions_declare_exactly_the_topics_exchanges() -> None:
    exchanges = {e["name"]: e for e in definitions()["exchanges"]}
    assert {name: e["type"] for name, e in exchanges.items()} == topics.EXCHANGES
    assert all(e["durable"] and not e["auto_delete"] and e["vhost"] == "dfca" for e in exchanges.values())


def test_dead_letter_queue_is_durable_and_bound_to_the_dlx() -> None:
    defs = definitions()
    assert [(q["name"], q["durable"], q["vhost"]) for q in defs["queues"]] == [
        (topics.DEAD_LETTER_QUEUE, True, "dfca")
    ]
    assert [(b["source"], b["destination"], b["destination_type"]) for b in defs["bindings"]] == [
        (topics.DEAD_LETTER_EXCHANGE, topics.DEAD_LETTER_QUEUE, "queue")
    ]


def test_dev_user_has_password_dfca_and_full_rights_on_the_vhost() -> None:
    defs = definitions()
    assert defs["vhosts"] == [{"name": "dfca"}]
    (user,) = defs["users"]
    assert user["hashing_algorithm"] == "rabbit_password_hashing_sha256"
    assert password_matches(user["password_hash"], "dfca")
    assert not password_matches(user["password_hash"], "dfcb")
    assert defs["permissions"] == [
        {"user": "dfca", "vhost": "dfca", "configure": ".*", "write": ".*", "read": ".*"}
    ]


def test_config_loads_definitions_and_sets_limits() -> None:
    conf = dict(
        re.split(r"\s*=\s*", line, maxsplit=1)
        for line in (BROKER / "rabbitmq.conf").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    assert conf["load_definitions"] == "/etc/rabbitmq/definitions.json"
    assert conf["loopback_users"] == "none"
    assert int(conf["max_message_size"]) == 128 * 1024 * 1024
    assert int(conf["heartbeat"]) == 30
    plugins = (BROKER / "enabled_plugins").read_text().strip()
    assert plugins == "[rabbitmq_management,rabbitmq_prometheus]."


def test_definitions_file_is_the_generated_document() -> None:
    defs = definitions()
    assert defs == broker_definitions(defs["users"][0]["password_hash"])


def test_password_hash_uses_a_fresh_salt() -> None:
    first, second = rabbitmq_password_hash("secret"), rabbitmq_password_hash("secret")
    assert first != second and password_matches(first, "secret") and password_matches(second, "secret")
