"""The benchmark's defaults are the server's preset for the device; flags override them, and say so."""

from __future__ import annotations

import pytest

from bench import cli, settings
from server.config_layers import load_config


def resolved(*flags: str) -> settings.Resolved:
    return settings.resolve(cli.build_parser().parse_args(["--device", "cpu", *flags]))


def test_no_flags_run_the_server_cpu_preset() -> None:
    server = load_config(device_preset="cpu")
    result = resolved()
    args = result.args
    for name in ("window_size", "ngram_size", "guess_set_size", "lazy_window", "copy_length"):
        assert getattr(args, name) == getattr(server.lookahead, name), name
    assert args.break_even == min(server.lookahead.break_even, server.lookahead.ngram_size - 1)
    assert (args.model, args.dtype, args.quantize, args.weight_layout, args.threads) == (
        server.model, server.dtype, server.quantize, server.weight_layout, server.threads
    )
    assert result.policy.max_step_tokens == server.batch.max_step_tokens
    assert result.policy.prefill_chunk == server.batch.prefill_chunk
    assert [list(point) for point in result.policy.step_cost] == [list(p) for p in server.batch.step_cost]
    assert set(result.sources.values()) == {"server preset cpu"} and result.preset == "cpu"


def test_flags_override_and_are_marked() -> None:
    result = resolved("--window-size", "3", "--no-lazy-window", "--copy-length", "0", "--threads", "0")
    assert (result.args.window_size, result.args.lazy_window, result.args.copy_length) == (3, False, 0)
    assert result.args.threads == 0
    assert {name for name, source in result.sources.items() if source == "flag"} == {
        "window_size", "lazy_window", "copy_length", "threads"
    }
    text = settings.describe(result)
    assert text.splitlines()[0] == "settings (server preset cpu unless marked [flag]):"
    assert "window_size=3 [flag]" in text and "lazy_window=False [flag]" in text
    assert f"ngram_size={result.args.ngram_size}," in text and "max_step_tokens=" in text


def test_a_preset_break_even_is_capped_at_n_minus_one_as_the_server_does(monkeypatch: pytest.MonkeyPatch) -> None:
    def high_break_even(device_preset: str):
        return load_config(overrides={"lookahead": {"break_even": 1.5}}, device_preset=device_preset)

    monkeypatch.setattr(settings, "load_config", high_break_even)
    assert resolved("--ngram-size", "2").args.break_even == 1.0
    assert resolved("--ngram-size", "4").args.break_even == 1.5
    assert resolved("--ngram-size", "2", "--break-even", "1.5").args.break_even == 1.5  # a flag is taken as is


def test_a_named_preset_gives_the_lookahead_settings_and_the_device_loads_the_model() -> None:
    """``--preset cuda`` on a CPU: the GPU's W, N, G and batch policy, the CPU's model settings."""
    cuda, cpu = load_config(device_preset="cuda"), load_config(device_preset="cpu")
    result = settings.resolve(cli.build_parser().parse_args(["--device", "cpu", "--ngram-size", "3"]), "cuda")
    args = result.args
    for name in ("window_size", "guess_set_size", "copy_length", "lazy_window", "break_even"):
        assert getattr(args, name) == getattr(cuda.lookahead, name), name
    assert args.ngram_size == 3 and result.sources["ngram_size"] == "flag"
    assert (args.dtype, args.weight_layout, args.threads) == (cpu.dtype, cpu.weight_layout, cpu.threads)
    assert result.policy.max_step_tokens == cuda.batch.max_step_tokens
    assert (result.preset, result.model_preset) == ("cuda", "cpu")
    assert result.sources["window_size"] == "server preset cuda" and result.sources["threads"] == "server preset cpu"
    assert settings.describe(result).splitlines()[0] == (
        "settings (lookahead and batch: server preset cuda, model: server preset cpu, unless marked [flag]):"
    )
    assert settings.resolve(cli.build_parser().parse_args(["--device", "cpu"]), "cpu") == resolved()
