"""The GPU check's machinery: parts run one by one, each in its own process under a time budget, and a report
folder rewritten as each part starts, records and ends.

Contract: ``Part(name, call, budget_seconds, run, needs)``; ``select_parts`` picks them by name, device call or
skip list; ``run_parts`` runs the selected ones in order, each in a child process (a part's CUDA context cannot
end another's), writing ``gpu.json`` and ``gpu.md`` through ``Output`` (at most ``MAX_FILES`` files, what comes
back from a device call) whenever a part starts, records a result or ends. ``bench.gpu`` (the command) and
``bench.gpu_parts`` (what each part measures) build on it; it imports neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILES = 8  # what comes back from a device call's $OUT
TAIL_LINES = 25


class TooManyFiles(RuntimeError):
    """A part asked for a file beyond ``MAX_FILES`` in the output folder."""


class PartTimeout(RuntimeError):
    """A part ran past its time budget."""


class Output:
    """The ``--out`` folder: files by name, at most ``limit`` of them (gpu.json and gpu.md included)."""

    def __init__(self, folder: Path, limit: int = MAX_FILES) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self._names: list[str] = []

    def file(self, name: str) -> Path:
        """The path of ``name`` in the folder; ``TooManyFiles`` when it would be one file too many."""
        if name not in self._names:
            if len(self._names) >= self.limit:
                raise TooManyFiles(f"{name}: the folder already has {self.limit} files ({', '.join(self._names)})")
            self._names.append(name)
        return self.folder / name

    def write(self, name: str, text: str) -> None:
        """Replace ``name`` with ``text`` whole (written aside, then renamed: never half a file)."""
        path = self.file(name)
        partial = path.with_name(f".{name}.partial")
        partial.write_text(text)
        partial.replace(path)


@dataclass
class PartContext:
    """What a running part gets: its output folder, its deadline, and where its results go."""

    output: Output
    deadline: float  # time.monotonic() at which the part's budget is spent
    results: dict = field(default_factory=dict)
    on_record: Callable[[], None] = lambda: None  # rewrites the report
    python: str = sys.executable

    def remaining(self) -> float:
        """Seconds left of the part's budget (negative once spent)."""
        return self.deadline - time.monotonic()

    def record(self, key: str, value: object) -> None:
        """Keep ``value`` under ``key`` in the part's results and rewrite the report now."""
        self.results[key] = value
        self.on_record()

    def run(self, command: Sequence[str], timeout: float | None = None, env: dict[str, str] | None = None) -> dict:
        """Run ``command`` from the repository root within the budget (and ``timeout``); its status, seconds and
        last lines, appended to the results' ``runs``. ``PartTimeout`` (after recording it) when the budget ends it.
        """
        limit = min(self.remaining(), timeout) if timeout is not None else self.remaining()
        if limit <= 0:
            raise PartTimeout(f"no time left for {' '.join(command)}")
        started = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
            status: int | str = done.returncode
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as error:
            status, output = "timeout", _text(error.stdout) + _text(error.stderr)
        run = {"command": " ".join(command), "status": status, "seconds": round(time.monotonic() - started, 1),
               "tail": output.strip().splitlines()[-TAIL_LINES:]}
        self.record("runs", [*self.results.get("runs", []), run])
        if status == "timeout" and self.remaining() <= 0:
            raise PartTimeout(f"{run['command']} ran past the part's budget")
        return run


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


@dataclass(frozen=True)
class Part:
    """One part of the check: what it runs, on which device call, within how long, and what it needs."""

    name: str
    call: int  # 1 or 2: which device call of scripts/gpu-check runs it
    budget_seconds: float
    run: Callable[[PartContext], None]  # records its results through the context; raises when it fails
    needs: Callable[[], str | None] = lambda: None  # why it cannot run here, or None
    summary: str = ""


def select_parts(parts: Sequence[Part], names: str = "", call: int | None = None, skip: str = "",
                 ) -> tuple[list[str], dict[str, str]]:
    """The names to run, in ``parts``' order, and why each other one is left out.

    ``names`` (a comma list; empty: all) or ``call`` (the parts of device call 1 or 2) chooses; ``skip`` leaves
    some out. Unknown names raise ``ValueError``.
    """
    known = [part.name for part in parts]
    asked = [name for name in names.split(",") if name]
    skipped = [name for name in skip.split(",") if name]
    unknown = sorted(set(asked + skipped) - set(known))
    if unknown:
        raise ValueError(f"unknown parts {', '.join(unknown)}: expected some of {', '.join(known)}")
    selected, left_out = [], {}
    for part in parts:
        if asked and part.name not in asked:
            left_out[part.name] = f"not selected (--parts {names})"
        elif call is not None and part.call != call:
            left_out[part.name] = f"runs in device call {part.call}, not this call {call}"
        elif part.name in skipped:
            left_out[part.name] = "left out by --skip"
        else:
            selected.append(part.name)
    return selected, left_out


def write_report(output: Output, report: dict, markdown: Callable[[dict], str]) -> None:
    """Rewrite gpu.json and gpu.md from ``report``."""
    output.write("gpu.json", json.dumps(report, indent=2, default=str))
    output.write("gpu.md", markdown(report))


def run_parts(parts: Sequence[Part], selected: Sequence[str], output: Output, report: dict,
              markdown: Callable[[dict], str], left_out: dict[str, str] | None = None) -> dict:
    """Run the ``selected`` parts in order (module contract); the report, written after every change."""
    report.setdefault("parts", {})
    report.setdefault("skipped", {}).update(left_out or {})

    def save() -> None:
        write_report(output, report, markdown)

    for part in parts:
        if part.name not in selected:
            continue
        try:
            reason = part.needs()
        except Exception as error:  # a check that breaks is a reason too
            reason = f"checking what it needs failed: {error!r}"
        if reason is not None:
            report["skipped"][part.name] = reason
            save()
            continue
        started = time.monotonic()
        context = PartContext(output, started + part.budget_seconds, on_record=save)
        section = {"status": "running", "budget_seconds": part.budget_seconds, "results": context.results}
        report["parts"][part.name] = section
        save()
        try:
            part.run(context)
            section["status"] = "done"
        except PartTimeout as error:
            section["status"], section["error"] = "timeout", str(error)
        except Exception as error:  # the next part still runs; the traceback's end says why this one did not
            section["status"] = "failed"
            section["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
            section["traceback"] = traceback.format_exc().strip().splitlines()[-TAIL_LINES:]
        section["seconds"] = round(time.monotonic() - started, 1)
        save()
    return report


def device_name() -> str:
    """The GPU's name, as nvidia-smi (else torch) gives it."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    import torch

    return torch.cuda.get_device_name()


def cuda_available() -> bool:
    """Whether torch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()
