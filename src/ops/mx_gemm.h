// The MX expert product for rows that are E4M3 bytes: expert rows in MXFP8 times each expert's
// matrix held as MX values in the compute dtype (ops::make_weight_copies). It computes either
// MX GEMM of the forward and input gradient, which multiply an operand quantized along the
// contraction by a weight copy quantized along it too:
//   forward:        out (M, N) = x (M, K) w[e] (K, N)     = x  b[e]^T, b = w^T   (E, N, K)
//   input gradient: dx  (M, K) = dy (M, N) w[e]^T         = dy b[e]^T, b = w     (E, K, N)
// The definition (the CPU reference) dequantizes a exactly (ops/mx.h) and runs the grouped GEMM;
// on an H200, over 128-row segments, one kernel converts a's E4M3 blocks to bf16 in registers on
// their way to the tensor cores (ops/cuda/cutlass/mx_gemm_sm90.cu says why that way). The MoE
// layer does not call it: its operands' MX values are written in bf16 by the kernels that make
// them, which costs less on sm_90 (ops/expert_gemm.h, docs/benchmarks-history.md).
#pragma once
#include "core/quant.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops {

// out (M, P) = a_e (M, Q) b[e]^T for each expert e's rows: a quantized along dim0 (Q, a
// multiple of 32), b (E, P, Q) and out in the compute dtype (bf16 on the GPU, f32/f64 on the
// CPU). The padding rows of a padded layout are written and meaningless, as grouped_gemm's.
void mx_grouped_gemm(const QuantTensor& a, const Tensor& b, const ExpertRows& rows, Tensor& out);

}  // namespace mt::ops
