"""The app as a Ray Serve deployment: replicas, load-aware routing, autoscaling and restarts from Ray.

Run it with ``serve run server.ray_app:build_app config=cpu`` (any ``RayAppArgs`` field as ``key=value``) or a
Serve config file (``docker/ray/serve.yaml``; KubeRay's ``RayService`` embeds the same file).

Contract:
- ``build_app(args)`` is Serve's application builder: it validates ``RayAppArgs``, resolves the server's config
  as the CLI does (``resolve_config``: the preset of the device the replica's resources give, then the
  ``config`` file, then ``overrides``) and binds ``LookaheadServer`` with ``deployment_options``: ``num_cpus`` /
  ``num_gpus``, ``max_ongoing_requests`` = ``max_running + max_queue``, autoscaling with a target of
  ``max_running`` ongoing requests per replica (or a fixed ``num_replicas``), ``graceful_shutdown_timeout_s``
  above the drain grace, a short health-check period. Pure, and tested without Ray.
- Each replica builds its own runtime (``create_app`` runs in the replica: the worker thread and the metrics
  registry do not pickle; only the config's plain data crosses). Its ASGI startup returns only once the model is
  loaded and warm, so Serve routes nothing to it before; a start that fails fails the replica, which Serve
  replaces. ``check_health`` raises once the runtime has failed or its worker thread died, so Ray restarts it.
- On shutdown Serve stops routing to the replica, waits for its ongoing requests up to
  ``graceful_shutdown_timeout_s``, then the app's own shutdown cancels what is left.
- Every answer carries ``x-lookahead-replica``: the replica that served it. Every ``metrics_interval_s`` the
  replica mirrors its registry into Ray's metrics (``server.ray_metrics``: ``ray_lookahead_*`` per replica).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import metrics as serve_metrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decoding.weights.cores import resolve_threads
from server.config import ServerConfig
from server.config_layers import requested_device, resolve
from server.ray_metrics import RayMirror, samples

logger = logging.getLogger("server.ray_app")
DEPLOYMENT_NAME = "LookaheadServer"
REPLICA_HEADER = "x-lookahead-replica"
SHUTDOWN_MARGIN_SECONDS = 5.0  # Serve's graceful-shutdown timeout exceeds the drain grace by this much
STARTING_STATES = ("loading", "warming")


class RayAppArgs(BaseModel):
    """The builder's arguments (``serve run ... key=value`` or a Serve config's ``args``)."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = Field(None, description="a lookahead-server YAML: a path or a name in configs/")
    overrides: dict[str, Any] = Field(default_factory=dict, description="config values over the file, "
                                      "in its shape ({lookahead: {window_size: 2}})")
    num_replicas: int | None = Field(None, ge=1, description="a fixed replica count; none: autoscaling")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float | None = Field(None, gt=0, description="per replica; none: max_running")
    autoscaling: dict[str, Any] = Field(default_factory=dict, description="more of Serve's autoscaling_config "
                                        "(upscale_delay_s, downscale_delay_s, look_back_period_s, ...)")
    num_cpus: float | None = Field(None, ge=0, description="per replica; none: the config's threads (at least 1; "
                                   "auto: the cores the deploying process may use)")
    num_gpus: float | None = Field(None, ge=0, description="per replica; none: 1 when the config asks for cuda")
    health_check_period_s: float = Field(5.0, gt=0)
    metrics_interval_s: float = Field(5.0, gt=0, description="how often a replica mirrors its metrics into Ray's")
    name: str = DEPLOYMENT_NAME


def gpus_for(args: RayAppArgs) -> float:
    """GPUs per replica: as given, else 1 when the config or overrides ask for a CUDA device, else 0."""
    if args.num_gpus is not None:
        return args.num_gpus
    return 1.0 if requested_device(args.config, args.overrides).startswith("cuda") else 0.0


def resolve_config(args: RayAppArgs) -> ServerConfig:
    """The replicas' config: the preset of the device their resources give (cuda with a GPU, else cpu), then the
    ``config`` file, then ``overrides``; ``device: auto`` becomes that device."""
    preset = "cuda" if gpus_for(args) > 0 else "cpu"
    config = resolve(args.config, args.overrides, device_preset=preset).config
    return config.model_copy(update={"device": preset}) if config.device == "auto" else config


