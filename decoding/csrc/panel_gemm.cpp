// Small-batch float32 matrix product over a weight stored as column panels, for AVX2 + FMA CPUs.
//
// y[m, n] = sum_k x[m, k] * W[n, k], with W packed as panels of 8 output columns: panel p holds
// W[8p .. 8p+7, k] for k = 0 .. K-1, contiguous ([N / 8][K][8]). Every output element is one FMA chain over
// k = 0 .. K-1 in order, whatever the number of rows and whichever tile computes it: a row's result is the
// same bit for bit whether it is computed alone or with other rows. The weight streams once per group of at
// most 8 rows, so a product over 2..8 rows reads as much memory as a product over one row.
//
// A tile is R rows x P panels of accumulators (R * P <= 12 of AVX2's 16 registers). The accumulators are
// named variables, not an array: GCC keeps an array of vectors on the stack and stores it every iteration.
#include <immintrin.h>
#include <cstdint>

namespace {

#define PANELS(r, OP) OP(r, 0) OP(r, 1) OP(r, 2) OP(r, 3)
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define DECLARE(r, p) __m256 a##r##p = _mm256_setzero_ps();
#define DECLARE_ROW(r) PANELS(r, DECLARE) const float* x##r = x + (row0 + (r < R ? r : 0)) * K;
#define FMA(r, p) if constexpr (P > p) a##r##p = _mm256_fmadd_ps(xk, w##p, a##r##p);
#define FMA_ROW(r) if constexpr (R > r) { const __m256 xk = _mm256_broadcast_ss(x##r + k); PANELS(r, FMA) }
#define STORE(r, p) if constexpr (P > p) _mm256_storeu_ps(y + (row0 + r) * N + (panel0 + p) * 8, a##r##p);
#define STORE_ROW(r) if constexpr (R > r) { PANELS(r, STORE) }

template <int R, int P>
void tile(const float* x, int64_t K, const float* panels, int64_t N, int64_t row0, int64_t panel0, float* y) {
    ROWS(DECLARE_ROW)
    const float* base = panels + panel0 * K * 8;
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = base + k * 8;
        const __m256 w0 = _mm256_loadu_ps(wk);
        const __m256 w1 = P > 1 ? _mm256_loadu_ps(wk + K * 8) : w0;
        const __m256 w2 = P > 2 ? _mm256_loadu_ps(wk + 2 * K * 8) : w0;
        const __m256 w3 = P > 3 ? _mm256_loadu_ps(wk + 3 * K * 8) : w0;
        ROWS(FMA_ROW)
    }
    ROWS(STORE_ROW)
}

// All panels for rows [row0, row0 + R): P panels at a time, the remainder one by one.
template <int R, int P>
void rows(const float* x, int64_t K, const float* panels, int64_t N, int64_t row0, float* y) {
    const int64_t count = N / 8;
    int64_t p = 0;
    for (; p + P <= count; p += P) tile<R, P>(x, K, panels, N, row0, p, y);
    for (; p < count; ++p) tile<R, 1>(x, K, panels, N, row0, p, y);
}

void group(const float* x, int64_t K, const float* panels, int64_t N, int64_t row0, int64_t r, float* y) {
    switch (r) {
        case 1: rows<1, 4>(x, K, panels, N, row0, y); break;
        case 2: rows<2, 4>(x, K, panels, N, row0, y); break;
        case 3: rows<3, 4>(x, K, panels, N, row0, y); break;
        case 4: rows<4, 3>(x, K, panels, N, row0, y); break;
        case 5: rows<5, 2>(x, K, panels, N, row0, y); break;
        case 6: rows<6, 2>(x, K, panels, N, row0, y); break;
        case 7: rows<7, 1>(x, K, panels, N, row0, y); break;
        default: rows<8, 1>(x, K, panels, N, row0, y); break;
    }
}

}  // namespace

extern "C" {

// x: [M, K] row-major; panels: [N / 8][K][8]; y: [M, N] row-major. N must be a multiple of 8.
void panel_gemm(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y) {
    for (int64_t row0 = 0; row0 < M; row0 += 8) {
        const int64_t r = M - row0 < 8 ? M - row0 : 8;
        group(x, K, panels, N, row0, r, y);
    }
}

}
