"""The ``lookahead-server`` command: ``lookahead-server [serve] [flags]`` (``serve`` is the default).

Contract: ``main(argv)`` returns the process exit status. ``serve`` builds the config (YAML layers, then
flags; see ``server.config``), loads the model before listening (a load failure exits with status 1 and a
one-line reason), and runs uvicorn. The first SIGTERM or SIGINT drains: ``/health`` and new requests answer
503, in-flight requests finish for up to ``drain_grace_seconds`` and are then cancelled, and the process
exits 0. A second signal stops at once. New subcommands register in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from server.chat_client import add_chat_flags, chat
from server.config import ConfigError, ServerConfig, load_config
from server.tuning import add_tune_flags, tune_command

API_KEY_ENV = "LOOKAHEAD_API_KEY"
logger = logging.getLogger("server.cli")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of ``serve``; every default is None so that only flags given on the command line override."""
    parser.add_argument("--config", help="YAML config: a path or a name in configs/ (e.g. cpu, cuda)")
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument("--model", help="model: the embedded default SmolLM2-135M-Instruct, a directory or hub id")
    parser.add_argument("--served-model-name", help="the name clients send as 'model'")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/* (or set ${API_KEY_ENV})")
    parser.add_argument("--api-keys-file", help="accept any key in this file (one per line, # comments)")
    parser.add_argument("--protect-health", action=argparse.BooleanOptionalAction, default=None,
                        help="with keys: /health requires one too (default: open)")
    parser.add_argument("--protect-metrics", action=argparse.BooleanOptionalAction, default=None,
                        help="with keys: /metrics requires one too (default: open)")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--quantize", choices=["none", "int8"],
                        help="int8: int8 weights with per-row activation scales (float32 CPU only)")
    parser.add_argument("--weight-layout", choices=["auto", "packed", "torch"],
                        help="packed: float32 weights laid out for the CPU's kernels (auto: on a float32 CPU)")
    lookahead = parser.add_argument_group("lookahead defaults (requests may override within the maxima)")
    lookahead.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=None,
                           help="decode with lookahead by default (--no-lookahead: autoregressive)")
    lookahead.add_argument("--window-size", type=int, help="W: Jacobi window columns")
    lookahead.add_argument("--ngram-size", type=int, help="N: n-gram size (a step commits up to N tokens)")
    lookahead.add_argument("--guess-set-size", type=int, help="G: candidates verified per step")
    lookahead.add_argument("--max-window-size", type=int)
    lookahead.add_argument("--max-ngram-size", type=int)
    lookahead.add_argument("--max-guess-set-size", type=int)
    limits = parser.add_argument_group("queue and concurrency")
    limits.add_argument("--max-running", type=int, help="requests decoding at once (each forward batches them)")
    limits.add_argument("--max-step-tokens", type=int, help="input tokens of one batched forward, all requests")
    limits.add_argument("--prefill-chunk", type=int, help="prompt tokens per forward while others decode")
    limits.add_argument("--max-queue", type=int, help="requests waiting for a slot; more -> 429")
    limits.add_argument("--default-max-tokens", type=int, help="max_tokens when a request gives none")
    limits.add_argument("--max-request-bytes", type=int, help="larger request bodies -> 413")
    limits.add_argument("--drain-grace-seconds", type=float, help="on SIGTERM, finish in-flight work this long")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="run one tiny decode before reporting ready")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The config-shaped overrides given on the command line (``None`` = not given)."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {
        "host": args.host, "port": args.port, "model": args.model, "served_model_name": args.served_model_name,
        "api_key": api_key, "api_keys_file": args.api_keys_file, "protect_health": args.protect_health,
        "protect_metrics": args.protect_metrics, "device": args.device, "dtype": args.dtype, "threads": args.threads,
        "quantize": args.quantize, "weight_layout": args.weight_layout,
        "max_running": args.max_running, "max_queue": args.max_queue, "default_max_tokens": args.default_max_tokens,
        "max_request_bytes": args.max_request_bytes, "drain_grace_seconds": args.drain_grace_seconds,
        "warmup": args.warmup, "log_level": args.log_level,
        "lookahead": {
            "enabled": args.lookahead, "window_size": args.window_size, "ngram_size": args.ngram_size,
            "guess_set_size": args.guess_set_size, "max_window_size": args.max_window_size,
            "max_ngram_size": args.max_ngram_size, "max_guess_set_size": args.max_guess_set_size,
        },
        "batch": {"max_step_tokens": args.max_step_tokens, "prefill_chunk": args.prefill_chunk},
    }


def device_preset(device: str) -> str:
    """``cpu`` or ``cuda``: the preset for a configured device (``auto`` asks torch, through decoding)."""
    if device == "auto":
        from decoding.loading import resolve_device

        device = str(resolve_device("auto"))
    return "cuda" if device.startswith("cuda") else "cpu"


def build_config(args: argparse.Namespace) -> ServerConfig:
    """Config from the layers and flags, with the device preset chosen from the resolved device."""
    overrides = overrides_from(args)
    first = load_config(args.config, overrides)
    return load_config(args.config, overrides, device_preset=device_preset(first.device))


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain on the first SIGTERM/SIGINT instead of an immediate stop."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[None]], grace: float) -> None:
        super().__init__(config)
        self._drain_runtime = drain
        self._grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: drain in the background. Second: stop now. Never re-raised, so the exit status is 0."""
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self._draining = True
        logger.info("signal %s: draining for up to %.0f s; send it again to stop now", sig, self._grace)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        await self._drain_runtime(self._grace)
        await asyncio.sleep(0.2)  # let the last chunks leave before uvicorn closes connections
        self.should_exit = True


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until drained."""
    from server.auth import load_api_keys

    try:
        config = build_config(args)
        keys = load_api_keys(config)  # an unreadable or empty keys file stops here, before the model loads
    except ConfigError as exc:
        print(f"lookahead-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (config.protect_health or config.protect_metrics) and not keys:
        logger.warning("--protect-health / --protect-metrics have no effect without --api-key or --api-keys-file")
    from decoding import InvalidParameterError, ModelLoadError, configure_threads
    from server.app import create_app, load_default_decoder

    configure_threads(config.threads)
    try:
        decoder = load_default_decoder(config)
    except (ModelLoadError, InvalidParameterError) as exc:
        print(f"lookahead-server: cannot load model {config.model!r}: {exc}", file=sys.stderr)
        return 1
    lookahead = config.lookahead
    logger.info(
        "model %s on %s (%s, linears: %s), lookahead W=%d N=%d G=%d%s", config.model_name, decoder.device,
        decoder.dtype, decoder.linears, lookahead.window_size, lookahead.ngram_size, lookahead.guess_set_size,
        "" if lookahead.enabled else " (off)",
    )
    app = create_app(config, decoder)
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=10
    )
    DrainingServer(uvicorn_config, app.state.runtime.drain, config.drain_grace_seconds).run()
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": ("run the OpenAI-compatible server (the default command)", add_serve_flags, serve),
    "chat": ("chat in the terminal with a running server (or --serve one), multi-token steps coloured",
             add_chat_flags, chat),
    "tune": ("measure this device and write configs/tuned-<device>.yaml (W/N/G and step policy)",
             add_tune_flags, tune_command),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lookahead-server",
        description="OpenAI-compatible inference server with lookahead decoding. "
        "`lookahead-server [serve] [flags]`; see `lookahead-server serve --help`.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_flags, handler) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        add_flags(sub)
        sub.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lookahead-server`` and ``python -m server``."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0] not in COMMANDS and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, "serve")
    args = build_parser().parse_args(args_list)
    return args.handler(args)
