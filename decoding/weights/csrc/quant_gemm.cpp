// Small-batch product over GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) stored as column panels, for AVX2 +
// FMA + F16C or AVX-512 CPUs: the weights stay quantized in memory and are de-quantized in registers.
//
// y[m, n] = sum_k x[m, k] * W[n, k]. W's GGUF blocks (32 consecutive k of one output column n, a float16 scale d,
// a float16 minimum m for Q4_1, 32 quants q) are repacked into panels of L output columns (L = 8 for AVX2, 16 for
// AVX-512): panel p, block b holds, contiguous, the L scales d (float16), the L minima m (Q4_1 only), then the
// quants of the block's 32 k, k after k, each k's L columns side by side: one byte per column for Q8_0 (int8), or
// for Q4_0 / Q4_1 one byte per column per pair of k (k = 2j in the low nibble, 2j + 1 in the high one). Layout
// [N / L][K / 32][block bytes]. The weight is w = d * q + m (Q4_1), d * (q - 8) (Q4_0), d * q (Q8_0), so a block
// contributes d * sum_k x[k] q[k] + m * sum_k x[k] (m = -8 d for Q4_0, no m for Q8_0): each output element is,
// block after block, one FMA chain over the block's 32 k in order from zero, then acc = fma(s, d, acc), then
// acc = fma(sum of the row's 32 x, m, acc). The row sums are summed in order by scalar code. Every output element
// is thus the same sequence of float32 operations whatever the number of rows, the tile that computes it and the
// vector width: a row's result is the same bit for bit alone or with other rows, and from either entry. The
// weight streams from memory once per call for every 128 rows (rows are taken 128 at a time).
//
// Threads: the panels are cut into ranges of whole tiles, each range run by one thread of the pool (thread_pool.h),
// so each output element is still one thread's chain and the bits do not depend on the thread count; the rows are
// transposed by the calling thread first. A small product runs on the calling thread alone.
//
// The file is compiled twice into the panel kernel's library, as panel_gemm.cpp is: ``quant_gemm`` (AVX2) and,
// with -DPANEL_WIDE -mavx512f, ``quant_gemm_wide``. A tile keeps R x P block sums in
// named registers (macros, as panel_gemm.cpp does); the accumulators wait in y between blocks.
#include <immintrin.h>
#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace {

enum Kind : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int64_t QK = 32;  // k per block
constexpr int64_t CHUNK_ROWS = 128;  // rows per pass over the weight

