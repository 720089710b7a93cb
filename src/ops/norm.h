// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w. QK-norm is the same op
// on (tokens * heads, head_dim) rows.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

// x (N, D), w (D); y (N, D); rstd (N) = 1 / sqrt(mean(x^2) + eps), saved for backward.
void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
// dx (N, D) overwritten; dw (D) accumulates.
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw);

}  // namespace mt::ops
