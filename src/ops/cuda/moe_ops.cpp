// Tensor-level wrappers of the MoE kernels (moe.cu): checks, device allocations from the
// caching allocator, and the launch.
#include "core/cuda_check.h"
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

void make_expert_permutation(const Tensor& expert_index, int64_t experts, int64_t align,
                             int64_t routed, ops::ExpertPermutation& out) {
  const profile::Phase phase("gpu.make_expert_permutation");
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1), m = n * k;
  out.source_token =
      gpu_empty({ops::permuted_rows(routed < 0 ? m : routed, experts, align)}, DType::kI32);
  out.row_of_choice = gpu_empty({m}, DType::kI32);
  out.expert_offsets = gpu_empty({experts + 1}, DType::kI64);
  out.segments = align > 1 ? gpu_empty({experts + 1}, DType::kI64) : out.expert_offsets;
  out.align = align;
  const size_t bytes = kernels::permutation_workspace(m, static_cast<int>(experts));
  Tensor ws = gpu_empty({static_cast<int64_t>(bytes)}, DType::kU8);
  MT_CUDA_CHECK(kernels::expert_permutation(
      expert_index.data<int32_t>(), m, static_cast<int>(k), static_cast<int>(experts), align,
      routed >= 0, ws.raw(), bytes, out.rows(), out.source_token.data<int32_t>(),
      out.row_of_choice.data<int32_t>(), out.expert_offsets.data<int64_t>(),
      out.segments.data<int64_t>(), stream()));
}

void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst) {
  const profile::Phase phase("gpu.gather_rows");
  MT_CHECK(src.dtype() == dst.dtype(), "gather of {} rows into {}", dtype_name(src.dtype()),
           dtype_name(dst.dtype()));
  const CopyUnits u = copy_units(src, dst.dim(1));
  MT_CUDA_CHECK(kernels::gather_rows(u.storage, src.raw(), index.data<int32_t>(), dst.raw(),
                                     dst.dim(0), u.per_row, stream()));
}

void peer_choices(const Tensor& expert_index, int64_t peers, int64_t per_peer, Tensor& out) {
  MT_CUDA_CHECK(kernels::peer_choices(
      expert_index.data<int32_t>(), expert_index.dim(0), static_cast<int>(expert_index.dim(1)),
      static_cast<int>(peers), static_cast<int>(per_peer), out.data<int32_t>(), stream()));
}

void peer_counts(const Tensor& expert_index, int64_t peers, int64_t per_peer, Tensor& out) {
  MT_CHECK(out.numel() <= 8192, "{} exchange counts: more than one block's shared histogram",
           out.numel());
  MT_CUDA_CHECK(kernels::peer_counts(expert_index.data<int32_t>(), expert_index.dim(0),
                                     static_cast<int>(expert_index.dim(1)), static_cast<int>(peers),
                                     static_cast<int>(per_peer), out.data<int64_t>(), stream()));
}

void local_choices(const Tensor& expert_index, int64_t rank, int64_t per_peer, Tensor& out,
                   const Tensor* received_counts) {
  const int64_t rows = expert_index.dim(0);
  const Tensor received = received_counts ? on_device(*received_counts) : Tensor();
  MT_CUDA_CHECK(kernels::local_choices(
      expert_index.data<int32_t>(), expert_index.numel(), static_cast<int>(expert_index.dim(1)),
      static_cast<int>(rank * per_peer), static_cast<int>(per_peer),
      received_counts ? received.data<int64_t>() : nullptr,
      received_counts ? rows / received.dim(0) : rows, out.data<int32_t>(), stream()));
}

void slots_within_experts(const Tensor& expert_index, const ops::ExpertPermutation& p,
                          int64_t region_rows, Tensor& out) {
  MT_CUDA_CHECK(
      kernels::slots_within_experts(expert_index.data<int32_t>(), p.row_of_choice.data<int32_t>(),
                                    p.expert_offsets.data<int64_t>(), expert_index.numel(),
                                    region_rows, out.data<int32_t>(), stream()));
}

void region_slots(const Tensor& received_counts, int64_t capacity, Tensor& out) {
  const Tensor received = on_device(received_counts);
  MT_CUDA_CHECK(kernels::region_slots(received.data<int64_t>(), static_cast<int>(received.dim(0)),
                                      static_cast<int>(received.dim(1)), capacity,
                                      out.data<int32_t>(), stream()));
}

void place_rows(const Tensor& x, const Tensor& slot, int64_t capacity, Tensor& out) {
  const Tensor s = on_device(slot);
  MT_CUDA_CHECK(kernels::place_rows(
      x.raw(), x.dim(0), x.dim(1) * static_cast<int64_t>(dtype_size(x.dtype())), s.data<int32_t>(),
      static_cast<int>(s.dim(1)), capacity, out.raw(), stream()));
}

