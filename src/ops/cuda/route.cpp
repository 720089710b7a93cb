// The router ops on the GPU (ops/cuda/ops.h): checks with named messages, then route.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void router_forward(const Tensor& logits, const Tensor& bias, int top_k, bool norm_topk,
                    ops::RoutingMode mode, ops::Routing& out) {
  const profile::Phase phase("gpu.router_forward");
  expect_dtype(logits, DType::kF32, "router logits (GPU: f32)");
  const int64_t n = logits.dim(0), e = logits.dim(1);
  MT_CHECK(e <= kernels::kMaxRoutedExperts && top_k <= kernels::kMaxRoutedTopK,
           "GPU routing: {} experts, top-{}; the kernels take up to {} experts and top-{}", e,
           top_k, kernels::kMaxRoutedExperts, kernels::kMaxRoutedTopK);
  out.scores = gpu_empty({n, e}, DType::kF32);
  out.expert_index = gpu_empty({n, top_k}, DType::kI32);
  out.expert_weight = gpu_empty({n, top_k}, DType::kF32);
  out.tokens_per_expert = gpu_empty({e}, DType::kI64);
  MT_CUDA_CHECK(kernels::router_forward(
      logits.data<float>(), bias.defined() ? bias.data<float>() : nullptr, n, static_cast<int>(e),
      top_k, norm_topk, mode, out.scores.data<float>(), out.expert_index.data<int32_t>(),
      out.expert_weight.data<float>(), out.tokens_per_expert.data<int64_t>(), stream()));
}

ops::AuxStats router_aux_stats(const ops::Routing& r) {
  const profile::Phase phase("gpu.router_aux_stats");
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1);
  ops::AuxStats s{r.tokens_per_expert.clone(), gpu_empty({e}, DType::kF32),
                  Tensor::empty({1}, DType::kI64)};
  Tensor partial = gpu_empty(
      {static_cast<int64_t>(kernels::column_sum_workspace(static_cast<int>(e)) / sizeof(float))},
      DType::kF32);
  MT_CUDA_CHECK(kernels::column_sum(r.scores.data<float>(), n, static_cast<int>(e),
                                    partial.data<float>(), s.score_sum.data<float>(), stream()));
  s.tokens.data<int64_t>()[0] = n;
  return s;
}

Tensor router_aux_loss(const ops::AuxStats& s) {
  const int64_t e = s.score_sum.numel();
  const double n = static_cast<double>(s.tokens.item(0));
  Tensor out = gpu_empty({1}, DType::kF64);
  MT_CUDA_CHECK(kernels::router_aux_loss(on_device(s.tokens_per_expert).data<int64_t>(),
                                         s.score_sum.data<float>(), static_cast<int>(e),
                                         n > 0 ? static_cast<double>(e) / (n * n) : 0.0,
                                         out.data<double>(), stream()));
  return out;
}

void add_aux_stats(const ops::AuxStats& layer, ops::AuxStats& pooled) {
  MT_CUDA_CHECK(kernels::add_aux_stats(
      on_device(layer.tokens_per_expert).data<int64_t>(), layer.score_sum.data<float>(),
      static_cast<int>(layer.score_sum.numel()), pooled.tokens_per_expert.data<int64_t>(),
      pooled.score_sum.data<float>(), stream()));
}

void router_backward(const ops::Routing& r, int top_k, bool norm_topk, const ops::AuxStats& stats,
                     const Tensor& dweight, double aux_grad, Tensor& dlogits) {
  const profile::Phase phase("gpu.router_backward");
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1);
  const double total = static_cast<double>(stats.tokens.item(0));
  const Tensor counts = on_device(stats.tokens_per_expert);
  MT_CUDA_CHECK(kernels::router_backward(
      r.scores.data<float>(), r.expert_index.data<int32_t>(), dweight.data<float>(),
      counts.data<int64_t>(), aux_grad * static_cast<double>(e) / (total * total), n,
      static_cast<int>(e), top_k, norm_topk, dlogits.data<float>(), stream()));
}

}  // namespace mt::cuda
