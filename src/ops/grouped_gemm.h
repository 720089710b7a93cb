// Grouped GEMMs for the experts: rows [offsets[e], offsets[e+1]) of x multiply w[e].
// Row counts are data (routing), shapes are static: M = tokens * top_k.
#pragma once
#include "core/tensor.h"
#include "ops/gemm.h"

namespace mt::ops {

// x (M, K), w (E, K, N), offsets i64 (E + 1), out (M, N).
void grouped_gemm_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out);
// dx (M, K) = dy_e w[e]^T, overwritten.
void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets,
                                 Tensor& dx);
// dw[e] (K, N) += x_e^T dy_e: the ragged-K product; experts with no rows keep their gradient.
// Accumulate::kNo overwrites instead (experts with no rows get zeros): the first gradient of a
// step needs neither a zeroed buffer nor a read of it.
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets,
                                  Tensor& dw, Accumulate accumulate = Accumulate::kYes);

}  // namespace mt::ops
