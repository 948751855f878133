"""``bench.kernels``: a C++ kernel counts one per loop nest (a whole-row reduction with the nest after it), a Triton
launch and a library call one each; and the fused step of a two-layer model stays under its ceiling of kernels per
forward."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from bench.kernels import count_kernels, fused_kernels

CPP_MODULE = """
cpp_fused_norm_0 = async_compile.cpp_pybinding(['float*'], r'''
extern "C" void kernel(float* out_ptr0)
{
    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(8L); x0+=static_cast<int64_t>(1L))
    {
        for(int64_t x1=static_cast<int64_t>(0L); x1<static_cast<int64_t>(8L); x1+=static_cast<int64_t>(1L)) {}
    }
    #pragma omp parallel
    {
        #pragma omp for
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(4L); x0+=static_cast<int64_t>(1L)) {}
    }
}
''')

cpp_fused_row_norm_1 = async_compile.cpp_pybinding(['float*'], r'''
extern "C" void kernel(float* out_ptr0, float* out_ptr1)
{
    {
        float tmp_acc0 = 0;
        for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(48L); x0+=static_cast<int64_t>(16L)) {}
        out_ptr0[static_cast<int64_t>(0L)] = static_cast<float>(tmp_acc0);
    }
    for(int64_t x0=static_cast<int64_t>(0L); x0<static_cast<int64_t>(48L); x0+=static_cast<int64_t>(16L))
    {
        tmp10.store(out_ptr1 + static_cast<int64_t>(x0));
    }
}
''')

def call(args):
    buf0 = empty_strided_cpu((8, 8), (8, 1), torch.float32)
    cpp_fused_norm_0(buf0)
    cpp_fused_row_norm_1(buf3, buf4)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf0, buf0, buf0)
    cpp_fused_norm_0(buf1)
"""

TRITON_MODULE = """
def call(args):
    triton_red_fused_mean_0.run(arg0_1, buf0, 8, 576, stream=stream0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    triton_poi_fused_silu_1.run(buf1, buf2, 4608, stream=stream0)
"""


def test_a_cpp_kernel_counts_its_loop_nests_and_a_row_reduction_with_the_nest_after_it():
    count = count_kernels(CPP_MODULE)
    assert (count.kernels, count.fused, count.functions, count.library) == (7, 5, 3, 2)
    assert count.by_call["extern_kernels.mm"] == 1 and count.by_call["generated"] == 5


def test_a_triton_launch_counts_one():
    count = count_kernels(TRITON_MODULE)
    assert (count.kernels, count.fused, count.functions, count.library) == (3, 2, 2, 1)


@pytest.mark.parametrize("tokens", [1, 8, 208])
def test_the_fused_steps_kernels_per_forward_stay_under_the_ceiling(tokens):
    """Two layers of the default model's head layout (3:1 grouped heads, heads of 16: the tree kernel takes them),
    steps of one token, eight and the CUDA preset's median lookahead step: 8 a layer (the four products, the tree
    attention op, two norms and the gate; before the op: 12) and at most 10 around them (the issue's ceiling: 8 a
    layer plus 10), whatever the step's size (the mask's closure is one op a step, ``tree_reach``)."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=3, num_key_value_heads=1)).eval()
    count = fused_kernels(model, tokens)
    assert count.by_call["extern_kernels.mm"] + count.by_call["extern_kernels.addmm"] == 2 * 4 + 1  # and the head
    assert count.by_call["torch.ops.lookahead.tree_attention.default"] == 2
    assert count.by_call["torch.ops.lookahead.tree_reach.default"] == 1
    assert "extern_kernels.bmm" not in count.by_call, count
    assert count.kernels <= 2 * 8 + 10, count
