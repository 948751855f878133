"""Start the real server (``python -m server``) on a free port, with the real default model (``server.spawn``)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from server.spawn import ServerProcess
from server.spawn import start_server as spawn_server

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2e-test-key"


class BlankPage(http.server.BaseHTTPRequestHandler):
    """Serves one blank HTML page: an origin for a browser to call the server from."""

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = b"<!doctype html><title>a page</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def page_server() -> Iterator[str]:
    """A ``BlankPage`` server on a loopback port the OS picks (bound before anyone learns it, so no other
    socket can take it); yields its origin, ``http://127.0.0.1:PORT``."""
    page = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BlankPage)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{page.server_address[1]}"
    finally:
        page.shutdown()
        page.server_close()


@pytest.fixture(scope="session")
def allowed_origin() -> Iterator[str]:
    """The one origin the session's server allows (CORS): a blank page that lives as long as the session."""
    with page_server() as origin:
        yield origin


def start_server(log_path: Path, *flags: str) -> ServerProcess:
    """Run ``python -m server *flags`` on a free port from the repository root and wait until /health is 200."""
    return spawn_server(flags, log_path, timeout=180, cwd=ROOT)


@pytest.fixture(scope="session")
def server(tmp_path_factory, allowed_origin: str) -> Iterator[ServerProcess]:
    """One server for the e2e session, with an API key, room for several concurrent streams, and CORS for one
    origin (``allowed_origin``)."""
    running = start_server(tmp_path_factory.mktemp("e2e") / "server.log", "--api-key", API_KEY, "--max-running", "4",
                           "--allowed-origins", allowed_origin)
    yield running
    assert running.stop() == 0, running.log()
