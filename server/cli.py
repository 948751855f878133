"""The ``lookahead-server`` command: ``lookahead-server [serve] [flags]`` (``serve`` is the default).

Contract: ``main(argv)`` returns the process exit status. ``serve`` builds the config (YAML layers, then
flags; see ``server.config``), loads the model before listening (a load failure exits with status 1 and a
one-line reason), and runs uvicorn; a start that fails after that (the static step's build or capture, the
warm-up decode) stops the server with status 1 and the reason on stderr. The first SIGTERM or SIGINT drains:
``/health`` and new requests answer 503, in-flight requests finish for up to ``drain_grace_seconds`` and are then
cancelled, and the process exits 0. A second signal stops at once. New subcommands register in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from server.chat_client import add_chat_flags, chat
from server.config import ConfigError
from server.config_reference import describe, reference_markdown
from server.flags import add_config_flags, build_config, resolve_args

logger = logging.getLogger("server.cli")
MOVED_TUNE = "python -m bench tune"


def add_show_config_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of ``lookahead-server config``: the serve flags, plus ``--reference``."""
    add_config_flags(parser)
    parser.add_argument("--reference", action="store_true",
                        help="print the markdown table of every key (docs/configuration.md) instead")


def show_config(args: argparse.Namespace) -> int:
    """Print the resolved configuration with each value's layer (or the reference table); 0, or 2 when invalid."""
    if args.reference:
        print(reference_markdown(), end="")
        return 0
    try:
        resolved = resolve_args(args)
    except ConfigError as exc:
        print(f"lookahead-server: {exc}", file=sys.stderr)
        return 2
    layers = " < ".join(resolved.layers)
    print(describe(resolved, f"# lookahead-server configuration (layers, later wins: {layers})"), end="")
    return 0


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
    from server.text import read_chat_template

    try:
        config = build_config(args)
        keys = load_api_keys(config)  # an unreadable or empty keys file stops here, before the model loads
        if config.chat_template is not None:
            read_chat_template(config.chat_template)  # so does an unreadable or invalid chat template
    except ConfigError as exc:
        print(f"lookahead-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (config.protect_health or config.protect_metrics) and not keys:
        logger.warning("--protect-health / --protect-metrics have no effect without --api-key or --api-keys-file")
    from decoding import InvalidParameterError, ModelLoadError, configure_threads, native_steps
    from server.app import create_app
    from server.runtime import load_default_decoder

    threads = configure_threads(config.threads, native_steps(config.quantize, config.weight_layout, config.device))
    logger.info("threads: %d (config: %s)", threads, config.threads)
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
    runtime = app.state.runtime
    server = DrainingServer(uvicorn_config, runtime.drain, config.drain_grace_seconds)

    def stop(error: Exception) -> None:  # a start that failed ends the process: never a server stuck at 503
        print(f"lookahead-server: startup failed: {type(error).__name__}: {error}", file=sys.stderr)
        server.should_exit = True

    runtime.on_boot_failure = stop
    server.run()
    return 1 if runtime.boot_error is not None else 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "serve": ("run the OpenAI-compatible server (the default command)", add_config_flags, serve),
    "config": ("print the configuration serve would run, and where each value comes from", add_show_config_flags,
               show_config),
    "chat": ("chat in the terminal with a running server (or --serve one), multi-token steps coloured",
             add_chat_flags, chat),
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
    if args_list[:1] == ["tune"]:
        print(f"lookahead-server: the tuner moved: run `{MOVED_TUNE}` (same flags)", file=sys.stderr)
        return 2
    if not args_list or (args_list[0] not in COMMANDS and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, "serve")
    args = build_parser().parse_args(args_list)
    return args.handler(args)
