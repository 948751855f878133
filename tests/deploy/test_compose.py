"""docker/compose.yaml, docker/prometheus.yml and Grafana provisioning agree with each other and the image.

The chain checked: Prometheus scrapes the compose service that runs the image, on the port the image
listens on; Grafana's datasource points at the Prometheus service; the dashboard provider reads the
directory the dashboard JSON is mounted into; every bind mount exists and every named volume is declared.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.deploy import dockerfile
from tests.deploy.conftest import DASHBOARD_FILE, DOCKER, ROOT
from tests.deploy.dockerfile import Instruction

SERVICES = ("server", "prometheus", "grafana")
PROMETHEUS_DEFAULT_CONFIG = "/etc/prometheus/prometheus.yml"


def published(service: dict) -> dict[int, int]:
    """Container port -> host port, from short ("8000:8000", "127.0.0.1:80:8000") or long port syntax."""
    ports = {}
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ports[int(port["target"])] = int(port.get("published", port["target"]))
            continue
        parts = str(port).split("/")[0].split(":")
        ports[int(parts[-1])] = int(parts[-2]) if len(parts) > 1 else int(parts[-1])
    return ports


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume entry; a source is a named volume or a path relative to docker/."""
    found = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            found.append((volume["source"], volume["target"]))
        else:
            source, target = str(volume).split(":")[:2]
            found.append((source, target))
    return found


def is_bind(source: str) -> bool:
    """Whether a volume source is a host path rather than a named volume."""
    return source.startswith((".", "/", "~"))


def mount_source(service: dict, target: str) -> str:
    """The source mounted at ``target`` in ``service``."""
    sources = [source for source, mounted in mounts(service) if mounted == target]
    assert sources, f"nothing is mounted at {target}"
    return sources[0]


def flag_value(command: list[str], flag: str) -> str | None:
    """The value of ``--flag=value`` in a command list."""
    return next((item.split("=", 1)[1] for item in command if item.startswith(f"{flag}=")), None)


def scrape_targets(prometheus_config: dict) -> list[tuple[dict, str]]:
    """(scrape config, target) for every static target."""
    return [
        (job, target)
        for job in prometheus_config["scrape_configs"]
        for group in job.get("static_configs", [])
        for target in group["targets"]
    ]


