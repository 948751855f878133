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
// The file is compiled twice into the panel kernel's library, as panel_gemm.cpp is: ``quant_gemm`` (AVX2) and,
// with -DPANEL_WIDE -mavx512f, ``quant_gemm_wide``. A tile keeps R x P block sums and R x P accumulators in
// named registers (macros, as panel_gemm.cpp does).
#include <immintrin.h>
#include <cstdint>
#include <vector>

namespace {

enum Kind : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int64_t QK = 32;  // k per block
constexpr int64_t CHUNK_ROWS = 128;  // rows per pass over the weight

#ifdef PANEL_WIDE
using Vec = __m512;
using Ints = __m512i;
constexpr int64_t LANES = 16;
constexpr int BAND_ROWS = 8;  // a band's tile: 8 rows x 1 panel, 16 accumulators and sums of 32 registers
constexpr int BAND_PANELS = 1;
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
constexpr int BAND_ROWS = 6;  // a band's tile: 6 rows x 1 panel, 12 accumulators and sums of 16 registers
constexpr int BAND_PANELS = 1;
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

// Panels per tile for R rows when they all fit one tile (R <= FEW_ROWS): as many as the registers hold
// (R x P sums and R x P accumulators, P weights).
constexpr int few_panels(int rows) {
#ifdef PANEL_WIDE
    return rows <= 3 ? 4 : rows == 4 ? 3 : rows <= 6 ? 2 : 1;
#else
    return rows == 1 ? 4 : rows <= 3 ? 2 : 1;
#endif
}

#define PANELS(r, OP) OP(r, 0) OP(r, 1) OP(r, 2) OP(r, 3)
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define DECLARE(r, p) Vec a##r##p = VZERO(); Vec s##r##p = VZERO();
#define DECLARE_ROW(r) PANELS(r, DECLARE)
#define LOAD(r, p) if constexpr (P > p) a##r##p = VLOAD(y + (row0 + r) * N + (panel0 + p) * LANES);
#define LOAD_ROW(r) if constexpr (R > r) { PANELS(r, LOAD) }
#define RESET(r, p) if constexpr (P > p) s##r##p = VZERO();
#define RESET_ROW(r) if constexpr (R > r) { PANELS(r, RESET) }
#define FMA(r, p) if constexpr (P > p) s##r##p = VFMA(xk, w##p, s##r##p);
#define FMA_ROW(r) if constexpr (R > r) { const Vec xk = VSET1(xs[r]); PANELS(r, FMA) }
#define SCALE(r, p)                                                                                      \
    if constexpr (P > p) {                                                                               \
        a##r##p = VFMA(s##r##p, d##p, a##r##p);                                                          \
        if constexpr (KIND != Q8_0) a##r##p = VFMA(VSET1(ts[r]), m##p, a##r##p);                         \
    }
#define SCALE_ROW(r) if constexpr (R > r) { PANELS(r, SCALE) }
#define STORE(r, p) if constexpr (P > p) VSTORE(y + (row0 + r) * N + (panel0 + p) * LANES, a##r##p);
#define STORE_ROW(r) if constexpr (R > r) { PANELS(r, STORE) }
#define BLOCK_OF(p) (P > p ? base + (p) * blocks * F::BLOCK_BYTES + b * F::BLOCK_BYTES : base + b * F::BLOCK_BYTES)

// The rows of a call, transposed so that a tile finds its rows' values side by side: ``x`` [K][M] (M rows of the
// chunk) and ``sums`` [K / 32][M], each row's sum of x over each block of 32 k.
struct Rows {
    const float* x;
    const float* sums;
    int64_t M;
    int64_t K;
};

// Rows [row0, row0 + R) x panels [panel0, panel0 + P) over blocks [b0, b1). The accumulators start from zero at
// b0 = 0 and from the partial sums stored in y otherwise (a float32 stored and loaded back is the same value).
template <int KIND, int R, int P>
void tile(const Rows& rows, const uint8_t* panels, int64_t N, int64_t row0, int64_t panel0, int64_t b0, int64_t b1,
          float* y) {
    static_assert(R >= 1 && R <= 8 && P >= 1 && P <= 4, "tile shape");
    using F = Format<KIND>;
    const int64_t blocks = rows.K / QK, M = rows.M;
    ROWS(DECLARE_ROW)
    if (b0 > 0) { ROWS(LOAD_ROW) }
    const uint8_t* base = panels + panel0 * blocks * F::BLOCK_BYTES;
    for (int64_t b = b0; b < b1; ++b) {
        ROWS(RESET_ROW)
        const uint8_t* q0 = BLOCK_OF(0) + F::SCALE_BYTES;
        const uint8_t* q1 = BLOCK_OF(1) + F::SCALE_BYTES;
        const uint8_t* q2 = BLOCK_OF(2) + F::SCALE_BYTES;
        const uint8_t* q3 = BLOCK_OF(3) + F::SCALE_BYTES;
        const float* xb = rows.x + b * QK * M + row0;
        if constexpr (KIND == Q8_0) {
            for (int64_t i = 0; i < QK; ++i) {
                const float* xs = xb + i * M;
                const Vec w0 = TO_FLOAT(SIGNED_BYTES(q0 + i * LANES));
                const Vec w1 = P > 1 ? TO_FLOAT(SIGNED_BYTES(q1 + i * LANES)) : w0;
                const Vec w2 = P > 2 ? TO_FLOAT(SIGNED_BYTES(q2 + i * LANES)) : w0;
                const Vec w3 = P > 3 ? TO_FLOAT(SIGNED_BYTES(q3 + i * LANES)) : w0;
                ROWS(FMA_ROW)
            }
        } else {
            for (int64_t j = 0; j < QK / 2; ++j) {
                const Ints e0 = UNSIGNED_BYTES(q0 + j * LANES);
                const Ints e1 = P > 1 ? UNSIGNED_BYTES(q1 + j * LANES) : e0;
                const Ints e2 = P > 2 ? UNSIGNED_BYTES(q2 + j * LANES) : e0;
                const Ints e3 = P > 3 ? UNSIGNED_BYTES(q3 + j * LANES) : e0;
                {
                    const float* xs = xb + 2 * j * M;
                    const Vec w0 = LOW_NIBBLES(e0), w1 = LOW_NIBBLES(e1), w2 = LOW_NIBBLES(e2), w3 = LOW_NIBBLES(e3);
                    ROWS(FMA_ROW)
                }
                {
                    const float* xs = xb + (2 * j + 1) * M;
                    const Vec w0 = HIGH_NIBBLES(e0), w1 = HIGH_NIBBLES(e1), w2 = HIGH_NIBBLES(e2),
                              w3 = HIGH_NIBBLES(e3);
                    ROWS(FMA_ROW)
                }
            }
        }
        const Vec d0 = HALVES(BLOCK_OF(0)), d1 = HALVES(BLOCK_OF(1)), d2 = HALVES(BLOCK_OF(2)),
                  d3 = HALVES(BLOCK_OF(3));
        Vec m0 = d0, m1 = d1, m2 = d2, m3 = d3;
        if constexpr (KIND == Q4_0) {
            const Vec eight = VSET1(-8.0f);
            m0 = VMUL(d0, eight), m1 = VMUL(d1, eight), m2 = VMUL(d2, eight), m3 = VMUL(d3, eight);
        } else if constexpr (KIND == Q4_1) {
            m0 = HALVES(BLOCK_OF(0) + 2 * LANES), m1 = HALVES(BLOCK_OF(1) + 2 * LANES);
            m2 = HALVES(BLOCK_OF(2) + 2 * LANES), m3 = HALVES(BLOCK_OF(3) + 2 * LANES);
        }
        const float* ts = rows.sums + b * M + row0;
        ROWS(SCALE_ROW)
    }
    ROWS(STORE_ROW)
}

// R <= FEW_ROWS rows against every panel over the whole of K, P panels a tile: the weight streams once, bound by
// memory.
template <int KIND, int R>
void few_rows(const Rows& rows, const uint8_t* panels, int64_t N, float* y) {
    constexpr int P = few_panels(R);
    const int64_t count = N / LANES, blocks = rows.K / QK;
    int64_t p = 0;
    for (; p + P <= count; p += P) tile<KIND, R, P>(rows, panels, N, 0, p, 0, blocks, y);
    for (; p < count; ++p) tile<KIND, R, 1>(rows, panels, N, 0, p, 0, blocks, y);
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

template <int KIND>
void product(const Rows& rows, const uint8_t* panels, int64_t N, float* y) {
    switch (rows.M) {
        case 1: few_rows<KIND, 1>(rows, panels, N, y); return;
        case 2: few_rows<KIND, 2>(rows, panels, N, y); return;
        case 3: few_rows<KIND, 3>(rows, panels, N, y); return;
        case 4: few_rows<KIND, 4>(rows, panels, N, y); return;
        case 5: few_rows<KIND, 5>(rows, panels, N, y); return;
        case 6: few_rows<KIND, 6>(rows, panels, N, y); return;
        case 7: few_rows<KIND, 7>(rows, panels, N, y); return;
        case 8: few_rows<KIND, 8>(rows, panels, N, y); return;
        default: break;
    }
    const int64_t count = N / LANES;
    int64_t p = 0;
    for (; p + BAND_PANELS <= count; p += BAND_PANELS) band<KIND, BAND_PANELS>(rows, panels, N, p, y);
    for (; p < count; ++p) band<KIND, 1>(rows, panels, N, p, y);
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
        switch (kind) {
            case Q4_0: product<Q4_0>(rows, panels, N, ys); break;
            case Q4_1: product<Q4_1>(rows, panels, N, ys); break;
            default: product<Q8_0>(rows, panels, N, ys); break;
        }
    }
    return 0;
}

}
