"""Config layering (defaults < default.yaml < device preset < --config < flags) and the CLI's parsing."""

from __future__ import annotations

import pytest

import server.app
from decoding import ModelLoadError
from server import cli
from server.config import CONFIG_DIR, ConfigError, ServerConfig, load_config, merge, read_yaml


def test_shipped_configs_are_valid():
    names = sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))
    assert {"default", "cpu", "cuda"} <= set(names)
    for name in names:
        assert isinstance(load_config(name), ServerConfig)


def test_default_file_matches_the_field_defaults():
    """configs/default.yaml documents the defaults: it must not drift from the code."""
    assert load_config() == ServerConfig()


def test_presets():
    cpu = load_config(device_preset="cpu")
    cuda = load_config(device_preset="cuda")
    for config, device in ((cpu, "cpu"), (cuda, "cuda")):
        tuned = read_yaml(CONFIG_DIR / f"tuned-{device}.yaml")["lookahead"]
        assert (config.lookahead.window_size, config.lookahead.ngram_size, config.lookahead.guess_set_size) == (
            tuned["window_size"], tuned["ngram_size"], tuned["guess_set_size"]
        )  # the tuner's preset, measured on the device, layered over configs/<device>.yaml
        assert (config.lookahead.lazy_window, config.lookahead.break_even) == (
            tuned["lazy_window"], tuned["break_even"]
        )
    assert cpu.lookahead.lazy_window and 0.0 < cpu.lookahead.break_even < 1.0
    assert cpu.lookahead.copy_length == read_yaml(CONFIG_DIR / "cpu.yaml")["lookahead"]["copy_length"] == 16
    assert not cuda.lookahead.lazy_window and cuda.lookahead.break_even == 0.0
    assert cpu.device == "cpu" and cuda.device == "cuda" and cuda.dtype == "float32"


def test_layers_in_order(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("port: 9000\nlookahead:\n  window_size: 5\n")
    config = load_config(str(path), {"port": 9100, "lookahead": {"ngram_size": 3, "guess_set_size": None}},
                         device_preset="cuda")
    assert config.port == 9100  # flag beats file
    assert config.lookahead.window_size == 5  # file beats default
    assert config.lookahead.ngram_size == 3
    assert config.lookahead.guess_set_size == 4  # a None flag does not override; an explicit --config skips the preset


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("prot: 9000\n", "prot"),
        ("port: nine\n", "port"),
        ("lookahead:\n  window_size: 0\n", "lookahead.window_size"),
        ("lookahead:\n  window_size: 20\n", "max_window_size"),
        ("- a list\n", "mapping"),
    ],
)
def test_bad_config_files(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(str(path))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("no-such-config")


def test_merge_is_deep():
    assert merge({"a": {"b": 1, "c": 2}, "d": 3}, {"a": {"b": 9}}) == {"a": {"b": 9, "c": 2}, "d": 3}


def test_model_name():
    assert ServerConfig().model_name == "SmolLM2-135M-Instruct"
    assert ServerConfig(model="/models/llama-3/").model_name == "llama-3"
    assert ServerConfig(model="org/repo", served_model_name="x").model_name == "x"


def parse(argv):
    return cli.build_parser().parse_args(argv)


def test_cli_flags_override_config(monkeypatch):
    monkeypatch.setattr(cli, "device_preset", lambda device: "cpu")
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    args = parse(["serve", "--config", "cuda", "--port", "8123", "--window-size", "7", "--no-lookahead",
                  "--max-running", "2", "--served-model-name", "smol", "--prefill-chunk", "32"])
    config = cli.build_config(args)
    assert config.port == 8123 and config.max_running == 2 and config.model_name == "smol"
    assert config.batch.prefill_chunk == 32 and config.batch.max_step_tokens == 1024  # from configs/cuda.yaml
    assert config.lookahead.window_size == 7 and config.lookahead.ngram_size == 5  # from configs/cuda.yaml
    assert config.lookahead.enabled is False
    assert config.api_key is None


def test_cli_api_key_from_environment(monkeypatch):
    monkeypatch.setattr(cli, "device_preset", lambda device: "cpu")
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.build_config(parse(["serve"])).api_key == "from-env"
    assert cli.build_config(parse(["serve", "--api-key", "flag"])).api_key == "flag"


def test_cli_defaults_to_serve(monkeypatch):
    seen = {}

    def fake_serve(args):
        seen["port"] = args.port
        return 0

    monkeypatch.setitem(cli.COMMANDS, "serve", (cli.COMMANDS["serve"][0], cli.add_serve_flags, fake_serve))
    assert cli.main(["--port", "8001"]) == 0 and seen["port"] == 8001
    assert cli.main([]) == 0 and seen["port"] is None
    assert cli.main(["serve", "--port", "8002"]) == 0 and seen["port"] == 8002


def test_cli_bad_config_exits_2(capsys):
    assert cli.main(["--config", "no-such-config"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_device_preset_names():
    assert cli.device_preset("cuda:1") == "cuda"
    assert cli.device_preset("cpu") == "cpu"


def test_read_yaml_of_an_empty_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert read_yaml(path) == {}


@pytest.mark.parametrize(
    "curve", [[[4, 1.0], [2, 2.0]], [[1, 1.0]], [[1, 1.0], [8, 0.0]], [[0, 1.0], [8, 2.0]]],
    ids=["descending", "one-point", "zero-cost", "zero-tokens"],
)
def test_a_bad_step_cost_curve_is_refused(curve):
    with pytest.raises(ConfigError, match="batch"):
        load_config(overrides={"batch": {"step_cost": curve}})


def test_the_shipped_cpu_preset_batches_with_its_measured_curve():
    config = load_config(device_preset="cpu")
    assert config.max_running >= 8 and config.batch.prefill_chunk <= config.batch.max_step_tokens
    assert config.batch.step_cost[0] == (1, 1.0) and len(config.batch.step_cost) >= 4


@pytest.mark.parametrize(
    ("flag", "field", "value", "default", "bad"),
    [
        ("--quantize", "quantize", "int8", "none", "int4"),
        ("--weight-layout", "weight_layout", "torch", "auto", "blocked"),
    ],
)
def test_linear_flags_reach_the_config(monkeypatch, flag, field, value, default, bad):
    monkeypatch.setattr(cli, "device_preset", lambda device: "cpu")
    assert getattr(cli.build_config(parse(["serve", flag, value])), field) == value
    assert getattr(cli.build_config(parse(["serve"])), field) == default
    with pytest.raises(SystemExit):
        parse(["serve", flag, bad])


def test_int8_with_the_packed_layout_is_refused(monkeypatch):
    monkeypatch.setattr(cli, "device_preset", lambda device: "cpu")
    with pytest.raises(ConfigError, match="own weight layout"):
        cli.build_config(parse(["serve", "--quantize", "int8", "--weight-layout", "packed"]))


def test_serve_loads_the_model_with_the_configured_linears(monkeypatch, capsys):
    monkeypatch.setattr(cli, "device_preset", lambda device: "cpu")
    seen = []

    def refuse(config):
        seen.append((config.quantize, config.weight_layout))
        raise ModelLoadError("not in this test")

    monkeypatch.setattr(server.app, "load_default_decoder", refuse)
    assert cli.main(["serve", "--quantize", "int8", "--weight-layout", "torch"]) == 1
    assert seen == [("int8", "torch")]
    assert "not in this test" in capsys.readouterr().err
