"""An earlier commit of this project as benchmark methods: ``base_greedy`` and ``base_lookahead``, in a child process.

Contract: ``--baseline REV`` (``add_baseline_flag``; ``python -m bench`` and ``python -m bench heldout``) makes the
methods ``base_greedy`` and ``base_lookahead`` runnable: commit REV's greedy loop and lookahead, each exactly as
that commit's ``python -m bench heldout`` ran it (its preset's lookahead settings, batch policy and model loading),
interleaved per prompt with today's methods in one run. ``checkout(commit)`` makes (or reuses) a detached
``git worktree`` of the commit under ``<cache>/baselines/<12 hex digits>`` (``decoding.weights.loading.cache_root``: not
inside the repository). ``BaselineChild`` runs ``bench/baseline_child.py`` of this tree with that checkout as its
``PYTHONPATH`` and working directory (the two trees share package names, so they cannot share an interpreter):
the model loads once, each decode is one JSON line each way, and the seconds a run reports are the child's,
timed around the decode alone by that commit's own ``bench.measure.time_run`` (the pipes are not counted).
``runner(method)`` is the ``bench.records.Runner`` of one of them; warm-ups go through it like any method's.

The child gets ``--device``, ``--threads`` and ``--preset`` as the parent resolved them, ``--model`` when the
parent's came from a flag, the shared memory flags of ``bench heldout``, and whatever ``--baseline-args`` adds;
everything else comes from the commit's own preset. A commit that served a GGUF model expanded to float32 can
emit other tokens than today's native GGUF weights after a while: ``comparison`` reports per prompt whether
``base_greedy`` equals ``greedy`` and ``base_lookahead`` equals ``base_greedy``, and fails on neither.

Raises ``BaselineError`` when the revision is not a commit, the checkout cannot be made or the child fails.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from transformers import PreTrainedModel

from bench.records import Decoded, Runner, RunRecord
from bench.report import by_method, first_difference, format_table, median_speedup, speedup
from bench.settings import FLAG, Resolved
from decoding.params import StopCriteria
from decoding.weights.loading import cache_root

BASE_METHODS = {"base_greedy": "greedy", "base_lookahead": "lookahead"}  # our method name -> the child's
CHILD = Path(__file__).resolve().with_name("baseline_child.py")
SHORT = 12  # hex digits of a commit in a checkout's folder name
COMPARISON_HEADERS = (
    "prompt", "base lookahead steps", "tok/step", "base greedy vs greedy", "base lookahead vs greedy",
    "lookahead vs base lookahead", "base greedy = greedy", "base lookahead = base greedy",
)


class BaselineError(RuntimeError):
    """The baseline could not be checked out or its child process failed."""


def add_baseline_flag(parser: argparse.ArgumentParser) -> None:
    """``--baseline REV`` and ``--baseline-args``."""
    parser.add_argument("--baseline", metavar="REV",
                        help="a commit of this repository whose greedy and lookahead run as base_greedy and "
                        "base_lookahead, in a child process")
    parser.add_argument("--baseline-args", default="", metavar="FLAGS",
                        help="more flags for the baseline's own 'bench heldout' parser (e.g. '--dtype float32')")


def _git(repository: Path, *arguments: str) -> str:
    """``git -C repository ARGUMENTS``' stdout, stripped; raises ``BaselineError`` with git's message."""
    try:
        done = subprocess.run(["git", "-C", str(repository), *arguments], capture_output=True, text=True)
    except OSError as error:
        raise BaselineError(f"git cannot run: {error}") from error
    if done.returncode != 0:
        raise BaselineError(f"git {' '.join(arguments)}: {done.stderr.strip() or f'status {done.returncode}'}")
    return done.stdout.strip()


def repository() -> Path:
    """The git checkout this ``bench`` package lives in (raises ``BaselineError`` outside one)."""
    return Path(_git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))


def resolve_commit(rev: str) -> str:
    """The full hash of commit ``rev`` (raises ``BaselineError`` naming ``rev`` when it is not one)."""
    try:
        return _git(repository(), "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    except BaselineError as error:
        raise BaselineError(f"--baseline {rev!r} is not a commit of this repository ({error})") from error


def check_baseline(args: argparse.Namespace, methods: Sequence[str]) -> None:
    """Validate ``--baseline`` against ``methods`` and store the commit's full hash as ``args.baseline_commit``;
    raises ``ValueError`` (the parsers' usage error) when base methods lack a baseline, a baseline has no base
    method to run, or the revision is not a commit."""
    asked = [name for name in methods if name in BASE_METHODS]
    args.baseline_commit = None
    if asked and not args.baseline:
        raise ValueError(f"{', '.join(asked)} need --baseline REV")
    if args.baseline and not asked:
        raise ValueError(f"--baseline runs only in {' and '.join(BASE_METHODS)}: add one to --methods")
    if args.baseline:
        try:
            args.baseline_commit = resolve_commit(args.baseline)
        except BaselineError as error:
            raise ValueError(str(error)) from error


def checkout(commit: str) -> Path:
    """A detached worktree of ``commit`` under ``<cache>/baselines/``: made on first use, reused after (raises
    ``BaselineError`` when the folder holds something else or git cannot make it)."""
    folder = cache_root() / "baselines" / commit[:SHORT]
    if folder.exists():
        try:
            found = _git(folder, "rev-parse", "HEAD")
        except BaselineError:
            found = None
        if found != commit or not (folder / "bench").is_dir():
            raise BaselineError(f"{folder} exists but is not a checkout of {commit[:SHORT]}: remove it "
                                "(git worktree remove --force) and run again")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _git(repository(), "worktree", "prune")  # forget checkouts whose folders were deleted
    _git(repository(), "worktree", "add", "--detach", str(folder), commit)
    return folder


def _absolute(value: str) -> str:
    """``value`` as an absolute path when it names an existing file or folder (the child runs elsewhere)."""
    return str(Path(value).resolve()) if Path(value).exists() else value


def child_flags(resolved: Resolved) -> list[str]:
    """The flags the child's ``bench heldout`` parser gets (see the module docstring)."""
    args = resolved.args
    flags = ["--device", args.device, "--threads", str(args.threads), "--preset", resolved.preset]
    if resolved.sources.get("model") == FLAG:
        flags += ["--model", _absolute(args.model)]
    if getattr(args, "memory_tokens", 0):
        flags += ["--memory-tokens", str(args.memory_tokens)]
    if getattr(args, "memory_file", None):
        flags += ["--memory-file", _absolute(args.memory_file)]
    return flags + shlex.split(args.baseline_args)


class BaselineChild:
    """One child process serving commit ``commit``'s greedy and lookahead (started by ``start``, model loaded
    once); ``close`` ends it (also at exit)."""

    def __init__(self, commit: str, process: subprocess.Popen[str], ready: Mapping[str, object]) -> None:
        self.commit = commit
        self.process = process
        self.ready = dict(ready)

    @classmethod
    def start(cls, commit: str, flags: Sequence[str]) -> BaselineChild:
        """Check out ``commit``, start the child with ``flags`` and wait until its model is loaded (its stderr
        is ours: its settings block and any traceback show there)."""
        folder = checkout(commit)
        environment = {**os.environ, "PYTHONPATH": str(folder)}
        process = subprocess.Popen(
            [sys.executable, str(CHILD), *flags], cwd=folder, env=environment, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, encoding="utf-8", bufsize=1,
        )
        child = cls(commit, process, {})
        atexit.register(child.close)
        child.ready = child._read()
        if not child.ready.get("ready"):
            child.close()
            raise BaselineError(f"the baseline {commit[:SHORT]} did not start: {child.ready}")
        return child

    def _read(self) -> dict[str, object]:
        """The child's next reply (raises ``BaselineError`` when it ended instead)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            status = self.process.wait()
            raise BaselineError(f"the baseline {self.commit[:SHORT]}'s child process ended (status {status}); "
                                "its messages are above")
        return json.loads(line)

    def _ask(self, request: Mapping[str, object]) -> dict[str, object]:
        """Send one request line and return the reply; raises ``BaselineError`` on an ``error`` reply."""
        stdin: IO[str] | None = self.process.stdin
        if stdin is None or self.process.poll() is not None:
            raise BaselineError(f"the baseline {self.commit[:SHORT]}'s child process is not running")
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise BaselineError(f"the baseline {self.commit[:SHORT]} failed: {reply['error']}")
        return reply

    def decode(self, method: str, prompt_ids: Sequence[int], stop: StopCriteria) -> Decoded:
        """One greedy decode by the commit's ``method`` (``greedy`` or ``lookahead``), with the child's seconds."""
        reply = self._ask({"method": method, "prompt_ids": list(prompt_ids), "max_tokens": stop.max_tokens,
                           "stop_token_ids": sorted(stop.stop_token_ids)})
        return Decoded(list(reply["tokens"]), reply["steps"], reply.get("offered"), reply.get("accepted"),
                       float(reply["seconds"]))

    def reset(self) -> None:
        """Put the child's shared memory back as loading left it (nothing without one)."""
        self._ask({"reset": True})

    def runner(self, name: str) -> Runner:
        """The ``bench.records.Runner`` of method ``name`` (a key of ``BASE_METHODS``); it ignores the model."""
        method = BASE_METHODS[name]

        def run(_model: PreTrainedModel, prompt_ids: Sequence[int], stop: StopCriteria) -> Decoded:
            return self.decode(method, prompt_ids, stop)

        return run

    def close(self) -> None:
        """End the child: close its input and wait (killed after 30 s). Idempotent."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def start_baseline(resolved: Resolved, methods: Sequence[str]) -> BaselineChild | None:
    """The child for ``--baseline`` when ``methods`` ask for a base method, else None; prints where it runs."""
    commit = getattr(resolved.args, "baseline_commit", None)
    if commit is None or not any(name in BASE_METHODS for name in methods):
        return None
    child = BaselineChild.start(commit, child_flags(resolved))
    ready = child.ready
    print(f"baseline: commit {commit[:SHORT]} ({resolved.args.baseline}) in a child process, preset "
          f"{ready.get('preset')}, linears {ready.get('linears')}, lookahead {ready.get('lookahead')}", flush=True)
    return child


# --- report -----------------------------------------------------------------------------------------------


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _same(reference: RunRecord | None, run: RunRecord | None) -> str:
    """``yes``, ``no@i`` (the first differing token) or ``-`` when either did not run."""
    if reference is None or run is None:
        return "-"
    index = first_difference(reference.output_ids, run.output_ids)
    return "yes" if index is None else f"no@{index}"


def comparison_rows(runs: Sequence[RunRecord]) -> list[list[str]]:
    """Per prompt: base lookahead's steps and tokens per step, base greedy's and base lookahead's speed-ups over
    our greedy, our lookahead's over base lookahead, and whether base greedy's output is our greedy's and base
    lookahead's is base greedy's (``-`` where a method did not run)."""
    grouped = by_method(runs)
    rows = []
    for prompt_id in dict.fromkeys(run.id for run in runs):
        greedy, lookahead, base_greedy, base_lookahead = (
            grouped.get(name, {}).get(prompt_id) for name in ("greedy", "lookahead", *BASE_METHODS)
        )

        def faster(slow: RunRecord | None, fast: RunRecord | None) -> float | None:
            return None if slow is None or fast is None else _ratio(slow.seconds, fast.seconds)

        steps = None if base_lookahead is None else base_lookahead.steps
        rows.append([
            prompt_id,
            "-" if steps is None else str(steps),
            "-" if not steps or base_lookahead is None else f"{base_lookahead.new_tokens / steps:.2f}",
            _cell(faster(greedy, base_greedy)),
            _cell(faster(greedy, base_lookahead)),
            _cell(faster(base_lookahead, lookahead)),
            _same(greedy, base_greedy),
            _same(base_greedy, base_lookahead),
        ])
    return rows


def comparison(runs: Sequence[RunRecord], baseline: Mapping[str, object] | None) -> tuple[str, dict[str, object]]:
    """The per-prompt table against the baseline (``baseline``: the JSON settings' ``{"commit", ...}`` of the
    child) and its closing lines, and the JSON ``baseline`` summary: our greedy's and lookahead's speed-ups over
    the commit's (total seconds, and median of the per-prompt ratios) and how many outputs agree."""
    grouped = by_method(runs)
    commit = None if baseline is None else str(baseline["commit"])
    label = "the baseline" if commit is None else commit[:SHORT]
    summary: dict[str, object] = {"commit": commit}
    lines = [format_table(COMPARISON_HEADERS, comparison_rows(runs))]
    for ours, base in (("greedy", "base_greedy"), ("lookahead", "base_lookahead")):
        if ours in grouped and base in grouped:
            total, median = speedup(grouped[base], grouped[ours]), median_speedup(grouped[base], grouped[ours])
            summary[f"{ours}_vs_{base}"], summary[f"{ours}_vs_{base}_median"] = total, median
            lines.append(f"{ours} vs {label}'s: {_cell(total)} (median {_cell(median)})")
    for reference, other in (("greedy", "base_greedy"), ("base_greedy", "base_lookahead")):
        if reference in grouped and other in grouped:
            same = sum(run.output_ids == grouped[reference][i].output_ids for i, run in grouped[other].items()
                       if i in grouped[reference])
            summary[f"{other}_identical_to_{reference}"] = same
            lines.append(f"{other}'s output identical to {reference}'s on {same} of {len(grouped[other])}")
    return "\n".join(lines), summary
