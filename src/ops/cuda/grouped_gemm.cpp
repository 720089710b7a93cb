// The grouped GEMM ops on the GPU (ops/cuda/ops.h): checks with named messages, then
// grouped_gemm.cu, or CUTLASS's (cutlass/).
#include <utility>

#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {
// Operands of the grouped GEMMs (v1: bf16 in, bf16 or f32 out, all on the GPU, 16-byte rows);
// the row offsets never leave the device.
kernels::ExpertSegments check_grouped(std::initializer_list<const Tensor*> bf16_operands,
                                      const Tensor& out, const ops::ExpertRows& rows,
                                      int64_t experts, int64_t k, int64_t n) {
  for (const Tensor* t : bf16_operands) {
    expect_dtype(*t, DType::kBF16, "grouped gemm operand (GPU v1 is bf16)");
    MT_CHECK(t->device() == Device::kCUDA, "grouped gemm operands must be on the GPU");
  }
  MT_CHECK(
      out.device() == Device::kCUDA && (out.dtype() == DType::kBF16 || out.dtype() == DType::kF32),
      "grouped gemm output must be bf16 or f32 on the GPU");
  for (const auto& [t, name] :
       {std::pair{&rows.offsets, "expert offsets"}, std::pair{&rows.segments, "expert segments"}}) {
    expect_dtype(*t, DType::kI64, name);
    MT_CHECK(t->device() == Device::kCUDA && t->numel() == experts + 1,
             "{} must be {} i64 on the GPU", name, experts + 1);
  }
  MT_CHECK(k % 8 == 0 && n % 8 == 0, "grouped gemm dims {} x {} must be multiples of 8", k, n);
  return {rows.offsets.data<int64_t>(), rows.segments.data<int64_t>()};
}

#if MOETRAIN_HAS_CUTLASS
// CUTLASS's kernels are instantiated for one output dtype per product (bf16 rows, f32 weight
// gradients); anything else takes version 1.
bool should_use_cutlass_grouped(const Tensor& out, DType instantiated_out) {
  return out.dtype() == instantiated_out;
}

Tensor workspace(size_t bytes) {
  return gpu_empty({static_cast<int64_t>(bytes)}, DType::kU8);
}

