// A decode step's decoder layers in one call: for each layer, the RMS norm, the q/k/v product, the rotary
// embedding, each sequence's attention (its keys/values stored), the output product and its residual addition, the
// second RMS norm, the gate/up product, SiLU(gate) * up, the down product and its residual addition.
//
// Why: decoding/forward/fused.py made a layer nine native calls, but called them from Python: on a 2-core Intel
// Xeon a one-token step of the default model spent ~3-4 ms of its ~16 between the calls (ctypes' argument
// conversion, the products' output tensors, slicing), all of it on one thread, and the pool's workers, idle in the
// gaps, missed the start of the next call. Here the gaps are a few instructions: the step is one call, its serial
// part is what the kernels cannot split, and a thread count of n divides the rest.
//
// Exactness: the same kernels in the same order as fused.py's layer (the same extern "C" entries, the products
// through the entries the Python side names), and the residual additions and biases as float32 adds: the output
// is the same bits as the per-call path's, at any thread count (tests/decoding/forward/test_fused.py).
//
// Compiled in the AVX2 pass alone (decoding/weights/native.py compiles every source twice); the products it calls
// may be either pass's entries, passed in as function pointers.
#ifndef PANEL_WIDE

#include <cstdint>
#include <vector>

extern "C" {
void fused_rms_norm(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* out);
void fused_rope(float* states, int64_t rows, int64_t row_stride, int64_t heads, int64_t dim, const float* cos,
                const float* sin);
void fused_attention(const float* qkv, int64_t count, int64_t row_stride, int64_t heads, int64_t kv_heads,
                     int64_t dim, float* keys, float* values, int64_t head_stride, int64_t past,
                     const uint8_t* visible, float scale, float* out);
void fused_silu_mul(const float* gate_up, int64_t rows, int64_t inner, float* out);
}

namespace {

using QuantEntry = int (*)(int kind, const float* x, int64_t M, int64_t K, const uint8_t* panels, int64_t N,
                           float* y);
using PanelEntry = void (*)(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y);

}  // namespace

extern "C" {

// One product y [M, N] = x [M, K] W^T (+ bias): ``entry`` is a quantized entry (quant_gemm or quant_gemm_wide) when
// kind >= 0 (GGUF block format), else a float32 panel entry (panel_gemm or panel_gemm_wide).
struct StepProduct {
    void* entry;
    int64_t kind;
    const void* panels;
    int64_t n, k;
    const float* bias;  // [N] or null
};

struct StepLayer {
    const float* input_norm;  // [width]
    const float* post_norm;   // [width]
    StepProduct qkv, output, gate_up, down;
};

// One sequence of the step: rows [start, start + count) of the step, ``past`` slots already cached, its visibility
// ([count, count] bytes, null: causal), and each layer's key and value buffers ([kv_heads, head_stride] floats).
struct StepSlice {
    int64_t start, count, past;
    const uint8_t* visible;
    float* const* keys;    // [layers]
    float* const* values;  // [layers]
    int64_t head_stride;
};

}  // extern "C"

namespace {

void multiply(const StepProduct& product, const float* x, int64_t rows, float* y) {
    if (product.kind >= 0) {
        reinterpret_cast<QuantEntry>(product.entry)(static_cast<int>(product.kind), x, rows, product.k,
                                                    static_cast<const uint8_t*>(product.panels), product.n, y);
    } else {
        reinterpret_cast<PanelEntry>(product.entry)(x, rows, product.k, static_cast<const float*>(product.panels),
                                                    product.n, y);
    }
    if (product.bias != nullptr) {
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < product.n; ++i) y[r * product.n + i] += product.bias[i];
        }
    }
}

void add_into(float* hidden, const float* delta, int64_t count) {
    for (int64_t i = 0; i < count; ++i) hidden[i] += delta[i];
}

}  // namespace

extern "C" {

// ``hidden`` [count, width] through ``layer_count`` decoder layers in place, each slice's keys/values stored at its
// slots past..past+count-1 of each layer. cos/sin [count, dim]: each row's rotary tables. Shapes: q/k/v product N
// = (heads + 2 kv_heads) * dim, output K = heads * dim, gate/up N = 2 inner, down K = inner.
void fused_step_layers(float* hidden, int64_t count, int64_t width, const StepLayer* layers, int64_t layer_count,
                       const StepSlice* slices, int64_t slice_count, int64_t heads, int64_t kv_heads, int64_t dim,
                       int64_t inner, float eps, float scale, const float* cos, const float* sin) {
    const int64_t qkv_width = (heads + 2 * kv_heads) * dim;
    std::vector<float> normed(count * width), states(count * qkv_width), attended(count * heads * dim),
        both(count * 2 * inner), activated(count * inner), delta(count * width);
    for (int64_t index = 0; index < layer_count; ++index) {
        const StepLayer& layer = layers[index];
        fused_rms_norm(hidden, count, width, layer.input_norm, eps, normed.data());
        multiply(layer.qkv, normed.data(), count, states.data());
        fused_rope(states.data(), count, qkv_width, heads + kv_heads, dim, cos, sin);
        for (int64_t s = 0; s < slice_count; ++s) {
            const StepSlice& slice = slices[s];
            fused_attention(states.data() + slice.start * qkv_width, slice.count, qkv_width, heads, kv_heads, dim,
                            slice.keys[index], slice.values[index], slice.head_stride, slice.past, slice.visible,
                            scale, attended.data() + slice.start * heads * dim);
        }
        multiply(layer.output, attended.data(), count, delta.data());
        add_into(hidden, delta.data(), count * width);
        fused_rms_norm(hidden, count, width, layer.post_norm, eps, normed.data());
        multiply(layer.gate_up, normed.data(), count, both.data());
        fused_silu_mul(both.data(), count, inner, activated.data());
        multiply(layer.down, activated.data(), count, delta.data());
        add_into(hidden, delta.data(), count * width);
    }
}

}  // extern "C"

#endif  // PANEL_WIDE
