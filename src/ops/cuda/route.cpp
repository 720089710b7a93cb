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

ops::AuxStats router_aux_stats(const ops::Routing& r, const Tensor& padding) {
  const profile::Phase phase("gpu.router_aux_stats");
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1), k = r.expert_index.dim(1);
  const Tensor pad_tensor = padding.defined() ? on_device(padding) : Tensor();
  const uint8_t* pad = pad_tensor.defined() ? pad_tensor.data<uint8_t>() : nullptr;
  ops::AuxStats s{Tensor(), gpu_empty({e}, DType::kF32), k};
  if (pad) {
    s.tokens_per_expert = gpu_empty({e}, DType::kI64);
    MT_CUDA_CHECK(kernels::expert_counts(r.expert_index.data<int32_t>(), pad, n,
                                         static_cast<int>(e), static_cast<int>(k),
                                         s.tokens_per_expert.data<int64_t>(), stream()));
  } else {
    s.tokens_per_expert = r.tokens_per_expert.clone();
  }
  Tensor partial = gpu_empty(
      {static_cast<int64_t>(kernels::column_sum_workspace(static_cast<int>(e)) / sizeof(float))},
      DType::kF32);
  MT_CUDA_CHECK(kernels::column_sum(r.scores.data<float>(), pad, n, static_cast<int>(e),
                                    partial.data<float>(), s.score_sum.data<float>(), stream()));
  return s;
}

Tensor router_aux_loss(const ops::AuxStats& s) {
  const int64_t e = s.score_sum.numel();
  Tensor out = gpu_empty({1}, DType::kF64);
  MT_CUDA_CHECK(kernels::router_aux_loss(on_device(s.tokens_per_expert).data<int64_t>(),
                                         s.score_sum.data<float>(), static_cast<int>(e),
                                         static_cast<int>(s.top_k), out.data<double>(), stream()));
  return out;
}

void add_aux_stats(const ops::AuxStats& layer, ops::AuxStats& pooled) {
  MT_CUDA_CHECK(kernels::add_aux_stats(
      on_device(layer.tokens_per_expert).data<int64_t>(), layer.score_sum.data<float>(),
      static_cast<int>(layer.score_sum.numel()), pooled.tokens_per_expert.data<int64_t>(),
      pooled.score_sum.data<float>(), stream()));
}

void router_backward(const ops::Routing& r, int top_k, bool norm_topk, const ops::AuxStats& stats,
                     const Tensor& padding, const Tensor& dweight, double aux_grad,
                     Tensor& dlogits) {
  const profile::Phase phase("gpu.router_backward");
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1);
  const Tensor counts = on_device(stats.tokens_per_expert);
  const Tensor pad = padding.defined() ? on_device(padding) : Tensor();
  Tensor scale = gpu_empty(
      {static_cast<int64_t>(kernels::router_backward_workspace() / sizeof(double))}, DType::kF64);
  MT_CUDA_CHECK(kernels::router_backward(r.scores.data<float>(), r.expert_index.data<int32_t>(),
                                         dweight.data<float>(), counts.data<int64_t>(),
                                         pad.defined() ? pad.data<uint8_t>() : nullptr, aux_grad, n,
                                         static_cast<int>(e), top_k, norm_topk,
                                         scale.data<double>(), dlogits.data<float>(), stream()));
}

}  // namespace mt::cuda
