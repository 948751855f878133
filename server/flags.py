"""The server's configuration as command-line flags, shared by ``lookahead-server`` and ``python -m bench tune``.

Contract: ``config_flags()`` derives one ``ConfigFlag`` per scalar config value from the definition
(``server.config``): named after its key's last part, typed, with the field's choices and meaning;
``flag_overrides`` turns the flags' values back into the config's shape. ``add_config_flags(parser, keys)`` adds
``--config`` and one flag per config value, or only those in ``keys``, every default None so that only flags given
on the command line override the layers below them; ``build_config(args)`` (``resolve_args(args).config``)
resolves the configuration exactly as ``serve`` does (``server.config_layers``): the preset of the device the file
and flags ask for, then the file, then the flags (the API key may come from ``$LOOKAHEAD_API_KEY``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from server.config import ServerConfig, field_extra, fields, scalar_type
from server.config_layers import Resolved, requested_device, resolve

API_KEY_ENV = "LOOKAHEAD_API_KEY"


@dataclass(frozen=True)
class ConfigFlag:
    """One command-line flag derived from a config field."""

    key: str  # dotted config key, e.g. "lookahead.window_size"
    name: str  # e.g. "--window-size"
    kind: type  # bool, int, float or str
    choices: tuple[str, ...] | None
    help: str
    multiple: bool = False  # a list of strings: the flag takes one or more values

    @property
    def dest(self) -> str:
        """The argparse attribute: the key with dots and dashes made underscores."""
        return self.key.replace(".", "_")


def config_flags() -> list[ConfigFlag]:
    """Every scalar config value as a flag named after its key's last part (``--window-size``), in order.

    A field may rename its flag (``json_schema_extra={"flag": ...}``); a list of strings (``allowed_origins``) is
    a flag taking one or more values; other lists (``batch.step_cost``) are file-only.
    """
    flags = []
    for key, info in fields():
        multiple = info.annotation == list[str]
        kind, choices = (str, None) if multiple else scalar_type(info.annotation)
        if kind is None:
            continue
        name = field_extra(info).get("flag", "--" + key.rsplit(".", 1)[-1].replace("_", "-"))
        flags.append(ConfigFlag(key, name, kind, choices, info.description or "", multiple))
    return flags


def flag_overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Config-shaped overrides from ``{dotted key: value}`` (``None`` = not given, kept for ``drop_none``).

    >>> flag_overrides({"port": 1, "lookahead.window_size": None})
    {'port': 1, 'lookahead': {'window_size': None}}
    """
    nested: dict[str, Any] = {}
    for key, value in values.items():
        *sections, leaf = key.split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
        target[leaf] = value
    return nested



def add_config_flags(parser: argparse.ArgumentParser, keys: Iterable[str] | None = None) -> None:
    """``--config`` and one flag per config value (``config_flags``), or only those in ``keys``.

    Every default is None, so that only flags given on the command line override the layers below them.
    """
    parser.add_argument("--config", help="YAML config layered over the device preset: a path or a name in configs/")
    wanted = None if keys is None else set(keys)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in config_flags():
        if wanted is not None and flag.key not in wanted:
            continue
        section = flag.key.split(".")[0] if "." in flag.key else ""
        if section not in groups:
            groups[section] = parser.add_argument_group(SECTION_TITLES[section]) if section else parser
        target = groups[section]
        if flag.kind is bool:
            target.add_argument(flag.name, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=flag.help)
        else:
            metavar = None if flag.choices else flag.name.removeprefix("--").replace("-", "_").upper()
            target.add_argument(flag.name, dest=flag.dest, type=flag.kind, choices=flag.choices, metavar=metavar,
                                nargs="+" if flag.multiple else None, help=flag.help)


SECTION_TITLES = {
    "lookahead": "lookahead defaults (requests may override W/N/G within the maxima)",
    "batch": "batching of the running requests' steps",
}


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The config-shaped overrides given on the command line (``None`` = not given); the API key may come from
    ``$LOOKAHEAD_API_KEY``."""
    values = {flag.key: getattr(args, flag.dest) for flag in config_flags() if hasattr(args, flag.dest)}
    if "api_key" in values and values["api_key"] is None:
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return flag_overrides(values)


def device_preset(device: str) -> str:
    """``cpu`` or ``cuda``: the preset for a configured device (``auto`` asks torch, through decoding)."""
    if device == "auto":
        from decoding.weights.loading import resolve_device

        device = str(resolve_device("auto"))
    return "cuda" if device.startswith("cuda") else "cpu"


def resolve_args(args: argparse.Namespace) -> Resolved:
    """The config and its sources: the preset of the device the file and flags ask for, then the file, flags."""
    overrides = overrides_from(args)
    preset = device_preset(requested_device(args.config, overrides))
    return resolve(args.config, overrides, device_preset=preset)


def build_config(args: argparse.Namespace) -> ServerConfig:
    """``resolve_args(args).config``."""
    return resolve_args(args).config


