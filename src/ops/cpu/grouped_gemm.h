// The grouped GEMMs' CPU reference (grouped_gemm.cpp): one dense GEMM per expert on row slices,
// called by ops/grouped_gemm.h's front door once it has checked the layout.
#pragma once
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops::cpu {

void grouped_gemm(const Tensor& a, const Tensor& w, Transpose tw, const ExpertRows& rows,
                  Tensor& out);
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                  Tensor& dw, Accumulate accumulate);

}  // namespace mt::ops::cpu
