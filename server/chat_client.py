"""``lookahead-server chat``: a terminal chat client against a running server, or one it starts itself.

Contract: ``add_chat_flags(parser)`` and ``chat(args)`` plug into ``server.cli.COMMANDS``; ``chat`` returns the
exit status. Each line typed is sent with the conversation so far to ``POST /v1/chat/completions`` as a stream
with the ``stream_steps`` extension and ``stream_options.include_usage``. The answer prints as it arrives, the
text of multi-token steps coloured by the step's token count (ANSI, off when stdout is not a terminal or with
``--no-color``), then one stats line: tokens, steps, tokens per step, acceptance, tokens per second. ``/reset``
clears the history; ``/quit`` or end of input exits 0. Ctrl-C during an answer closes the connection (the server
cancels the request) and returns to the prompt. ``--serve`` starts ``python -m server`` on a free port first and
stops it at exit (``server.spawn``); streams are read with ``server.sse``. Standard library only (``urllib``), so
the client needs nothing beyond the server's install.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, TextIO

from server.spawn import ServerProcess, ServerStartError, launch
from server.sse import iter_data

DEFAULT_URL = "http://127.0.0.1:8000"
API_KEY_ENV = "LOOKAHEAD_API_KEY"
STEP_COLORS = {2: "36", 3: "32", 4: "33", 5: "35"}  # tokens in one step -> ANSI colour (5 means 5 or more)
DIM, RESET = "\033[2m", "\033[0m"
HELP = "/reset clears the conversation, /quit exits; Ctrl-C stops an answer."


def add_chat_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of ``chat``."""
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server address (default {DEFAULT_URL})")
    parser.add_argument("--api-key", help=f"sent as 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
    parser.add_argument("--model", help="model name to send (default: the server's)")
    parser.add_argument("--system", help="a system message that opens the conversation")
    parser.add_argument("--max-tokens", type=int, default=256, help="per answer (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--window-size", type=int, help="W (default: the server's)")
    parser.add_argument("--ngram-size", type=int, help="N (default: the server's)")
    parser.add_argument("--guess-set-size", type=int, help="G (default: the server's)")
    parser.add_argument("--no-lookahead", action="store_true", help="decode with the plain autoregressive loop")
    parser.add_argument("--no-color", action="store_true", help="no ANSI colours (also off when not a terminal)")
    parser.add_argument("--serve", action="store_true", help="start a local server first, stop it at exit")
    parser.add_argument("--server-args", default="",
                        help="extra flags for --serve, e.g. --server-args='--window-size 3'")


# ---- the wire ---------------------------------------------------------------------------------------------


class ClientError(Exception):
    """The server refused a request or could not be reached; the message is for the user."""


def request_body(args: argparse.Namespace, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The streamed chat request for ``messages`` with the flags' settings."""
    lookahead: dict[str, Any] = {"enabled": not args.no_lookahead}
    for name in ("window_size", "ngram_size", "guess_set_size"):
        value = getattr(args, name)
        if value is not None and not args.no_lookahead:
            lookahead[name] = value
    body: dict[str, Any] = {
        "messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
        "stream_options": {"include_usage": True}, "stream_steps": True, "lookahead": lookahead,
    }
    if args.model:
        body["model"] = args.model
    return body


def open_request(url: str, api_key: str | None, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
    """GET (no body) or POST JSON; the open response, or ``ClientError`` with the server's error message."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise ClientError(f"HTTP {exc.code}: {error_message(exc.read())}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ClientError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from exc


def error_message(payload: bytes) -> str:
    """The ``error.message`` of an OpenAI error envelope, or the raw text."""
    try:
        return json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return payload.decode(errors="replace").strip() or "no details"


# ---- one answer -------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One streamed answer: its text and what the stream said about it."""

    text: str = ""
    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    offered: int = 0
    finish_reason: str | None = None
    decoding: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    stopped: bool = False
    method: str = ""  # as requested; the usage chunk's decoding.method replaces it

    def add_step(self, step: dict[str, int]) -> None:
        """Count one chunk's ``step`` object."""
        self.tokens += step["tokens"]
        self.steps += 1 if step["tokens"] > 0 else 0
        self.accepted += step["accepted"]
        self.offered += step["offered"]

    def add_usage(self, chunk: dict[str, Any]) -> None:
        """The usage chunk's totals replace the running sums."""
        self.tokens = chunk["usage"]["completion_tokens"]
        self.decoding = chunk.get("decoding") or {}
        self.steps = self.decoding.get("steps", self.steps)
        self.accepted = self.decoding.get("accepted_tokens", self.accepted)
        self.offered = self.decoding.get("offered_tokens", self.offered)


def colored(text: str, tokens: int, color: bool) -> str:
    """``text`` in the colour of a ``tokens``-token step (single-token steps stay plain)."""
    if not color or tokens < 2:
        return text
    return f"\033[1;{STEP_COLORS[min(tokens, 5)]}m{text}{RESET}"


def stats_line(answer: Answer) -> str:
    """``[42 tokens, 20 steps, 2.10 tokens/step, acceptance 35%, 23.4 tok/s, lookahead]``.

    >>> stats_line(Answer(tokens=6, steps=3, accepted=3, offered=6, started=0.0, ended=2.0,
    ...                   decoding={"method": "lookahead"}, finish_reason="stop"))
    '[6 tokens, 3 steps, 2.00 tokens/step, acceptance 50%, 3.0 tok/s, lookahead]'
    """
    ended = answer.ended if answer.ended is not None else time.perf_counter()
    seconds = max(ended - answer.started, 1e-9)
    parts = [f"{answer.tokens} tokens", f"{answer.steps} steps"]
    parts.append(f"{answer.tokens / answer.steps:.2f} tokens/step" if answer.steps else "- tokens/step")
    parts.append(f"acceptance {answer.accepted / answer.offered:.0%}" if answer.offered else "acceptance -")
    parts.append(f"{answer.tokens / seconds:.1f} tok/s")
    method = answer.decoding.get("method") or answer.method
    if method:
        parts.append(method)
    if answer.stopped:
        parts.append("stopped")
    elif answer.finish_reason == "length":
        parts.append("max tokens reached")
    return "[" + ", ".join(parts) + "]"


def stream_answer(base_url: str, api_key: str | None, body: dict[str, Any], out: TextIO, color: bool) -> Answer:
    """Send one request and print the answer as it streams; Ctrl-C closes the connection and keeps the part."""
    answer = Answer(method="lookahead" if body["lookahead"]["enabled"] else "autoregressive")
    response = None
    try:
        response = open_request(f"{base_url}/v1/chat/completions", api_key, body)
        for data in iter_data(response):
            if data == "[DONE]":
                break
            handle_chunk(json.loads(data), answer, out, color)
    except KeyboardInterrupt:
        answer.stopped = True
    finally:
        if response is not None:
            response.close()
        answer.ended = time.perf_counter()
    return answer


def handle_chunk(chunk: dict[str, Any], answer: Answer, out: TextIO, color: bool) -> None:
    """Print a chunk's text and count it; raise ``ClientError`` for an error event."""
    if "error" in chunk:
        raise ClientError(chunk["error"].get("message", "generation failed"))
    step = chunk.get("step")
    if step is not None:
        answer.add_step(step)
    if chunk.get("usage"):
        answer.add_usage(chunk)
    for choice in chunk.get("choices", []):
        text = choice.get("delta", {}).get("content")
        if text:
            answer.text += text
            out.write(colored(text, step["tokens"] if step else 1, color))
            out.flush()
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]


# ---- the conversation -------------------------------------------------------------------------------------


class Conversation:
    """The message history, the settings and where to send them."""

    def __init__(self, args: argparse.Namespace, base_url: str, api_key: str | None, color: bool) -> None:
        self.args = args
        self.base_url = base_url
        self.api_key = api_key
        self.color = color
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget everything but the system message."""
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def ask(self, text: str, out: TextIO) -> Answer:
        """Send ``text`` after the history, print the answer and its stats, keep both in the history."""
        self.messages.append({"role": "user", "content": text})
        try:
            answer = stream_answer(self.base_url, self.api_key, request_body(self.args, self.messages), out, self.color)
        except ClientError:
            self.messages.pop()
            raise
        if answer.text:
            self.messages.append({"role": "assistant", "content": answer.text})
        else:
            self.messages.pop()
        stats = stats_line(answer)
        out.write(f"\n{DIM}{stats}{RESET}\n" if self.color else f"\n{stats}\n")
        out.flush()
        return answer


def read_line(prompt: str) -> str | None:
    """One line of input (None at end of input); Ctrl-C at the prompt gives an empty line."""
    try:
        line = input(prompt)
    except EOFError:
        return None
    except KeyboardInterrupt:
        print("\n(/quit or Ctrl-D to exit)")
        return ""
    if not sys.stdin.isatty():  # piped input is not echoed: show it, so the transcript reads as a dialogue
        print(line)
    return line


def repl(conversation: Conversation, out: TextIO) -> int:
    """Read lines until ``/quit`` or end of input; each other line is a message (or a command)."""
    while True:
        line = read_line("you> ")
        if line is None or line.strip() == "/quit":
            if line is None:
                out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            conversation.reset()
            out.write("(conversation cleared)\n")
            continue
        if text in ("/help", "/?"):
            out.write(HELP + "\n")
            continue
        out.write("assistant> ")
        out.flush()
        try:
            conversation.ask(text, out)
        except ClientError as exc:
            out.write(f"\nerror: {exc}\n")
        out.flush()


def legend(color: bool) -> str:
    """One line explaining the colours."""
    if not color:
        return ""
    samples = " ".join(colored(f"{tokens}{'+' if tokens == 5 else ''}", tokens, True) for tokens in STEP_COLORS)
    return f"colour = tokens that one decoding step committed: {samples}\n"


def server_models(base_url: str, api_key: str | None) -> list[str]:
    """The served model names (``ClientError`` if the server is unreachable or refuses the key)."""
    with open_request(f"{base_url}/v1/models", api_key, timeout=30) as response:
        return [model["id"] for model in json.load(response)["data"]]


# ---- a local server ---------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, api_key: str | None) -> ServerProcess:
    """Start ``python -m server`` on a free local port (``server.spawn``, not waiting for it), in its own session:
    Ctrl-C in the chat must not reach it."""
    flags = (["--api-key", api_key] if api_key else []) + shlex.split(args.server_args)
    server = launch(flags, new_session=True)
    print(f"starting a local server on {server.base_url} (log: {server.log_path}) ...", file=sys.stderr, flush=True)
    return server


def wait_until_ready(server: ServerProcess, timeout: float = 300) -> None:
    """Poll ``/health`` until 200; ``ClientError`` if the server exits or takes too long."""
    try:
        server.wait_ready(timeout)
    except ServerStartError as exc:
        raise ClientError(str(exc).splitlines()[0]) from exc


def stop_server(server: ServerProcess, timeout: float = 30) -> None:
    """SIGTERM (the server drains), then kill if it lingers; the log is removed after a clean exit."""
    if server.stop(timeout) == 0:
        os.unlink(server.log_path)


# ---- the command ------------------------------------------------------------------------------------------


def chat(args: argparse.Namespace) -> int:
    """The ``chat`` command: connect (or start a server), then chat until ``/quit``."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    color = sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        # Ctrl-C stops an answer even when the client was started with SIGINT ignored (a background job).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    server = None
    try:
        base_url = args.url.rstrip("/")
        if args.serve:
            server = start_server(args, api_key)
            base_url = server.base_url
            wait_until_ready(server)
        models = server_models(base_url, api_key)
        print(f"connected to {base_url} ({', '.join(models)}). {HELP}", flush=True)
        print(legend(color), end="", flush=True)
        return repl(Conversation(args, base_url, api_key, color), sys.stdout)
    except ClientError as exc:
        print(f"lookahead-server chat: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            stop_server(server)
