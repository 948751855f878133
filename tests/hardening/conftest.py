"""One live server (``python -m server`` on a free loopback port, the real default model) shared by the
hardening tests, started with small limits so that overload, queueing and fuzzing stay fast and bounded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import ServerProcess, start_server

MAX_RUNNING = 2
MAX_QUEUE = 4
LIVE_FLAGS = (
    "--max-running", str(MAX_RUNNING), "--max-queue", str(MAX_QUEUE), "--default-max-tokens", "8",
    "--max-window-size", "8", "--max-ngram-size", "8", "--max-guess-set-size", "8", "--drain-grace-seconds", "5",
)


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> Iterator[ServerProcess]:
    """The shared live server; at the end it must drain, exit 0, and have logged no error or traceback at all
    (hostile input, overload, vanishing clients and the soak are all expected, never unhandled)."""
    server = start_server(tmp_path_factory.mktemp("hardening") / "server.log", *LIVE_FLAGS)
    yield server
    assert server.stop() == 0, server.log()[-5000:]
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-5000:]
