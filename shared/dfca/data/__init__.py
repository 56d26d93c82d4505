"""Federated datasets: rotated MNIST/EMNIST/CIFAR-10/FEMNIST/digits split into client shards, or feature vectors."""

from dfca.data.federated import build_federated_data, load_source
from dfca.data.folder_checks import FolderDataError
from dfca.data.folder_federation import list_client_ids, read_folder_federation
from dfca.data.folder_report import FolderReport, inspect_folder
from dfca.data.locate import DatasetFilesMissing
from dfca.data.shards import FederatedData

__all__ = ["DatasetFilesMissing", "FederatedData", "FolderDataError", "FolderReport", "build_federated_data",
           "inspect_folder", "list_client_ids", "load_source", "read_folder_federation"]
