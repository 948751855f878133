"""The GPU check: the CUDA tests and the GPU's timings, in parts, each written to one folder as soon as it ends.

Contract: ``python -m bench gpu --out DIR [--call 1|2 | --parts a,b] [--skip a,b]`` (``scripts/gpu-check`` wraps
it) runs the selected parts in order, each in its own process (a part's CUDA context cannot end another's) under
its own time budget (``Part.budget_seconds``). ``DIR/gpu.json`` (everything) and ``DIR/gpu.md`` (the tables) are
rewritten when a part starts (marked ``running``), when it records a result and when it ends (``done``,
``failed`` or ``timeout``), so a part that raises or runs out of time, or a command stopped from outside, leaves
every earlier part's results. A part that is not selected, or cannot run here (its ``needs``), is named with why
under ``skipped``. DIR holds at most 8 files (``Output``): gpu.json, gpu.md, step-cost.json, heldout-<set>.json
(3), load.json. The short table prints last. Exit status: 2 without a CUDA device, 1 when a part failed or timed
out, else 0.

The parts (``bench.gpu_parts.PARTS``) and the device call of each: the GPU machine reaches no registry and a call
carries at most 64 MiB, so ``scripts/gpu-pack`` lays out two carries and the check runs in two calls to the same
warm machine (it stays warm ~30 s after a call, so call 2 goes at once):

    here, once:     scripts/gpu-pack
    device call 1:  run  command="scripts/gpu-check 1"  carry=[".gpu-model-1"]  timeout_s=330
    device call 2:  run  command="scripts/gpu-check 2"  carry=[".gpu-carry"]    timeout_s=390

- call 1, ``scripts/gpu-check 1``, carry ``.gpu-model-1`` (``gguf.part-0``: half the GGUF; ``whl/``: the wheels
  of what the image lacks, ``bench.gpu_wheels``): installs the wheels into /tmp/site, copies the half to
  /tmp/lookahead-gpu, then runs ``tests`` (``pytest -m "not real_model" tests/decoding/test_cuda.py``, 130 s) and
  ``step_cost`` (``python -m bench.gpu_step_cost`` on random weights of the default model's shape, 80 s).
- call 2, ``scripts/gpu-check 2``, carry ``.gpu-carry`` (``gguf.part-1``: the other half; ``datasets/``: the
  prompt sets): joins the halves into the model cache, then runs, with /tmp/site, ``model_tests`` (``pytest -m
  real_model tests/decoding/test_cuda.py``, 75 s), ``heldout`` (``python -m bench heldout --preset cuda --device
  cuda --methods greedy,lookahead`` on HumanEval, chat and MT-bench, 105 s), ``server`` (``python -m server serve
  --device cuda`` spawned as ``server.spawn`` does: seconds until ``/health`` answers, then the first and a second
  streamed request's time to first text and seconds, 45 s) and ``load`` (``scripts/loadtest.py --spawn
  --server-arg=--device=cuda`` at 1 and 8 streams, lookahead on, HumanEval and chat, 75 s).

``python -m bench anatomy`` is not a part: it has no ``--device`` flag (it times host work on a tiny CPU model).

Goals (issue #40; ``bench.gpu_parts.goals`` checks what a report holds): the whole greedy step through graphs
<= 1.2 ms at k=1 and <= 2.0 ms for every k <= 128 at batch 1, <= 1.6 ms at batch 8 k=1; greedy >= 700 tok/s;
lookahead >= 2.0x greedy on HumanEval, >= 1.4x on MT-bench and chat; one stream through the server within 10% of
the engine's lookahead (HumanEval), 8 streams >= 4x one.
"""

from __future__ import annotations

import argparse
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench gpu``: the exit status of the module contract."""
    from bench import gpu_parts

    parser = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-results", help="folder for the report (gpu-results)")
    names = ", ".join(part.name for part in gpu_parts.PARTS)
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--parts", default="", help=f"comma list of parts to run (default: all): {names}")
    choice.add_argument("--call", type=int, choices=(1, 2), help="run the parts of device call 1 or 2")
    parser.add_argument("--skip", default="", help="comma list of parts to leave out")
    args = parser.parse_args(argv)
    try:
        selected, left_out = select_parts(gpu_parts.PARTS, args.parts, args.call, args.skip)
    except ValueError as error:
        parser.error(str(error))
    if not cuda_available():
        print("no CUDA device: the GPU check needs one", file=sys.stderr)
        return 2
    import torch

    output = Output(Path(args.out))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit.stdout.strip() or "unknown",
                    "device": device_name(), "torch": torch.__version__, "python": sys.version.split()[0],
                    "selected": selected}
    run_parts(gpu_parts.PARTS, selected, output, report, gpu_parts.markdown, left_out)
    print(gpu_parts.markdown(report), flush=True)
    statuses = [section["status"] for section in report["parts"].values()]
    return 1 if any(status != "done" for status in statuses) else 0


if __name__ == "__main__":  # python -m bench.gpu: run the package's module, the one bench.gpu_parts imports
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bench.gpu import main as package_main

    sys.exit(package_main())
