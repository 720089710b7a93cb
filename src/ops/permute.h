// Moving token rows between token order (N tokens, k choices each) and expert-major order
// (N*k rows, expert e owning expert_offsets[e + 1] - expert_offsets[e] rows from row
// segments[e]). Within an expert, rows keep token order (stable), so the layout is a pure
// function of the routing. Dense (align 1): segments are the offsets and the rows number
// M = N*k. Padded (align > 1): each expert's segment starts at a multiple of `align` rows, the
// buffer has M = N*k + E*(align - 1) rows (the most any routing needs) and the rows between an
// expert's last and the next segment are padding, never read (see ExpertRows).
#pragma once
#include "core/tensor.h"
#include "ops/fp8.h"
#include "ops/grouped_gemm.h"
#include "ops/mx.h"

namespace mt::ops {

struct ExpertPermutation {
  Tensor source_token;    // i32 (M): the token whose row fills expert-major row i; -1: padding
  Tensor row_of_choice;   // i32 (N * k): expert-major row of (token t, choice j) at t*k + j
  Tensor expert_offsets;  // i64 (E + 1): prefix sums of the experts' row counts
  Tensor segments;        // i64 (E + 1): expert e's first row (the offsets when dense)
  int64_t align = 1;

  int64_t rows() const { return source_token.numel(); }  // M
  ExpertRows expert_rows() const { return {expert_offsets, segments, align}; }
};

// Rows a permutation of `choices` (N*k) over `experts` takes with segments aligned to `align`.
inline int64_t permuted_rows(int64_t choices, int64_t experts, int64_t align) {
  return choices + (align > 1 && choices > 0 ? experts * (align - 1) : 0);
}

// expert_index i32 (N, k) -> permutation over E experts, segments aligned to `align` rows.
// A negative index is a choice not routed here (expert parallelism: another rank's expert): it
// gets no row and row_of_choice -1, and every op below skips it (unpermute_rows writes zeros).
// `routed`: the number of non-negative indices, or more: the dense layout then has that many
// rows (padded: permuted_rows(routed, ...)), those past the routed ones naming no token; -1 when
// every index is routed (the GPU cannot count them without waiting for the device).
void make_expert_permutation(const Tensor& expert_index, int64_t num_experts,
                             ExpertPermutation& out, int64_t align = 1, int64_t routed = -1);

// xp (M, D) = x (N, D) rows gathered into expert-major order; padding rows are left as they are.
// The row moves copy any dtype; the sums (permute_rows_backward, combine_forward) need a float.
// mx: the rows' MX values too (ops/mx.h); fp8: their FP8 copies in 1 x 128 blocks (ops/fp8.h), a
// token's row quantized once for its k copies; not both. On the GPU their padding rows are left
// as they are.
void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp,
                  const MxValuesOut* mx = nullptr, const Fp8RowsOut* fp8 = nullptr);
// FP8 rows moved as permute_rows moves rows: x (N, D) in 1 x 128 blocks along dim0 (rows an FP8
// wire delivered) -> xp (M, D) in the same format, data and scales as they are (padding rows
// left as they are).
void permute_rows(const QuantTensor& x, const ExpertPermutation& p, QuantTensor& xp);
// dx (N, D) overwritten: each token sums the gradients of its k copies.
void permute_rows_backward(const Tensor& dxp, const ExpertPermutation& p, Tensor& dx);

// Back to token order: y (N, k, D) with y[t, j] = yp[row_of_choice[t*k + j]] (0: not routed).
void unpermute_rows(const Tensor& yp, const ExpertPermutation& p, Tensor& y);
// dyp (M, D) overwritten (padding rows: left as they are).
void unpermute_rows_backward(const Tensor& dy, const ExpertPermutation& p, Tensor& dyp);

// Back to token order in one pass: out[t] = sum_j yp[row(t, j)], plus residual[t] when given (the
// block's residual add, folded into the same pass). The routing weights are already in the rows
// (ops::SwigluRows::weight), so the backward is permute_rows: each copy receives dout[t].
void combine_forward(const Tensor& yp, const ExpertPermutation& p, Tensor& out,
                     const Tensor* residual = nullptr);

}  // namespace mt::ops
