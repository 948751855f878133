// What the panel kernels (panel_gemm.cpp, quant_gemm.cpp) share about reading their weights from memory.
#pragma once

#include <cstdint>

namespace lookahead {

// How far ahead of its tile each panel stream is prefetched, in bytes (2 KiB: 6 blocks of Q4_1 on the quantized
// kernel's AVX-512 entry, 12 on AVX2; 32 / 64 k of a float32 panel; a prefetch past a buffer's end is harmless).
// The hardware's own prefetcher kept a one-row tile fed from memory but not a tile of more rows, whose arithmetic
// per byte then no longer hid the loads. On a 2-core AMD EPYC: quantized, a decode step of 2 / 8 tokens cost 1.23 /
// 1.88 one-token steps without it, 1.14 / 1.71 with it, and a one-token step 0-10 % less; float32, an 8-token step
// 1.44-1.49 -> 1.27-1.29 one-token steps, the one-token step unchanged (docs/journal.md, 2026-12-08). Prefetching
// changes no arithmetic.
constexpr int64_t PREFETCH_BYTES = 2048;

}  // namespace lookahead
