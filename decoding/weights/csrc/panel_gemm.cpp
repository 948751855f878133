// Small-batch float32 matrix product over a weight stored as column panels, for AVX2 + FMA or AVX-512 CPUs.
//
// y[m, n] = sum_k x[m, k] * W[n, k], with W packed as panels of L output columns (L = one vector register of
// float32: 8 for AVX2, 16 for AVX-512): panel p holds W[L p .. L p + L - 1, k] for k = 0 .. K-1, contiguous
// ([N / L][K][L]). Every output element is one FMA chain over k = 0 .. K-1 in order, whatever the number of
// rows, whichever tile computes it and whatever the vector width: a row's result is the same bit for bit
// whether it is computed alone or with other rows, and the same from either kernel. The weight streams from
// memory once whatever the number of rows. Threads: the panels are cut into ranges of whole tiles, each run by one
// thread of the pool (thread_pool.h), so the bits do not depend on the thread count either.
//
// The file is compiled twice into one library: as is (AVX2, ``panel_gemm``) and with -DPANEL_WIDE -mavx512f
// (AVX-512, ``panel_gemm_wide``). A tile is R rows x P panels of accumulators, held in named variables (GCC keeps
// an array of vectors on the stack and stores it every iteration): R * P <= 12 of AVX2's 16 registers, <= 24 of
// AVX-512's 32.
#include <immintrin.h>
#include <cstdint>

#include "prefetch.h"
#include "thread_pool.h"

