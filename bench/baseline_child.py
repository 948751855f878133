"""The child process of ``bench.baseline``: an earlier commit's greedy loop and lookahead, answering over pipes.

Run as a script file (``python bench/baseline_child.py FLAG...``) with ``PYTHONPATH`` and the working directory
set to a checkout of the earlier commit: everything it imports (``bench``, ``decoding``) is that commit's, never
the tree this file lives in (its own folder is taken off ``sys.path`` first; it would shadow packages such as
``datasets`` with ``bench/datasets.py``). It uses only what that commit's ``python -m bench heldout`` used (the
API of ``507a7ad`` and later): ``bench.heldout.parse(build_parser(), FLAGS)`` resolves the commit's own preset,
``bench.cli.start`` prints its settings and loads the model as that preset says (threads included),
``bench.cli.lookahead_config`` and ``bench.measure.make_runners`` give its greedy and lookahead runners under its
batch policy, and ``bench.measure.time_run`` times each decode as its benchmark timed it. With ``--memory-tokens``
(and ``--memory-file``) lookahead shares one n-gram memory as that commit's ``bench heldout`` built it.

Protocol: JSON lines. Stdout carries only the protocol (everything printed, the settings block included, goes to
stderr). First line out: ``{"ready": true, "preset", "linears", "lookahead": {...}, "batch": {...}}``. Then per
line in: ``{"method": "greedy"|"lookahead", "prompt_ids": [...], "max_tokens": N, "stop_token_ids": [...]}`` ->
``{"tokens": [...], "steps": S, "seconds": T, "offered", "accepted"}`` (T: the decode alone, timed here), or
``{"reset": true}`` -> ``{"reset": true}`` (the memory back to what it held after loading, as after the
warm-up); a request that fails -> ``{"error": "Type: message"}``. End of input ends the process (status 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]

import json  # noqa: E402  (after the path fix: nothing of the tree this file lives in may load)
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict  # noqa: E402
from typing import Any, TextIO  # noqa: E402


def protocol_stream() -> TextIO:
    """The real stdout for the protocol; file descriptor 1 and ``sys.stdout`` then point at stderr, so whatever
    the commit's code prints (or a library writes) cannot corrupt a reply."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def memory_of(args: Any, loaded: Any) -> tuple[Any, Callable[[], None]]:
    """The shared n-gram memory the commit's ``bench heldout`` builds from ``--memory-tokens``/``--memory-file``
    (None without), and what puts it back as loading left it."""
    if not getattr(args, "memory_tokens", 0):
        return None, lambda: None
    from decoding.decoder import Decoder

    try:
        from decoding.proposers.ngram_memory import NGramMemory, load_memory
    except ImportError:  # a commit from before decoding's rooms (issue #41), when it was decoding.memory
        from decoding.memory import NGramMemory, load_memory

    memory = NGramMemory(args.memory_tokens)
    if args.memory_file:
        load_memory(memory, args.memory_file, Decoder(loaded).vocabulary_id)
    saved = memory.snapshot()

    def reset() -> None:
        memory.clear()
        for document in saved:
            memory.add(document)

    return memory, reset


def serve(argv: list[str], out: TextIO) -> int:
    """Load the commit's model and runners as its ``bench heldout`` does for ``argv``, then answer requests."""
    from bench import cli, heldout, measure
    from decoding.params import StopCriteria

    resolved = heldout.parse(heldout.build_parser(), argv)
    loaded, linears = cli.start(resolved)
    config = cli.lookahead_config(resolved.args)
    memory, reset = memory_of(resolved.args, loaded)
    runners = measure.make_runners(
        ["greedy", "lookahead"], config, resolved.args.prompt_lookup_tokens, None, resolved.policy, memory
    )
    ready = {"ready": True, "preset": resolved.preset, "linears": linears, "lookahead": asdict(config),
             "batch": asdict(resolved.policy)}
    out.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("reset"):
                reset()
                out.write(json.dumps({"reset": True}) + "\n")
                continue
            stop = StopCriteria(int(request["max_tokens"]), frozenset(request["stop_token_ids"]))
            runner = runners[request["method"]]
            record = measure.time_run(loaded.model, "baseline", request["method"], runner, request["prompt_ids"], stop)
            reply = {"tokens": record.output_ids, "steps": record.steps, "seconds": record.seconds,
                     "offered": record.offered, "accepted": record.accepted}
        except Exception as error:  # noqa: BLE001  (told to the parent, which raises it there)
            reply = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:], protocol_stream()))
