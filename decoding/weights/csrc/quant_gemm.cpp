// Small-batch product over GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) stored as column panels, the rows
// rounded to 8 bits a block at a time, for AVX2 + FMA + F16C or AVX-512 (F, BW, VNNI) CPUs: integer dot products
// over each block, the scales applied in float32 once a block.
//
// y[m, n] = sum_k x'[m, k] * W[n, k], where x' is x rounded block by block the way llama.cpp rounds a product's
// activations: each row's 32 consecutive k share a scale e = max |x| / 127 and become integers u = round(x / e) in
// [-127, 127] (x' = e * u). W's GGUF blocks (32 consecutive k of one output column n, a float16 scale d, a float16
// minimum m for Q4_1, 32 quants q) are repacked into panels of L output columns (L = 8 for AVX2, 16 for AVX-512):
// panel p, block b holds, contiguous, the L scales d (float16), the L minima m (Q4_1 only), then the quants in
// groups of four k: group g, column c, byte j is the quant of k = 4g + j (Q8_0, int8, plus 128 in the AVX-512
// panels for dpbusd's unsigned operand; 8 groups) or, for Q4_0 / Q4_1, GGUF's own byte 4g + j of the column's block
// (k = 4g + j in the low nibble, 16 + 4g + j in the high one; 4 groups). Layout [N / L][K / 32][block bytes]. A
// lane of a vector holds one column's four k, so one integer dot instruction (AVX-512 VNNI's dpbusd; AVX2's maddubs
// + madd) multiplies and adds four k of L columns.
//
// With w = d q + m (Q4_1), d (q - 8) (Q4_0), d q (Q8_0), a block contributes e * (d * S + m * U) to y, where
// S = sum_k q u and U = sum_k u are exact integers (|S| < 2^16); Q4_0's is e * d * (S - 8 U). Each output element
// is, block after block: t = float(S) * d (Q4_1: t = fma(float(U), m, t)), then acc = fma(t, e, acc) from zero at
// the first block. The integers are exact and the float32 operations are the same on either entry, for any number
// of rows and any tile: a row's result is the same bit for bit alone or with other rows, and from either entry. The
// weight streams from memory once per call for every 128 rows (rows are taken 128 at a time). A row holding an
// infinity or a NaN in a block gets NaN there (its scale is NaN), so a broken activation is not hidden.
//
// Why integers: the float32 kernel this replaced de-quantized each weight to float32 and spent one FMA per weight
// per row; on a 2-core AMD EPYC every row after the first added ~0.23 of a one-token step (a 9-token step cost
// 3.0x). One dpbusd does the multiply-adds of 16 of those FMAs' weights' four k: on one thread there, gate/up
// (3072 x 576) went from 32 to 16 us at one row and from 124 to 47 at eight, down (576 x 1536) from 19 to 8 and 64 to
// 27 (docs/journal.md, 2026-12-07 evening).
//
// Threads: the panels are cut into ranges of whole tiles, each range run by one thread of the pool (thread_pool.h),
// so each output element is still one thread's chain and the bits do not depend on the thread count; the rows are
// rounded by the calling thread first. A small product runs on the calling thread alone.
//
// The file is compiled twice into the panel kernel's library, as panel_gemm.cpp is: ``quant_gemm`` (AVX2) and,
// with -DPANEL_WIDE -mavx512f -mavx512bw -mavx512vnni, ``quant_gemm_wide``. A tile keeps R x P block sums in
// named registers (macros, as panel_gemm.cpp does), and their float32 accumulators; a band's tile over part of K
// leaves its accumulators in y until the next part.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "prefetch.h"
#include "thread_pool.h"

