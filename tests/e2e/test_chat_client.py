"""``lookahead-server chat`` against the real server: piped input, a real terminal (a pty), and ``--serve``.

Piped: answers stream, one stats line per answer, no colour codes, ``/reset`` and ``/quit`` work, exit 0. In a
pty: multi-token steps come out coloured and Ctrl-C stops the answer (the server counts an abort) while the
program goes on to the next prompt.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time

import httpx
import pytest

from tests.e2e.conftest import API_KEY, ROOT

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
STATS = re.compile(r"\[(\d+) tokens, (\d+) steps, ([\d.]+|-) tokens/step, acceptance (\d+%|-), ([\d.]+) tok/s, "
                   r"(lookahead|autoregressive)")
ANSI_COLOR = re.compile(r"\x1b\[1;3\dm")


def chat_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "server", "chat", *flags]


def run_piped(lines: list[str], *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(chat_command(*flags), input="".join(f"{line}\n" for line in lines), text=True,
                          capture_output=True, timeout=timeout, cwd=ROOT)


def test_piped_conversation_with_stats_reset_and_quit(server):
    result = run_piped(["Repeat the word hello ten times.", "/reset", "Say hi.", "/quit"],
                       "--url", server.base_url, "--api-key", API_KEY, "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "connected to" in out and "(conversation cleared)" in out
    assert out.count("assistant> ") == 2 and "hello" in out.lower()
    stats = STATS.findall(out)
    assert len(stats) == 2, out
    tokens, steps = int(stats[0][0]), int(stats[0][1])
    assert 1 <= steps < tokens <= 24 and stats[0][5] == "lookahead"  # repeated words come in multi-token steps
    assert "\x1b[" not in out  # not a terminal: no colour


def test_plain_decoding_flag_and_a_wrong_key(server):
    result = run_piped(["Name a fruit."], "--url", server.base_url, "--api-key", API_KEY, "--max-tokens", "8",
                       "--no-lookahead")
    assert result.returncode == 0, result.stderr  # end of input quits too
    [stats] = STATS.findall(result.stdout)
    assert stats[5] == "autoregressive" and stats[0] == stats[1]
    refused = run_piped(["hi"], "--url", server.base_url, "--api-key", "wrong")
    assert refused.returncode == 1 and "401" in refused.stderr


class Terminal:
    """The chat client on a pseudo-terminal that is its controlling terminal (so Ctrl-C is a real SIGINT)."""

    def __init__(self, *flags: str) -> None:
        self.master, slave = os.openpty()
        self.process = subprocess.Popen(
            chat_command(*flags), stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True,
            preexec_fn=self._take_terminal, env={**os.environ, "TERM": "xterm-256color"},
        )
        os.close(slave)
        self.screen = ""

    @staticmethod
    def _take_terminal() -> None:
        # A test run started in the background inherits SIGINT ignored, and so would the client: a person's
        # terminal delivers it.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    def read_until(self, pattern: str, timeout: float = 120) -> str:
        """Read output until ``pattern`` (a regex) matches what arrived since the call; return that part."""
        start = len(self.screen)
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.screen[start:]):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout} s; screen:\n{self.screen[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.screen += os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break
        return self.screen[start:]

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        """Wait for the exit status (killing the client if it hangs)."""
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            os.close(self.master)


def aborted_requests(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics", timeout=10).text
    match = re.search(r'^lookahead_requests_total\{finish_reason="abort"\} (\S+)$', metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_terminal_colours_and_ctrl_c_stops_only_the_answer(server):
    terminal = Terminal("--url", server.base_url, "--api-key", API_KEY, "--max-tokens", "60")
    try:
        terminal.read_until(r"you> ")
        terminal.type("Repeat the word hello ten times.\r")
        answer = terminal.read_until(r"tok/s.*\n.*you> ")
        assert ANSI_COLOR.search(answer), "multi-token steps should be coloured on a terminal"
        assert STATS.search(answer)
        before = aborted_requests(server.base_url)
        terminal.type("Write a long story about a dragon who learns to paint.\r")
        terminal.read_until(r"assistant> \S+ \S+ \S+")
        terminal.type("\x03")  # Ctrl-C
        stopped = terminal.read_until(r"stopped\].*\n.*you> ", timeout=30)
        assert STATS.search(stopped)
        deadline = time.monotonic() + 30
        while aborted_requests(server.base_url) < before + 1:
            assert time.monotonic() < deadline, "the server did not cancel the request"
            time.sleep(0.2)
        terminal.type("/quit\r")
    finally:
        status = terminal.close()
    assert status == 0


def test_serve_starts_and_stops_its_own_server():
    result = run_piped(["Say hi.", "/quit"], "--serve", "--max-tokens", "8", "--server-args=--no-warmup",
                       timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(STATS.findall(result.stdout)) == 1
    url = re.search(r"starting a local server on (\S+) ", result.stderr).group(1)
    with pytest.raises(httpx.ConnectError):  # stopped at exit
        httpx.get(f"{url}/health", timeout=5)
