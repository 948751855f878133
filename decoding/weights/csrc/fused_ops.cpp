// The small operations of a CPU decoder step, each one call over all of a step's rows: RMS norm, rotary
// embedding, attention over a sequence's KV cache (its new keys/values stored first), and SiLU(gate) * up.
//
// Why: on a 2-core CPU a one-token step of a 30-layer model is ~1,250 ATen ops, and their dispatch cost as much
// as the quantized products themselves (decoding/forward/fused.py). Here a layer is four calls besides its
// products.
//
// Exactness: every output row depends on that row's inputs alone, computed by the same instructions in the same
// order whatever the other rows of the call. Attention visits a row's visible keys in position order, the cached
// ones then the step's own; its softmax is two passes over exactly those keys (max, then exponentials summed in
// order), so a token attended in a one-token step and in a many-token step whose mask shows it the same keys gets
// the same bits. That makes lookahead == greedy exact, not just within rounding.
//
// Threads: each call cuts its work into ranges run on the thread pool (thread_pool.h) when it is big enough: rows
// for the norm, rotary, activation and top tokens, (row, query head) pairs of each kv head for attention. A row (a
// pair) is computed whole by one thread, so the bits do not depend on the thread count either.
//
// Built with the panel kernels into one library (decoding/weights/native.py compiles every source twice: AVX2, and
// AVX-512 with PANEL_WIDE); these use 256-bit instructions only and are compiled in the AVX2 pass alone.
#ifndef PANEL_WIDE

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "thread_pool.h"

namespace {

constexpr int64_t MAX_DIM = 256;  // the widest head the fused step takes (decoding/forward/fused.py checks)

// exp(x) for 8 floats: Cephes' range reduction x = n ln2 + r and degree-5 polynomial (about 1 ulp over the
// range used here), the same instructions for every lane and every call.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// exp of count floats in place, 8 at a time; a short tail goes through the same 8-wide code.
void exp_inplace(float* x, int64_t count) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
    if (i < count) {
        float tail[8] = {0};
        std::memcpy(tail, x + i, (count - i) * sizeof(float));
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        std::memcpy(x + i, tail, (count - i) * sizeof(float));
    }
}

// The 8 lanes of v summed in one fixed order.
inline float sum8(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

// The dot products of q with the four keys k[0..3] (dim a multiple of 8) into out[0..3]. Each key's sum is
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) over its 8 lane partial sums, whichever keys share the call.
inline void dot4(const float* q, const float* const* k, int64_t dim, float* out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[0] + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[1] + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[2] + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[3] + d), a3);
    }
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}

constexpr int64_t SLOT_BLOCK = 64;  // cached keys (or values) per block: 16 KB of a 64-float head, in L1

// scores[i] = (q . keys[slots[i]]) * scale for i in [begin, end), four keys a pass (a short tail repeats the last
// key and drops its extra results).
void score(const float* query, const float* keys, const int64_t* slots, int64_t begin, int64_t end, int64_t dim,
           float scale, float* scores) {
    for (int64_t i = begin; i < end; i += 4) {
        const float* four[4];
        for (int64_t j = 0; j < 4; ++j) four[j] = keys + slots[i + j < end ? i + j : end - 1] * dim;
        float dots[4];
        dot4(query, four, dim, dots);
        for (int64_t j = 0; j < 4 && i + j < end; ++j) scores[i + j] = dots[j] * scale;
    }
}

// The softmax weights of scores[0, count) in place, unnormalized (exp(score - max)); returns their sum, in order.
float softmax_weights(float* scores, int64_t count) {
    float top = -INFINITY;
    for (int64_t i = 0; i < count; ++i) top = scores[i] > top ? scores[i] : top;
    for (int64_t i = 0; i < count; ++i) scores[i] -= top;
    exp_inplace(scores, count);
    float total = 0.0f;
    for (int64_t i = 0; i < count; ++i) total += scores[i];
    return total;
}

// acc[dim] += sum over i in [begin, end) of weights[i] * values[slots[i]], dim / 8 FMA chains in slot order.
void weigh(const float* weights, const float* values, const int64_t* slots, int64_t begin, int64_t end, int64_t dim,
           float* acc) {
    const int64_t blocks = dim / 8;
    __m256 sum[MAX_DIM / 8];
    for (int64_t b = 0; b < blocks; ++b) sum[b] = _mm256_loadu_ps(acc + 8 * b);
    for (int64_t i = begin; i < end; ++i) {
        const __m256 weight = _mm256_set1_ps(weights[i]);
        const float* value = values + slots[i] * dim;
        for (int64_t b = 0; b < blocks; ++b) sum[b] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * b), sum[b]);
    }
    for (int64_t b = 0; b < blocks; ++b) _mm256_storeu_ps(acc + 8 * b, sum[b]);
}

