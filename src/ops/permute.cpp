// The expert permutation's front door (ops/permute.h): the arguments checked once, then the CPU
// reference (ops/cpu/permute.cpp) or the kernels (ops/cuda/permute.cu).
#include "ops/permute.h"

#include "ops/cpu/permute.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/permute.h"
#endif

namespace mt::ops {

namespace {
int64_t choices_per_token(const ExpertPermutation& p, int64_t n) {
  return n == 0 ? 0 : p.row_of_choice.numel() / n;
}

#if MOETRAIN_HAS_CUDA
// dst[row_of_choice[t * k + j]] = src[t], each token read once; the rows' MX values too where
// mx is given and the kernel can fuse them (whether it did is returned).
bool gpu_scatter_token_rows(const Tensor& src, const Tensor& row_of_choice, int64_t k, Tensor& dst,
                            const MxValuesOut* mx) {
  const profile::Phase phase("gpu.scatter_token_rows");
  const int64_t tokens = src.dim(0), width = dst.dim(1);
  // The fused MX values need the rows' own float storage; otherwise rows move as raw units.
  const auto fused = cuda::fused_mx_values(mx, src.dtype(), width, {src.raw(), dst.raw()});
  if (fused.values) {
    MT_CUDA_CHECK(cuda::kernels::scatter_token_rows(
        src.dtype(), src.raw(), row_of_choice.data<int32_t>(), tokens, static_cast<int>(k),
        dst.raw(), width, fused, cuda::kernels::kNoFp8Rows, cuda::stream()));
    return true;
  }
  const cuda::CopyUnits u = cuda::copy_units(src, width);
  MT_CUDA_CHECK(cuda::kernels::scatter_token_rows(
      u.storage, src.raw(), row_of_choice.data<int32_t>(), tokens, static_cast<int>(k), dst.raw(),
      u.per_row, fused, cuda::kernels::kNoFp8Rows, cuda::stream()));
  return false;
}
#endif
}  // namespace

void make_expert_permutation(const Tensor& expert_index, int64_t num_experts,
                             ExpertPermutation& out, int64_t align, int64_t routed) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  MT_CHECK(expert_index.ndim() == 2, "expert_index must be (N, k), got {}",
           shape_str(expert_index.shape()));
  MT_CHECK(align >= 1, "expert segments aligned to {} rows", align);
  MT_CHECK(routed >= -1, "{} routed choices", routed);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index)) {
    const profile::Phase phase("gpu.make_expert_permutation");
    const int64_t n = expert_index.dim(0), k = expert_index.dim(1), m = n * k;
    out.source_token =
        cuda::gpu_empty({permuted_rows(routed < 0 ? m : routed, num_experts, align)}, DType::kI32);
    out.row_of_choice = cuda::gpu_empty({m}, DType::kI32);
    out.expert_offsets = cuda::gpu_empty({num_experts + 1}, DType::kI64);
    out.segments = align > 1 ? cuda::gpu_empty({num_experts + 1}, DType::kI64) : out.expert_offsets;
    out.align = align;
    const size_t bytes = cuda::kernels::permutation_workspace(m, static_cast<int>(num_experts));
    Tensor ws = cuda::gpu_workspace(bytes);
    MT_CUDA_CHECK(cuda::kernels::expert_permutation(
        expert_index.data<int32_t>(), m, static_cast<int>(k), static_cast<int>(num_experts), align,
        routed >= 0, ws.raw(), bytes, out.rows(), out.source_token.data<int32_t>(),
        out.row_of_choice.data<int32_t>(), out.expert_offsets.data<int64_t>(),
        out.segments.data<int64_t>(), cuda::stream()));
    return;
  }
#endif
  cpu::make_expert_permutation(expert_index, num_experts, out, align, routed);
}

void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp, const MxValuesOut* mx,
                  const Fp8RowsOut* fp8) {
  const int64_t d = x.dim(1), m = p.rows();
  expect_shape(xp, {m, d}, "permuted rows");
  MT_CHECK(x.dtype() == xp.dtype(), "permute of {} rows into {}", dtype_name(x.dtype()),
           dtype_name(xp.dtype()));
  check_mx_values("permute_rows", xp, mx);
  check_fp8_rows("permute_rows", xp, fp8);
  MT_CHECK(!(mx && fp8), "permute_rows: MX values or FP8 rows, not both");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    if (x.dim(0) == 0) return;
    MT_CHECK(p.row_of_choice.numel() % x.dim(0) == 0, "permutation of {} choices for {} tokens",
             p.row_of_choice.numel(), x.dim(0));
    const int64_t k = choices_per_token(p, x.dim(0));
    if (fp8) {
      const profile::Phase phase("gpu.scatter_token_rows");
      cuda::launch_with_fp8_rows(fp8, xp, [&](cuda::kernels::Fp8RowsOut rows) {
        if (!rows.data) {
          gpu_scatter_token_rows(x, p.row_of_choice, k, xp, nullptr);
          return cudaSuccess;
        }
        return cuda::kernels::scatter_token_rows(
            cuda::storage_of(x), x.raw(), p.row_of_choice.data<int32_t>(), x.dim(0),
            static_cast<int>(k), xp.raw(), d, cuda::kernels::kNoMxValues, rows, cuda::stream());
      });
      return;
    }
    const bool fused = gpu_scatter_token_rows(x, p.row_of_choice, k, xp, mx);
    if (mx && !fused) write_mx_values(xp, *mx);
    return;
  }
