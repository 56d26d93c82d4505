"""Federated datasets: rotated MNIST/EMNIST/CIFAR-10/FEMNIST/digits split into client shards, or feature vectors."""

from dfca.data.federated import build_federated_data, load_source
from dfca.data.locate import DatasetFilesMissing
from dfca.data.shards import FederatedData

__all__ = ["DatasetFilesMissing", "FederatedData", "build_federated_data", "load_source"]
