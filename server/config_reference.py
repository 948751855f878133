"""The configuration written out for people: the resolved values with their layers, and the reference table.

Contract: ``describe(resolved)`` is what ``lookahead-server config`` prints: the resolved config as YAML that
``--config`` accepts, each value commented with the layer it came from (secrets hidden); ``reference_markdown()``
is what ``lookahead-server config --reference`` prints: the table of every key in ``docs/configuration.md``
(flag, default, what each device preset sets, range, meaning), derived from ``server.config``'s definition.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import yaml
from pydantic.fields import FieldInfo

from decoding.weights.cores import AUTO, usable_cores
from server.config import ServerConfig, field_extra, fields, scalar_type
from server.config_layers import DEFAULT_LAYER, DEVICE_PRESETS, Resolved, resolve
from server.flags import config_flags


def value_text(value: Any) -> str:
    """A value as one line of YAML (``null``, ``true``, ``[[1, 1.0], [2, 1.4]]``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def describe(resolved: Resolved, header: str = "") -> str:
    """The resolved config as YAML that ``--config`` accepts, each value commented with the layer it came from.

    Secrets (``api_key``) are not printed: their line is commented out and says where they were set; ``threads:
    auto`` says how many threads it gives here (``decoding.weights.cores.usable_cores``).
    """
    lines = [header] if header else []
    section = ""
    dumped = resolved.config.model_dump(mode="json")
    for key, info in fields():
        *parents, leaf = key.split(".")
        if parents and parents[0] != section:
            section = parents[0]
            lines.append(f"{section}:")
        indent = "  " * len(parents)
        value = dumped
        for part in key.split("."):
            value = value[part]
        source = resolved.source(key)
        if key == "threads" and value == AUTO:
            source += f" (auto: {usable_cores()} here)"
        if field_extra(info).get("secret") and value is not None:
            lines.append(f"{indent}# {leaf}: <hidden>".ljust(48) + f"  # {source}")
        else:
            lines.append(f"{indent}{leaf}: {value_text(value)}".ljust(48) + f"  # {source}")
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The table of every config key for ``docs/configuration.md``: flag, default, what each device preset sets,
    range, meaning."""
    presets = {name: resolve(device_preset=name) for name in DEVICE_PRESETS}
    dumped = {name: resolved.config.model_dump(mode="json") for name, resolved in presets.items()}
    defaults = ServerConfig().model_dump(mode="json")
    flags = {flag.key: flag.name for flag in config_flags()}
    rows = ["| key | flag | default | cpu preset | cuda preset | range | meaning |",
            "|---|---|---|---|---|---|---|"]
    for key, info in fields():
        parts = key.split(".")
        cells = [f"`{key}`", f"`{flags[key]}`" if key in flags else "(file only)",
                 f"`{value_text(_lookup(defaults, parts))}`"]
        for name, resolved in presets.items():
            preset_sets = resolved.source(key) != DEFAULT_LAYER
            cells.append(f"`{value_text(_lookup(dumped[name], parts))}`" if preset_sets else "")
        cells += [_range(info), (info.description or "").replace("|", "\\|")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _lookup(mapping: dict[str, Any], parts: list[str]) -> Any:
    for part in parts:
        mapping = mapping[part]
    return mapping


def _member_range(annotation: Any) -> str:
    """One member of a union as ``_range`` writes it: an Annotated int's bound, a Literal's choices."""
    if typing.get_origin(annotation) is Literal:
        return ", ".join(typing.get_args(annotation))
    low = next((m.ge for m in typing.get_args(annotation)[1:] if hasattr(m, "ge")), None)
    return f">= {low}" if low is not None else "any"


def _range(info: FieldInfo) -> str:
    """``[low, high]``, ``>= low`` or a Literal's choices, from the field's own constraints."""
    low = next((m.ge for m in info.metadata if hasattr(m, "ge")), None)
    high = next((m.le for m in info.metadata if hasattr(m, "le")), None)
    _, choices = scalar_type(info.annotation)
    if choices:
        return ", ".join(choices)
    members = typing.get_args(info.annotation)
    if any(typing.get_origin(member) is Literal for member in members):  # a count or a word (threads)
        return ", or ".join(_member_range(member) for member in members)
    if low is not None and high is not None:
        return f"[{low}, {high}]"
    return f">= {low}" if low is not None else ""
