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
// dx (N, in) is overwritten; dw (in, out) accumulates (gradient accumulation across calls).
void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw);

}  // namespace mt::ops
