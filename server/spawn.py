"""Start the real server (``python -m server``) as a subprocess on a free loopback port, for clients and tests.

Contract: ``spawned_server(args, log_path)`` is a context manager that runs ``python -m server *args --host
127.0.0.1 --port <free port>`` with its output in ``log_path`` (a temporary file when None), waits until
``GET /health`` answers 200 (``ServerStartError``, with the log's tail, when the process exits first or
``timeout`` passes), yields a ``ServerProcess`` (``base_url`` is ``http://127.0.0.1:<port>``, without
``/v1``), and at exit stops it: SIGTERM, so the server drains, then SIGKILL after ``stop_timeout``.
``start_server`` / ``ServerProcess.stop`` are the same two halves for callers that stop the server themselves
(to signal it mid-test, or to read its exit status). Standard library only; it never imports the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The spawned server exited, or did not answer ``/health`` with 200 in time; the message has its log tail."""


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A spawned server: its process, root URL and log file."""

    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        """The server's output so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's output."""
        return "\n".join(self.log().splitlines()[-lines:])

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200 right now."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        """Return once ``/health`` is 200; raise ``ServerStartError`` if the process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"the server exited with status {self.process.returncode}; log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.3)
        raise ServerStartError(
            f"the server was not ready within {timeout:g} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the server drains), SIGKILL after ``timeout`` seconds; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def launch(
    args: Sequence[str] = (), log_path: Path | None = None, cwd: Path | None = None, new_session: bool = False
) -> ServerProcess:
    """Start ``python -m server *args`` on a free loopback port without waiting; output goes to ``log_path``.

    ``new_session`` puts the server in its own session, so a Ctrl-C in the terminal does not reach it.
    """
    port = free_port()
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix="lookahead-server-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
    command = [sys.executable, "-m", "server", *args, "--host", HOST, "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=new_session,
        )  # fmt: skip
    return ServerProcess(process, f"http://{HOST}:{port}", Path(log_path))


def start_server(
    args: Sequence[str] = (),
    log_path: Path | None = None,
    timeout: float = 300.0,
    cwd: Path | None = None,
    new_session: bool = False,
) -> ServerProcess:
    """``launch`` and wait until ready; a server that fails to start is stopped before ``ServerStartError``."""
    server = launch(args, log_path, cwd, new_session)
    try:
        server.wait_ready(timeout)
    except BaseException:
        server.stop(timeout=10)
        raise
    return server


@contextmanager
def spawned_server(
    args: Sequence[str] = (),
    log_path: Path | None = None,
    timeout: float = 300.0,
    stop_timeout: float = 30.0,
    cwd: Path | None = None,
    new_session: bool = False,
) -> Iterator[ServerProcess]:
    """A ready server for the block (see the module contract); stopped at exit, whatever happens."""
    server = start_server(args, log_path, timeout, cwd, new_session)
    try:
        yield server
    finally:
        server.stop(stop_timeout)