bool scatter_token_rows(const Tensor& src, const Tensor& row_of_choice, int64_t k, Tensor& dst,
                        const ops::MxValuesOut* mx) {
  const profile::Phase phase("gpu.scatter_token_rows");
  // dst may hold padding rows (a padded expert layout), which the scatter leaves as they are,
  // and fewer rows than choices (choices not routed here have none).
  MT_CHECK(src.dtype() == dst.dtype() && row_of_choice.numel() == src.dim(0) * k,
           "scatter of {} {} rows (top-{}) into {} {}", dtype_name(src.dtype()),
           shape_str(src.shape()), k, dtype_name(dst.dtype()), shape_str(dst.shape()));
  // The fused MX values need the rows' own float storage; otherwise rows move as raw units.
  const bool fusable = src.dtype() == DType::kF32 || src.dtype() == DType::kBF16;
  return launch_row_writer(fusable ? mx : nullptr, [&](const ops::MxValuesOut* with) {
    if (with)
      return kernels::scatter_token_rows(src.dtype(), src.raw(), row_of_choice.data<int32_t>(),
                                         src.dim(0), static_cast<int>(k), dst.raw(), dst.dim(1),
                                         mx_values_out(with), stream());
    const CopyUnits u = copy_units(src, dst.dim(1));
    return kernels::scatter_token_rows(u.storage, src.raw(), row_of_choice.data<int32_t>(),
                                       src.dim(0), static_cast<int>(k), dst.raw(), u.per_row,
                                       mx_values_out(nullptr), stream());
  });
}

void sum_token_rows(const Tensor& rows, const Tensor& row_of_choice, const Tensor* residual,
                    int64_t k, Tensor& out) {
  const profile::Phase phase("gpu.sum_token_rows");
  MT_CHECK(rows.dtype() == out.dtype(), "sum of {} rows into {}", dtype_name(rows.dtype()),
           dtype_name(out.dtype()));
  MT_CUDA_CHECK(kernels::sum_token_rows(storage_of(rows), rows.raw(), row_of_choice.data<int32_t>(),
                                        residual ? residual->raw() : nullptr, out.dim(0),
                                        static_cast<int>(k), out.raw(), out.dim(1), stream()));
}

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const profile::Phase phase("gpu.embedding_forward");
  MT_CHECK(ids.device() == Device::kCUDA && ids.dtype() == DType::kI32,
           "ids must be i32 on the GPU");
  gather_rows(table, ids, out);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const profile::Phase phase("gpu.embedding_backward");
  MT_CHECK(ids.device() == Device::kCUDA && ids.dtype() == DType::kI32,
           "ids must be i32 on the GPU");
  MT_CHECK(dout.dtype() == dtable.dtype() || dtable.dtype() == DType::kF32,
           "embedding gradient {} into a {} table (valid: the same dtype or f32)",
           dtype_name(dout.dtype()), dtype_name(dtable.dtype()));
  // Token positions sorted by id (stable), then each id's rows summed in token order.
  ops::ExpertPermutation by_id;
  cuda::make_expert_permutation(ids.reshape({ids.numel(), 1}), dtable.dim(0), 1, -1, by_id);
  MT_CUDA_CHECK(
      kernels::segment_sum_rows(storage_of(dout), dout.raw(), by_id.source_token.data<int32_t>(),
                                by_id.expert_offsets.data<int64_t>(), dtable.dim(0), dtable.dim(1),
                                dtable.raw(), dtable.dtype() == DType::kF32, stream()));
}

double sum_of_squares(const Tensor& x) {
  const profile::Phase phase("gpu.sum_of_squares");
  Tensor ws = gpu_empty({static_cast<int64_t>(kernels::sum_of_squares_workspace())}, DType::kU8);
  double result = 0;
  MT_CUDA_CHECK(
      kernels::sum_of_squares(storage_of(x), x.raw(), x.numel(), ws.raw(), &result, stream()));
  return result;
}

void scale_(Tensor& x, double factor) {
  const profile::Phase phase("gpu.scale_");
  MT_CUDA_CHECK(
      kernels::scale(storage_of(x), x.raw(), static_cast<float>(factor), x.numel(), stream()));
}

void convert(const Tensor& src, Tensor& dst) {
  const profile::Phase phase("gpu.convert");
  MT_CHECK(src.numel() == dst.numel() && src.dtype() != dst.dtype(), "convert of {} {} into {} {}",
           dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dst.dtype()),
           shape_str(dst.shape()));
  storage_of(dst);
  MT_CUDA_CHECK(kernels::convert(storage_of(src), src.raw(), dst.raw(), src.numel(), stream()));
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const profile::Phase phase("gpu.add");
  MT_CUDA_CHECK(kernels::add(storage_of(a), a.raw(), b.raw(), out.raw(), a.numel(), stream()));
}

}  // namespace mt::cuda
