"""GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) kept quantized, in the native kernel's panel layout.

Contract: ``QuantizedWeight`` holds a weight [N, K] as GGUF stores it, one row per output feature of ``K / 32``
blocks (``raw``: uint8 [N, K / 32 * block bytes]). ``QuantKernel(weight, gemm)`` repacks it once into panels
(``csrc/quant_gemm.cpp`` has the layout: per panel of L columns and block of 32 k, the L float16 scales, the L
float16 minima for Q4_1, then the quants in groups of four k, each group's L columns side by side) and keeps that
one copy; calling it on rows [M, K] gives ``rounded(rows) @ W^T`` [M, N] in float32: the rows rounded to 8 bits a
block of 32 at a time (``rounded``, as llama.cpp rounds a product's activations), W's integers multiplied with
theirs in registers; a row's result is the same bit for bit whatever other rows share the call.
``QuantKernel.weight_rows(ids)`` de-quantizes whole rows of W from the same panels in one native call (``quant_rows``),
equal bit for bit to ``gguf.dequantize`` of those rows: the tied embedding of a GGUF model is read that way
(``PanelEmbedding``), so the token embedding and the output projection share one copy. ``dequantize(weight)``
is the float32 weight (tests, fallbacks).

GGUF's blocks: Q4_0 is a float16 scale d and 32 4-bit quants (w = d (q - 8)), Q4_1 adds a float16 minimum m
(w = d q + m), Q8_0 is d and 32 int8 quants (w = d q); in a 4-bit block, byte j holds element j in its low
nibble and element j + 16 in its high one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from decoding.weights.native import WIDE_PANEL, PanelGemm

BLOCK = 32  # weights per GGUF block
GROUP = 4  # consecutive k a lane of the kernel's integer dot products takes


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: its name, the kernel's number for it, float16 scales per block (d; or d and m),
    bits per quant and the bytes of one GGUF block."""

    name: str
    kind: int
    scales: int
    bits: int
    raw_bytes: int

    def quant_bytes(self, lanes: int) -> int:
        """Bytes of one packed block's quants for ``lanes`` columns."""
        return BLOCK * self.bits // 8 * lanes

    def block_bytes(self, lanes: int) -> int:
        """Bytes of one packed block (scales then quants) for ``lanes`` columns."""
        return 2 * self.scales * lanes + self.quant_bytes(lanes)


