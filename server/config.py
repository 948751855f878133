"""The server's one typed configuration object, loaded from YAML and overridden by command-line flags.

Contract: ``load_config(path, overrides, device_preset=...)`` returns a validated, immutable ``ServerConfig``.
Layers, later wins: field defaults < ``configs/default.yaml`` < the device preset (``configs/cpu.yaml`` or
``configs/cuda.yaml``, then ``configs/tuned-<device>.yaml`` written by ``lookahead-server tune`` if present;
only when no ``--config`` is given) < the ``--config`` file < flags. Unknown keys in a
YAML file are an error (a typo must not be silently ignored). Nothing here imports torch: the caller resolves
``device: auto`` and passes the preset name in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration file or flag is invalid; the message says which and why."""


class LookaheadSettings(BaseModel):
    """Server-wide lookahead defaults (used when a request leaves a value out) and the per-request maxima."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    window_size: int = Field(2, ge=1)
    ngram_size: int = Field(4, ge=2)
    guess_set_size: int = Field(4, ge=0)
    max_window_size: int = Field(16, ge=1)
    max_ngram_size: int = Field(8, ge=2)
    max_guess_set_size: int = Field(16, ge=0)
    lazy_window: bool = Field(False, description="plain one-token steps when the pool has no candidate")
    break_even: float = Field(
        0.0, ge=0.0, description="accepted guesses per verifying step below which to fall back to one-token steps"
    )
    copy_length: int = Field(
        0, ge=0, le=32, description="copy steps: verify up to this many tokens copied from a matching context (0: off)"
    )

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> LookaheadSettings:
        for name in ("window_size", "ngram_size", "guess_set_size"):
            if getattr(self, name) > getattr(self, f"max_{name}"):
                raise ValueError(f"lookahead.{name} = {getattr(self, name)} exceeds lookahead.max_{name}")
        return self


class BatchSettings(BaseModel):
    """How the worker batches the running requests' steps into one forward pass (see ``decoding.batch``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_step_tokens: int = Field(128, ge=1, description="input tokens of one forward, all requests together")
    prefill_chunk: int = Field(128, ge=1, description="prompt tokens per forward while other requests decode")
    step_cost: list[tuple[int, float]] | None = Field(
        None, description="(tokens, relative cost) points of the step-cost curve; null: the built-in CPU curve"
    )

    @model_validator(mode="after")
    def _curve_ascends(self) -> BatchSettings:
        if self.step_cost is not None:
            tokens = [point[0] for point in self.step_cost]
            if len(tokens) < 2 or tokens != sorted(set(tokens)) or tokens[0] < 1:
                raise ValueError("batch.step_cost needs >= 2 points with distinct ascending token counts >= 1")
            if any(cost <= 0 for _, cost in self.step_cost):
                raise ValueError("batch.step_cost costs must be positive")
        return self


class ServerConfig(BaseModel):
    """Everything the server needs to start; handed down explicitly, never read from globals."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    api_key: str | None = None
    api_keys_file: str | None = Field(None, description="a file of API keys, one per line (# comments)")
    protect_health: bool = Field(False, description="/health requires a key too (when keys are configured)")
    protect_metrics: bool = Field(False, description="/metrics requires a key too (when keys are configured)")
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    quantize: Literal["none", "int8"] = Field("none", description="int8: row-independent int8 linears (CPU)")
    weight_layout: Literal["auto", "packed", "torch"] = Field(
        "auto", description="packed: float32 linears laid out for the CPU's kernels; auto: packed on a float32 CPU"
    )
    threads: int = Field(1, ge=0, description="torch intra-op threads; 0 keeps torch's default")
    max_running: int = Field(16, ge=1, description="requests decoding at once (their steps share each forward)")
    max_queue: int = Field(32, ge=0, description="admitted requests waiting for a running slot")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request leaves it out")
    max_request_bytes: int = Field(1 << 20, ge=1024)
    drain_grace_seconds: float = Field(30.0, ge=0)
    warmup: bool = True
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    lookahead: LookaheadSettings = LookaheadSettings()
    batch: BatchSettings = BatchSettings()

    @model_validator(mode="after")
    def _one_weight_format(self) -> ServerConfig:
        if self.quantize == "int8" and self.weight_layout == "packed":
            raise ValueError("quantize int8 has its own weight layout: use weight_layout auto (or torch) with it")
        return self

    @property
    def model_name(self) -> str:
        """The name clients use in ``model``: ``served_model_name``, else the model's last path component."""
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


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


def layered_settings(path: str | None, overrides: dict[str, Any], device_preset: str | None) -> dict[str, Any]:
    """The merged raw mapping of every layer (see the module docstring), before validation."""
    settings: dict[str, Any] = {}
    default_file = CONFIG_DIR / "default.yaml"
    if default_file.exists():
        settings = read_yaml(default_file)
    if path is None and device_preset is not None:
        for preset in (f"{device_preset}.yaml", f"tuned-{device_preset}.yaml"):
            if (CONFIG_DIR / preset).exists():
                settings = merge(settings, read_yaml(CONFIG_DIR / preset))
    if path is not None:
        settings = merge(settings, read_yaml(resolve_config_path(path)))
    return merge(settings, overrides)


def load_config(
    path: str | None = None, overrides: dict[str, Any] | None = None, device_preset: str | None = None
) -> ServerConfig:
    """Build and validate the config; raise ``ConfigError`` naming the bad field.

    ``overrides`` uses the config's own shape (``{"lookahead": {"window_size": 7}}``); ``None`` values in it
    are dropped so unset flags never override a file. ``device_preset`` is ``"cpu"`` or ``"cuda"``.
    """
    settings = layered_settings(path, drop_none(overrides or {}), device_preset)
    try:
        return ServerConfig.model_validate(settings)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "config"
        raise ConfigError(f"invalid configuration: {where}: {first['msg']}") from exc


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
