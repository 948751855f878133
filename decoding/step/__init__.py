"""The step room: one decode, and the steps it is made of.

Its modules import one another, the rooms below (``decoding.proposers``, ``decoding.forward``, ``decoding.weights``)
and the top-level ground (``decoding.params``, ``decoding.errors``, ``decoding.grammar``); nothing above
(``tests/test_layering.py``).
Nothing is imported here: name the module you need.

Modules, from a decode down to its parts:

- ``stream``: ``DecodeStream``, one decode: an iterator of ``Step`` that can also be stepped inside a batch
  (``propose`` / ``plan`` / ``finish``); ``generate_autoregressive``, ``generate_lookahead``, ``validate_request``.
- ``prefix_cache``: finished decodes' KV and copy index, which a later decode whose prompt starts the same way starts
  from (``PrefixHit``).
- ``steps``: what a step is (``Step``, ``StepStats``, ``StepCounts``, ``Proposal``), a decode's committed state
  (``SequenceState``: the one place tokens are committed) and ``PlainStep``, the one-token autoregressive step.
- ``lookahead``: ``LookaheadStep``, the lookahead step.
- ``drafts``: a step's drafts, asked of the proposers at their price, cut by the grammar, merged in order.
- ``tree``: the verification branch as a token tree (candidates that start alike share their prefix).
- ``verify``: which guesses the step's chosen tokens confirm (greedy, on a tree, under a grammar).
- ``logits``: the adjustments that depend on the tokens before a row: penalties, logit bias, ``min_tokens``.
- ``sampling``: seeded sampling decided per position, so a seed gives the same tokens whatever the decoding.
- ``logprobs``: committed tokens' logprobs, read off the raw logits rows that predicted them.

The order of one lookahead step: ``DecodeStream.propose`` (what it wants of the batch), ``plan`` (``LookaheadStep``
asks the proposers through ``drafts``, merges their drafts into a ``tree`` beside the Jacobi window's rows and fits
them to the budget: a ``Slice``), the forward (``decoding.forward``), then ``finish``: the rows adjusted (``logits``),
each position's token chosen (``decoding.forward.choice``, or ``sampling``), the guesses verified (``verify``), the
accepted run committed (``steps.SequenceState.accept``) with its KV (``SlotCache.commit``), and every proposer told
what happened. A plain step is ``steps.PlainStep``: one token in, one token out, chosen by the same rule.
"""
