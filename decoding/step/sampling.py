"""Sampling decided per position: a seed gives the same tokens whatever the decoding.

Contract: the token sampled at output index ``i`` (0 = the first generated token) is a pure function of the
decode's seed, ``i`` and that position's scores (the logits after penalties, bias and grammar): the Gumbel-max
rule, ``argmax(warp_scores(scores) + g)``, where ``g[v]`` is Gumbel noise from a counter-based hash of (seed, i,
v). There is no generator state, so:

- the noise at index ``i`` is independent of everything before ``i``, hence the token is distributed as
  ``softmax(warp_scores(scores))`` given the tokens before it: sampling keeps the model's distribution;
- it does not matter how a position was reached: the plain loop, a lookahead step that verified a guess there,
  a batch, a warm or cold n-gram memory all commit the same token, to float tolerance as greedy decoding (a
  flip needs the two best perturbed scores within the logits' rounding, about as rare as a greedy near-tie);
- verifying a sampled step is the greedy rule on the sampled tokens (``verify_greedy``): a guess ``x`` is
  accepted when it is the perturbed argmax, i.e. with probability ``P[x]``, as under the rejection rule it
  replaces, and several distinct guesses at one position are accepted with their summed probability, as under
  SpecInfer's.

The hash is computed where the logits are, in fixed shapes (a ``[rows, vocab]`` XOR with a per-row key of a fixed
per-vocabulary table, one 32-bit mix); only the chosen ids cross to the host. (Inversion sampling, one uniform
per position against the cumulative distribution, is cheaper but not robust: every one of the vocabulary's
boundaries moves with the logits' rounding, and on the real model 2 of 16 sampled answers of 200 tokens
diverged between lookahead and the plain loop.)
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence

import torch

from decoding.forward.choice import greedy_id, greedy_ids
from decoding.params import SamplingParams

FLOAT32_TINY = torch.finfo(torch.float32).tiny
INT64 = 1 << 64
MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B1  # spreads the token ids before the table's mix
NUCLEUS_WIDTHS = (64, 1024)  # how many of the most likely tokens top-p looks among before the whole vocabulary (CPU)


def warp_scores(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Log-probabilities up to a constant per row, ``[rows, vocab]`` float32: the logits shifted so the best is 0,
    divided by the temperature, with the tokens min-p, top-k and top-p drop at ``-inf``.

    min-p drops tokens less likely than ``min_p`` times the best one (after temperature). top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (at least one token; ``top_p == 0``: one).
    Any valid temperature and top-p give a distribution, even denormals such as 5e-324, which float32 rounds
    to 0: scores are shifted before dividing (no inf - inf), and the best token always survives top-p.
    """
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / max(sampling.temperature, FLOAT32_TINY)
    vocab = scores.shape[-1]
    if sampling.min_p > 0.0:
        scores = scores.masked_fill(scores < math.log(sampling.min_p), float("-inf"))  # the best scores 0
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        scores = _nucleus(scores, sampling.top_p)
    return scores


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` with every token outside the top-p nucleus at ``-inf`` (the most likely first, while the mass
    before a token is below ``top_p``; the best always stays). On a CPU the nucleus is looked for among the
    ``NUCLEUS_WIDTHS`` most likely tokens first (a partial sort: a tenth of a full one's time on a 49k vocabulary,
    and a peaked distribution's nucleus is that narrow), then the whole vocabulary; elsewhere one full sort, with no
    read to the host. The result does not depend on the width it was found at."""
    vocab = scores.shape[-1]
    total = scores.exp().sum(dim=-1, keepdim=True)  # the best scores 0: no overflow
    widths = [width for width in NUCLEUS_WIDTHS if width < vocab] if scores.device.type == "cpu" else []
    for width in [*widths, vocab]:
        if width == vocab:
            top_scores, order = torch.sort(scores, dim=-1, descending=True)
        else:
            top_scores, order = torch.topk(scores, width, dim=-1)  # sorted, most likely first
        top_probs = top_scores.exp() / total
        if width == vocab or bool((top_probs.sum(dim=-1) >= top_p).all()):
            break
    remove = top_probs.cumsum(dim=-1) - top_probs >= top_p
    remove[..., 0] = False
    return torch.full_like(scores, float("-inf")).scatter(-1, order, top_scores.masked_fill(remove, float("-inf")))


def warp(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The probabilities ``[rows, vocab]`` (float32) that sampling draws from: ``softmax(warp_scores(...))``."""
    return warp_scores(logits, sampling).softmax(dim=-1)


def mix32(value: int) -> int:
    """The 32-bit integer hash ``gumbel`` applies on the device (lowbias32), on a Python int in [0, 2**32).

    >>> hex(mix32(1))
    '0x688990c0'
    """
    value ^= value >> 16
    value = (value * 0x7FEB352D) & MASK32
    value ^= value >> 15
    value = (value * 0x846CA68B) & MASK32
    return value ^ (value >> 16)


def _mix32(values: torch.Tensor) -> torch.Tensor:
    """``mix32`` of every element of an int64 tensor of values in [0, 2**32), in place. A product may pass
    2**63 and wrap, as torch's integer arithmetic does: its low 32 bits, all that is kept, are right either way."""
    values ^= values >> 16
    values *= 0x7FEB352D
    values &= MASK32
    values ^= values >> 15
    values *= 0x846CA68B
    values &= MASK32
    values ^= values >> 16
    return values


_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _token_table(vocab: int, device: torch.device) -> torch.Tensor:
    """``[vocab]`` int64: each token id mixed once (built once per vocabulary size and device)."""
    table = _TABLES.get((device, vocab))
    if table is None:
        table = _mix32((torch.arange(vocab, dtype=torch.int64) * GOLDEN32) & MASK32).to(device)
        _TABLES[(device, vocab)] = table
    return table


def row_key(seed: int, index: int) -> int:
    """The 32-bit key of output index ``index`` under ``seed`` (any int, taken modulo 2**64): BLAKE2b of the pair.

    >>> row_key(7, 0) == row_key(7, 0) != row_key(7, 1)
    True
    >>> row_key(2**64 + 5, 3) == row_key(5, 3)
    True
    """
    digest = hashlib.blake2b(struct.pack("<QQ", seed % INT64, index % INT64), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def gumbel(keys: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel noise ``[len(keys), vocab]`` (float32): row r, token v from the uniform
    ``(mix32(table[v] ^ keys[r]) + 0.5) / 2**32`` (``-log(-log(u))``, computed in float64). For a row the map from
    tokens to hashes is one-to-one, so no two tokens of a row draw the same noise."""
    key = torch.tensor(keys, dtype=torch.int64).to(device, non_blocking=True).unsqueeze(-1)
    hashed = _mix32(_token_table(vocab, device) ^ key)
    uniform = (hashed.double() + 0.5) * 2.0**-32
    return uniform.log_().neg_().log_().neg_().float()


def sample_rows(scores: torch.Tensor, sampling: SamplingParams, seed: int, indices: Sequence[int]) -> list[int]:
    """The tokens sampled from ``scores`` ``[rows, vocab]`` (adjusted and masked logits), row r at output index
    ``indices[r]``: the perturbed argmax, one read of the ids (nothing else leaves the device)."""
    noise = gumbel([row_key(seed, index) for index in indices], scores.shape[-1], scores.device)
    return greedy_ids(warp_scores(scores, sampling) + noise)


class SampledRows:
    """The sampled token of each logits row a step may read: ``rows[r]``, row r at output index ``indices[r]``.

    Rows are sampled when first read (a verification usually reads a few of a step's rows), one at a time on a
    CPU; on another device all of ``indices`` at once, in one read. ``scores`` is ``[rows, vocab]``.

    >>> rows = SampledRows(torch.tensor([[0.0, 40.0], [40.0, 0.0]]), SamplingParams(temperature=1.0), 7, {0: 0, 1: 1})
    >>> rows[0], rows[1]
    (1, 0)
    """

    def __init__(self, scores: torch.Tensor, sampling: SamplingParams, seed: int, indices: Mapping[int, int]) -> None:
        self.scores = scores
        self.sampling = sampling
        self.seed = seed
        self.indices = indices
        self.chosen: dict[int, int] = {}
        if scores.device.type != "cpu" and indices:
            rows = list(indices)
            self.chosen = dict(zip(rows, sample_rows(scores[rows], sampling, seed, list(indices.values())),
                                   strict=True))

    def prefetch(self, rows: Sequence[int]) -> None:
        """Sample those of ``rows`` not sampled yet, together (the window's row, read whole)."""
        missing = [row for row in rows if row not in self.chosen]
        if missing:
            tokens = sample_rows(self.scores[missing], self.sampling, self.seed, [self.indices[r] for r in missing])
            self.chosen.update(zip(missing, tokens, strict=True))

    def __getitem__(self, row: int) -> int:
        token = self.chosen.get(row)
        if token is None:
            token = sample_rows(self.scores[row : row + 1], self.sampling, self.seed, [self.indices[row]])[0]
            self.chosen[row] = token
        return token


def row_chooser(sampling: SamplingParams, seed: int, first_index: int) -> Callable[[torch.Tensor, int], int]:
    """How ``verify_constrained`` picks the token of a ``[vocab]`` row ``depth`` tokens past ``first_index``:
    the argmax when greedy (``seed`` unused), else the sample at output index ``first_index + depth``."""
    if sampling.greedy:
        return lambda row, depth: greedy_id(row)
    return lambda row, depth: sample_rows(row.unsqueeze(0), sampling, seed, [first_index + depth])[0]
