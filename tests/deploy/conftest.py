"""Fixtures for the deployment tests: the parsed deployment files and what the server really exports.

Contract: every fixture reads files from the repository (no Docker, no network, no model); ``exported`` and
``cli_parser`` import ``server.metrics`` / ``server.cli`` and are the only fixtures that touch the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy import dockerfile, exported_metrics

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
GRAFANA = DOCKER / "grafana"
DATASOURCE_FILE = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDER_FILE = GRAFANA / "provisioning" / "dashboards" / "dashboards.yaml"
DASHBOARD_FILE = GRAFANA / "dashboards" / "lookahead.json"


def read_yaml(path: Path) -> dict:
    """One YAML mapping from ``path``."""
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} must hold a mapping"
    return data


@pytest.fixture(scope="session")
def dashboard() -> dict:
    """The provisioned Grafana dashboard."""
    return json.loads(DASHBOARD_FILE.read_text())


@pytest.fixture(scope="session")
def datasources() -> list[dict]:
    """The provisioned Grafana datasources."""
    return read_yaml(DATASOURCE_FILE)["datasources"]


@pytest.fixture(scope="session")
def dashboard_providers() -> list[dict]:
    """The provisioned Grafana dashboard providers."""
    return read_yaml(DASHBOARD_PROVIDER_FILE)["providers"]


@pytest.fixture(scope="session")
def compose() -> dict:
    """docker/compose.yaml."""
    return read_yaml(DOCKER / "compose.yaml")


@pytest.fixture(scope="session")
def compose_gpu() -> dict:
    """docker/compose.gpu.yaml, the GPU override."""
    return read_yaml(DOCKER / "compose.gpu.yaml")


@pytest.fixture(scope="session")
def prometheus_config() -> dict:
    """docker/prometheus.yml."""
    return read_yaml(DOCKER / "prometheus.yml")


@pytest.fixture(scope="session")
def instructions() -> list[dockerfile.Instruction]:
    """The Dockerfile's instructions."""
    return dockerfile.read_instructions((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="session")
def pyproject() -> dict:
    """pyproject.toml."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="session")
def exported() -> dict[str, exported_metrics.Family]:
    """Every metric family the server's metrics module declares, by family name."""
    return exported_metrics.families()