// One row of fused_silu_mul: y[i] = silu(gate[i]) * up[i], up = gate + inner.
void silu_mul_row(const float* gate, int64_t inner, float* y) {
    const float* up = gate + inner;
    int64_t i = 0;
    for (; i + 8 <= inner; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (; i < inner; ++i) {
        float e = -gate[i];
        exp_inplace(&e, 1);
        y[i] = gate[i] / (1.0f + e) * up[i];
    }
}

// One row of fused_top_tokens: the k (<= 64) highest of row[0, width)'s scores' indices into out[0, k).
void top_of_row(const float* row, int64_t width, int64_t k, int64_t* out) {
    float best[64];
    int64_t ids[64];
    int64_t held = 0;
    auto offer = [&](float value, int64_t id) {
        if (held == k && !(value > best[k - 1])) return;
        int64_t at = held < k ? held : k - 1;
        while (at > 0 && value > best[at - 1]) {
            best[at] = best[at - 1];
            ids[at] = ids[at - 1];
            --at;
        }
        best[at] = value;
        ids[at] = id;
        held = held < k ? held + 1 : k;
    };
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        const __m256 block = _mm256_loadu_ps(row + i);
        if (held == k && _mm256_movemask_ps(_mm256_cmp_ps(block, _mm256_set1_ps(best[k - 1]), _CMP_GT_OQ)) == 0) {
            continue;
        }
        for (int64_t j = 0; j < 8; ++j) {
            if (row[i + j] == row[i + j]) offer(row[i + j], i + j);
        }
    }
    for (; i < width; ++i) {
        if (row[i] == row[i]) offer(row[i], i);
    }
    for (int64_t j = 0; j < k; ++j) out[j] = j < held ? ids[j] : 0;
}

// One kv head's share of a step's attention: (row, query head) pairs [first, last) of kv head g, pair p being
// row p / group, query head g * group + p % group. The cached keys and values are read in blocks of SLOT_BLOCK
// slots, each block used by every pair of the range while it sits in L1. A pair's arithmetic is the same whatever
// the other pairs of the range: each score one dot product, the softmax over its own keys in position order, the
// weighted sum dim / 8 FMA chains over those keys in position order (a block boundary only parks the running sums
// in memory). ``scores`` [pairs][span], ``totals`` [pairs], ``acc`` [pairs][dim] are this kv head's scratch.
struct Attention {
    const float* qkv;
    int64_t count, row_stride, heads, kv_heads, dim;
    const float* keys;
    const float* values;
    int64_t head_stride, past, span, group;
    const int64_t* slots;  // [count][span]: each row's visible slots, 0..past-1 then its step slots
    const int64_t* seen;   // [count]: how many of them
    float scale;
    float* out;

    const float* query(int64_t g, int64_t p) const {
        return qkv + (p / group) * row_stride + (g * group + p % group) * dim;
    }

    void pairs(int64_t g, int64_t first, int64_t last, float* scores, float* totals, float* acc) const {
        const float* head_keys = keys + g * head_stride;
        const float* head_values = values + g * head_stride;
        for (int64_t begin = 0; begin < past; begin += SLOT_BLOCK) {
            const int64_t end = begin + SLOT_BLOCK < past ? begin + SLOT_BLOCK : past;
            for (int64_t p = first; p < last; ++p) {
                score(query(g, p), head_keys, slots + (p / group) * span, begin, end, dim, scale, scores + p * span);
            }
        }
        for (int64_t p = first; p < last; ++p) {
            const int64_t t = p / group;
            float* own = scores + p * span;
            score(query(g, p), head_keys, slots + t * span, past, seen[t], dim, scale, own);
            totals[p] = softmax_weights(own, seen[t]);
        }
        std::fill(acc + first * dim, acc + last * dim, 0.0f);
        for (int64_t begin = 0; begin < past; begin += SLOT_BLOCK) {
            const int64_t end = begin + SLOT_BLOCK < past ? begin + SLOT_BLOCK : past;
            for (int64_t p = first; p < last; ++p) {
                weigh(scores + p * span, head_values, slots + (p / group) * span, begin, end, dim, acc + p * dim);
            }
        }
        for (int64_t p = first; p < last; ++p) {
            const int64_t t = p / group;
            float* sum = acc + p * dim;
            weigh(scores + p * span, head_values, slots + t * span, past, seen[t], dim, sum);
            const __m256 divisor = _mm256_set1_ps(totals[p]);
            float* target = out + (t * heads + g * group + p % group) * dim;
            for (int64_t d = 0; d < dim; d += 8) {
                _mm256_storeu_ps(target + d, _mm256_div_ps(_mm256_loadu_ps(sum + d), divisor));
            }
        }
    }
};

}  // namespace

extern "C" {

// out[r] = weight * (x[r] / sqrt(mean(x[r]^2) + eps)) for rows x [rows, dim] (dim a multiple of 8). Rows are split
// over the thread pool when there are enough of them.
void fused_rms_norm(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* out) {
    lookahead::parallel_ranges(rows, 1, rows * dim, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
            const float* row = x + r * dim;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 v = _mm256_loadu_ps(row + d);
                acc = _mm256_fmadd_ps(v, v, acc);
            }
            const float inverse = 1.0f / std::sqrt(sum8(acc) / static_cast<float>(dim) + eps);
            const __m256 factor = _mm256_set1_ps(inverse);
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(row + d), factor);
                _mm256_storeu_ps(out + r * dim + d, _mm256_mul_ps(_mm256_loadu_ps(weight + d), normed));
            }
        }
    });
}

