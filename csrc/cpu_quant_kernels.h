// Quantized CPU linears (csrc/cpu_quant_kernels.cpp): int8 / int4 weights repacked once at load,
// activations quantized per row to int8 blocks of 32, integer dot products (AVX512-VNNI, AVX2 or
// scalar, chosen at run time), one fixed-order float epilogue: every row's result is independent
// of the other rows of the call and of the thread count (batch-invariant).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace radix_cpu {

// the `kind` argument; cpu_quant.py's KIND_INT8 / KIND_INT4
constexpr int64_t kQuantInt8 = 1;
constexpr int64_t kQuantInt4 = 2;

// y[R, N] = x[R, K] W^T (+ bias): `packed` is cpu_quant.pack_int8 / pack_int4's [N/16, K/32, record]
// uint8 tensor. x is float32 or bfloat16 (any strides); y has x's dtype, or float32 with
// `float_out`. `act_passes` 2 quantizes each activation block twice (the block, then what its
// int8 rounding left): ~14 bits instead of ~7 for twice the integer work.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind,
                        int64_t out_features, int64_t in_features,
                        const std::optional<at::Tensor>& bias, bool float_out,
                        int64_t act_passes);

// The module's kernel functions: quant_linear, kernel_isa, set_kernel_isa, kernel_isas.
void bind_quant_kernels(pybind11::module& m);

}  // namespace radix_cpu
