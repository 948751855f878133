"""The benchmark's defaults are the server's: the settings ``lookahead-server`` runs with on this device.

Contract: ``resolve(args)`` takes the parsed flags, where every server-configurable flag left out is ``None``,
and returns ``Resolved``: the flags with each ``None`` filled from ``server.config_layers.load_config(
device_preset="cpu" or "cuda")`` (the preset of the device ``--device`` resolves to: the same layers the server
stacks without a ``--config`` file, field defaults < ``configs/<device>.yaml``), where each value came from
(``"flag"`` or ``"server preset <device>"``), and the server's ``BatchPolicy``. ``resolve(args, preset="cuda")``
takes the lookahead step settings and the batch policy from the named preset instead, and still loads the model
as this device's preset does (``python -m bench heldout --preset cuda`` on a CPU: the GPU's settings, counted in
steps here). As in the server (``server.serving.resolve_lookahead``), a preset's ``break_even`` is capped at
``ngram_size - 1``.
``describe(resolved)`` is the settings block the benchmark prints before it starts.

Raises ``server.config.ConfigError`` when the server's configuration does not load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass

from decoding.batch import BatchPolicy
from decoding.weights.loading import resolve_device
from server.config import LOOKAHEAD_STEP_FIELDS, ServerConfig, batch_policy
from server.config_layers import load_config

LOOKAHEAD_FIELDS = LOOKAHEAD_STEP_FIELDS  # the server's lookahead step settings, each a benchmark flag
MODEL_FIELDS = ("model", "dtype", "quantize", "weight_layout", "weights", "threads")
DECODING_SECTIONS = ("lookahead", "batch", *MODEL_FIELDS)  # what of a preset decides how a benchmark decodes
SERVER_MEMORY_TOKENS = ServerConfig().lookahead.memory_tokens  # the server's shared n-gram memory, by default
FLAG = "flag"


@dataclass(frozen=True)
class Resolved:
    """The flags with the server's defaults filled in, where each came from, and the server's batch policy.
    ``preset`` gave the lookahead settings and the batch policy, ``model_preset`` (the device's) the model's."""

    args: argparse.Namespace
    sources: dict[str, str]
    policy: BatchPolicy
    preset: str
    model_preset: str | None = None


def device_preset(device: str) -> str:
    """``"cpu"`` or ``"cuda"``: the server preset for ``device`` (``auto`` resolves as the server resolves it)."""
    return "cuda" if resolve_device(device).type == "cuda" else "cpu"


def server_defaults(config: ServerConfig) -> dict[str, object]:
    """The benchmark's flag values that ``config`` sets: its lookahead step settings and how it loads the model."""
    values: dict[str, object] = {name: getattr(config.lookahead, name) for name in LOOKAHEAD_FIELDS}
    values.update({name: getattr(config, name) for name in MODEL_FIELDS})
    return values


def resolve(args: argparse.Namespace, preset: str | None = None) -> Resolved:
    """Fill every ``None`` flag of ``args`` (a copy) from the server's config for the resolved device; the lookahead
    settings and the batch policy from ``preset``'s config instead when one is named (``"cpu"`` or ``"cuda"``)."""
    model_preset = device_preset(args.device)
    preset = preset or model_preset
    config = load_config(device_preset=preset)
    defaults = server_defaults(config)
    if preset != model_preset:
        model_defaults = server_defaults(load_config(device_preset=model_preset))
        defaults.update({name: model_defaults[name] for name in MODEL_FIELDS})
    filled = argparse.Namespace(**vars(args))
    sources: dict[str, str] = {}
    for name, value in defaults.items():
        if getattr(filled, name) is None:
            setattr(filled, name, value)
            sources[name] = f"server preset {model_preset if name in MODEL_FIELDS else preset}"
        else:
            sources[name] = FLAG
    if sources["break_even"] != FLAG:
        filled.break_even = min(filled.break_even, max(filled.ngram_size - 1, 0))
    return Resolved(filled, sources, batch_policy(config), preset, model_preset)


def preset_digest(preset: str) -> str:
    """12 hex digits of SHA-256 over what ``preset`` (``"cpu"`` or ``"cuda"``) resolves to for decoding (its
    lookahead and batch settings but the prefix cache's budget, the model, dtype, linears and threads, defaults
    included): a figure stamped with it was measured on that preset exactly; any change to a value there changes
    it."""
    config = load_config(device_preset=preset).model_dump(mode="json")
    config["batch"].pop("prefix_cache_tokens", None)  # the prefix cache never changes a decode (benchmarks run without)
    decoding = {name: config[name] for name in DECODING_SECTIONS}
    return hashlib.sha256(json.dumps(decoding, sort_keys=True).encode()).hexdigest()[:12]


def describe(resolved: Resolved) -> str:
    """The settings block printed at the start: each value, marked ``[flag]`` when a flag set it.

    Example first line: ``settings (server preset cpu unless marked [flag]):``.
    """
    args, sources, policy = resolved.args, resolved.sources, resolved.policy

    def cells(names: tuple[str, ...]) -> str:
        marks = {name: " [flag]" if sources[name] == FLAG else "" for name in names}
        return ", ".join(f"{name}={getattr(args, name)}{marks[name]}" for name in names)

    curve = ", ".join(f"{tokens}:{cost:g}" for tokens, cost in policy.step_cost)
    presets = f"server preset {resolved.preset}"
    if resolved.model_preset not in (None, resolved.preset):
        presets = f"lookahead and batch: server preset {resolved.preset}, model: server preset {resolved.model_preset},"
    return "\n".join(
        [
            f"settings ({presets} unless marked [flag]):",
            f"  lookahead: {cells(LOOKAHEAD_FIELDS)}",
            f"  batch: max_step_tokens={policy.max_step_tokens}, prefill_chunk={policy.prefill_chunk}, "
            f"step_cost={curve} (binds only concurrent streams; the benchmark runs one at a time)",
            f"  model: {cells(MODEL_FIELDS)}",
        ]
    )
