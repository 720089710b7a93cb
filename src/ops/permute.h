// Moving token rows between token order (N tokens, k choices each) and expert-major order
// (M = N*k rows, expert e owning rows [expert_offsets[e], expert_offsets[e+1])). Within an
// expert, rows keep token order (stable), so the layout is a pure function of the routing.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

struct ExpertPermutation {
  Tensor source_token;    // i32 (M): the token whose row fills expert-major row i
  Tensor row_of_choice;   // i32 (N * k): expert-major row of (token t, choice j) at t*k + j
  Tensor expert_offsets;  // i64 (E + 1)
};

// expert_index i32 (N, k) -> permutation over E experts.
void make_expert_permutation(const Tensor& expert_index, int64_t num_experts,
                             ExpertPermutation& out);

// xp (M, D) = x (N, D) rows gathered into expert-major order.
void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp);
// dx (N, D) overwritten: each token sums the gradients of its k copies.
void permute_rows_backward(const Tensor& dxp, const ExpertPermutation& p, Tensor& dx);

// Back to token order: y (N, k, D) with y[t, j] = yp[row_of_choice[t*k + j]].
void unpermute_rows(const Tensor& yp, const ExpertPermutation& p, Tensor& y);
// dyp (M, D) overwritten.
void unpermute_rows_backward(const Tensor& dy, const ExpertPermutation& p, Tensor& dyp);

// Weighted combine, back to token order in one pass: out[t] = sum_j weight[t, j] * yp[row(t, j)],
// plus residual[t] when given (the block's residual add, folded into the same pass).
void combine_forward(const Tensor& yp, const ExpertPermutation& p, const Tensor& weight,
                     Tensor& out, const Tensor* residual = nullptr);
// dyp (M, D) and dweight (N, k) overwritten.
void combine_backward(const Tensor& dout, const Tensor& yp, const ExpertPermutation& p,
                      const Tensor& weight, Tensor& dyp, Tensor& dweight);

}  // namespace mt::ops
