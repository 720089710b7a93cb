// Dense matrix products. Weights are stored (in, out) so that a linear layer is y = x W.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

enum class Transpose { kNo, kYes };
enum class Accumulate { kNo, kYes };

// c (M, N) = op(a) (M, K) @ op(b) (K, N), plus the old c when accumulating.
void gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, Tensor& c, Accumulate acc);

// Linear layer without bias. x (N, in), w (in, out), y (N, out).
void linear_forward(const Tensor& x, const Tensor& w, Tensor& y);
// y = residual + x w, the residual added in the GEMM's epilogue (on the GPU cuBLASLt reads it
// as C and writes D = y): no separate pass over the sum. residual and y (N, out), distinct.
void linear_forward_residual(const Tensor& x, const Tensor& w, const Tensor& residual, Tensor& y);
// dx = dy w^T (added to dx with dx_accumulate = kYes: several projections of one input sum their
// input gradients inside the GEMM); dw += x^T dy. With tw = kYes, w is stored (out, in) and used
// transposed (a tied LM head's embedding table): dx = dy w, dw += dy^T x.
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw,
                     Accumulate dx_accumulate = Accumulate::kNo, Transpose tw = Transpose::kNo);
// dw += x^T dy alone (linear_backward's second product, beside an input gradient made elsewhere);
// with tw = kYes the weight is stored (out, in) and used transposed (a tied LM head's embedding
// table): dw += dy^T x.
void linear_backward_weight(const Tensor& x, const Tensor& dy, Tensor& dw,
                            Transpose tw = Transpose::kNo);

}  // namespace mt::ops
