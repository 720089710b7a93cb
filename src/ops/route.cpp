// The router's front door (ops/route.h): the arguments checked once, then the CPU reference
// (ops/cpu/route.cpp) or the kernels (ops/cuda/route.cu).
#include "ops/route.h"

#include <array>

#include "core/enum_names.h"
#include "ops/cpu/route.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/route.h"
#endif

namespace mt::ops {

namespace {
constexpr std::array<EnumName<RoutingMode>, 3> kRoutingModes = {{
    {RoutingMode::kLearned, "learned"},
    {RoutingMode::kBalanced, "balanced"},
    {RoutingMode::kSkewed, "skewed"},
}};

void check_padding(const Tensor& padding, int64_t n) {
  if (!padding.defined()) return;
  expect_shape(padding, {n}, "padding mask");
  expect_dtype(padding, DType::kU8, "padding mask");
}
}  // namespace

std::string_view routing_mode_name(RoutingMode m) {
  return enum_name(kRoutingModes, m);
}

bool parse_routing_mode(std::string_view name, RoutingMode* out) {
  return parse_enum(kRoutingModes, name, out);
}

void router_forward(const Tensor& logits, const Tensor& bias, const RouterOptions& opt,
                    Routing& out) {
  MT_CHECK(logits.ndim() == 2, "router logits must be (N, E), got {}", shape_str(logits.shape()));
  const int64_t e = logits.dim(1), k = opt.top_k;
  MT_CHECK(k >= 1 && k <= e, "top_k {} outside [1, {}]", k, e);
  if (bias.defined()) expect_shape(bias, {e}, "router bias");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(logits)) {
    const profile::Phase phase("gpu.router_forward");
    expect_dtype(logits, DType::kF32, "router logits (GPU: f32)");
    const int64_t n = logits.dim(0);
    MT_CHECK(e <= cuda::kernels::kMaxRoutedExperts && k <= cuda::kernels::kMaxRoutedTopK,
             "GPU routing: {} experts, top-{}; the kernels take up to {} experts and top-{}", e, k,
             cuda::kernels::kMaxRoutedExperts, cuda::kernels::kMaxRoutedTopK);
    out.scores = cuda::gpu_empty({n, e}, DType::kF32);
    out.expert_index = cuda::gpu_empty({n, k}, DType::kI32);
    out.expert_weight = cuda::gpu_empty({n, k}, DType::kF32);
    out.tokens_per_expert = cuda::gpu_empty({e}, DType::kI64);
    MT_CUDA_CHECK(cuda::kernels::router_forward(
        logits.data<float>(), bias.defined() ? bias.data<float>() : nullptr, n, static_cast<int>(e),
        static_cast<int>(k), opt.norm_topk_prob, opt.mode, out.scores.data<float>(),
        out.expert_index.data<int32_t>(), out.expert_weight.data<float>(),
        out.tokens_per_expert.data<int64_t>(), cuda::stream()));
    return;
  }
#endif
  cpu::router_forward(logits, bias, opt, out);
}

AuxStats router_aux_stats(const Routing& r, const Tensor& padding) {
  const int64_t n = r.scores.dim(0);
  check_padding(padding, n);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(r.scores)) {
    const int64_t e = r.scores.dim(1), k = r.expert_index.dim(1);
    const profile::Phase phase("gpu.router_aux_stats");
    const Tensor pad_tensor = padding.defined() ? cuda::on_device(padding) : Tensor();
    const uint8_t* pad = pad_tensor.defined() ? pad_tensor.data<uint8_t>() : nullptr;
    AuxStats s{Tensor(), cuda::gpu_empty({e}, DType::kF32), k};
    if (pad) {
      s.tokens_per_expert = cuda::gpu_empty({e}, DType::kI64);
      MT_CUDA_CHECK(cuda::kernels::expert_counts(
          r.expert_index.data<int32_t>(), pad, n, static_cast<int>(e), static_cast<int>(k),
          s.tokens_per_expert.data<int64_t>(), cuda::stream()));
    } else {
      s.tokens_per_expert = r.tokens_per_expert.clone();
    }
    Tensor partial = cuda::gpu_empty(
        {static_cast<int64_t>(cuda::kernels::column_sum_workspace(static_cast<int>(e)) /
                              sizeof(float))},
        DType::kF32);
    MT_CUDA_CHECK(cuda::kernels::column_sum(r.scores.data<float>(), pad, n, static_cast<int>(e),
                                            partial.data<float>(), s.score_sum.data<float>(),
                                            cuda::stream()));
    return s;
  }
