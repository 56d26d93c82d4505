"""A config as it arrives, before validation: a YAML file's mapping and the CLI's `--set` overrides.

No torch and no algorithms here: `dfca submit` reads a config with these and lets the topology service validate it
(its errors name the field, as `dfca.config.parse_config`'s do).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config that failed validation; the message names each bad field."""


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (the CLI's `--set`) to a config mapping, in place.

    The value is read as YAML (`0.05`, `[0, 180]`, `true`, `null`, `erdos_renyi`); missing sections are made.
    The result still has to pass `parse_config`, so a wrong key or value is reported like one in the file.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. train.lr=0.05")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: the value {raw!r} is not valid YAML ({err})") from err
        node = data
        path = key.split(".")
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path[: depth + 1])}: is a value, not a section, so {key} cannot be set")
            node = child
        node[path[-1]] = value
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping of a config file, before validation."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data
