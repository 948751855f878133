"""The Ray Serve builder's pure parts (``server.ray_app``), without a Ray instance: the options it derives from the
server's config, the Serve config files, the replica header, and the warm-before-traffic lifespan."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi import FastAPI

pytest.importorskip("ray.serve")

from ray.serve.schema import ServeDeploySchema  # noqa: E402

from server.app import create_app  # noqa: E402
from server.ray_app import (  # noqa: E402
    REPLICA_HEADER,
    SHUTDOWN_MARGIN_SECONDS,
    RayAppArgs,
    ReplicaHeader,
    build_app,
    deployment_options,
    resolve_config,
    serve_when_warm,
)
from tests.server.conftest import make_config  # noqa: E402
from tests.server.helpers import gated_loader  # noqa: E402
from tests.server.test_scheduler import decoder_with  # noqa: E402

SERVE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "docker" / "ray").glob("serve*.yaml"))


def test_autoscaling_options_follow_the_server_config():
    config = make_config(max_running=6, max_queue=10, drain_grace_seconds=20, threads=2)
    options = deployment_options(config, RayAppArgs(min_replicas=1, max_replicas=3,
                                                    autoscaling={"upscale_delay_s": 5}))
    assert options["max_ongoing_requests"] == 16
    assert options["graceful_shutdown_timeout_s"] == 20 + SHUTDOWN_MARGIN_SECONDS
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 6.0,
                                             "upscale_delay_s": 5}
    assert "num_replicas" not in options


def test_a_fixed_replica_count_turns_autoscaling_off():
    options = deployment_options(make_config(), RayAppArgs(num_replicas=3, target_ongoing_requests=2))
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options


def test_the_device_follows_the_replicas_gpus():
    assert resolve_config(RayAppArgs()).device == "cpu"
    gpu = resolve_config(RayAppArgs(num_gpus=1))
    assert gpu.device == "cuda" and gpu.dtype == resolve_config(RayAppArgs(config="cuda", num_gpus=1)).dtype
    assert deployment_options(gpu, RayAppArgs(config="cuda"))["ray_actor_options"]["num_gpus"] == 1.0
    assert resolve_config(RayAppArgs(overrides={"device": "cpu", "max_running": 3})).max_running == 3


def test_unknown_builder_arguments_are_refused():
    with pytest.raises(ValueError, match="replicas"):
        RayAppArgs.model_validate({"replicas": 2})


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=[path.name for path in SERVE_CONFIGS])
def test_serve_configs_are_valid_and_build(path):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for application in schema.applications:
        assert application.import_path == "server.ray_app:build_app"
        args = RayAppArgs.model_validate(application.args)
        config = resolve_config(args)
        options = deployment_options(config, args)
        assert options["max_ongoing_requests"] == config.max_running + config.max_queue
        assert options["graceful_shutdown_timeout_s"] > config.drain_grace_seconds
        assert options["autoscaling_config"]["target_ongoing_requests"] == config.max_running
        assert build_app(application.args) is not None


async def test_the_replica_header_is_on_every_answer():
    app = FastAPI()

    @app.get("/x")
    async def x() -> dict:
        return {}

    transport = httpx.ASGITransport(app=ReplicaHeader(app, replica="r1"))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/x")).headers[REPLICA_HEADER] == "r1"
        assert (await client.get("/missing")).headers[REPLICA_HEADER] == "r1"


async def test_startup_returns_only_once_warm(tokenizer):
    decoder = decoder_with(tokenizer, {})
    release, slow_load = gated_loader(decoder)

    app = create_app(make_config(), load_decoder=slow_load)
    serve_when_warm(app, interval_s=60)
    runtime = app.state.runtime
    threading.Timer(0.3, release.set).start()
    async with app.router.lifespan_context(app):
        assert runtime.state == "ready"  # Serve routes to the replica only from here on


async def test_a_failed_start_fails_the_replica():
    def failing_load(config):
        raise RuntimeError("no such model")

    app = create_app(make_config(), load_decoder=failing_load)
    serve_when_warm(app, interval_s=60)
    with pytest.raises(RuntimeError, match="did not start"):
        async with app.router.lifespan_context(app):
            pass