#endif
  return cpu::router_aux_stats(r, padding);
}

AuxStats zero_aux_stats(const AuxStats& like) {
  return {
      Tensor::zeros(like.tokens_per_expert.shape(), DType::kI64, like.tokens_per_expert.device()),
      Tensor::zeros(like.score_sum.shape(), like.score_sum.dtype(), like.score_sum.device()),
      like.top_k};
}

void add_aux_stats(const AuxStats& layer, AuxStats& pooled) {
  const int64_t e = layer.score_sum.numel();
  MT_CHECK(pooled.score_sum.numel() == e && pooled.tokens_per_expert.numel() == e &&
               layer.tokens_per_expert.numel() == e &&
               pooled.score_sum.dtype() == layer.score_sum.dtype() &&
               pooled.score_sum.device() == layer.score_sum.device() && pooled.top_k == layer.top_k,
           "aux statistics of {} experts ({}, top-{}) added to {} ({}, top-{})", e,
           dtype_name(layer.score_sum.dtype()), layer.top_k, pooled.score_sum.numel(),
           dtype_name(pooled.score_sum.dtype()), pooled.top_k);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(layer.score_sum)) {
    MT_CUDA_CHECK(cuda::kernels::add_aux_stats(
        cuda::on_device(layer.tokens_per_expert).data<int64_t>(), layer.score_sum.data<float>(),
        static_cast<int>(e), pooled.tokens_per_expert.data<int64_t>(),
        pooled.score_sum.data<float>(), cuda::stream()));
    return;
  }
#endif
  cpu::add_aux_stats(layer, pooled);
}

Tensor router_aux_loss(const AuxStats& s) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(s.score_sum)) {
    Tensor out = cuda::gpu_empty({1}, DType::kF64);
    MT_CUDA_CHECK(cuda::kernels::router_aux_loss(
        cuda::on_device(s.tokens_per_expert).data<int64_t>(), s.score_sum.data<float>(),
        static_cast<int>(s.score_sum.numel()), static_cast<int>(s.top_k), out.data<double>(),
        cuda::stream()));
    return out;
  }
#endif
  return cpu::router_aux_loss(s);
}

void router_backward(const Routing& r, const RouterOptions& opt, const AuxStats& stats,
                     const Tensor& padding, const Tensor& dweight, double aux_grad,
                     Tensor& dlogits) {
  const int64_t n = r.scores.dim(0), e = r.scores.dim(1), k = opt.top_k;
  check_padding(padding, n);
  expect_shape(dweight, {n, k}, "router dweight");
  expect_shape(dlogits, {n, e}, "router dlogits");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(r.scores)) {
    const profile::Phase phase("gpu.router_backward");
    const Tensor counts = cuda::on_device(stats.tokens_per_expert);
    const Tensor pad = padding.defined() ? cuda::on_device(padding) : Tensor();
    Tensor scale = cuda::gpu_empty(
        {static_cast<int64_t>(cuda::kernels::router_backward_workspace() / sizeof(double))},
        DType::kF64);
    MT_CUDA_CHECK(cuda::kernels::router_backward(
        r.scores.data<float>(), r.expert_index.data<int32_t>(), dweight.data<float>(),
        counts.data<int64_t>(), pad.defined() ? pad.data<uint8_t>() : nullptr, aux_grad, n,
        static_cast<int>(e), static_cast<int>(k), opt.norm_topk_prob, scale.data<double>(),
        dlogits.data<float>(), cuda::stream()));
    return;
  }
#endif
  cpu::router_backward(r, opt, stats, padding, dweight, aux_grad, dlogits);
}

}  // namespace mt::ops
