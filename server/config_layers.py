"""Where the configuration's values come from: its layers, merged in order, later wins.

Contract: field defaults (``server.config.ServerConfig``) < the device preset ``configs/<cpu|cuda>.yaml`` (always,
for the resolved device) < the ``--config`` file < flags. Nothing else is read: what a device runs is its preset
file. ``resolve`` returns the validated, immutable config and, for every value, the layer it came from
(``Resolved``); ``load_config`` the config alone. Unknown keys in a YAML file are an error (a typo must not be
silently ignored): a ``ConfigError`` naming the bad field. Nothing here imports torch: the caller resolves
``device: auto`` (``server.flags.device_preset``) and passes the preset name in; ``requested_device`` is the
device the file and flags ask for, before any preset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from server.config import ConfigError, ServerConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEVICE_PRESETS = ("cpu", "cuda")
DEFAULT_LAYER = "default"
FLAG_LAYER = "flag"


@dataclass(frozen=True)
class Resolved:
    """A validated config, its layers in order, and per dotted key (``lookahead.window_size``) the layer its
    value came from."""

    config: ServerConfig
    sources: dict[str, str]
    layers: tuple[str, ...] = ()

    def source(self, key: str) -> str:
        """The layer of ``key``: a file's name, ``flag``, or ``default``."""
        return self.sources.get(key, DEFAULT_LAYER)


def resolve_config_path(name: str) -> Path:
    """Map ``cpu`` or ``cpu.yaml`` to ``configs/cpu.yaml``; pass any existing path through."""
    path = Path(name)
    if path.exists():
        return path
    candidate = CONFIG_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if candidate.exists():
        return candidate
    raise ConfigError(f"config file not found: {name}")


def read_yaml(path: Path) -> dict[str, Any]:
    """Read one YAML mapping (an empty file is an empty mapping)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge two mappings; ``override`` wins, nested mappings merge key by key.

    >>> merge({"lookahead": {"window_size": 2, "ngram_size": 4}}, {"lookahead": {"window_size": 7}})
    {'lookahead': {'window_size': 7, 'ngram_size': 4}}
    """
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def leaves(mapping: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-mapping value.

    >>> list(leaves({"port": 1, "lookahead": {"window_size": 2}}))
    [('port', 1), ('lookahead.window_size', 2)]
    """
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def layers(path: str | None, overrides: dict[str, Any], device_preset: str | None) -> list[tuple[str, dict]]:
    """The ``(name, mapping)`` layers in order, later wins (see the module docstring)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if device_preset is not None:
        preset = CONFIG_DIR / f"{device_preset}.yaml"
        found.append((f"configs/{preset.name}", read_yaml(preset)))
    if path is not None:
        resolved = resolve_config_path(path)
        found.append((str(resolved), read_yaml(resolved)))
    found.append((FLAG_LAYER, drop_none(overrides)))
    return found


def resolve(
    path: str | None = None, overrides: dict[str, Any] | None = None, device_preset: str | None = None
) -> Resolved:
    """Build and validate the config from its layers; raise ``ConfigError`` naming the bad field.

    ``overrides`` uses the config's own shape (``{"lookahead": {"window_size": 7}}``); ``None`` values in it
    are dropped so unset flags never override a file. ``device_preset`` is ``"cpu"``, ``"cuda"`` or None (no
    preset: field defaults, then the file and the flags).
    """
    if device_preset is not None and device_preset not in DEVICE_PRESETS:
        raise ConfigError(f"unknown device preset {device_preset!r}: expected one of {', '.join(DEVICE_PRESETS)}")
    settings: dict[str, Any] = {}
    sources: dict[str, str] = {}
    found = layers(path, overrides or {}, device_preset)
    for name, mapping in found:
        settings = merge(settings, mapping)
        sources.update((key, name) for key, _ in leaves(mapping))
    try:
        return Resolved(ServerConfig.model_validate(settings), sources, (DEFAULT_LAYER, *(name for name, _ in found)))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "config"
        raise ConfigError(f"invalid configuration: {where}: {first['msg']}") from exc


def load_config(
    path: str | None = None, overrides: dict[str, Any] | None = None, device_preset: str | None = None
) -> ServerConfig:
    """``resolve(...).config``: the validated config alone."""
    return resolve(path, overrides, device_preset).config


def requested_device(path: str | None, overrides: dict[str, Any]) -> str:
    """The ``device`` the file and flags ask for (``auto`` when neither does), before any preset."""
    settings = read_yaml(resolve_config_path(path)) if path is not None else {}
    return str(drop_none(overrides).get("device", settings.get("device", ServerConfig.model_fields["device"].default)))


def drop_none(mapping: dict[str, Any]) -> dict[str, Any]:
    """Remove ``None`` values recursively, and nested mappings left empty."""
    cleaned: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            value = drop_none(value)
            if value:
                cleaned[key] = value
        elif value is not None:
            cleaned[key] = value
    return cleaned
