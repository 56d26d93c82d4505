"""`topic_matches`: AMQP 0-9-1 topic rules (`*` is exactly one word, `#` zero or more)."""

from __future__ import annotations

import pytest

from dfca.identity import topics
from dfca.transport import topic_matches

CASES = [
    ("a.b.c", "a.b.c", True),
    ("a.b.c", "a.b", False),
    ("a.b", "a.b.c", False),
    ("a.*.c", "a.b.c", True),
    ("a.*.c", "a.c", False),
    ("a.*.c", "a.b.b.c", False),
    ("*", "a", True),
    ("*", "a.b", False),
    ("*", "", False),
    ("a.#", "a", True),
    ("a.#", "a.b", True),
    ("a.#", "a.b.c", True),
    ("a.#", "b.a", False),
    ("a.#", "ab", False),
    ("#", "", True),
    ("#", "a.b.c", True),
    ("#.c", "c", True),
    ("#.c", "a.b.c", True),
    ("#.c", "a.b.c.d", False),
    ("a.#.c", "a.c", True),
    ("a.#.c", "a.x.y.c", True),
    ("a.#.c", "a.x.y", False),
    ("#.b.#", "b", True),
    ("#.b.#", "a.b.c", True),
    ("#.b.#", "a.c", False),
    ("*.#", "", False),
    ("*.#", "a", True),
    ("#.*", "a.b", True),
    ("", "", True),
    ("", "a", False),
    (topics.neighbour_binding("exp1", 2), topics.model_key("exp1", "worker-0", 2, 0), True),
    (topics.neighbour_binding("exp1", 2), topics.model_key("exp1", "worker-0", 22, 0), False),
    (topics.neighbour_binding("exp1", 2), topics.model_key("exp2", "worker-0", 2, 0), False),
    (topics.experiment_binding("exp1"), topics.model_key("exp1", "worker-0", 9, 3), True),
    (topics.experiment_binding("exp1"), topics.model_key("exp1", "aggregator", topics.SERVER_SENDER, 1), True),
]


@pytest.mark.parametrize(("binding", "routing_key", "expected"), CASES)
def test_topic_matches(binding: str, routing_key: str, expected: bool) -> None:
    assert topic_matches(binding, routing_key) is expected
