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
    device call 2:  run  command="scripts/gpu-check 2"  carry=[".gpu-carry"]    timeout_s=420

- call 1, ``scripts/gpu-check 1``, carry ``.gpu-model-1`` (``gguf.part-0``: half the GGUF; ``whl/``: the wheels
  of what the image lacks, ``bench.gpu_wheels``): installs the wheels into /tmp/site, copies the half to
  /tmp/lookahead-gpu, then runs ``tests`` (``pytest -m "not real_model" tests/decoding/test_cuda.py``, 130 s),
  ``step_cost`` (``python -m bench.gpu_step_cost`` on random weights of the default model's shape, 80 s) and
  ``fused_step_cost`` (the same with ``--fused``: the fused step, its compiles included, 90 s).
- call 2, ``scripts/gpu-check 2``, carry ``.gpu-carry`` (``gguf.part-1``: the other half; ``datasets/``: the
  prompt sets): joins the halves into the model cache, then runs, with /tmp/site, ``model_tests`` (``pytest -m
  real_model tests/decoding/test_cuda.py``, 75 s), ``heldout`` (``python -m bench heldout --preset cuda --device
  cuda --methods greedy,lookahead`` on HumanEval, chat and MT-bench, 105 s), ``server`` (``python -m server serve
  --device cuda`` spawned as ``server.spawn`` does: seconds until ``/health`` answers, then the first and a second
  streamed request's time to first text and seconds, each failing the part when its stream carries an error, 75 s)
  ``load`` (``scripts/loadtest.py --spawn --server-arg=--device=cuda`` at 1 and 8 streams, lookahead on,
  HumanEval and chat, 75 s) and ``anatomy`` (``python -m bench anatomy --device cuda``: a step's wall, host and
  device ms through captured graphs on the tiny-width 30-layer model, and the server's worker around it, serial and
  overlapped; random weights, 45 s).

Goals (issue #40; ``bench.gpu_parts.goals`` checks what a report holds): the whole greedy step through graphs
<= 1.2 ms at k=1 and <= 2.0 ms for every k <= 128 at batch 1, <= 1.6 ms at batch 8 k=1; greedy >= 700 tok/s;
lookahead >= 2.0x greedy on HumanEval, >= 1.4x on MT-bench and chat; one stream through the server within 10% of
the engine's lookahead (HumanEval), 8 streams >= 4x one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.gpu_runner import ROOT, Output, cuda_available, device_name, run_parts, select_parts


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


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
