// Small-batch float32 matrix product over a weight stored as column panels, for AVX2 + FMA CPUs.
//
// y[m, n] = sum_k x[m, k] * W[n, k], with W packed as panels of 8 output columns: panel p holds
// W[8p .. 8p+7, k] for k = 0 .. K-1, contiguous ([N / 8][K][8]). Every output element is one FMA chain over
// k = 0 .. K-1 in order, whatever the number of rows and whichever tile computes it: a row's result is the
// same bit for bit whether it is computed alone or with other rows. The weight streams from memory once
// whatever the number of rows.
//
// A tile is R rows x P panels of accumulators (R * P <= 12 of AVX2's 16 registers). The accumulators are
// named variables, not an array: GCC keeps an array of vectors on the stack and stores it every iteration.
#include <immintrin.h>
#include <cstdint>

namespace {

#define PANELS(r, OP) OP(r, 0) OP(r, 1) OP(r, 2) OP(r, 3)
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3)
#define DECLARE(r, p) __m256 a##r##p = _mm256_setzero_ps();
#define DECLARE_ROW(r) PANELS(r, DECLARE) const float* x##r = x + (row0 + (r < R ? r : 0)) * K;
#define LOAD(r, p) if constexpr (P > p) a##r##p = _mm256_loadu_ps(y + (row0 + r) * N + (panel0 + p) * 8);
#define LOAD_ROW(r) if constexpr (R > r) { PANELS(r, LOAD) }
#define FMA(r, p) if constexpr (P > p) a##r##p = _mm256_fmadd_ps(xk, w##p, a##r##p);
#define FMA_ROW(r) if constexpr (R > r) { const __m256 xk = _mm256_broadcast_ss(x##r + k); PANELS(r, FMA) }
#define STORE(r, p) if constexpr (P > p) _mm256_storeu_ps(y + (row0 + r) * N + (panel0 + p) * 8, a##r##p);
#define STORE_ROW(r) if constexpr (R > r) { PANELS(r, STORE) }

// Rows [row0, row0 + R) x panels [panel0, panel0 + P) over k in [k0, k1). The accumulators start from zero at
// k0 = 0 and from the partial sums stored in y otherwise: a float32 stored and loaded back is the same value,
// so a chain cut into blocks of k is the same FMA chain as one unbroken pass.
template <int R, int P>
void tile(const float* x, int64_t K, const float* panels, int64_t N, int64_t row0, int64_t panel0, int64_t k0,
          int64_t k1, float* y) {
    ROWS(DECLARE_ROW)
    if (k0 > 0) { ROWS(LOAD_ROW) }
    const float* base = panels + panel0 * K * 8;
    for (int64_t k = k0; k < k1; ++k) {
        const float* wk = base + k * 8;
        const __m256 w0 = _mm256_loadu_ps(wk);
        const __m256 w1 = P > 1 ? _mm256_loadu_ps(wk + K * 8) : w0;
        const __m256 w2 = P > 2 ? _mm256_loadu_ps(wk + 2 * K * 8) : w0;
        const __m256 w3 = P > 3 ? _mm256_loadu_ps(wk + 3 * K * 8) : w0;
        ROWS(FMA_ROW)
    }
    ROWS(STORE_ROW)
}

// 1-3 rows against every panel, P panels at a time and the remainder one by one: the product is bound by
// streaming the weight, which each tile reads once.
template <int R, int P>
void few_rows(const float* x, int64_t K, const float* panels, int64_t N, float* y) {
    const int64_t count = N / 8;
    int64_t p = 0;
    for (; p + P <= count; p += P) tile<R, P>(x, K, panels, N, 0, p, 0, K, y);
    for (; p < count; ++p) tile<R, 1>(x, K, panels, N, 0, p, 0, K, y);
}

constexpr int64_t K_BLOCK = 32;

// Every row against panels [panel0, panel0 + P), in blocks of K_BLOCK input features: a block of the P panels
// (at most 3 x K_BLOCK x 32 bytes) comes from memory once and stays in L1 while every group of four rows uses
// it. The weight thus streams once whatever the number of rows, and the FMAs of all the rows run while it
// streams (without the blocks, rows 5 and up would re-read each band from L2 after the first four had waited
// on memory: 16 rows cost 2.5x one row, against 1.6x blocked).
template <int P>
void band(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, int64_t panel0, float* y) {
    for (int64_t k0 = 0; k0 < K; k0 += K_BLOCK) {
        const int64_t k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
        int64_t row0 = 0;
        for (; row0 + 4 <= M; row0 += 4) tile<4, P>(x, K, panels, N, row0, panel0, k0, k1, y);
        switch (M - row0) {
            case 1: tile<1, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
            case 2: tile<2, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
            case 3: tile<3, P>(x, K, panels, N, row0, panel0, k0, k1, y); break;
            default: break;
        }
    }
}

}  // namespace

extern "C" {

// x: [M, K] row-major; panels: [N / 8][K][8]; y: [M, N] row-major. N must be a multiple of 8.
void panel_gemm(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y) {
    switch (M) {
        case 1: few_rows<1, 4>(x, K, panels, N, y); return;
        case 2: few_rows<2, 4>(x, K, panels, N, y); return;
        case 3: few_rows<3, 4>(x, K, panels, N, y); return;
        default: break;
    }
    const int64_t count = N / 8;
    int64_t p = 0;
    for (; p + 3 <= count; p += 3) band<3>(x, M, K, panels, N, p, y);
    for (; p < count; ++p) band<1>(x, M, K, panels, N, p, y);
}

}
