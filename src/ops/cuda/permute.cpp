// The expert permutation ops on the GPU (ops/cuda/ops.h): checks with named messages, then
// permute.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

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

void peer_slots(const Tensor& to_peer, int64_t region_rows, Tensor& out) {
  MT_CHECK(out.device() == Device::kCUDA, "peer slots must be on the GPU");
  MT_CUDA_CHECK(kernels::peer_slots(to_peer.data<int32_t>(), to_peer.dim(0),
                                    static_cast<int>(to_peer.dim(1)), region_rows,
                                    out.data<int32_t>(), stream()));
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

}  // namespace mt::cuda