// Rotary embedding, rotate-half form, in place on the first `heads` heads of each row of states
// ([rows, row_stride], heads of dim floats side by side): x * cos + rotate_half(x) * sin, cos/sin [rows, dim].
void fused_rope(float* states, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim, const float* cos,
                const float* sin) {
    const int64_t half = dim / 2;
    lookahead::parallel_ranges(rows, 1, rows * heads * dim, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) {
            const float* c = cos + r * dim;
            const float* s = sin + r * dim;
            for (int64_t h = 0; h < heads; ++h) {
                float* x = states + r * row_stride + h * dim;
                for (int64_t i = 0; i < half; ++i) {
                    const float first_half = x[i], second_half = x[i + half];
                    x[i] = first_half * c[i] - second_half * s[i];
                    x[i + half] = second_half * c[i + half] + first_half * s[i + half];
                }
            }
        }
    });
}

// One sequence's attention for a step of `count` rows. qkv [count, row_stride] holds each row's query heads,
// then its key heads, then its value heads (dim floats each; rotary applied). The keys/values are stored at
// slots past..past+count-1 of the cache (keys/values: [kv_heads, head_stride] floats, slot s of head g at
// g * head_stride + s * dim), then every row attends to slots 0..past-1 and to the step's slots its row of
// `visible` ([count, count] bytes, nonzero = visible; null = causal) shows. out [count, heads * dim].
// Query head h reads key/value head h / (heads / kv_heads).
//
// The (row, query head) pairs of each kv head are cut into ranges run on the thread pool (``Attention::pairs``):
// each pair computed by one thread, in the same order whatever the range, the thread or the other rows.
void fused_attention(const float* qkv, int64_t count, int64_t row_stride, int64_t heads, int64_t kv_heads,
                     int64_t dim, float* keys, float* values, int64_t head_stride, int64_t past,
                     const uint8_t* visible, float scale, float* out) {
    for (int64_t t = 0; t < count; ++t) {
        for (int64_t g = 0; g < kv_heads; ++g) {
            const float* row = qkv + t * row_stride;
            std::memcpy(keys + g * head_stride + (past + t) * dim, row + (heads + g) * dim, dim * sizeof(float));
            std::memcpy(values + g * head_stride + (past + t) * dim, row + (heads + kv_heads + g) * dim,
                        dim * sizeof(float));
        }
    }
    const int64_t group = heads / kv_heads, span = past + count, pairs = count * group;
    std::vector<int64_t> slots(count * span);
    std::vector<int64_t> seen(count);
    for (int64_t t = 0; t < count; ++t) {
        int64_t* own = slots.data() + t * span;
        for (int64_t s = 0; s < past; ++s) own[s] = s;
        seen[t] = past;
        for (int64_t j = 0; j < count; ++j) {
            if (visible == nullptr ? j <= t : visible[t * count + j] != 0) own[seen[t]++] = past + j;
        }
    }
    std::vector<float> scores(kv_heads * pairs * span), totals(kv_heads * pairs), acc(kv_heads * pairs * dim);
    const Attention attention{qkv, count, row_stride, heads, kv_heads, dim, keys, values, head_stride, past, span,
                              group, slots.data(), seen.data(), scale, out};
    // Items: kv head g's pairs, g after g; a range crossing a kv head's end is run as one range per kv head.
    lookahead::parallel_ranges(kv_heads * pairs, 1, span * pairs * kv_heads * dim, [&](int64_t first, int64_t last) {
        for (int64_t g = first / pairs; g * pairs < last; ++g) {
            const int64_t begin = first > g * pairs ? first - g * pairs : 0;
            const int64_t end = last < (g + 1) * pairs ? last - g * pairs : pairs;
            attention.pairs(g, begin, end, scores.data() + g * pairs * span, totals.data() + g * pairs,
                            acc.data() + g * pairs * dim);
        }
    });
}

// out[r, i] = silu(gate) * up with gate = gate_up[r, i], up = gate_up[r, inner + i]; silu(x) = x / (1 + exp(-x)).
void fused_silu_mul(const float* gate_up, int64_t rows, int64_t inner, float* out) {
    lookahead::parallel_ranges(rows, 1, rows * inner, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) silu_mul_row(gate_up + r * 2 * inner, inner, out + r * inner);
    });
}

// Each row's k highest scores' indices, highest first, the lower index first among equal scores (so k = 1 is
// torch's argmax): scores [rows, width], out [rows, k] (k <= 64). NaN scores are never chosen.
void fused_top_tokens(const float* scores, int64_t rows, int64_t width, int64_t k, int64_t* out) {
    lookahead::parallel_ranges(rows, 1, rows * width, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r) top_of_row(scores + r * width, width, k, out + r * k);
    });
}

}  // extern "C"

#endif  // PANEL_WIDE
