"""``lookahead-server serve`` as a process: a start that fails after the server listens (a static step's capture,
the warm-up decode) ends the process with status 1 and the reason on stderr, instead of a server that answers
503 forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
FAILING_START = """
import sys
import decoding.decoder
from server.cli import main

def broken(*args, **kwargs):
    raise RuntimeError("CUDA error: device-side assert triggered (simulated)")

decoding.decoder.Decoder.batch_engine = broken
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.real_model
def test_a_start_that_fails_after_listening_exits_one_with_the_reason():
    command = [sys.executable, "-c", FAILING_START, "--port", str(free_port()), "--log-level", "warning"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)  # else: stuck at 503
    assert done.returncode == 1, done.stderr[-2000:]
    reason = ("lookahead-server: startup failed: RuntimeError: CUDA error: device-side assert triggered "
              "(simulated)")
    assert reason in done.stderr.splitlines(), done.stderr[-2000:]
