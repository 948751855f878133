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
// for the norm, rotary, activation and top tokens, (kv head, row) units for attention. A row (a
// unit) is computed whole by one thread, so the bits do not depend on the thread count either.
//
// Built with the panel kernels into one library (decoding/weights/native.py compiles every source twice: AVX2, and
// AVX-512 with PANEL_WIDE); these use 256-bit instructions only and are compiled in the AVX2 pass alone.
#ifndef PANEL_WIDE

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "thread_pool.h"

namespace {

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

constexpr int64_t SLOT_BLOCK = 64;   // cached keys (or values) per block: 16 KB of a 64-float head, in L1
constexpr int64_t UNIT_BLOCK = 16;   // (kv head, row) units sharing a block of cached keys; bounds their scratch
constexpr int64_t MAX_QUERIES = 3;   // query heads of a unit scored (weighed) together: 12 accumulators
constexpr int64_t VALUE_CHUNKS = 4;  // 8-float chunks of a head weighed at once: 3 x 4 accumulators

// The dot products of Q queries q[0..Q) with the four keys k[0..3] (dim a multiple of 8), times scale, into
// out[j * stride + 0..3]. Each (query, key) sum is one FMA chain per lane over d in order, then
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) over its 8 lanes: the same bits whichever queries and keys
// share the call. A key is loaded once for all Q queries.
template <int Q>
inline void dots(const float* const* q, const float* const* k, int64_t dim, float scale, float* out,
                 int64_t stride) {
    __m256 acc[Q][4];
    for (int j = 0; j < Q; ++j) {
        for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < dim; d += 8) {
        __m256 x[Q];
        for (int j = 0; j < Q; ++j) x[j] = _mm256_loadu_ps(q[j] + d);
        for (int i = 0; i < 4; ++i) {
            const __m256 key = _mm256_loadu_ps(k[i] + d);
            for (int j = 0; j < Q; ++j) acc[j][i] = _mm256_fmadd_ps(x[j], key, acc[j][i]);
        }
    }
    for (int j = 0; j < Q; ++j) {
        const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]), _mm256_hadd_ps(acc[j][2], acc[j][3]));
        const __m128 four = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
        _mm_storeu_ps(out + j * stride, _mm_mul_ps(four, _mm_set1_ps(scale)));
    }
}

