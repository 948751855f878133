"""The Dockerfile builds a CPU or a CUDA image that runs the real CLI as a non-root user.

Read, not built (Docker cannot run here): stages and the VARIANT argument, the entrypoint against
pyproject's console scripts, the default command against the CLI's own parser and config, the healthcheck
(run for real against a stub /health), the cache volume against decoding.weights.loading, and the build context.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.deploy import dockerfile
from tests.deploy.conftest import ROOT
from tests.deploy.dockerfile import Instruction


def test_variants_select_a_cpu_or_cuda_base(instructions: list[Instruction]) -> None:
    """VARIANT (default cpu) picks base-cpu (python slim) or base-cuda (nvidia/cuda runtime) for both stages."""
    assert dockerfile.arg_defaults(instructions, None)["VARIANT"] == "cpu"
    stages = {i.stage: i for i in instructions if i.keyword == "FROM"}
    images = dockerfile.arg_defaults(instructions, None)
    assert re.fullmatch(
        r"python:3\.1[0-3]-slim.*", dockerfile.expand(dockerfile.from_image(stages["base-cpu"]), images)
    )
    assert re.fullmatch(
        r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+",
        dockerfile.expand(dockerfile.from_image(stages["base-cuda"]), images),
    )
    for stage in ("builder", dockerfile.final_stage(instructions)):
        base = dockerfile.from_image(stages[stage])
        assert base == "base-${VARIANT}", stage
        for variant in dockerfile.VARIANTS:
            assert base.replace("${VARIANT}", variant) in stages


def test_torch_pin_matches_the_project(instructions: list[Instruction], pyproject: dict) -> None:
    """The image installs the torch the Makefile pins, and it satisfies pyproject's requirement."""
    version = dockerfile.arg_defaults(instructions, "builder")["TORCH_VERSION"]
    requirement = next(Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("torch"))
    assert requirement.specifier.contains(version)
    pin = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    if pin:
        assert version == pin.group(1)


def test_the_runtime_runs_as_a_non_root_user(instructions: list[Instruction]) -> None:
    """The final stage switches to a numeric non-root uid:gid, created by useradd, before the entrypoint."""
    stage = dockerfile.final_stage(instructions)
    user = dockerfile.only(instructions, "USER", stage)
    uid, _, gid = dockerfile.expand(user.args, dockerfile.arg_defaults(instructions, stage)).partition(":")
    assert uid.isdigit() and int(uid) >= 1000 and gid.isdigit()
    assert user.line < dockerfile.only(instructions, "ENTRYPOINT", stage).line
    user_variable = user.args.partition(":")[0].strip("${}")
    creates = [i.args for i in instructions if i.stage == stage and i.keyword == "RUN" and "useradd" in i.args]
    assert creates and re.search(rf"useradd --uid \"?\$\{{{user_variable}\}}", creates[0])


def test_entrypoint_is_the_console_script(instructions: list[Instruction], pyproject: dict) -> None:
    """ENTRYPOINT runs the console script pyproject declares for server.cli:main."""
    entrypoint = dockerfile.exec_form(
        dockerfile.only(instructions, "ENTRYPOINT", dockerfile.final_stage(instructions)).args
    )
    scripts = pyproject["project"]["scripts"]
    assert len(entrypoint) == 1 and entrypoint[0] in scripts
    assert scripts[entrypoint[0]] == "server.cli:main"


def test_default_command_is_accepted_by_the_cli(instructions: list[Instruction]) -> None:
    """CMD parses with the CLI's own parser (as main() would) and yields a valid config on 0.0.0.0:EXPOSE."""
    from server import cli

    argv = dockerfile.cli_argv(instructions)[1:]
    if not argv or argv[0] not in cli.COMMANDS:
        argv = ["serve", *argv]
    args = cli.build_parser().parse_args(argv)
    config = cli.build_config(args)
    assert config.host == "0.0.0.0"
    assert config.port == dockerfile.exposed_port(instructions)


def test_a_misspelt_flag_would_be_rejected() -> None:
    """The check above can fail: argparse exits on a flag the CLI does not have."""
    from server import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--hostname", "0.0.0.0"])


