// The expert permutation's CPU reference (permute.cpp), called by ops/permute.h's front door once
// it has checked the arguments; the MX values of permuted rows are the front door's.
#pragma once
#include "core/tensor.h"
#include "ops/permute.h"

namespace mt::ops::cpu {

void make_expert_permutation(const Tensor& expert_index, int64_t num_experts,
                             ExpertPermutation& out, int64_t align, int64_t routed);
void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp);
// out[t] = residual[t] (or 0) + sum_j rows[row_of_choice[t*k + j]], in token order over the k
// copies: deterministic, no scatter races.
void sum_token_rows(const Tensor& rows, const ExpertPermutation& p, const Tensor* residual,
                    Tensor& out);
void unpermute_rows(const Tensor& yp, const ExpertPermutation& p, Tensor& y);
void unpermute_rows_backward(const Tensor& dy, const ExpertPermutation& p, Tensor& dyp);

}  // namespace mt::ops::cpu
