// The FP8 blockwise expert products (DeepSeek-V3's recipe): E4M3 operands with f32 block scales
// (ops/fp8.h), products accumulated in f32 and promoted with the blocks' scales every 128 of the
// contraction. The definition (the CPU reference) dequantizes both operands exactly (f64) and
// multiplies in f64; on an H200 they run on the FP8 tensor cores, every per-expert argument built
// on the device: short contractions (the down forward) over a padded layout by our
// warp-specialized kernel (ops/cuda/cutlass/fp8_gemm_sm90_fixed.cu), the rest by CUTLASS's Hopper
// blockwise-scaled grouped kernels (ops/cuda/cutlass/fp8_gemm_sm90.cuh).
#pragma once
#include "core/quant.h"
#include "core/tensor.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"

namespace mt::ops {

// out (M, P) = a_e (M, Q) b[e]^T over each expert's rows: the forward (a = x, b = w^T: w's
// dim1 copy) and the input gradient (a = dy, b = w: its dim0 copy). a in 1 x 128 blocks along
// dim0 (Q a multiple of 128), b (E, P, Q) stored, in 128 x 128 tiles. out bf16 on the GPU (f32
// or f64 on the CPU). The padding rows of a padded layout are written and meaningless.
void fp8_grouped_gemm(const QuantTensor& a, const QuantTensor& b, const ExpertRows& rows,
                      Tensor& out);

// dw[e] (K, N) (+)= x_e^T dy_e: the weight gradient from x (M, K) and dy (M, N) quantized along
// the tokens per expert (ops::fp8_quantize_expert_rows: 1 x 128 along dim1). dw f32 (f64 on the
// CPU); Accumulate::kNo overwrites (experts with no rows get zeros).
void fp8_grouped_gemm_weight(const QuantTensor& x, const QuantTensor& dy, const ExpertRows& rows,
                             Tensor& dw, Accumulate accumulate = Accumulate::kYes);

}  // namespace mt::ops