#ifdef PANEL_WIDE
using Vec = __m512;
using Ints = __m512i;
constexpr int64_t LANES = 16;
constexpr int BAND_ROWS = 8;  // a band's tile: 8 rows x 3 panels, 24 block sums of 32 registers
constexpr int BAND_PANELS = 3;
constexpr int64_t K_BLOCKS = 4;  // blocks of 32 k per band pass: 4 x 320 bytes of Q4_1 stay in L1
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(v) _mm512_set1_ps(v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
#define UNSIGNED_BYTES(p) _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define SIGNED_BYTES(p) _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define LOW_NIBBLES(v) _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)))
#define HIGH_NIBBLES(v) _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4))
#define TO_FLOAT(v) _mm512_cvtepi32_ps(v)
#define ENTRY quant_gemm_wide
#else
using Vec = __m256;
using Ints = __m256i;
constexpr int64_t LANES = 8;
constexpr int BAND_ROWS = 6;  // a band's tile: 6 rows x 2 panels, 12 block sums of 16 registers
constexpr int BAND_PANELS = 2;
constexpr int64_t K_BLOCKS = 4;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(v) _mm256_set1_ps(v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define UNSIGNED_BYTES(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))
#define SIGNED_BYTES(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))
#define LOW_NIBBLES(v) _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)))
#define HIGH_NIBBLES(v) _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4))
#define TO_FLOAT(v) _mm256_cvtepi32_ps(v)
#define ENTRY quant_gemm
#endif

template <int KIND>
struct Format {
    static constexpr int64_t SCALE_BYTES = (KIND == Q4_1 ? 4 : 2) * LANES;  // d (and m): float16 per column
    static constexpr int64_t QUANT_BYTES = (KIND == Q8_0 ? QK : QK / 2) * LANES;
    static constexpr int64_t BLOCK_BYTES = SCALE_BYTES + QUANT_BYTES;
};

// Panels per tile for R rows when they all fit one tile (R <= 8): R x P block sums in registers, each an FMA chain
// of its own, enough of them (8+ on AVX-512's two FMA units of latency 4) to keep the units busy, plus P weights.
constexpr int few_panels(int rows) {
#ifdef PANEL_WIDE
    return rows <= 2 ? 8 : rows == 3 ? 6 : rows <= 6 ? 4 : 3;
#else
    return rows == 1 ? 6 : rows == 2 ? 4 : rows == 3 ? 3 : rows <= 6 ? 2 : 1;
#endif
}

#define PANELS(r, OP) OP(r, 0) OP(r, 1) OP(r, 2) OP(r, 3) OP(r, 4) OP(r, 5) OP(r, 6) OP(r, 7)
#define EACH_PANEL(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define DECLARE(r, p) Vec s##r##p = VZERO();
#define DECLARE_ROW(r) PANELS(r, DECLARE)
#define RESET(r, p) if constexpr (P > p) s##r##p = VZERO();
#define RESET_ROW(r) if constexpr (R > r) { PANELS(r, RESET) }
#define FMA(r, p) if constexpr (P > p) s##r##p = VFMA(xk, w##p, s##r##p);
#define FMA_ROW(r) if constexpr (R > r) { const Vec xk = VSET1(xs[r]); PANELS(r, FMA) }
#define QUANTS(p) const uint8_t* q##p = BLOCK_OF(p) + F::SCALE_BYTES;
#define WIDE_BYTES(p) const Vec w##p = P > p ? TO_FLOAT(SIGNED_BYTES(q##p + i * LANES)) : VZERO();
#define NIBBLE_BYTES(p) const Ints e##p = P > p ? UNSIGNED_BYTES(q##p + j * LANES) : e0;
#define LOWS(p) const Vec w##p = P > p ? LOW_NIBBLES(e##p) : VZERO();
#define HIGHS(p) const Vec w##p = P > p ? HIGH_NIBBLES(e##p) : VZERO();
// acc = fma(s, d, acc), then acc = fma(sum of the row's x over the block, m, acc), the accumulator in y (zero at the
// first block): a float32 stored and loaded back is the same value, so each element is one chain over the blocks.
#define SCALE(r, p)                                                                                      \
    if constexpr (R > r) {                                                                               \
        float* out = y + (row0 + r) * N + (panel0 + p) * LANES;                                          \
        Vec acc = VFMA(s##r##p, d, b == 0 ? VZERO() : VLOAD(out));                                       \
        if constexpr (KIND != Q8_0) acc = VFMA(VSET1(ts[r]), m, acc);                                    \
        VSTORE(out, acc);                                                                                \
    }
#define SCALE_PANEL(p)                                                                                   \
    if constexpr (P > p) {                                                                               \
        const Vec d = HALVES(BLOCK_OF(p));                                                               \
        Vec m = d;                                                                                       \
        if constexpr (KIND == Q4_0) m = VMUL(d, VSET1(-8.0f));                                           \
        if constexpr (KIND == Q4_1) m = HALVES(BLOCK_OF(p) + 2 * LANES);                                 \
        ROWS_OF_PANEL(p)                                                                                 \
    }
#define ROWS_OF_PANEL(p) SCALE(0, p) SCALE(1, p) SCALE(2, p) SCALE(3, p) SCALE(4, p) SCALE(5, p) SCALE(6, p) SCALE(7, p)
#define BLOCK_OF(p) (P > p ? base + (p) * blocks * F::BLOCK_BYTES + b * F::BLOCK_BYTES : base + b * F::BLOCK_BYTES)

// The rows of a call, transposed so that a tile finds its rows' values side by side: ``x`` [K][M] (M rows of the
// chunk) and ``sums`` [K / 32][M], each row's sum of x over each block of 32 k.
struct Rows {
    const float* x;
    const float* sums;
    int64_t M;
    int64_t K;
};

// Rows [row0, row0 + R) x panels [panel0, panel0 + P) over blocks [b0, b1), the accumulators in y (see SCALE).
template <int KIND, int R, int P>
void tile(const Rows& rows, const uint8_t* panels, int64_t N, int64_t row0, int64_t panel0, int64_t b0, int64_t b1,
          float* y) {
    static_assert(R >= 1 && R <= 8 && P >= 1 && P <= 8, "tile shape");
    using F = Format<KIND>;
    const int64_t blocks = rows.K / QK, M = rows.M;
    ROWS(DECLARE_ROW)
    const uint8_t* base = panels + panel0 * blocks * F::BLOCK_BYTES;
    for (int64_t b = b0; b < b1; ++b) {
        ROWS(RESET_ROW)
        EACH_PANEL(QUANTS)
        const float* xb = rows.x + b * QK * M + row0;
        if constexpr (KIND == Q8_0) {
            for (int64_t i = 0; i < QK; ++i) {
                const float* xs = xb + i * M;
                EACH_PANEL(WIDE_BYTES)
                ROWS(FMA_ROW)
            }
        } else {
            for (int64_t j = 0; j < QK / 2; ++j) {
                const Ints e0 = UNSIGNED_BYTES(q0 + j * LANES);
                NIBBLE_BYTES(1) NIBBLE_BYTES(2) NIBBLE_BYTES(3) NIBBLE_BYTES(4) NIBBLE_BYTES(5) NIBBLE_BYTES(6)
                NIBBLE_BYTES(7)
                {
                    const float* xs = xb + 2 * j * M;
                    EACH_PANEL(LOWS)
                    ROWS(FMA_ROW)
                }
                {
                    const float* xs = xb + (2 * j + 1) * M;
                    EACH_PANEL(HIGHS)
                    ROWS(FMA_ROW)
                }
            }
        }
        const float* ts = rows.sums + b * M + row0;
        EACH_PANEL(SCALE_PANEL)
    }
}

// R <= 8 rows against panels [first, last) over the whole of K, P panels a tile: the weight streams once, bound by
// memory.
template <int KIND, int R>
void few_rows(const Rows& rows, const uint8_t* panels, int64_t N, int64_t first, int64_t last, float* y) {
    constexpr int P = few_panels(R);
    const int64_t blocks = rows.K / QK;
    int64_t p = first;
    for (; p + P <= last; p += P) tile<KIND, R, P>(rows, panels, N, 0, p, 0, blocks, y);
    for (; p < last; ++p) tile<KIND, R, 1>(rows, panels, N, 0, p, 0, blocks, y);
}

template <int KIND, int P>
void band_rest(const Rows& rows, int64_t count, const uint8_t* panels, int64_t N, int64_t row0, int64_t panel,
               int64_t b0, int64_t b1, float* y) {
    switch (count) {
        case 1: tile<KIND, 1, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        case 2: tile<KIND, 2, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        case 3: tile<KIND, 3, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        case 4: tile<KIND, 4, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        case 5: tile<KIND, 5, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        case 6: tile<KIND, 6, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        case 7: tile<KIND, 7, P>(rows, panels, N, row0, panel, b0, b1, y); break;
        default: break;
    }
}

// Every row of the chunk against panels [panel, panel + P), K_BLOCKS blocks at a time: that part of the
// panels comes from memory once and stays in L1 while every group of BAND_ROWS rows uses it.
template <int KIND, int P>
void band(const Rows& rows, const uint8_t* panels, int64_t N, int64_t panel, float* y) {
    const int64_t blocks = rows.K / QK;
    for (int64_t b0 = 0; b0 < blocks; b0 += K_BLOCKS) {
        const int64_t b1 = b0 + K_BLOCKS < blocks ? b0 + K_BLOCKS : blocks;
        int64_t row0 = 0;
        for (; row0 + BAND_ROWS <= rows.M; row0 += BAND_ROWS)
            tile<KIND, BAND_ROWS, P>(rows, panels, N, row0, panel, b0, b1, y);
        band_rest<KIND, P>(rows, rows.M - row0, panels, N, row0, panel, b0, b1, y);
    }
}

// Panels per tile of a call of M rows: the unit its panel ranges are cut in, so that each range runs whole tiles.
int64_t tile_panels(int64_t M) { return M <= 8 ? few_panels(static_cast<int>(M)) : BAND_PANELS; }

// Every row of the chunk against panels [first, last) (``first`` a multiple of tile_panels(rows.M)).
template <int KIND>
void product(const Rows& rows, const uint8_t* panels, int64_t N, int64_t first, int64_t last, float* y) {
    switch (rows.M) {
        case 1: few_rows<KIND, 1>(rows, panels, N, first, last, y); return;
        case 2: few_rows<KIND, 2>(rows, panels, N, first, last, y); return;
        case 3: few_rows<KIND, 3>(rows, panels, N, first, last, y); return;
        case 4: few_rows<KIND, 4>(rows, panels, N, first, last, y); return;
        case 5: few_rows<KIND, 5>(rows, panels, N, first, last, y); return;
        case 6: few_rows<KIND, 6>(rows, panels, N, first, last, y); return;
        case 7: few_rows<KIND, 7>(rows, panels, N, first, last, y); return;
        case 8: few_rows<KIND, 8>(rows, panels, N, first, last, y); return;
        default: break;
    }
    int64_t p = first;
    for (; p + BAND_PANELS <= last; p += BAND_PANELS) band<KIND, BAND_PANELS>(rows, panels, N, p, y);
    for (; p < last; ++p) band<KIND, 1>(rows, panels, N, p, y);
}

// Rows [start, start + M) of x [*, K], transposed into xt [K][M], and their block sums [K / 32][M], each summed in
// order (the same bits on either entry).
void transpose_rows(const float* x, int64_t M, int64_t K, float* xt, float* sums) {
    const int64_t blocks = K / QK;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            float total = 0.0f;
            for (int64_t i = 0; i < QK; ++i) {
                const float value = x[r * K + b * QK + i];
                xt[(b * QK + i) * M + r] = value;
                total += value;
            }
            sums[b * M + r] = total;
        }
    }
}

}  // namespace