def test_model_cache_is_a_volume_read_by_the_loader(instructions: list[Instruction], monkeypatch) -> None:
    """LOOKAHEAD_CACHE points into a VOLUME, and it is the variable decoding.weights.loading reads."""
    from decoding.weights.loading import cache_root

    cache = dockerfile.runtime_env(instructions)["LOOKAHEAD_CACHE"]
    volumes = dockerfile.exec_form(dockerfile.only(instructions, "VOLUME", dockerfile.final_stage(instructions)).args)
    assert cache in volumes
    monkeypatch.setenv("LOOKAHEAD_CACHE", cache)
    assert cache_root() == Path(cache)
    assert dockerfile.runtime_env(instructions).get("HF_HOME", cache).startswith(cache)


def healthcheck_command(instructions: list[Instruction]) -> list[str]:
    """The exec-form command of the final stage's HEALTHCHECK."""
    args = dockerfile.only(instructions, "HEALTHCHECK", dockerfile.final_stage(instructions)).args
    return dockerfile.exec_form(args[args.index("CMD") + len("CMD") :].strip())


class _Health(BaseHTTPRequestHandler):
    """A stub server: GET /health answers ``status``; every other path 404."""

    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args) -> None:
        """Keep test output quiet."""


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    """A stub /health on a free loopback port, shut down after the test."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    _Health.status = 200


def test_healthcheck_probes_health_without_curl(
    instructions: list[Instruction], health_server: ThreadingHTTPServer
) -> None:
    """The healthcheck is a python one-liner on /health of the exposed port: 0 on 200, non-zero on 503."""
    command = healthcheck_command(instructions)
    assert command[:2] == ["python", "-c"]
    url = f"http://127.0.0.1:{dockerfile.exposed_port(instructions)}/health"
    assert url in command[2]
    code = command[2].replace(url, f"http://127.0.0.1:{health_server.server_port}/health")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode == 0
    _Health.status = 503
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode != 0


def test_build_context_has_what_the_image_copies(instructions: list[Instruction], pyproject: dict) -> None:
    """Every COPY source exists and survives .dockerignore; the packages, configs/ and the readme are copied."""
    patterns = dockerfile.read_dockerignore((ROOT / ".dockerignore").read_text())
    sources = [source for i in instructions if i.keyword in ("COPY", "ADD") for source in dockerfile.copy_sources(i)]
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not dockerfile.ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    packages = {include.rstrip("*") for include in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"configs", "pyproject.toml", pyproject["project"]["readme"]} <= set(sources)


def test_dockerignore_keeps_local_state_out(instructions: list[Instruction]) -> None:
    """The virtual environment, git metadata and caches never enter the build context."""
    patterns = dockerfile.read_dockerignore((ROOT / ".dockerignore").read_text())
    for path in (".venv", ".git", "server/__pycache__", ".pytest_cache", ".ruff_cache", "lookahead_server.egg-info"):
        assert dockerfile.ignored(path, patterns), path
    for path in ("server/cli.py", "decoding/step/stream.py", "configs/cpu.yaml", "pyproject.toml"):
        assert not dockerfile.ignored(path, patterns), path


def test_editable_install_keeps_configs_next_to_the_packages(instructions: list[Instruction]) -> None:
    """server.config finds configs/ beside the package directory, so the image installs in place from /app."""
    from server.config_layers import CONFIG_DIR

    assert CONFIG_DIR == ROOT / "configs"
    builder = [i for i in instructions if i.stage == "builder"]
    workdir = [i.args for i in builder if i.keyword == "WORKDIR"][-1]
    assert any(i.keyword == "RUN" and re.search(r"pip install (-e|--editable) \"?\.", i.args) for i in builder)
    assert any(i.keyword == "COPY" and i.args == "configs ./configs" for i in builder)
    final = dockerfile.final_stage(instructions)
    assert any(
        i.keyword == "COPY" and i.args == f"--from=builder {workdir} {workdir}"
        for i in instructions
        if i.stage == final
    )
