"""Tooling around the decoder: the benchmark, the tuner and their prompt sets. Not imported by a running server.

Contract: this package measures ``decoding`` and may import ``decoding``, ``server.config`` and ``server.flags``
(the settings the server runs with, and their command-line flags); neither ``decoding`` nor ``server`` imports it.

- ``bench.cli`` (``python -m bench``): the benchmark's command line; its defaults are the server's
  (``bench.settings``).
- ``bench.measure``: timed decodes of each method and the step-cost curve; ``bench.report``: the arithmetic,
  tables and JSON.
- ``bench.heldout`` (``python -m bench heldout``): lookahead against our greedy loop and transformers' prompt
  lookup, on the held-out split of a prompt set.
- ``bench.tune``: choose W, N, G and the step policy for a model on a device, by measurement, on tune splits;
  ``bench.tuning`` (``python -m bench tune``) runs it on the server's configuration and writes a config file.
- ``bench.datasets``: HumanEval and AlpacaEval (fetched through ``decoding.fetch``), chat questions, JSONL
  prompt files, and the tune / held-out split of each built-in set.
"""
