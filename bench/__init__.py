"""Tooling around the decoder: the benchmark, the tuner and their prompt sets. Not imported by a running server.

Contract: this package measures ``decoding`` and may import ``decoding``, ``server.config``, ``server.config_layers``
and ``server.flags`` (the settings the server runs with, their layers, and their command-line flags) and
``server.spawn``; neither ``decoding`` nor ``server`` imports it.

- ``bench.cli`` (``python -m bench``): the benchmark's command line; its defaults are the server's
  (``bench.settings``).
- ``bench.measure``: timed decodes of each method and the step-cost curve; ``bench.report``: the arithmetic,
  tables and JSON.
- ``bench.heldout`` (``python -m bench heldout``): lookahead against our greedy loop and transformers' prompt
  lookup, on the held-out split of a prompt set.
- ``bench.tune`` (``python -m bench tune``): choose W, N, G and the step policy for a model on a device, by
  measurement, on tune splits, with the server's configuration, and write them as a config file.
- ``bench.memory_file`` (``python -m bench memory``): a memory file of tune-split completions for ``heldout``;
  ``bench.cpu_forwards`` (``python -m bench compile``): the CPU forwards (fused, lean, ``torch.compile``) side
  by side; ``bench.weight_formats`` (``python -m bench weights``): the GGUF weights against float32; the other
  subcommands are ``bench.cli.SUBCOMMANDS``.
- ``bench.datasets``: HumanEval and AlpacaEval (fetched through ``decoding.weights.fetch``), chat questions, JSONL
  prompt files, and the tune / held-out split of each built-in set.
"""
