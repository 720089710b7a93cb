// Grouped GEMMs for the experts: expert e's rows of x multiply w[e]. Row counts are data
// (routing), shapes are static: M = tokens * top_k rows, or more in a padded layout.
#pragma once
#include "core/tensor.h"
#include "ops/gemm.h"

namespace mt::ops {

// Where expert e's rows are: offsets[e + 1] - offsets[e] of them (offsets: i64 (E + 1), prefix
// sums of the counts), starting at row segments[e]. Dense (built from the offsets alone):
// segments are the offsets. Padded (ops::make_expert_permutation with align > 1): each segment
// starts at a multiple of `align` rows, and the rows between an expert's last one and the next
// segment are padding, which no op reads and which the forward and input-gradient products may
// write. Over 128-row segments the GPU runs the input gradient and the short-K forward (the down
// projection's) with one TMA descriptor per operand (whole row tiles per expert).
struct ExpertRows {
  ExpertRows(const Tensor& offsets) : offsets(offsets), segments(offsets) {}  // NOLINT: dense
  ExpertRows(const Tensor& offsets, const Tensor& segments, int64_t align)
      : offsets(offsets), segments(segments), align(align) {}
  Tensor offsets;
  Tensor segments;
  int64_t align = 1;
};

// The product of the forward and the input gradient: out rows of expert e = a_e op(w[e]), w
// (E, K, N): a (M, K) -> out (M, N) as is, a (M, N) -> out (M, K) transposed. Padding rows of out
// may be written.
void grouped_gemm(const Tensor& a, const Tensor& w, Transpose tw, const ExpertRows& rows,
                  Tensor& out);
// x (M, K), w (E, K, N), out (M, N).
void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows, Tensor& out);
// dx (M, K) = dy_e w[e]^T, overwritten.
void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                 Tensor& dx);
// dw[e] (K, N) += x_e^T dy_e: the ragged-K product; experts with no rows keep their gradient.
// Accumulate::kNo overwrites instead (experts with no rows get zeros): the first gradient of a
// step needs neither a zeroed buffer nor a read of it.
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                  Tensor& dw, Accumulate accumulate = Accumulate::kYes);

}  // namespace mt::ops