namespace {

enum Kind : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
constexpr int64_t QK = 32;  // k per block
constexpr int64_t GROUP = 4;  // k per integer lane
constexpr int64_t CHUNK_ROWS = 128;  // rows per pass over the weight
using lookahead::PREFETCH_BYTES;  // prefetch.h

#ifdef PANEL_WIDE
using Vec = __m512;
using Ints = __m512i;
constexpr int64_t LANES = 16;
constexpr int BAND_ROWS = 8;  // a band's tile: 8 rows x 1 panel, 8 block sums and 8 accumulators of 32 registers
constexpr int FEW_ROWS = 12;  // up to 12 rows stream the weight once in one tile of 1 panel: 24 of 32 registers
// (a 9-token step, a copy of 8, cost 1.91 one-token steps banded and 1.77 so on the 2-core AMD EPYC)
constexpr int BAND_PANELS = 1;
constexpr int64_t K_BLOCKS = 32;  // blocks of 32 k per band pass: 32 x 544 bytes of Q8_0 (17 KiB) stay in L1
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(v) _mm512_set1_ps(v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
#define TO_FLOAT(v) _mm512_cvtepi32_ps(v)
#define IZERO() _mm512_setzero_si512()
#define ILOAD(p) _mm512_loadu_si512(reinterpret_cast<const void*>(p))
#define ISET1(v) _mm512_set1_epi32(v)
#define IAND(a, b) _mm512_and_si512(a, b)
#define ISHIFT4(v) _mm512_srli_epi16(v, 4)
#define NIBBLE_MASK() _mm512_set1_epi8(15)
#define Q8_OFFSET 1  // Q8_0 quants stored as q + 128: dpbusd multiplies them (unsigned) by the row's (signed)
#define IDOT(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define ENTRY quant_gemm_wide
#define ROWS_ENTRY quant_rows_wide
#else
using Vec = __m256;
using Ints = __m256i;
constexpr int64_t LANES = 8;
constexpr int BAND_ROWS = 6;  // a band's tile: 6 rows x 1 panel, 6 block sums and 6 accumulators of 16 registers
constexpr int FEW_ROWS = 8;  // up to 8 rows stream the weight once in one tile
constexpr int BAND_PANELS = 1;
constexpr int64_t K_BLOCKS = 16;  // 16 x 272 bytes of Q8_0 (4 KiB)
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(v) _mm256_set1_ps(v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
#define TO_FLOAT(v) _mm256_cvtepi32_ps(v)
#define IZERO() _mm256_setzero_si256()
#define ILOAD(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
#define ISET1(v) _mm256_set1_epi32(v)
#define IAND(a, b) _mm256_and_si256(a, b)
#define ISHIFT4(v) _mm256_srli_epi16(v, 4)
#define NIBBLE_MASK() _mm256_set1_epi8(15)
#define Q8_OFFSET 0  // Q8_0 quants stored as q: each row's four k take the weights' signs, the weights' magnitudes
#define ABS8(v) _mm256_abs_epi8(v)
#define SIGN8(x, w) _mm256_sign_epi8(x, w)
// u (0..128) times s (-127..127), pairs summed in 16 bits (at most 2 * 128 * 127 < 2^15: exact), then fours in 32.
#define IDOT(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define ENTRY quant_gemm
#define ROWS_ENTRY quant_rows
#endif

template <int KIND>
struct Format {
    static constexpr int64_t SCALE_BYTES = (KIND == Q4_1 ? 4 : 2) * LANES;  // d (and m): float16 per column
    static constexpr int64_t QUANT_BYTES = (KIND == Q8_0 ? QK : QK / 2) * LANES;
    static constexpr int64_t BLOCK_BYTES = SCALE_BYTES + QUANT_BYTES;
    static constexpr int64_t GROUP_BYTES = GROUP * LANES;  // one vector: four k (or eight, nibbles) of L columns
};

// Panels per tile for R rows when they all fit one tile (R <= FEW_ROWS): R x P integer sums in registers, plus the P
// weights' vectors (two for 4 bits) and the broadcast rows.
constexpr int few_panels(int rows) {
#ifdef PANEL_WIDE
    return rows == 1 ? 6 : rows == 2 ? 4 : rows <= 4 ? 2 : 1;
#else
    return rows == 1 ? 3 : rows == 2 ? 2 : 1;
#endif
}

#define PANELS(r, OP) OP(r, 0) OP(r, 1) OP(r, 2) OP(r, 3) OP(r, 4) OP(r, 5) OP(r, 6) OP(r, 7)
#define EACH_PANEL(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)
#define ROWS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define DECLARE(r, p) Ints s##r##p = IZERO(); Vec acc##r##p = VZERO();
#define LOAD_ACC(r, p) if constexpr (R > r && P > p) acc##r##p = VLOAD(y + (row0 + r) * N + (panel0 + p) * LANES);
#define LOAD_ACC_ROW(r) PANELS(r, LOAD_ACC)
#define STORE_ACC(r, p) if constexpr (R > r && P > p) VSTORE(y + (row0 + r) * N + (panel0 + p) * LANES, acc##r##p);
#define STORE_ACC_ROW(r) PANELS(r, STORE_ACC)
#define DECLARE_ROW(r) PANELS(r, DECLARE)
#define RESET(r, p) if constexpr (P > p) s##r##p = IZERO();
#define RESET_ROW(r) if constexpr (R > r) { PANELS(r, RESET) }
// Each panel's stream asked of memory ``ahead`` bytes past the block being multiplied (the tile's argument).
#define PREFETCH(p)                                                                                      \
    if constexpr (P > p) {                                                                               \
        const char* next = reinterpret_cast<const char*>(BLOCK_OF(p)) + ahead;                           \
        for (int64_t line = 0; line < F::BLOCK_BYTES; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);   \
    }
#define QUANTS(p) const uint8_t* q##p = BLOCK_OF(p) + F::SCALE_BYTES;
// 4 bits: the group's vector, its low nibbles (k = 4g + j) and its high ones (k = 16 + 4g + j).
#define NIBBLES(p)                                                                                       \
    Ints lo##p = IZERO(), hi##p = IZERO();                                                               \
    if constexpr (P > p) {                                                                               \
        const Ints v = ILOAD(q##p + g * F::GROUP_BYTES);                                                 \
        lo##p = IAND(v, mask);                                                                           \
        hi##p = IAND(ISHIFT4(v), mask);                                                                  \
    }
#define DOT4(r, p) if constexpr (P > p) s##r##p = IDOT(IDOT(s##r##p, lo##p, low), hi##p, high);
#define DOT4_ROW(r)                                                                                      \
    if constexpr (R > r) {                                                                               \
        const Ints low = ISET1(lanes_of(xb, r, g)), high = ISET1(lanes_of(xb, r, g + 4));                \
        PANELS(r, DOT4)                                                                                  \
    }
// 8 bits, AVX-512: the group's quants plus 128 (unsigned) times the row's four k, S + 128 U, 128 U taken off in
// SCALE; AVX2: the quants' magnitudes times the row's four k with each weight's sign (maddubs would saturate at
// 2 * 255 * 127).
#if Q8_OFFSET
#define BYTES(p) Ints w##p = IZERO(); if constexpr (P > p) w##p = ILOAD(q##p + g * F::GROUP_BYTES);
#define DOT8(r, p) if constexpr (P > p) s##r##p = IDOT(s##r##p, w##p, row);
#else
#define BYTES(p)                                                                                         \
    Ints w##p = IZERO(), a##p = IZERO();                                                                 \
    if constexpr (P > p) {                                                                               \
        w##p = ILOAD(q##p + g * F::GROUP_BYTES);                                                         \
        a##p = ABS8(w##p);                                                                               \
    }
#define DOT8(r, p) if constexpr (P > p) s##r##p = IDOT(s##r##p, a##p, SIGN8(row, w##p));
#endif
#define DOT8_ROW(r)                                                                                      \
    if constexpr (R > r) {                                                                               \
        const Ints row = ISET1(lanes_of(xb, r, g));                                                      \
        PANELS(r, DOT8)                                                                                  \
    }
// t = float(S) * d (Q4_1: t = fma(float(U), m, t); Q4_0: S - 8 U first), acc = fma(t, e, acc) from zero at the
// first block; a tile over part of K starts from y and leaves its accumulators there: a float32 stored and loaded
// back is the same value, so each element is one chain over the blocks.
#define SCALE(r, p)                                                                                      \
    if constexpr (R > r) {                                                                               \
        Ints sums = s##r##p;                                                                             \
        if constexpr (KIND == Q4_0) sums = ISUB(sums, ISET1(8 * us[r]));                                 \
        if constexpr (KIND == Q8_0 && Q8_OFFSET) sums = ISUB(sums, ISET1(128 * us[r]));                  \
        Vec t = VMUL(TO_FLOAT(sums), d);                                                                 \
        if constexpr (KIND == Q4_1) t = VFMA(VSET1(static_cast<float>(us[r])), m, t);                    \
        acc##r##p = VFMA(t, VSET1(es[r]), acc##r##p);                                                    \
    }
#define SCALE_PANEL(p)                                                                                   \
    if constexpr (P > p) {                                                                               \
        const Vec d = HALVES(BLOCK_OF(p));                                                               \
        Vec m = d;                                                                                       \
        if constexpr (KIND == Q4_1) m = HALVES(BLOCK_OF(p) + 2 * LANES);                                 \
        ROWS_OF_PANEL(p)                                                                                 \
    }
#define ROWS_OF_PANEL(p)                                                                                 \
    SCALE(0, p) SCALE(1, p) SCALE(2, p) SCALE(3, p) SCALE(4, p) SCALE(5, p) SCALE(6, p) SCALE(7, p) SCALE(8, p) \
    SCALE(9, p) SCALE(10, p) SCALE(11, p)
#define BLOCK_OF(p) (P > p ? base + (p) * blocks * F::BLOCK_BYTES + b * F::BLOCK_BYTES : base + b * F::BLOCK_BYTES)
#ifdef PANEL_WIDE
#define ISUB(a, b) _mm512_sub_epi32(a, b)
#else
#define ISUB(a, b) _mm256_sub_epi32(a, b)
#endif

// The rows of a call, rounded: ``quants`` [K / 32][M][32] (each block's rows side by side), ``scales`` and
// ``sums`` [K / 32][M]: each row's scale e and sum of its integers U over each block.
struct Rows {
    const int8_t* quants;
    const float* scales;
    const int32_t* sums;
    int64_t M;
    int64_t K;
};

// The four integers of row r's group g in block ``xb`` as one 32-bit lane (memcpy: the compiler's single load).
inline int32_t lanes_of(const int8_t* xb, int r, int64_t g) {
    int32_t four;
    std::memcpy(&four, xb + r * QK + g * GROUP, sizeof four);
    return four;
}

// Rows [row0, row0 + R) x panels [panel0, panel0 + P) over blocks [b0, b1), the accumulators in y (see SCALE);
// each block's panels prefetched ``ahead`` bytes on (0: not at all).
template <int KIND, int R, int P>
void tile(const Rows& rows, const uint8_t* panels, int64_t N, int64_t row0, int64_t panel0, int64_t b0, int64_t b1,
          float* y, int64_t ahead = PREFETCH_BYTES) {
    static_assert(R >= 1 && R <= FEW_ROWS && P >= 1 && P <= 8 && (R <= 8 || P == 1), "tile shape");
    using F = Format<KIND>;
    const int64_t blocks = rows.K / QK, M = rows.M;
    ROWS(DECLARE_ROW)
    const uint8_t* base = panels + panel0 * blocks * F::BLOCK_BYTES;
    const Ints mask = NIBBLE_MASK();
    (void)mask;
    if (b0 > 0) { ROWS(LOAD_ACC_ROW) }
    for (int64_t b = b0; b < b1; ++b) {
        ROWS(RESET_ROW)
        EACH_PANEL(QUANTS)
        if (ahead) { EACH_PANEL(PREFETCH) }
        const int8_t* xb = rows.quants + (b * M + row0) * QK;
        if constexpr (KIND == Q8_0) {
            for (int64_t g = 0; g < QK / GROUP; ++g) {
                EACH_PANEL(BYTES)
                ROWS(DOT8_ROW)
            }
        } else {
            for (int64_t g = 0; g < QK / GROUP / 2; ++g) {
                EACH_PANEL(NIBBLES)
                ROWS(DOT4_ROW)
            }
        }
        const float* es = rows.scales + b * M + row0;
        const int32_t* us = rows.sums + b * M + row0;
        (void)us;
        EACH_PANEL(SCALE_PANEL)
    }
    ROWS(STORE_ACC_ROW)
}

// R <= FEW_ROWS rows against panels [first, last) over the whole of K, P panels a tile: the weight streams once,
// bound by memory.
template <int KIND, int R>
void few_rows(const Rows& rows, const uint8_t* panels, int64_t N, int64_t first, int64_t last, float* y) {
    constexpr int P = few_panels(R);
    const int64_t blocks = rows.K / QK;
    int64_t p = first;
    for (; p + P <= last; p += P) tile<KIND, R, P>(rows, panels, N, 0, p, 0, blocks, y);
    for (; p < last; ++p) tile<KIND, R, 1>(rows, panels, N, 0, p, 0, blocks, y);
}

// Rows [row0, row0 + count) of a band (1 <= count <= BAND_ROWS) against panels [panel, panel + P), prefetching
// ``ahead`` bytes on.
template <int KIND, int P>
void band_tile(const Rows& rows, int64_t count, const uint8_t* panels, int64_t N, int64_t row0, int64_t panel,
               int64_t b0, int64_t b1, float* y, int64_t ahead) {
    switch (count) {
        case 1: tile<KIND, 1, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
        case 2: tile<KIND, 2, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
        case 3: tile<KIND, 3, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
        case 4: tile<KIND, 4, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
        case 5: tile<KIND, 5, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
        case 6: tile<KIND, 6, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
#ifdef PANEL_WIDE
        case 7: tile<KIND, 7, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
        case 8: tile<KIND, 8, P>(rows, panels, N, row0, panel, b0, b1, y, ahead); break;
#endif
        default: break;
    }
}

// Every row of the chunk against panels [panel, panel + P), K_BLOCKS blocks at a time (a pass): that part of the
// panels comes from memory once and stays in L1 while every group of BAND_ROWS rows uses it. The first group
// streams it in (prefetched PREFETCH_BYTES ahead); the second prefetches the next pass's blocks (one pass ahead: the
// rest of this panel, or the next panel's start) so that memory keeps working while it computes from L1, and the
// later groups prefetch nothing. With every prefetch 2 KiB ahead the later groups computed with memory idle (a
// 9-token step, banded 8 + 1, cost 1.17x an 8-token step); prefetching the next pass made a 16 / 32-token step 4-7 %
// faster on the 2-core AMD EPYC (docs/journal.md, 2026-12-08).
template <int KIND, int P>
void band(const Rows& rows, const uint8_t* panels, int64_t N, int64_t panel, float* y) {
    const int64_t blocks = rows.K / QK;
    for (int64_t b0 = 0; b0 < blocks; b0 += K_BLOCKS) {
        const int64_t b1 = b0 + K_BLOCKS < blocks ? b0 + K_BLOCKS : blocks;
        const int64_t pass_bytes = (b1 - b0) * Format<KIND>::BLOCK_BYTES;
        int64_t row0 = 0;
        for (int64_t group = 0; row0 < rows.M; ++group) {
            const int64_t count = rows.M - row0 < BAND_ROWS ? rows.M - row0 : BAND_ROWS;
            const int64_t ahead = group == 0 ? PREFETCH_BYTES : group == 1 ? pass_bytes : 0;
            band_tile<KIND, P>(rows, count, panels, N, row0, panel, b0, b1, y, ahead);
            row0 += count;
        }
    }
}

// Panels per tile of a call of M rows: the unit its panel ranges are cut in, so that each range runs whole tiles.
int64_t tile_panels(int64_t M) { return M <= FEW_ROWS ? few_panels(static_cast<int>(M)) : BAND_PANELS; }

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
#ifdef PANEL_WIDE
        case 9: few_rows<KIND, 9>(rows, panels, N, first, last, y); return;
        case 10: few_rows<KIND, 10>(rows, panels, N, first, last, y); return;
        case 11: few_rows<KIND, 11>(rows, panels, N, first, last, y); return;
        case 12: few_rows<KIND, 12>(rows, panels, N, first, last, y); return;
#endif
        default: break;
    }
    int64_t p = first;
    for (; p + BAND_PANELS <= last; p += BAND_PANELS) band<KIND, BAND_PANELS>(rows, panels, N, p, y);
    for (; p < last; ++p) band<KIND, 1>(rows, panels, N, p, y);
}

// Rows [0, M) of x [M, K], rounded block by block (see the file's head; 256-bit code, the same on either entry):
// quants [K / 32][M][32], scales and sums [K / 32][M]. A block holding an infinity or a NaN gets a NaN scale and
// zeros. The conversion rounds to nearest, ties to even (the default rounding mode), as torch.round does.
void round_rows(const float* x, int64_t M, int64_t K, int8_t* quants, float* scales, int32_t* sums) {
    const int64_t blocks = K / QK;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 finite_limit = _mm256_set1_ps(3.402823466e38f);
    const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
            const float* v = x + r * K + b * QK;
            __m256 parts[4], largest = _mm256_setzero_ps(), broken = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                parts[i] = _mm256_loadu_ps(v + 8 * i);
                const __m256 size = _mm256_and_ps(parts[i], magnitude);
                largest = _mm256_max_ps(largest, size);
                broken = _mm256_or_ps(broken, _mm256_cmp_ps(size, finite_limit, _CMP_NLE_UQ));  // NaN or infinite
            }
            __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
            half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            half = _mm_max_ss(half, _mm_movehdup_ps(half));
            const float scale = _mm_cvtss_f32(half) / 127.0f;
            const bool bad = _mm256_movemask_ps(broken) != 0;
            const float inverse = !bad && scale > 0.0f ? 1.0f / scale : 0.0f;
            __m256i words[4];
            __m256i total = _mm256_setzero_si256();
            for (int i = 0; i < 4; ++i) {
                const __m256i units = _mm256_cvtps_epi32(_mm256_mul_ps(parts[i], _mm256_set1_ps(inverse)));
                words[i] = _mm256_max_epi32(low, _mm256_min_epi32(high, units));
                total = _mm256_add_epi32(total, words[i]);
            }
            // int32 x 32 -> int8 x 32 in order: packs work within 128-bit halves, the permute puts them back.
            const __m256i shorts01 = _mm256_packs_epi32(words[0], words[1]);
            const __m256i shorts23 = _mm256_packs_epi32(words[2], words[3]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(shorts01, shorts23), order);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(quants + (b * M + r) * QK), bytes);
            __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
            sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1));
            scales[b * M + r] = bad ? NAN : scale;
            sums[b * M + r] = _mm_cvtsi128_si32(sum);
        }
    }
}

