"""The forward room: how one step's forward runs on a device.

Its modules import one another, the weights room (``decoding.weights``: the kernels) and the top-level ground
(``decoding.params``, ``decoding.errors``, ``decoding.grammar``); no room above (``tests/test_layering.py``).
Nothing is imported here: name the module you need.

A decode hands a forward one ``Slice`` per sequence (``slices``: the step's tokens, their positions, which of them see
which, the rows whose logits it reads, and the ``SlotCache`` its keys and values go to) and gets each slice's logits
back. Every forward below computes the model's logits (bit for bit, or to float tolerance where its docstring says
so), and on each of them a lookahead step commits what the one-token loop on that forward does. Which forward runs a
step, in this order (``decoding.batch.forward_batch`` chooses between 1 and 2, ``packed.forward_packed`` among 2a-2c):

1. the static step (``static``, over ``static_forward`` and ``static_inputs``), when the engine has one
   (``BatchPolicy.static_step`` is not ``"off"``) and the step's slices fit one of its buckets: fixed shapes over the
   rows of a ``KVPool``, run eagerly, through ``torch.compile`` or replayed as a CUDA graph; it also reads the rows'
   argmax and top ids on the device (``choice.RowIds``). A step that fits no bucket runs as in 2.
2. the eager packed forward (``packed.forward_packed``): every slice's tokens in one row, attention per slice:

   a. the fused CPU step (``fused``), for a LLaMA-family model in float32 on the CPU whose projections are native
      kernels (``decoding.weights.linears``, ``decoding.weights.gguf_model``) with the native library built, unless
      the model names its own forward (``packed.LEAN_FORWARD``);
   b. else, for a model ``lean.supports`` (LLaMA-family), the forward it names in ``LEAN_FORWARD``
      (``compiled.CompiledForward``: the lean forward with the work between attentions compiled, for the A/B of
      ``python -m bench compile``), or else the lean step (``lean``: the model's own modules called directly);
   c. else the model's public ``forward``, with the packed attention function selected.

Modules:

- ``kv_cache``: ``SlotCache`` (preallocated, written in place; ``commit`` is a lookahead step's whole KV fix-up) and
  ``KVPool`` (the rows of the static step's caches).
- ``slices``: ``Slice``, plain data, made by a decode's plan and read by every forward.
- ``packed``, ``fused``, ``lean``, ``compiled``, ``static``, ``static_forward``, ``static_inputs``: the forwards above.
- ``choice``: each row's greedy id and top ids (the native kernel on a float32 CPU, else torch), through which every
  greedy choice of a decode goes; ``RowIds``, the ids a static step read on the device.
- ``private_api``: every private torch / transformers API ``decoding`` relies on, each with a check.

The step-cost curve measured on the device through ``forward_batch`` is ``decoding.calibration``.
"""
