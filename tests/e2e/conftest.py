"""Start the real server (``python -m server``) on a free port, with the real default model (``server.spawn``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.spawn import ServerProcess, free_port
from server.spawn import start_server as spawn_server

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2e-test-key"
PAGE_PORT = free_port()  # a web page on this loopback port is the one origin the session's server allows (CORS)
ALLOWED_ORIGIN = f"http://127.0.0.1:{PAGE_PORT}"


def start_server(log_path: Path, *flags: str) -> ServerProcess:
    """Run ``python -m server *flags`` on a free port from the repository root and wait until /health is 200."""
    return spawn_server(flags, log_path, timeout=180, cwd=ROOT)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One server for the e2e session, with an API key, room for several concurrent streams, and CORS for one
    origin (``ALLOWED_ORIGIN``)."""
    running = start_server(tmp_path_factory.mktemp("e2e") / "server.log", "--api-key", API_KEY, "--max-running", "4",
                           "--allowed-origins", ALLOWED_ORIGIN)
    yield running
    assert running.stop() == 0, running.log()
