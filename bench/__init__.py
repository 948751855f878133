"""Tooling around the decoder: the benchmark, the tuner and their prompt sets. Not imported by a running server.

Contract: this package measures ``decoding`` and may import ``decoding`` and ``server.config`` (the settings the
server runs with); ``decoding`` never imports it, and ``server`` only from the ``lookahead-server tune`` command.

- ``bench.cli`` (``python -m bench``): the benchmark's command line; its defaults are the server's
  (``bench.settings``).
- ``bench.measure``: timed decodes of each method and the step-cost curve; ``bench.report``: the arithmetic,
  tables and JSON.
- ``bench.heldout`` (``python -m bench heldout``): lookahead against our greedy loop and transformers' prompt
  lookup, on the held-out split of a prompt set.
- ``bench.tune``: choose W, N, G and the step policy for a model on a device, by measurement, on tune splits.
- ``bench.datasets``: HumanEval and AlpacaEval (fetched through ``decoding.fetch``), chat questions, JSONL
  prompt files, and the tune / held-out split of each built-in set.
"""