extern "C" {

// kind: 0 Q4_0, 1 Q4_1, 2 Q8_0. x: [M, K] row-major; panels: [N / LANES][K / 32][block bytes] (see above);
// y: [M, N] row-major. N must be a multiple of LANES and K of 32. Returns 0, or -1 on an unknown kind.
int ENTRY(int kind, const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t N, float* y) {
    if (kind != Q4_0 && kind != Q4_1 && kind != Q8_0) return -1;
    const int64_t chunk = M < CHUNK_ROWS ? M : CHUNK_ROWS;
    std::vector<float> xt(chunk * K), sums(chunk * (K / QK));
    for (int64_t start = 0; start < M; start += CHUNK_ROWS) {
        const int64_t count = M - start < CHUNK_ROWS ? M - start : CHUNK_ROWS;
        transpose_rows(x + start * K, count, K, xt.data(), sums.data());
        const Rows rows{xt.data(), sums.data(), count, K};
        float* ys = y + start * N;
        lookahead::parallel_ranges(N / LANES, tile_panels(count), count * N * K, [&](int64_t first, int64_t last) {
            switch (kind) {
                case Q4_0: product<Q4_0>(rows, panels, N, first, last, ys); break;
                case Q4_1: product<Q4_1>(rows, panels, N, first, last, ys); break;
                default: product<Q8_0>(rows, panels, N, first, last, ys); break;
            }
        });
    }
    return 0;
}

}