// scores[j * stride + i] = (q[j] . key(i)) * scale for Q queries and i in [begin, end), four keys a pass (a short
// tail repeats the last key and drops its extra results). ``key(i)`` is slot i's key: keys + slots[i] * dim, or
// keys + i * dim without slots (the cached keys, slot i at i).
template <int Q>
void score(const float* const* q, const float* keys, const int64_t* slots, int64_t begin, int64_t end, int64_t dim,
           float scale, float* scores, int64_t stride) {
    for (int64_t i = begin; i < end; i += 4) {
        const float* four[4];
        for (int64_t j = 0; j < 4; ++j) {
            const int64_t at = i + j < end ? i + j : end - 1;
            four[j] = keys + (slots == nullptr ? at : slots[at]) * dim;
        }
        if (i + 4 <= end) {
            dots<Q>(q, four, dim, scale, scores + i, stride);
        } else {
            float tail[Q * 4];
            dots<Q>(q, four, dim, scale, tail, 4);
            for (int j = 0; j < Q; ++j) {
                for (int64_t t = 0; i + t < end; ++t) scores[j * stride + i + t] = tail[j * 4 + t];
            }
        }
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

// acc[j * dim + c] += sum over i in [begin, end) of weights[j * stride + i] * value(i)[c] for Q queries and the
// C chunks of 8 floats from ``first`` (value(i) as ``score``'s key(i)): one FMA chain per float in slot order, a
// value chunk loaded once for all Q queries.
template <int Q, int C>
void weigh_chunks(const float* weights, int64_t stride, const float* values, const int64_t* slots, int64_t begin,
                  int64_t end, int64_t dim, int64_t first, float* acc) {
    __m256 sum[Q][C];
    for (int j = 0; j < Q; ++j) {
        for (int c = 0; c < C; ++c) sum[j][c] = _mm256_loadu_ps(acc + j * dim + first + 8 * c);
    }
    for (int64_t i = begin; i < end; ++i) {
        const float* value = values + (slots == nullptr ? i : slots[i]) * dim + first;
        __m256 weight[Q];
        for (int j = 0; j < Q; ++j) weight[j] = _mm256_set1_ps(weights[j * stride + i]);
        for (int c = 0; c < C; ++c) {
            const __m256 v = _mm256_loadu_ps(value + 8 * c);
            for (int j = 0; j < Q; ++j) sum[j][c] = _mm256_fmadd_ps(weight[j], v, sum[j][c]);
        }
    }
    for (int j = 0; j < Q; ++j) {
        for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + j * dim + first + 8 * c, sum[j][c]);
    }
}

// ``weigh_chunks`` over every chunk of the head, VALUE_CHUNKS at a time.
template <int Q>
void weigh(const float* weights, int64_t stride, const float* values, const int64_t* slots, int64_t begin,
           int64_t end, int64_t dim, float* acc) {
    int64_t first = 0;
    for (; first + 8 * VALUE_CHUNKS <= dim; first += 8 * VALUE_CHUNKS) {
        weigh_chunks<Q, VALUE_CHUNKS>(weights, stride, values, slots, begin, end, dim, first, acc);
    }
    switch ((dim - first) / 8) {
        case 3: weigh_chunks<Q, 3>(weights, stride, values, slots, begin, end, dim, first, acc); break;
        case 2: weigh_chunks<Q, 2>(weights, stride, values, slots, begin, end, dim, first, acc); break;
        case 1: weigh_chunks<Q, 1>(weights, stride, values, slots, begin, end, dim, first, acc); break;
        default: break;
    }
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

// A step's attention cut into units: unit (g, t) is row t's query heads of kv head g (``group`` of them, which
// read the same keys and values), units ordered g-major. A range of one kv head's units is run UNIT_BLOCK units at
// a time: the cached keys (values) are read in blocks of SLOT_BLOCK slots, each block used by every unit of the
// block while it sits in L1; then each unit's step slots. A query's arithmetic is the same whatever the other units,
// queries or blocks: each score one ``dots`` sum, the softmax over its own keys in position order, the weighted sum
// one FMA chain per float over those keys in position order (a block boundary only parks the running sums in
// memory).
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

    // Units [first, last) of kv head g, at most UNIT_BLOCK of them; scores [UNIT_BLOCK * group][span],
    // acc [UNIT_BLOCK * group][dim] and totals [UNIT_BLOCK * group] are the caller's scratch.
    void block(int64_t g, int64_t first, int64_t last, float* scores, float* totals, float* acc) const {
        const float* head_keys = keys + g * head_stride;
        const float* head_values = values + g * head_stride;
        for (int64_t begin = 0; begin < past; begin += SLOT_BLOCK) {
            const int64_t end = begin + SLOT_BLOCK < past ? begin + SLOT_BLOCK : past;
            for (int64_t t = first; t < last; ++t) {
                each_query(g, t, [&](auto q, const float* const* query, int64_t j) {
                    score<decltype(q)::value>(query, head_keys, nullptr, begin, end, dim, scale,
                                              scores + ((t - first) * group + j) * span, span);
                });
            }
        }
        for (int64_t t = first; t < last; ++t) {
            each_query(g, t, [&](auto q, const float* const* query, int64_t j) {
                score<decltype(q)::value>(query, head_keys, slots + t * span, past, seen[t], dim, scale,
                                          scores + ((t - first) * group + j) * span, span);
            });
            for (int64_t j = 0; j < group; ++j) {
                const int64_t unit_query = (t - first) * group + j;
                totals[unit_query] = softmax_weights(scores + unit_query * span, seen[t]);
            }
        }
        std::fill(acc, acc + (last - first) * group * dim, 0.0f);
        for (int64_t begin = 0; begin < past; begin += SLOT_BLOCK) {
            const int64_t end = begin + SLOT_BLOCK < past ? begin + SLOT_BLOCK : past;
            for (int64_t t = first; t < last; ++t) {
                each_query(g, t, [&](auto q, const float* const*, int64_t j) {
                    const int64_t unit_query = (t - first) * group + j;
                    weigh<decltype(q)::value>(scores + unit_query * span, span, head_values, nullptr, begin, end, dim,
                                              acc + unit_query * dim);
                });
            }
        }
        for (int64_t t = first; t < last; ++t) {
            each_query(g, t, [&](auto q, const float* const*, int64_t j) {
                const int64_t unit_query = (t - first) * group + j;
                weigh<decltype(q)::value>(scores + unit_query * span, span, head_values, slots + t * span, past,
                                          seen[t], dim, acc + unit_query * dim);
            });
            for (int64_t j = 0; j < group; ++j) {
                const float* sum = acc + ((t - first) * group + j) * dim;
                const __m256 divisor = _mm256_set1_ps(totals[(t - first) * group + j]);
                float* target = out + (t * heads + g * group + j) * dim;
                for (int64_t d = 0; d < dim; d += 8) {
                    _mm256_storeu_ps(target + d, _mm256_div_ps(_mm256_loadu_ps(sum + d), divisor));
                }
            }
        }
    }

    // body(std::integral_constant<int, Q>, queries, j) for unit (g, t)'s query heads j .. j + Q - 1, in runs of
    // at most MAX_QUERIES.
    template <class Body>
    void each_query(int64_t g, int64_t t, Body&& body) const {
        const float* query[MAX_QUERIES];
        for (int64_t j = 0; j < group; j += MAX_QUERIES) {
            const int64_t run = group - j < MAX_QUERIES ? group - j : MAX_QUERIES;
            for (int64_t i = 0; i < run; ++i) query[i] = qkv + t * row_stride + (g * group + j + i) * dim;
            if (run == 3) {
                body(std::integral_constant<int, 3>{}, query, j);
            } else if (run == 2) {
                body(std::integral_constant<int, 2>{}, query, j);
            } else {
                body(std::integral_constant<int, 1>{}, query, j);
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
// The (kv head, row) units are cut into ranges run on the thread pool (``Attention::block``): each query head of a
// row computed by one thread, in the same order whatever the range, the thread or the other rows.
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
    const Attention attention{qkv, count, row_stride, heads, kv_heads, dim, keys, values, head_stride, past, span,
                              group, slots.data(), seen.data(), scale, out};
    // Items: kv head g's units (rows), g after g; a range is run one kv head and UNIT_BLOCK units at a time.
    lookahead::parallel_ranges(kv_heads * count, 1, span * pairs * kv_heads * dim, [&](int64_t first, int64_t last) {
        const int64_t units = std::min<int64_t>(UNIT_BLOCK, last - first) * group;
        std::vector<float> scores(units * span), totals(units), acc(units * dim);
        for (int64_t g = first / count; g * count < last; ++g) {
            const int64_t begin = first > g * count ? first - g * count : 0;
            const int64_t end = last < (g + 1) * count ? last - g * count : count;
            for (int64_t t = begin; t < end; t += UNIT_BLOCK) {
                attention.block(g, t, std::min(t + UNIT_BLOCK, end), scores.data(), totals.data(), acc.data());
            }
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
