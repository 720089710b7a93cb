// SwiGLU on a fused gate|up projection: h (M, 2F) holds gate in columns [0, F) and up in
// [F, 2F); a = silu(gate) * up, silu(g) = g * sigmoid(g).
#pragma once
#include "core/tensor.h"

namespace mt::ops {

// row_token (i32 (M), optional): rows whose entry is negative are padding (a padded expert
// layout's ExpertPermutation::source_token): skipped, their outputs left as they are.
void swiglu_forward(const Tensor& h, Tensor& a, const Tensor* row_token = nullptr);
// dh (M, 2F) overwritten (padding rows: left as they are).
void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh,
                     const Tensor* row_token = nullptr);

}  // namespace mt::ops
