// SwiGLU on a fused gate|up projection: h (M, 2F) holds gate in columns [0, F) and up in
// [F, 2F); a = silu(gate) * up, silu(g) = g * sigmoid(g).
#pragma once
#include "core/tensor.h"

namespace mt::ops {

void swiglu_forward(const Tensor& h, Tensor& a);
// dh (M, 2F) overwritten.
void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh);

}  // namespace mt::ops
