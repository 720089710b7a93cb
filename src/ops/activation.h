// SwiGLU on a fused gate|up projection: h (M, 2F) holds gate in columns [0, F) and up in
// [F, 2F); a = silu(gate) * up, silu(g) = g * sigmoid(g).
#pragma once
#include "core/tensor.h"
#include "ops/fp8.h"
#include "ops/mx.h"

namespace mt::ops {

// What an MoE layer's expert rows add to the plain SwiGLU; every member is optional.
struct SwigluRows {
  // i32 (M): rows whose entry is negative are padding (a padded expert layout's
  // ExpertPermutation::source_token): skipped, their outputs left as they are.
  const Tensor* token = nullptr;
  // (M): a = weight * silu(gate) * up, the routing weight of the row's choice (h's dtype on the
  // CPU, f32 on the GPU). The down projection is linear, so this equals weighting the expert's
  // output, and the combine becomes a plain sum whose backward needs no expert output.
  const Tensor* weight = nullptr;
};

// mx (both directions): the output's MX values too (ops/mx.h; padding rows left as they are on
// the GPU); fp8 (both directions): the output's FP8 rows too (ops/fp8.h), not with mx.
void swiglu_forward(const Tensor& h, Tensor& a, const SwigluRows& rows = {},
                    const MxValuesOut* mx = nullptr, const Fp8RowsOut* fp8 = nullptr);
// dh (M, 2F) overwritten (padding rows: left as they are). With rows.weight, dweight (M, the
// weight's dtype) is overwritten too: d loss / d weight = <da, silu(gate) * up> per row.
void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const SwigluRows& rows = {},
                     Tensor* dweight = nullptr, const MxValuesOut* mx = nullptr,
                     const Fp8RowsOut* fp8 = nullptr);

}  // namespace mt::ops
