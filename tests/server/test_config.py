"""The one config definition: layering (defaults < device preset < --config < flags), sources, derived flags."""

from __future__ import annotations

import pytest

import server.runtime
from decoding import ModelLoadError
from decoding.params import LOOKAHEAD_BOUNDS, LookaheadConfig
from decoding.weights.cores import usable_cores
from server import cli, flags
from server.config import ConfigError, LookaheadSettings, ServerConfig, fields, lookahead_bounds
from server.config_layers import CONFIG_DIR, load_config, merge, read_yaml, resolve
from server.flags import config_flags


def test_the_shipped_configs_are_the_two_device_presets():
    """What a device runs is its preset file: no hidden layer (default.yaml, tuned-*.yaml) beside it."""
    assert sorted(path.name for path in CONFIG_DIR.iterdir()) == ["cpu.yaml", "cuda.yaml"]
    for name in ("cpu", "cuda"):
        assert isinstance(load_config(name), ServerConfig)


def test_without_a_preset_the_field_defaults_apply():
    assert load_config() == ServerConfig()
    assert all(source == "flag" for source in resolve(overrides={"port": 1}).sources.values())


def test_lookahead_defaults_and_bounds_are_the_decoders():
    """The server's lookahead fields take their defaults and bounds from decoding.params, where they are checked."""
    settings, library = LookaheadSettings(), LookaheadConfig()
    for name in ("window_size", "ngram_size", "guess_set_size", "lazy_window", "break_even", "copy_length"):
        assert getattr(settings, name) == getattr(library, name)
    for name, (low, high) in LOOKAHEAD_BOUNDS.items():
        for bad in (low - 1, high + 1):
            with pytest.raises(ConfigError, match=f"lookahead.{name}"):
                load_config(overrides={"lookahead": {name: bad, f"max_{name}": high}} if name != "copy_length"
                            else {"lookahead": {name: bad}})
    assert lookahead_bounds(settings) == {
        "window_size": (1, settings.max_window_size),
        "ngram_size": (2, settings.max_ngram_size),
        "guess_set_size": (0, settings.max_guess_set_size),
    }


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_device_runs_exactly_its_preset_file(device):
    preset = read_yaml(CONFIG_DIR / f"{device}.yaml")
    resolved = resolve(device_preset=device)
    for section in ("lookahead", "batch"):
        for key, value in preset[section].items():
            got = getattr(getattr(resolved.config, section), key)
            assert (got if key != "step_cost" else [list(point) for point in got]) == value, f"{section}.{key}"
            assert resolved.source(f"{section}.{key}") == f"configs/{device}.yaml"


def test_presets():
    cpu = load_config(device_preset="cpu")
    cuda = load_config(device_preset="cuda")
    assert (cpu.lookahead.window_size, cpu.lookahead.ngram_size, cpu.lookahead.guess_set_size) == (1, 3, 2)
    assert cpu.lookahead.lazy_window and cpu.lookahead.break_even == 1.5 and cpu.lookahead.copy_length == 8
    assert (cuda.lookahead.window_size, cuda.lookahead.ngram_size, cuda.lookahead.guess_set_size) == (16, 5, 32)
    assert not cuda.lookahead.lazy_window and cuda.lookahead.break_even == 0.0
    assert cpu.device == "cpu" and cuda.device == "cuda" and cuda.dtype == "float32"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_step_cost_curves_never_fall(device):
    """A falling last segment would extrapolate to negative costs past the curve's end."""
    costs = [cost for _, cost in load_config(device_preset=device).batch.step_cost]
    assert costs == sorted(costs)


