"""Communication graphs: the configured kinds, connected, and the Erdős–Rényi draw networkx's own edge for edge."""

from __future__ import annotations

import time

import networkx as nx
import pytest

from dfca.config import TopologyConfig
from dfca.graph import GraphBudgetExceeded, adjacency_matrix, build_graph, erdos_renyi_graph


@pytest.mark.parametrize("n,p,seed", [(2, 0.5, 0), (10, 0.5, 1), (57, 0.1, 7), (300, 0.03, 12_345),
                                      (1000, 0.01, 2**40 + 3), (40, 0.0, 3), (40, 1.0, 3)])
def test_erdos_renyi_graph_is_networkx_s_edge_for_edge(n: int, p: float, seed: int) -> None:
    """Every run's topology (and every published figure) depends on the seeded draw: the numpy form must give
    networkx's graph, the same edges in the same order."""
    ours, theirs = erdos_renyi_graph(n, p, seed), nx.erdos_renyi_graph(n, p, seed=seed)
    assert list(ours.nodes()) == list(theirs.nodes())
    assert list(ours.edges()) == list(theirs.edges())


def test_build_graph_redraws_until_connected_and_names_the_setting_when_it_cannot() -> None:
    g = build_graph(TopologyConfig(kind="erdos_renyi", p=0.05), 200, seed=4)
    assert nx.is_connected(g) and g.number_of_nodes() == 200
    a = adjacency_matrix(g, 200)
    assert bool((a == a.T).all()) and not bool(a.diagonal().any()) and int(a.sum()) == 2 * g.number_of_edges()
    with pytest.raises(ValueError, match="raise topology.p"):
        build_graph(TopologyConfig(kind="erdos_renyi", p=0.001, max_tries=3), 200, seed=4)


def test_a_graph_that_cannot_be_drawn_within_the_budget_is_refused_at_once() -> None:
    """A nearly empty Erdős–Rényi graph with 100,000 tries took minutes of CPU; under a budget it is refused within
    it, naming the settings to change."""
    hopeless = TopologyConfig(kind="erdos_renyi", p=5e-324, max_tries=100_000)
    started = time.monotonic()
    with pytest.raises(GraphBudgetExceeded, match=r"topology.max_tries=100000") as refused:
        build_graph(hopeless, 24, seed=0, budget_s=0.3)
    assert time.monotonic() - started < 5.0 and "raise topology.p" in str(refused.value)
    assert nx.is_connected(build_graph(TopologyConfig(kind="erdos_renyi", p=0.3), 24, seed=0, budget_s=0.3))
