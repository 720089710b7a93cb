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

// out (M, P) = a (M, Q) b^T for one matrix b, stored (P, Q) in 128 x 128 tiles: a weight w's
// dim1 copy for the forward y = x w, its dim0 copy for the input gradient dx = dy w^T. a in 1 x
// 128 blocks along dim0. out bf16 on the GPU (our kernel over one segment of all rows, any M),
// f32 or f64 on the CPU (the definition: both dequantized exactly, the product in f64).
void fp8_gemm(const QuantTensor& a, const QuantTensor& b, Tensor& out);

// The dense layers' FP8 products (model.dense_recipe = "fp8_wgrad_with_hp"; the weight gradient
// stays the bf16 one, ops::gemm over the unquantized x and dy). w is (in, out) as stored by
// the model (tw = kNo), or (out, in) used transposed (tw = kYes: a tied LM head's embedding
// table); in and out multiples of 128.

// w's tiles in the layouts of its products (fp8_gemm's b): `forward` for y = x w, `input_gradient`
// for dx = dy w^T, each made where `use` asks for it (both from one read of w). For a layer whose
// products run several times (the LM head over its loss chunks): quantized once.
enum class Fp8LinearUse { kForward, kInputGradient, kBoth };
struct Fp8LinearWeight {
  QuantTensor forward, input_gradient;
};
Fp8LinearWeight fp8_linear_weight(const Tensor& w, Transpose tw, Fp8ScaleRule rule,
                                  Fp8LinearUse use);

// The products with w's tiles quantized at each call.
// y (N, out) = x w, x quantized already (kRow128 along dim0, (N, in)).
void fp8_linear_forward(const QuantTensor& x, const Tensor& w, Transpose tw, Fp8ScaleRule rule,
                        Tensor& y);
// dx (N, in) = dy w^T, dy (N, out) quantized here in 1 x 128 blocks, dx overwritten.
void fp8_linear_backward_input(const Tensor& dy, const Tensor& w, Transpose tw, Fp8ScaleRule rule,
                               Tensor& dx);
// linear_backward's pair in this recipe: dx (N, in) = dy w^T in FP8 (overwritten), dw += x^T dy
// in bf16 (w (in, out), tw = kNo).
void fp8_linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Fp8ScaleRule rule,
                         Tensor& dx, Tensor& dw);

}  // namespace mt::ops