// A layout of whole 128-row tiles per expert: the forward and input-gradient products run on
// fixed TMA descriptors (cutlass/fixed_gemm_sm90.cuh; docs/benchmarks.md compares them with the
// grouped kernels).
bool whole_row_tiles(const ops::ExpertRows& rows) {
  return rows.align % kernels::kFixedRowTile == 0;
}
#endif
}  // namespace

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ops::ExpertRows& rows,
                          Tensor& out) {
  const profile::Phase phase("gpu.grouped_gemm_forward");
  const int64_t m = x.dim(0), e = w.dim(0), k = w.dim(1), n = w.dim(2);
  expect_shape(x, {m, k}, "grouped gemm x");
  expect_shape(out, {m, n}, "grouped gemm out");
  const kernels::ExpertSegments layout = check_grouped({&x, &w}, out, rows, e, k, n);
#if MOETRAIN_HAS_CUTLASS
  if (should_use_cutlass_grouped(out, DType::kBF16) && whole_row_tiles(rows) &&
      k <= kernels::kCutlassShortK) {  // the long-K forward gains nothing (docs/benchmarks.md)
    Tensor ws = workspace(kernels::cutlass_fixed_forward_workspace(m, n));
    MT_CUDA_CHECK(kernels::cutlass_fixed_forward(layout.segments, static_cast<int>(e), x.raw(),
                                                 w.raw(), out.raw(), m, k, n, ws.raw(), ws.nbytes(),
                                                 stream()));
    return;
  }
  if (should_use_cutlass_grouped(out, DType::kBF16)) {
    Tensor ws = workspace(kernels::cutlass_grouped_forward_workspace(static_cast<int>(e)));
    MT_CUDA_CHECK(kernels::cutlass_grouped_forward(layout, static_cast<int>(e), x.raw(), w.raw(),
                                                   out.raw(), m, k, n, ws.raw(), ws.nbytes(),
                                                   stream()));
    return;
  }
#endif
  MT_CUDA_CHECK(kernels::grouped_gemm_rows(x.raw(), w.raw(), layout, static_cast<int>(e), m, k, n,
                                           false, out.raw(), out.dtype() == DType::kF32, stream()));
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const ops::ExpertRows& rows,
                                 Tensor& dx) {
  const profile::Phase phase("gpu.grouped_gemm_backward_input");
  const int64_t m = dy.dim(0), e = w.dim(0), k = w.dim(1), n = w.dim(2);
  expect_shape(dy, {m, n}, "grouped gemm dy");
  expect_shape(dx, {m, k}, "grouped gemm dx");
  const kernels::ExpertSegments layout = check_grouped({&dy, &w}, dx, rows, e, k, n);
#if MOETRAIN_HAS_CUTLASS
  if (should_use_cutlass_grouped(dx, DType::kBF16) && whole_row_tiles(rows)) {
    Tensor ws = workspace(kernels::cutlass_fixed_input_gradient_workspace(m, k));
    MT_CUDA_CHECK(kernels::cutlass_fixed_input_gradient(layout.segments, static_cast<int>(e),
                                                        dy.raw(), w.raw(), dx.raw(), m, k, n,
                                                        ws.raw(), ws.nbytes(), stream()));
    return;
  }
  if (should_use_cutlass_grouped(dx, DType::kBF16)) {
    Tensor ws = workspace(kernels::cutlass_grouped_input_gradient_workspace(static_cast<int>(e)));
    MT_CUDA_CHECK(kernels::cutlass_grouped_input_gradient(layout, static_cast<int>(e), dy.raw(),
                                                          w.raw(), dx.raw(), m, k, n, ws.raw(),
                                                          ws.nbytes(), stream()));
    return;
  }
#endif
  // dx (m, k) = dy (m, n) @ w[e]^T: inner n, output width k.
  MT_CUDA_CHECK(kernels::grouped_gemm_rows(dy.raw(), w.raw(), layout, static_cast<int>(e), m, n, k,
                                           true, dx.raw(), dx.dtype() == DType::kF32, stream()));
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ops::ExpertRows& rows,
                                  Tensor& dw, ops::Accumulate acc) {
  const profile::Phase phase("gpu.grouped_gemm_backward_weight");
  const bool accumulate = acc == ops::Accumulate::kYes;
  const int64_t m = x.dim(0), e = dw.dim(0), k = dw.dim(1), n = dw.dim(2);
  expect_shape(x, {m, k}, "grouped gemm x");
  expect_shape(dy, {m, n}, "grouped gemm dy");
  const kernels::ExpertSegments layout = check_grouped({&x, &dy}, dw, rows, e, k, n);
  if (!accumulate)  // the GEMMs write only experts with rows
    MT_CUDA_CHECK(kernels::zero_empty_groups(layout.offsets, static_cast<int>(e), dw.raw(), k * n,
                                             dw.dtype() == DType::kF32, stream()));
#if MOETRAIN_HAS_CUTLASS
  if (should_use_cutlass_grouped(dw, DType::kF32)) {
    Tensor ws = workspace(kernels::cutlass_grouped_weight_gradient_workspace(static_cast<int>(e)));
    MT_CUDA_CHECK(kernels::cutlass_grouped_weight_gradient(layout, static_cast<int>(e), x.raw(),
                                                           dy.raw(), dw.raw(), m, k, n, ws.raw(),
                                                           ws.nbytes(), accumulate, stream()));
    return;
  }
#endif
  MT_CUDA_CHECK(kernels::grouped_gemm_weight(x.raw(), dy.raw(), layout, static_cast<int>(e), k, n,
                                             dw.raw(), dw.dtype() == DType::kF32, accumulate,
                                             stream()));
}

}  // namespace mt::cuda