def test_layers_in_order(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("port: 9000\nlookahead:\n  window_size: 5\n")
    resolved = resolve(str(path), {"port": 9100, "lookahead": {"ngram_size": 3, "guess_set_size": None}},
                       device_preset="cuda")
    config = resolved.config
    assert config.port == 9100 and resolved.source("port") == "flag"  # flag beats file
    assert config.lookahead.window_size == 5 and resolved.source("lookahead.window_size") == str(path)
    assert config.lookahead.ngram_size == 3
    assert config.lookahead.guess_set_size == 32  # a None flag does not override; the preset still applies
    assert resolved.source("lookahead.guess_set_size") == "configs/cuda.yaml"
    assert config.host == "127.0.0.1" and resolved.source("host") == "default"


def test_every_scalar_value_has_a_flag_and_every_flag_a_value():
    keys = [key for key, _ in fields()]
    flags = config_flags()
    assert [flag.key for flag in flags] == [key for key in keys if key != "batch.step_cost"]
    assert len({flag.name for flag in flags}) == len(flags)  # no two values share a flag
    parser = cli.build_parser()
    serve_flags = {option for action in parser._subparsers._group_actions[0].choices["serve"]._actions
                   for option in action.option_strings}
    assert {flag.name for flag in flags} <= serve_flags


def test_a_flag_reaches_its_key_with_the_fields_bounds(monkeypatch):
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    config = cli.build_config(parse(["serve", "--break-even", "0.5", "--copy-length", "4", "--no-lazy-window"]))
    assert (config.lookahead.break_even, config.lookahead.copy_length, config.lookahead.lazy_window) == (0.5, 4, False)
    with pytest.raises(ConfigError, match="lookahead.copy_length"):
        cli.build_config(parse(["serve", "--copy-length", str(LOOKAHEAD_BOUNDS["copy_length"][1] + 1)]))


def test_the_config_command_prints_what_serve_runs_and_where_it_came_from(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    monkeypatch.delenv(flags.API_KEY_ENV, raising=False)
    assert cli.main(["config", "--window-size", "2", "--api-key", "sekrit"]) == 0
    out = capsys.readouterr().out
    assert "sekrit" not in out and "# api_key: <hidden>" in out
    assert out.startswith("# lookahead-server configuration (layers, later wins: default < configs/cpu.yaml < flag)")
    lines = {line.split("#")[0].strip(): line.rsplit("#", 1)[1].strip() for line in out.splitlines()
             if ":" in line.split("#")[0] and "#" in line}
    assert lines["window_size: 2"] == "flag"
    assert lines["ngram_size: 3"] == "configs/cpu.yaml"
    assert lines["host: 127.0.0.1"] == "default"
    saved = tmp_path / "saved.yaml"  # the listing is itself a config file that gives the same config back
    saved.write_text(out)
    assert load_config(str(saved)) == cli.build_config(parse(["serve", "--window-size", "2"]))


def test_the_reference_page_is_generated_from_the_definition():
    page = (CONFIG_DIR.parent / "docs" / "configuration.md").read_text()
    from server.config_reference import reference_markdown

    assert reference_markdown() in page, "docs/configuration.md is stale: regenerate it (see its first lines)"


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
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    monkeypatch.delenv(flags.API_KEY_ENV, raising=False)
    args = parse(["serve", "--config", "cuda", "--port", "8123", "--window-size", "7", "--no-lookahead",
                  "--max-running", "2", "--served-model-name", "smol", "--prefill-chunk", "32"])
    config = cli.build_config(args)
    assert config.port == 8123 and config.max_running == 2 and config.model_name == "smol"
    assert config.batch.prefill_chunk == 32 and config.batch.max_step_tokens == 1024  # from configs/cuda.yaml
    assert config.lookahead.window_size == 7 and config.lookahead.ngram_size == 5  # from configs/cuda.yaml
    assert config.lookahead.enabled is False
    assert config.api_key is None


def test_cli_api_key_from_environment(monkeypatch):
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    monkeypatch.setenv(flags.API_KEY_ENV, "from-env")
    assert cli.build_config(parse(["serve"])).api_key == "from-env"
    assert cli.build_config(parse(["serve", "--api-key", "flag"])).api_key == "flag"


def test_cli_defaults_to_serve(monkeypatch):
    seen = {}

    def fake_serve(args):
        seen["port"] = args.port
        return 0

    monkeypatch.setitem(cli.COMMANDS, "serve", (cli.COMMANDS["serve"][0], cli.add_config_flags, fake_serve))
    assert cli.main(["--port", "8001"]) == 0 and seen["port"] == 8001
    assert cli.main([]) == 0 and seen["port"] is None
    assert cli.main(["serve", "--port", "8002"]) == 0 and seen["port"] == 8002


def test_cli_bad_config_exits_2(capsys):
    assert cli.main(["--config", "no-such-config"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_device_preset_names():
    assert flags.device_preset("cuda:1") == "cuda"
    assert flags.device_preset("cpu") == "cpu"


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
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    assert getattr(cli.build_config(parse(["serve", flag, value])), field) == value
    assert getattr(cli.build_config(parse(["serve"])), field) == default
    with pytest.raises(SystemExit):
        parse(["serve", flag, bad])


def test_threads_take_a_count_or_auto_and_the_cpu_preset_says_auto(monkeypatch, capsys):
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    assert ServerConfig().threads == "auto" and load_config(device_preset="cpu").threads == "auto"
    assert load_config(device_preset="cuda").threads == 0
    assert cli.build_config(parse(["serve", "--threads", "3"])).threads == 3
    assert cli.build_config(parse(["serve", "--threads", "auto"])).threads == "auto"
    for bad in ("-1", "two"):
        with pytest.raises(ConfigError, match="threads"):
            cli.build_config(parse(["serve", "--threads", bad]))
    assert cli.main(["config"]) == 0  # the listing says what auto gives here
    assert f"(auto: {usable_cores()} here)" in next(line for line in capsys.readouterr().out.splitlines()
                                                  if line.startswith("threads:"))


def test_int8_with_the_packed_layout_is_refused(monkeypatch):
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    with pytest.raises(ConfigError, match="own weight layout"):
        cli.build_config(parse(["serve", "--quantize", "int8", "--weight-layout", "packed"]))


def test_serve_loads_the_model_with_the_configured_linears(monkeypatch, capsys):
    monkeypatch.setattr(flags, "device_preset", lambda device: "cpu")
    seen = []

    def refuse(config):
        seen.append((config.quantize, config.weight_layout))
        raise ModelLoadError("not in this test")

    monkeypatch.setattr(server.runtime, "load_default_decoder", refuse)
    assert cli.main(["serve", "--quantize", "int8", "--weight-layout", "torch"]) == 1
    assert seen == [("int8", "torch")]
    assert "not in this test" in capsys.readouterr().err


def test_the_step_policy_reaches_each_requests_lookahead_config():
    """A request's LookaheadConfig carries the configured step policy (copy steps included) with its own W/N/G."""
    from server.protocol import LookaheadRequest
    from server.serving import resolve_lookahead

    settings = load_config(device_preset="cpu").lookahead
    config = resolve_lookahead(LookaheadRequest(window_size=2), settings)
    assert (config.window_size, config.ngram_size) == (2, settings.ngram_size)
    assert (config.copy_length, config.copy_min_match, config.lazy_window) == (
        settings.copy_length, settings.copy_min_match, settings.lazy_window
    )
    assert resolve_lookahead(LookaheadRequest(enabled=False), settings) is None
    cuda = load_config(device_preset="cuda").lookahead
    config = resolve_lookahead(None, cuda)
    assert (config.copy_candidates, config.copy_stretch, config.window_chains) == (
        cuda.copy_candidates, cuda.copy_stretch, cuda.window_chains
    )
    assert config.copy_stretch > 1  # the CUDA preset stretches copies; a dropped field would leave the default 1


def test_memory_tokens_field_flag_and_bounds():
    """The shared n-gram memory's size: on by default on both devices, a flag, 0 allowed (off), bounded."""
    for device in ("cpu", "cuda"):
        assert load_config(device_preset=device).lookahead.memory_tokens == 200_000
    flag = next(flag for flag in config_flags() if flag.key == "lookahead.memory_tokens")
    assert (flag.name, flag.kind) == ("--memory-tokens", int)
    assert load_config(overrides={"lookahead": {"memory_tokens": 0}}).lookahead.memory_tokens == 0
    for bad in (-1, 10_000_001):
        with pytest.raises(ConfigError, match="lookahead.memory_tokens"):
            load_config(overrides={"lookahead": {"memory_tokens": bad}})


def test_the_shared_memory_opt_out_reaches_each_requests_lookahead_config():
    from server.protocol import LookaheadRequest
    from server.serving import resolve_lookahead

    settings = LookaheadSettings()
    assert resolve_lookahead(None, settings).shared_memory is True
    assert resolve_lookahead(LookaheadRequest(shared_memory=True), settings).shared_memory is True
    assert resolve_lookahead(LookaheadRequest(shared_memory=False), settings).shared_memory is False


def test_a_request_sets_exactly_the_request_lookahead_knobs_each_with_a_maximum():
    """``LookaheadRequest`` and ``lookahead_bounds`` follow from ``REQUEST_LOOKAHEAD`` (one declaration)."""
    from server.config import REQUEST_LOOKAHEAD, LookaheadSettings, lookahead_bounds
    from server.protocol import LookaheadRequest

    assert set(LookaheadRequest.model_fields) == {"enabled", "shared_memory", *REQUEST_LOOKAHEAD}
    assert set(lookahead_bounds(LookaheadSettings())) == set(REQUEST_LOOKAHEAD)
    assert all(f"max_{name}" in LookaheadSettings.model_fields for name in REQUEST_LOOKAHEAD)


def test_every_decoder_knob_is_a_server_setting_or_listed_as_decoder_only():
    import dataclasses

    from decoding.params import LookaheadConfig
    from server.config import DECODER_ONLY, LOOKAHEAD_STEP_FIELDS, LookaheadSettings

    decoder = {field.name for field in dataclasses.fields(LookaheadConfig)}
    exposed = decoder & set(LookaheadSettings.model_fields)
    assert set(LOOKAHEAD_STEP_FIELDS) == exposed
    assert decoder - exposed == set(DECODER_ONLY), "a decoder knob is neither a server setting nor in DECODER_ONLY"
    assert not exposed & set(DECODER_ONLY) and all(reason for reason in DECODER_ONLY.values())
    assert "runner_up" in exposed  # it had no way in from any config
