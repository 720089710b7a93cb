// The CUDA launchers, one line per op: the ops in src/ops/*.h call these when their tensors are
// on the GPU. Same shapes and semantics as the CPU reference; storage f32 or bf16 (compute in
// fp32); saved statistics (rstd, lse) are always f32. All run on the thread's stream
// (cuda::stream()).
#pragma once
#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/mx.h"
#include "ops/optim.h"
#include "ops/permute.h"
#include "ops/route.h"

namespace mt::cuda {

// c (M, N) = op(a) op(b) (+ c): a, b f32 or bf16; c the same or f32 (weight gradients).
void gemm(const Tensor& a, ops::Transpose ta, const Tensor& b, ops::Transpose tb, Tensor& c,
          ops::Accumulate acc);
// d (M, N) = a b + c, c read by the epilogue (bf16 a, b, c, d; c and d distinct).
void gemm_residual(const Tensor& a, const Tensor& b, const Tensor& c, Tensor& d);
// Grouped GEMMs over experts with the rows' offsets and segments on the device: no host sync.
void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ops::ExpertRows& rows,
                          Tensor& out);
void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const ops::ExpertRows& rows,
                                 Tensor& dx);
void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ops::ExpertRows& rows,
                                  Tensor& dw, ops::Accumulate acc);

// Attention, lse f32: cuDNN's fused SDPA where it applies (bf16, head dims multiples of 8 up
// to 256; deterministic backward), else the reference kernel (attention.cu).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       const ops::Documents& docs, double scale, Tensor& out, Tensor& lse);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const ops::Documents& docs,
                        double scale, Tensor& dq, Tensor& dk, Tensor& dv);
// The two implementations, named for tests and benchmarks.
void reference_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const ops::Documents& docs, double scale, Tensor& out,
                                 Tensor& lse);
void reference_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  const ops::Documents& docs, double scale, Tensor& dq, Tensor& dk,
                                  Tensor& dv);
bool cudnn_attention_available();  // built with the cuDNN frontend
bool cudnn_attention_supports(const Tensor& q, const Tensor& v);
void cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const ops::Documents& docs, double scale, Tensor& out, Tensor& lse);
// The backward runs over groups of KV heads (with their query heads) when its workspace for all
// heads at once would exceed workspace_budget_bytes (the deterministic algorithm's grows with
// heads and document length); the results are the same bit for bit.
inline constexpr int64_t kAttentionWorkspaceBudget = int64_t{1} << 30;
void cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, const Tensor& dout, const ops::Documents& docs,
                              double scale, bool deterministic, Tensor& dq, Tensor& dk, Tensor& dv,
                              int64_t workspace_budget_bytes = kAttentionWorkspaceBudget);
// Embedding (embedding.cpp): forward is a row gather; backward sums the rows of each id in token
// order (sorted by id, deterministic) into dtable.
void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out);
void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable);

// Router and permutation (route.cpp, permute.cpp): logits, scores, weights f32; rows f32 or bf16.
void router_forward(const Tensor& logits, const Tensor& bias, int top_k, bool norm_topk,
                    ops::RoutingMode mode, ops::Routing& out);
ops::AuxStats router_aux_stats(const ops::Routing& r,
                               const Tensor& padding);  // counts and sums stay on the GPU
Tensor router_aux_loss(const ops::AuxStats& s);         // one f64 on the GPU
void add_aux_stats(const ops::AuxStats& layer, ops::AuxStats& pooled);  // counts and sums
void router_backward(const ops::Routing& r, int top_k, bool norm_topk, const ops::AuxStats& stats,
                     const Tensor& padding, const Tensor& dweight, double aux_grad,
                     Tensor& dlogits);
void make_expert_permutation(const Tensor& expert_index, int64_t experts, int64_t align,
                             int64_t routed, ops::ExpertPermutation& out);
// Row moves copy 2- and 4-byte elements of any dtype; a negative index gives a zero row.
void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst);
// The choices of expert parallelism (ops/permute.h), i32 index tensors on the GPU.
void peer_choices(const Tensor& expert_index, int64_t peers, int64_t per_peer, Tensor& out);
void peer_counts(const Tensor& expert_index, int64_t peers, int64_t per_peer, Tensor& out);
void local_choices(const Tensor& expert_index, int64_t rank, int64_t per_peer, Tensor& out,
                   const Tensor* received_counts);
void peer_slots(const Tensor& to_peer, int64_t region_rows, Tensor& out);
void region_slots(const Tensor& received_counts, int64_t capacity, Tensor& out);
void place_rows(const Tensor& x, const Tensor& slot, int64_t capacity, Tensor& out);
// dst[row_of_choice[t * k + j]] = src[t]: the expert-major permutation, each token read once.
// The three row writers below take an optional ops::MxValuesOut (checked by the front door) and
// return whether their kernel wrote it (false: the caller runs ops::write_mx_values).
bool scatter_token_rows(const Tensor& src, const Tensor& row_of_choice, int64_t k, Tensor& dst,
                        const ops::MxValuesOut* mx = nullptr);
// out[t] = residual[t] + sum_j rows[row_of_choice[t * k + j]] (residual optional).
void sum_token_rows(const Tensor& rows, const Tensor& row_of_choice, const Tensor* residual,
                    int64_t k, Tensor& out);
// MX conversions (mx.cpp): f32 or bf16 in (quantize) and out (dequantize); checked by ops/mx.h.
void mx_quantize(const Tensor& x, MxScaleRule rule, MxTensor& out);
void mx_dequantize(const MxTensor& q, Tensor& out);
// dim0: out in x's layout; dim1: transposed (ops::mx_round_trip_transposed).
void mx_round_trip(const Tensor& x, MxAxis axis, MxScaleRule rule, Tensor& out);
void mx_round_trip_both_axes(const Tensor& x, MxScaleRule rule, Tensor& dim0, Tensor& transposed);
void mx_round_trip_expert_rows(const Tensor& x, const ops::ExpertRows& rows, MxScaleRule rule,
                               Tensor& out);
// The MX expert product (mx_gemm.cpp; shapes checked by ops/mx_gemm.h).
void mx_grouped_gemm(const MxTensor& a, const Tensor& b, const ops::ExpertRows& rows, Tensor& out);
void add(const Tensor& a, const Tensor& b, Tensor& out);
void convert(const Tensor& src, Tensor& dst);  // f32 <-> bf16 on the GPU
double sum_of_squares(const Tensor& x);        // deterministic; waits for the GPU
void scale_(Tensor& x, double factor);

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw);
void rope_apply(const Tensor& x, const Tensor& positions, double theta, int direction, Tensor& y);
// row_token: device i32 marks (negative: padding row, skipped); row_weight (M) and drow_weight:
// shapes and devices checked by ops/activation.h, f32 here. Null where absent.
bool swiglu_forward(const Tensor& h, Tensor& a, const int32_t* row_token, const Tensor* row_weight,
                    const ops::MxValuesOut* mx);
bool swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const int32_t* row_token,
                     const Tensor* row_weight, Tensor* drow_weight, const ops::MxValuesOut* mx);
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, const Tensor& grad_scale, Tensor& dlogits);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const ops::AdamWHyper& h,
                Tensor* compute);  // compute: bf16 or null
// The hyper-parameters as the kernel reads them (u8 bytes on the GPU), and the step reading them
// from there: a captured optimizer step replays with each step's values.
Tensor adamw_scalars(const ops::AdamWHyper& h);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const Tensor& scalars,
                Tensor* compute);

}  // namespace mt::cuda
