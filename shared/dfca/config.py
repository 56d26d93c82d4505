"""The one experiment config schema, shared by `dfca run`, the REST API and YAML files.

The sections every run has (data, model, train, topology, network, runtime) are declared here; each
algorithm's own section (`dfca:`, `fedspd:`, ...) is declared in its file (dfca.algorithms) and named by its
clients class (`section`, `Section`). `compose_config` builds the schema from the registry: `algorithm` takes
the registered names, and every registered section is a field of its own, so `cfg.dfca.variant` reads as
before and an error names its field (`dfca.variant: ...`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError, create_model

from dfca.algorithms import CLIENTS
from dfca.algorithms.server_clustering import ClusteredClients
from dfca.config_files import ConfigError, apply_overrides, read_config_file
from dfca.sections import (
    MAX_CATEGORIES_PER_CLIENT,
    DataConfig,
    ExperimentBase,
    ModelConfig,
    NetworkConfig,
    RuntimeConfig,
    Strict,
    TopologyConfig,
    TrainConfig,
)

if TYPE_CHECKING:
    from dfca.algorithms import Algorithm

__all__ = ["ALGORITHMS", "KMEANS_ALGORITHMS", "MAX_CATEGORIES_PER_CLIENT", "SERVER_CLUSTERING", "ConfigError",
           "DataConfig", "ExperimentBase", "ExperimentConfig", "ModelConfig", "NetworkConfig", "RuntimeConfig",
           "Strict", "TopologyConfig", "TrainConfig", "compose_config", "load_config", "parse_config"]

ALGORITHMS: tuple[str, ...] = tuple(CLIENTS)  # the registered algorithms (dfca.algorithms)
KMEANS_ALGORITHMS = tuple(n for n, c in CLIENTS.items() if c.feature_vectors)  # they cluster feature vectors
SERVER_CLUSTERING = tuple(n for n, c in CLIENTS.items() if issubclass(c, ClusteredClients))  # a server clusters


def compose_config(algorithms: Mapping[str, type[Algorithm]]) -> type[ExperimentBase]:
    """The experiment schema of `algorithms` (name -> clients class; the first is the default): `algorithm` is one
    of their names, then every section they declare follows as a field (`dfca: DFCAConfig`), then `runtime`."""
    names = tuple(algorithms)
    sections: dict[str, Any] = {}
    for algorithm in algorithms.values():
        if algorithm.section is not None and algorithm.Section is not None:
            sections[algorithm.section] = (algorithm.Section, Field(default_factory=algorithm.Section))
    schema = create_model(
        "ExperimentConfig", __base__=ExperimentBase, __module__=__name__,
        algorithm=(Literal[names], names[0]),  # type: ignore[valid-type]
        **sections, runtime=(RuntimeConfig, Field(default_factory=RuntimeConfig)))
    schema.algorithms = dict(algorithms)
    return schema


ExperimentConfig = compose_config(CLIENTS)  # the registry's: `algorithm: dfca`, `dfca:` ... `fedcref:`, `runtime:`


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(config)"
        lines.append(f"{field}: {e['msg']}")
    return "; ".join(lines)


def parse_config(data: dict[str, Any]) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from err


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read, override (`--set`) and validate a config file (a folder federation's client count from its folder)."""
    return parse_config(with_folder_clients(apply_overrides(read_config_file(path), overrides)))


def with_folder_clients(data: dict[str, Any]) -> dict[str, Any]:
    """`data.clients` of a `data.source: folder` config is the folder's client count: filled in where it is left
    out, refused where it differs."""
    section = data.get("data")
    if not isinstance(section, dict) or section.get("source") != "folder" or not isinstance(section.get("path"), str):
        return data
    from dfca.data.folder_federation import FolderDataError, list_client_ids

    try:
        count = len(list_client_ids(section["path"]))
    except FolderDataError as err:
        raise ConfigError(f"data.path: {err}") from err
    if section.setdefault("clients", count) != count:
        raise ConfigError(f"data.clients: {section['clients']}, but {section['path']} holds {count} clients (leave "
                          "data.clients out to use them all)")
    return data
