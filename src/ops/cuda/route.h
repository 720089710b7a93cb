// The router's kernels (route.cu) behind ops/route.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/routing_mode.h"

namespace mt::cuda::kernels {

// The routing kernels keep one token's experts in a warp's registers and its choices in lanes.
constexpr int kMaxRoutedExperts = 1024;
constexpr int kMaxRoutedTopK = 16;
// logits, scores f32 (n, e); index i32 / weight f32 (n, k); counts i64 (e), zeroed here.
// *out = E / N^2 * sum_e counts[e] * score_sum[e] (the load-balancing loss), N = sum(counts) /
// top_k read on the device (0 when N is 0).
cudaError_t router_aux_loss(const int64_t* counts, const float* score_sum, int e, int top_k,
                            double* out, cudaStream_t stream);
// counts (e) = choices per expert of the tokens whose padding byte is 0 (index i32 (n, k)).
cudaError_t expert_counts(const int32_t* index, const uint8_t* padding, int64_t n, int e, int k,
                          int64_t* counts, cudaStream_t stream);
// pooled_counts[e] += counts[e], pooled_sum[e] += score_sum[e].
cudaError_t add_aux_stats(const int64_t* counts, const float* score_sum, int e,
                          int64_t* pooled_counts, float* pooled_sum, cudaStream_t stream);
cudaError_t router_forward(const float* logits, const float* bias, int64_t n, int e, int k,
                           bool norm_topk, ops::RoutingMode mode, float* scores, int32_t* index,
                           float* weight, int64_t* counts, cudaStream_t stream);
// out (e) = column sums of scores (n, e) over the rows whose padding byte is 0 (padding null:
// every row); partial: column_sum_workspace(e) bytes.
size_t column_sum_workspace(int e);
cudaError_t column_sum(const float* scores, const uint8_t* padding, int64_t n, int e,
                       float* partial, float* out, cudaStream_t stream);
// The aux term of token t's score gradient is aux_grad * E * counts[c] / N^2 (N = sum(counts) /
// k, the whole batch's real tokens, read on the device into the workspace's
// router_backward_workspace() bytes), 0 for padding tokens (padding null: none); dlogits f32
// (n, e).
size_t router_backward_workspace();
cudaError_t router_backward(const float* scores, const int32_t* index, const float* dweight,
                            const int64_t* counts, const uint8_t* padding, double aux_grad,
                            int64_t n, int e, int k, bool norm_topk, double* workspace,
                            float* dlogits, cudaStream_t stream);

}  // namespace mt::cuda::kernels