FORMATS = {
    "Q4_0": BlockFormat("Q4_0", 0, 1, 4, 18),
    "Q4_1": BlockFormat("Q4_1", 1, 2, 4, 20),
    "Q8_0": BlockFormat("Q8_0", 2, 1, 8, 34),
}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [``rows``, ``columns``] in GGUF's blocks: ``raw`` uint8 [rows, columns / 32 * raw block bytes]."""

    format: BlockFormat
    raw: torch.Tensor
    columns: int

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    def permuted(self, order: torch.Tensor) -> QuantizedWeight:
        """The weight with its rows taken in ``order`` (whole rows move, blocks and all)."""
        return QuantizedWeight(self.format, self.raw[order].contiguous(), self.columns)

    @staticmethod
    def stacked(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights' rows one after the other (one format, one width)."""
        if len({(weight.format, weight.columns) for weight in weights}) != 1:
            raise ValueError("only weights of one format and width stack")
        return QuantizedWeight(weights[0].format, torch.cat([weight.raw for weight in weights]), weights[0].columns)


def unpack(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight``'s quants [N, K] (uint8 0..15 for 4 bits, int8 for Q8_0) and float16 scales [N, K / 32, scales]
    (d, then m for Q4_1), in GGUF's element order."""
    fmt, rows = weight.format, weight.rows
    blocks = weight.raw.reshape(rows, weight.columns // BLOCK, fmt.raw_bytes)
    scales = blocks[..., : 2 * fmt.scales].contiguous().view(torch.float16)  # [N, B, scales]
    body = blocks[..., 2 * fmt.scales :]
    if fmt.bits == 8:
        quants = body.contiguous().view(torch.int8)  # [N, B, 32]
    else:
        quants = torch.cat((body & 15, body >> 4), dim=-1)  # [N, B, 32]: elements j and j + 16 of byte j
    return quants.reshape(rows, weight.columns), scales


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K], as ``gguf.dequantize`` computes it."""
    quants, scales = unpack(weight)
    return _values(weight.format, quants.reshape(weight.rows, -1, BLOCK), scales.float()).reshape(weight.rows, -1)


def _values(fmt: BlockFormat, quants: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Weights [..., B, 32] from quants [..., B, 32] and float32 scales [..., B, scales], as gguf does it."""
    d = scales[..., :1]
    if fmt.name == "Q4_1":
        return d * quants.float() + scales[..., 1:2]
    if fmt.name == "Q4_0":
        return d * (quants.to(torch.int8) - 8).float()
    return d * quants.float()


def rounded(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [..., K] (K a multiple of 32) as the quantized kernel rounds them: each block of 32 consecutive
    values ``e * u`` with ``e = max |x| / 127`` and ``u = round(x / e)`` in [-127, 127] (float32 [..., K]; a block
    holding an infinity or a NaN gives NaN).

    >>> rounded(torch.linspace(-1.0, 1.0, 32))[:3].tolist()
    [-1.0, -0.9370078444480896, -0.874015748500824]
    """
    blocks = rows.float().reshape(*rows.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    finite = torch.isfinite(scale) & (scale > 0)
    inverse = torch.where(finite, 1.0 / torch.where(finite, scale, 1.0), 0.0)
    units = torch.round(blocks * inverse).clamp(-127.0, 127.0)
    scale = torch.where(torch.isfinite(scale), scale, torch.nan)
    return (units * scale).reshape(rows.shape)


def q8_offset(lanes: int) -> int:
    """What Q8_0 panels of ``lanes`` columns add to each quant: 128 in the AVX-512 entry's (its dot product takes the
    weights as unsigned bytes), 0 in the AVX2 entry's (it takes their signs onto the rows)."""
    return 128 if lanes == WIDE_PANEL else 0


def pack(weight: QuantizedWeight, lanes: int) -> torch.Tensor:
    """``weight`` in panels of ``lanes`` columns: uint8 [N / lanes, K / 32, block bytes] (layout: module docs)."""
    fmt, rows, blocks = weight.format, weight.rows, weight.columns // BLOCK
    if rows % lanes:
        raise ValueError(f"the panel layout needs a multiple of {lanes} output features, got {rows}")
    quants, scales = unpack(weight)
    panels = rows // lanes
    # scales [N, B, S] -> [P, B, S, L] as bytes
    scale_bytes = scales.reshape(panels, lanes, blocks, fmt.scales).permute(0, 2, 3, 1).contiguous()
    scale_bytes = scale_bytes.view(torch.uint8).reshape(panels, blocks, -1)
    if fmt.bits == 8:
        body = (quants.to(torch.int16) + q8_offset(lanes)).to(torch.uint8).reshape(panels, lanes, blocks, BLOCK)
    else:
        halves = quants.reshape(panels, lanes, blocks, 2, BLOCK // 2)
        body = halves[..., 0, :] | (halves[..., 1, :] << 4)  # [P, L, B, 16]: GGUF's bytes, k and 16 + k
    groups = body.shape[-1] // GROUP
    body = body.reshape(panels, lanes, blocks, groups, GROUP).permute(0, 2, 3, 1, 4)  # [P, B, group, L, 4]
    return torch.cat((scale_bytes, body.reshape(panels, blocks, -1)), dim=-1).contiguous()


class QuantKernel:
    """``rows @ W^T + b`` for a GGUF-quantized ``W`` kept once, in panels (a ``decoding.weights.linears`` kernel)."""

    def __init__(self, weight: QuantizedWeight, gemm: PanelGemm, bias: torch.Tensor | None = None) -> None:
        self.format, self.gemm, self.bias = weight.format, gemm, bias
        self.out_features, self.in_features = weight.rows, weight.columns
        self.lanes = gemm.lanes if weight.rows % gemm.lanes == 0 else 8
        self.panels = pack(weight, self.lanes)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.gemm.quantized(self.format.kind, rows, self.panels, self.lanes, self.in_features)
        return out if self.bias is None else out.add_(self.bias)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of W de-quantized: float32 [*ids.shape, K], ``gguf.dequantize``'s bits (one
        native call; ``IndexError`` for an id outside W's rows)."""
        return self.gemm.quantized_rows(self.format.kind, self.panels, self.lanes, self.in_features, ids)


class PanelEmbedding(nn.Module):
    """A token embedding read from a ``QuantKernel``'s panels (the tied output projection's one copy):
    ``forward(ids)`` [...] -> [..., hidden] float32, only the looked-up rows de-quantized."""

    def __init__(self, kernel: QuantKernel) -> None:
        super().__init__()
        self.kernel = kernel
        self.num_embeddings, self.embedding_dim = kernel.out_features, kernel.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.kernel.weight_rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.kernel.format.name}"