#endif
  cpu::permute_rows(x, p, xp);
  if (mx) write_mx_values(xp, *mx);
  if (fp8) write_fp8_rows(xp, *fp8);
}

void permute_rows(const QuantTensor& x, const ExpertPermutation& p, QuantTensor& xp) {
  const auto fp8_rows = [](const QuantTensor& q) {
    return q.defined() && q.block() == QuantBlock::kRow128 && q.axis() == QuantAxis::kDim0 &&
           q.shape().size() == 2;
  };
  MT_CHECK(fp8_rows(x) && fp8_rows(xp) && x.shape()[1] == xp.shape()[1] &&
               xp.shape()[0] == p.rows() && x.device() == xp.device(),
           "permute_rows of FP8 rows: {} into {} for a permutation of {} rows (both 1x128 blocks "
           "along dim0, the same width and device)",
           shape_str(x.shape()), shape_str(xp.shape()), p.rows());
  Tensor data = xp.data(), scales = xp.scales();
  permute_rows(x.data(), p, data);
  permute_rows(x.scales(), p, scales);
}

namespace {
void sum_token_rows(const Tensor& rows, const ExpertPermutation& p, const Tensor* residual,
                    Tensor& out) {
  const int64_t n = out.dim(0), k = choices_per_token(p, n);
  MT_CHECK(p.row_of_choice.numel() == n * k, "{} tokens for a permutation of {} choices", n,
           p.row_of_choice.numel());
  MT_CHECK(rows.dtype() == out.dtype(), "sum of {} rows into {}", dtype_name(rows.dtype()),
           dtype_name(out.dtype()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) {
    const profile::Phase phase("gpu.sum_token_rows");
    MT_CUDA_CHECK(cuda::kernels::sum_token_rows(
        cuda::storage_of(rows), rows.raw(), p.row_of_choice.data<int32_t>(),
        residual ? residual->raw() : nullptr, n, static_cast<int>(k), out.raw(), out.dim(1),
        cuda::stream()));
    return;
  }
#endif
  cpu::sum_token_rows(rows, p, residual, out);
}
}  // namespace

void permute_rows_backward(const Tensor& dxp, const ExpertPermutation& p, Tensor& dx) {
  sum_token_rows(dxp, p, nullptr, dx);
}

void unpermute_rows(const Tensor& yp, const ExpertPermutation& p, Tensor& y) {
  const int64_t d = yp.dim(1), m = p.row_of_choice.numel();
  MT_CHECK(y.numel() == m * d && y.dtype() == yp.dtype(), "unpermuted {} rows {} for {} rows of {}",
           dtype_name(y.dtype()), shape_str(y.shape()), m, d);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(yp)) {
    Tensor rows = y.reshape({m, d});
    return cuda::gather_rows(yp, p.row_of_choice, rows);
  }
#endif
  cpu::unpermute_rows(yp, p, y);
}

void unpermute_rows_backward(const Tensor& dy, const ExpertPermutation& p, Tensor& dyp) {
  const int64_t d = dyp.dim(1), m = p.row_of_choice.numel();
  MT_CHECK(dy.numel() == m * d && dy.dtype() == dyp.dtype(),
           "unpermuted {} gradient {} for {} rows of {}", dtype_name(dy.dtype()),
           shape_str(dy.shape()), m, d);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dyp)) {
    gpu_scatter_token_rows(dy.reshape({m, d}), p.row_of_choice, 1, dyp, nullptr);
    return;
  }
#endif
  cpu::unpermute_rows_backward(dy, p, dyp);
}

void combine_forward(const Tensor& yp, const ExpertPermutation& p, Tensor& out,
                     const Tensor* residual) {
  MT_CHECK(
      yp.ndim() == 2 && out.ndim() == 2 && yp.dim(1) == out.dim(1) && yp.dtype() == out.dtype(),
      "combine of {} {} rows into {} {}", dtype_name(yp.dtype()), shape_str(yp.shape()),
      dtype_name(out.dtype()), shape_str(out.shape()));
  if (residual) {
    expect_shape(*residual, out.shape(), "combine residual");
    MT_CHECK(residual->dtype() == out.dtype(), "combine residual {} for output {}",
             dtype_name(residual->dtype()), dtype_name(out.dtype()));
  }
  sum_token_rows(yp, p, residual, out);
}

}  // namespace mt::ops