def test_the_three_services(compose: dict) -> None:
    """server, prometheus and grafana, with the images issue 4 names."""
    services = compose["services"]
    assert set(SERVICES) <= set(services)
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def test_server_builds_this_repository(compose: dict, instructions: list[Instruction]) -> None:
    """The server builds the repository's Dockerfile, with a VARIANT the Dockerfile has a stage for."""
    build = compose["services"]["server"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == ROOT
    assert (context / build.get("dockerfile", "Dockerfile")).resolve() == ROOT / "Dockerfile"
    stages = {i.stage for i in instructions if i.keyword == "FROM"}
    assert f"base-{build['args']['VARIANT']}" in stages


def test_server_publishes_the_image_port(compose: dict, instructions: list[Instruction]) -> None:
    """The server's container port is the image's EXPOSE port, published on localhost:8000."""
    assert published(compose["services"]["server"]) == {dockerfile.exposed_port(instructions): 8000}


def test_server_keeps_the_model_cache_in_a_named_volume(compose: dict, instructions: list[Instruction]) -> None:
    """The image's LOOKAHEAD_CACHE is a named volume, so the converted model survives restarts."""
    cache = dockerfile.runtime_env(instructions)["LOOKAHEAD_CACHE"]
    source = mount_source(compose["services"]["server"], cache)
    assert not is_bind(source)
    assert source in compose["volumes"]


def test_prometheus_scrapes_the_server_service(compose: dict, prometheus_config: dict) -> None:
    """docker/prometheus.yml scrapes server:<container port>/metrics every 5 s."""
    targets = scrape_targets(prometheus_config)
    assert len(targets) == 1
    job, target = targets[0]
    host, port = target.rsplit(":", 1)
    assert host in compose["services"] and host == "server"
    assert int(port) in published(compose["services"]["server"])
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job.get("scrape_interval", prometheus_config.get("global", {}).get("scrape_interval")) == "5s"


def test_promtool_accepts_the_prometheus_config() -> None:
    """Prometheus' own checker (promtool check config) accepts docker/prometheus.yml."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus); prometheus.yml syntax not checked")
    command = [promtool, "check", "config", str(DOCKER / "prometheus.yml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_mounts_its_config(compose: dict) -> None:
    """compose mounts docker/prometheus.yml where the Prometheus command reads its config."""
    service = compose["services"]["prometheus"]
    config_path = flag_value(service.get("command", []), "--config.file") or PROMETHEUS_DEFAULT_CONFIG
    source = mount_source(service, config_path)
    assert (DOCKER / source).resolve() == DOCKER / "prometheus.yml"
    assert 9090 in published(service)


def test_grafana_datasource_is_the_prometheus_service(compose: dict, datasources: list[dict]) -> None:
    """The provisioned datasource URL is http://prometheus:<its container port>."""
    url = urlparse(datasources[0]["url"])
    assert url.hostname in compose["services"] and url.hostname == "prometheus"
    assert url.port in published(compose["services"][url.hostname])
    assert datasources[0]["isDefault"] is True


def test_grafana_mounts_provisioning_and_the_dashboard(compose: dict, dashboard_providers: list[dict]) -> None:
    """Provisioning lands in /etc/grafana/provisioning; the provider reads the dir the dashboard is mounted in."""
    service = compose["services"]["grafana"]
    provisioning = DOCKER / mount_source(service, "/etc/grafana/provisioning")
    assert (provisioning / "datasources").is_dir() and (provisioning / "dashboards").is_dir()
    dashboards_dir = dashboard_providers[0]["options"]["path"]
    assert (DOCKER / mount_source(service, dashboards_dir)).resolve() == DASHBOARD_FILE.parent
    assert 3000 in published(service)
    environment = service["environment"]
    assert environment.get("GF_AUTH_ANONYMOUS_ENABLED") == "true" or "GF_SECURITY_ADMIN_PASSWORD" in environment
    home = environment.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home is None or home == f"{dashboards_dir}/{DASHBOARD_FILE.name}"


@pytest.mark.parametrize("service", SERVICES)
def test_mounts_exist_and_volumes_are_declared(compose: dict, service: str) -> None:
    """Every bind mount names a file or directory under docker/; every named volume is declared."""
    for source, _ in mounts(compose["services"][service]):
        if is_bind(source):
            assert (DOCKER / source).exists(), f"{service}: {source} missing"
        else:
            assert source in compose.get("volumes", {}), f"{service}: volume {source} not declared"


def test_gpu_override_reserves_a_gpu_for_the_cuda_image(
    compose: dict, compose_gpu: dict, instructions: list[Instruction]
) -> None:
    """compose.gpu.yaml only overrides the server: CUDA variant and one NVIDIA GPU reservation."""
    assert set(compose_gpu["services"]) == {"server"}
    server = compose_gpu["services"]["server"]
    variant = server["build"]["args"]["VARIANT"]
    assert variant == "cuda" and f"base-{variant}" in {i.stage for i in instructions}
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in devices)
    assert server["image"] != compose["services"]["server"]["image"]


def test_every_compose_file_is_documented() -> None:
    """Each compose file says in its header how to run it."""
    for path in (DOCKER / "compose.yaml", DOCKER / "compose.gpu.yaml"):
        header = Path(path).read_text().split("\n\n")[0]
        assert "docker compose -f docker/compose.yaml" in header, path


def test_cache_env_is_not_overridden_by_compose(compose: dict, instructions: list[Instruction]) -> None:
    """compose leaves LOOKAHEAD_CACHE to the image, so the volume and the variable cannot drift apart."""
    environment = compose["services"]["server"].get("environment", {})
    value = environment.get("LOOKAHEAD_CACHE") if isinstance(environment, dict) else None
    assert value in (None, dockerfile.runtime_env(instructions)["LOOKAHEAD_CACHE"])
    assert dockerfile.exec_form(
        next(i for i in instructions if i.keyword == "VOLUME" and i.stage == "runtime").args
    ) == [dockerfile.runtime_env(instructions)["LOOKAHEAD_CACHE"]]