// Column ``id`` of the panels (row id of W) de-quantized into row [K] (``ROWS_ENTRY``), block by block in the
// layout ``Format<KIND>`` gives the product.
template <int KIND>
void weight_row(const uint8_t* panels, int64_t K, int64_t id, float* row) {
    using F = Format<KIND>;
    const int64_t blocks = K / QK, panel = id / LANES, lane = id % LANES;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = panels + (panel * blocks + b) * F::BLOCK_BYTES;
        uint16_t halves[2] = {0, 0};  // d, and m for Q4_1: float16 per column
        std::memcpy(halves, block + 2 * lane, 2);
        if constexpr (KIND == Q4_1) std::memcpy(halves + 1, block + 2 * (LANES + lane), 2);
        const float d = _cvtsh_ss(halves[0]), m = _cvtsh_ss(halves[1]);
        const uint8_t* body = block + F::SCALE_BYTES;
        float* values = row + b * QK;
        for (int64_t g = 0; g < F::QUANT_BYTES / F::GROUP_BYTES; ++g) {
            for (int64_t j = 0; j < GROUP; ++j) {
                const uint8_t byte = body[g * F::GROUP_BYTES + lane * GROUP + j];
                const int64_t k = g * GROUP + j;
                if constexpr (KIND == Q8_0) {
                    const int q = static_cast<int8_t>(static_cast<uint8_t>(byte - (Q8_OFFSET ? 128 : 0)));
                    values[k] = d * static_cast<float>(q);
                } else if constexpr (KIND == Q4_1) {
                    const float low = d * static_cast<float>(byte & 15), high = d * static_cast<float>(byte >> 4);
                    values[k] = low + m;
                    values[QK / 2 + k] = high + m;
                } else {
                    values[k] = d * static_cast<float>((byte & 15) - 8);
                    values[QK / 2 + k] = d * static_cast<float>((byte >> 4) - 8);
                }
            }
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
    std::vector<int8_t> quants(chunk * K);
    std::vector<float> scales(chunk * (K / QK));
    std::vector<int32_t> sums(chunk * (K / QK));
    for (int64_t start = 0; start < M; start += CHUNK_ROWS) {
        const int64_t count = M - start < CHUNK_ROWS ? M - start : CHUNK_ROWS;
        round_rows(x + start * K, count, K, quants.data(), scales.data(), sums.data());
        const Rows rows{quants.data(), scales.data(), sums.data(), count, K};
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

// out[i, :] = row ids[i] of W de-quantized as gguf does it (float32 [count, K]; w = d q + m, d (q - 8) or d q, one
// rounding each: no FMA), read from the same panels: the token embedding a tied output projection shares. Returns
// 0, -1 on an unknown kind, -2 on an id outside [0, N).
int ROWS_ENTRY(int kind, const uint8_t* panels, int64_t N, int64_t K, const int64_t* ids, int64_t count, float* out) {
    if (kind != Q4_0 && kind != Q4_1 && kind != Q8_0) return -1;
    for (int64_t i = 0; i < count; ++i) {
        if (ids[i] < 0 || ids[i] >= N) return -2;
    }
    for (int64_t i = 0; i < count; ++i) {
        switch (kind) {
            case Q4_0: weight_row<Q4_0>(panels, K, ids[i], out + i * K); break;
            case Q4_1: weight_row<Q4_1>(panels, K, ids[i], out + i * K); break;
            default: weight_row<Q8_0>(panels, K, ids[i], out + i * K); break;
        }
    }
    return 0;
}

}
