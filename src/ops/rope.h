// Rotary embedding, Hugging Face "rotate half" convention: the head dimension splits into
// halves (x1, x2) and pair i rotates by angle position * theta^(-2i / head_dim):
//   y1 = x1 cos - x2 sin,  y2 = x2 cos + x1 sin.
// Positions are per token so that they restart at each packed document.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

// x, y (N, H, head_dim); positions i32 (N). y may not alias x.
void rope_forward(const Tensor& x, const Tensor& positions, double theta, Tensor& y);
// The inverse rotation; dx overwritten.
void rope_backward(const Tensor& dy, const Tensor& positions, double theta, Tensor& dx);

}  // namespace mt::ops
