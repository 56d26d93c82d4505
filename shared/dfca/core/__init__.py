"""The algorithm core: pure tensor math batched over a set of clients; it reads no config.

The algorithms (dfca.algorithms) call these functions, whichever driver runs them.
"""

from dfca.core.aggregation import fold_models, self_weights
from dfca.core.assignment import accuracy_with, assign_clusters, loss_matrix
from dfca.core.local_update import round_seeds, train_assigned
from dfca.core.params import gather_clusters, init_cluster_models, scatter_clusters

__all__ = [
    "accuracy_with",
    "assign_clusters",
    "fold_models",
    "gather_clusters",
    "init_cluster_models",
    "loss_matrix",
    "round_seeds",
    "scatter_clusters",
    "self_weights",
    "train_assigned",
]