namespace {

using lookahead::PREFETCH_BYTES;  // prefetch.h

#ifdef PANEL_WIDE
using Vec = __m512;
constexpr int64_t LANES = 16;
constexpr int BAND_ROWS = 8;  // rows per tile in a band: 8 x 3 accumulators + 3 weights + 1 broadcast
constexpr int64_t K_BLOCK = 64;  // 3 panels x 64 x 64 bytes = 12 KiB of L1 (16 rows: 0.97x the time at 32)
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VBROADCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ENTRY panel_gemm_wide
#else
using Vec = __m256;
constexpr int64_t LANES = 8;
constexpr int BAND_ROWS = 4;  // rows per tile in a band: 4 x 3 accumulators + 3 weights + 1 broadcast
constexpr int64_t K_BLOCK = 32;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VBROADCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ENTRY panel_gemm
#endif

#define PANELS(r, OP) OP(r, 0) OP(r, 1) OP(r, 2) OP(r, 3)
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define DECLARE(r, p) Vec a##r##p = VZERO();
#define DECLARE_ROW(r) PANELS(r, DECLARE) const float* x##r = x + (row0 + (r < R ? r : 0)) * K;
#define LOAD(r, p) if constexpr (P > p) a##r##p = VLOAD(y + (row0 + r) * N + (panel0 + p) * LANES);
#define LOAD_ROW(r) if constexpr (R > r) { PANELS(r, LOAD) }
#define FMA(r, p) if constexpr (P > p) a##r##p = VFMA(xk, w##p, a##r##p);
#define FMA_ROW(r) if constexpr (R > r) { const Vec xk = VBROADCAST(x##r + k); PANELS(r, FMA) }
#define STORE(r, p) if constexpr (P > p) VSTORE(y + (row0 + r) * N + (panel0 + p) * LANES, a##r##p);
#define STORE_ROW(r) if constexpr (R > r) { PANELS(r, STORE) }

// Rows [row0, row0 + R) x panels [panel0, panel0 + P) over k in [k0, k1). The accumulators start from zero at
// k0 = 0 and from the partial sums stored in y otherwise: a float32 stored and loaded back is the same value,
// so a chain cut into blocks of k is the same FMA chain as one unbroken pass.
template <int R, int P>
void tile(const float* x, int64_t K, const float* panels, int64_t N, int64_t row0, int64_t panel0, int64_t k0,
          int64_t k1, float* y) {
    static_assert(R >= 1 && R <= 8 && P >= 1 && P <= 4, "tile shape");
    ROWS(DECLARE_ROW)
    if (k0 > 0) { ROWS(LOAD_ROW) }
    const float* base = panels + panel0 * K * LANES;
    for (int64_t k = k0; k < k1; ++k) {
        const float* wk = base + k * LANES;
        for (int p = 0; p < P; ++p) {
            _mm_prefetch(reinterpret_cast<const char*>(wk + p * K * LANES) + PREFETCH_BYTES, _MM_HINT_T0);
        }
        const Vec w0 = VLOAD(wk);
        const Vec w1 = P > 1 ? VLOAD(wk + K * LANES) : w0;
        const Vec w2 = P > 2 ? VLOAD(wk + 2 * K * LANES) : w0;
        const Vec w3 = P > 3 ? VLOAD(wk + 3 * K * LANES) : w0;
        ROWS(FMA_ROW)
    }
    ROWS(STORE_ROW)
}

// 1-3 rows against panels [first, last), P panels at a time and the remainder one by one: the product is bound by
// streaming the weight, which each tile reads once.
template <int R, int P>
void few_rows(const float* x, int64_t K, const float* panels, int64_t N, int64_t first, int64_t last, float* y) {
    int64_t p = first;
    for (; p + P <= last; p += P) tile<R, P>(x, K, panels, N, 0, p, 0, K, y);
    for (; p < last; ++p) tile<R, 1>(x, K, panels, N, 0, p, 0, K, y);
}

// Rows [row0, row0 + rows) (rows < BAND_ROWS) against panels [panel0, panel0 + P) over k in [k0, k1).
template <int P>
void band_rest(const float* x, int64_t rows, int64_t K, const float* panels, int64_t N, int64_t row0,
               int64_t panel0, int64_t k0, int64_t k1, float* y) {
    switch (rows) {
        case 1: tile<1, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        case 2: tile<2, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        case 3: tile<3, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        case 4: tile<4, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        case 5: tile<5, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        case 6: tile<6, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        case 7: tile<7, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
        default: break;
    }
}

// Every row against panels [panel0, panel0 + P), in blocks of K_BLOCK input features: a block of the P panels
// (3 x K_BLOCK x 4 x LANES bytes) comes from memory once and stays in L1 while every group of BAND_ROWS rows
// uses it. The weight thus streams once whatever the number of rows, and the FMAs of all the rows run while it
// streams (without the blocks, later rows would re-read each band from L2 after the first group had waited on
// memory: on AVX2, 16 rows cost 2.5x one row, against 1.6x blocked).
template <int P>
void band(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, int64_t panel0, float* y) {
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
        int64_t row0 = 0;
        for (; row0 + BAND_ROWS <= M; row0 += BAND_ROWS) tile<BAND_ROWS, P>(x, K, panels, N, row0, panel0, k0, k1, y);
        band_rest<P>(x, M - row0, K, panels, N, row0, panel0, k0, k1, y);
    }
}

constexpr int FEW_PANELS = 4;  // panels per tile for 1-3 rows
constexpr int BAND_PANELS = 3;  // for more

// Every row against panels [first, last) (``first`` a multiple of the call's panels per tile).
void product(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, int64_t first, int64_t last,
             float* y) {
    switch (M) {
        case 1: few_rows<1, FEW_PANELS>(x, K, panels, N, first, last, y); return;
        case 2: few_rows<2, FEW_PANELS>(x, K, panels, N, first, last, y); return;
        case 3: few_rows<3, FEW_PANELS>(x, K, panels, N, first, last, y); return;
        default: break;
    }
    int64_t p = first;
    for (; p + BAND_PANELS <= last; p += BAND_PANELS) band<BAND_PANELS>(x, M, K, panels, N, p, y);
    for (; p < last; ++p) band<1>(x, M, K, panels, N, p, y);
}

}  // namespace

extern "C" {

// x: [M, K] row-major; panels: [N / LANES][K][LANES]; y: [M, N] row-major. N must be a multiple of LANES. The
// panels are cut into ranges of whole tiles run on the thread pool (thread_pool.h).
void ENTRY(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y) {
    lookahead::parallel_ranges(N / LANES, M <= 3 ? FEW_PANELS : BAND_PANELS, M * N * K,
                               [&](int64_t first, int64_t last) { product(x, M, K, panels, N, first, last, y); });
}

}