def autoscaling_config(config: ServerConfig, args: RayAppArgs) -> dict[str, Any]:
    """Serve's ``autoscaling_config``: ``min``/``max``/``initial`` replicas, a target of ``max_running``
    ongoing requests per replica (a replica starts queueing beyond it), then ``args.autoscaling`` over them."""
    derived: dict[str, Any] = {
        "min_replicas": args.min_replicas,
        "max_replicas": max(args.max_replicas, args.min_replicas),
        "target_ongoing_requests": args.target_ongoing_requests or float(config.max_running),
    }
    if args.initial_replicas is not None:
        derived["initial_replicas"] = args.initial_replicas
    return {**derived, **args.autoscaling}


def deployment_options(config: ServerConfig, args: RayAppArgs) -> dict[str, Any]:
    """The options ``LookaheadServer.options(...)`` takes for ``config`` (see the module docstring).

    >>> options = deployment_options(ServerConfig(max_running=4, max_queue=8, threads=1), RayAppArgs(num_replicas=2))
    >>> options["max_ongoing_requests"], options["num_replicas"], options["ray_actor_options"]
    (12, 2, {'num_cpus': 1.0, 'num_gpus': 0.0})
    """
    options: dict[str, Any] = {
        "name": args.name,
        "max_ongoing_requests": config.max_running + config.max_queue,
        "graceful_shutdown_timeout_s": config.drain_grace_seconds + SHUTDOWN_MARGIN_SECONDS,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": args.health_check_period_s,
        "ray_actor_options": {
            "num_cpus": args.num_cpus if args.num_cpus is not None else float(max(resolve_threads(config.threads), 1)),
            "num_gpus": gpus_for(args),
        },
    }
    if args.num_replicas is not None:
        options["num_replicas"] = args.num_replicas
    else:
        options["autoscaling_config"] = autoscaling_config(config, args)
    return options


class ReplicaHeader:
    """ASGI middleware: every HTTP answer carries ``x-lookahead-replica: <replica id>``."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.asgi = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.asgi(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.asgi(scope, receive, send_with_header)


def ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]) -> serve_metrics.Gauge:
    """A Ray Serve gauge (Serve adds the deployment, replica and application tags)."""
    return serve_metrics.Gauge(name, description=description, tag_keys=tag_keys or None)


async def mirror_metrics(runtime: Any, interval_s: float) -> None:
    """Copy the runtime's registry into Ray's metrics every ``interval_s`` until cancelled."""
    mirror = RayMirror(ray_gauge)
    while True:
        try:
            mirror.publish(samples(runtime.metrics.registry))
        except Exception:  # a metrics hiccup must never take the replica down
            logger.exception("mirroring metrics into Ray failed")
        await asyncio.sleep(interval_s)


def serve_when_warm(app: FastAPI, interval_s: float) -> None:
    """Wrap ``app``'s lifespan: startup returns only once the runtime is ready (raises if it failed), and the
    metrics mirror runs while it serves."""
    runtime = app.state.runtime
    inner = runtime.lifespan

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with inner(app):
            while runtime.state in STARTING_STATES:
                await asyncio.sleep(0.05)
            if runtime.state != "ready":
                raise RuntimeError(f"the replica did not start: its runtime is {runtime.state}")
            mirror = asyncio.create_task(mirror_metrics(runtime, interval_s))
            try:
                yield
            finally:
                mirror.cancel()
                with suppress(asyncio.CancelledError):
                    await mirror

    app.router.lifespan_context = lifespan


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class LookaheadServer:
    """One replica: its own runtime and app (``server.app.create_app``), served by Serve's proxy."""

    def __init__(self, settings: dict[str, Any], metrics_interval_s: float = 5.0) -> None:
        from server.app import create_app  # here, in the replica: it imports torch through decoding

        self.replica = serve.get_replica_context().replica_id.unique_id
        self.asgi = create_app(ServerConfig.model_validate(settings))
        serve_when_warm(self.asgi, metrics_interval_s)
        self.asgi.add_middleware(ReplicaHeader, replica=self.replica)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.asgi

    async def check_health(self) -> None:
        """Raise once the runtime failed or its worker thread died: Serve then replaces the replica."""
        runtime = self.asgi.state.runtime
        if not runtime.alive:
            raise RuntimeError(f"the replica's runtime is {runtime.state}, worker alive: {runtime.worker.alive}")

    async def replica_info(self) -> dict[str, Any]:
        """This replica's id, process id and state (for operators and tests, through a deployment handle)."""
        return {"replica": self.replica, "pid": os.getpid(), "state": self.asgi.state.runtime.state}


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: ``RayAppArgs`` in, the bound ``LookaheadServer`` deployment out."""
    parsed = RayAppArgs.model_validate(args)
    config = resolve_config(parsed)
    options = deployment_options(config, parsed)
    return LookaheadServer.options(**options).bind(config.model_dump(mode="json"), parsed.metrics_interval_s)
