"""``server.spawn``: free ports, and a server that fails to start is reported with its log, not waited on."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from server import spawn

ROOT = Path(__file__).resolve().parents[2]


def test_free_port_is_bindable() -> None:
    port = spawn.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_server_that_exits_raises_with_its_log(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(spawn.ServerStartError, match=r"exited with status 2(.|\n)*no-such-flag"):
        with spawn.spawned_server(["--no-such-flag"], tmp_path / "server.log", timeout=120, cwd=ROOT):
            pytest.fail("the block must not run")
    assert time.monotonic() - started < 120


def test_stop_of_an_exited_server_returns_its_status(tmp_path: Path) -> None:
    server = spawn.launch(["--no-such-flag"], tmp_path / "server.log", cwd=ROOT)
    server.process.wait(60)
    assert server.stop() == 2 and server.stop() == 2  # no signal to an exited process; idempotent
    assert not server.healthy() and "no-such-flag" in server.log_tail()
