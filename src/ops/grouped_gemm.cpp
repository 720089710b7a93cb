// The grouped GEMMs' front door (ops/grouped_gemm.h): the layout checked once, then the CPU
// reference (ops/cpu/grouped_gemm.cpp) or a GPU kernel (ops/cuda/grouped_gemm.h): CUTLASS's
// Hopper kernels where they are instantiated (fixed TMA descriptors over whole 128-row tiles per
// expert, else the grouped ones), else version 1 (grouped_gemm.cu). The row offsets never leave
// the device.
#include "ops/grouped_gemm.h"

#include <utility>

#include "ops/cpu/grouped_gemm.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/grouped_gemm.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {
struct GroupDims {
  int64_t experts, k, n, m;
};

// The expert weights' dims and the layout's tensors; on the CPU also the offsets' values.
GroupDims check_group(const Tensor& rows_tensor, const Tensor& w, const ExpertRows& rows) {
  MT_CHECK(w.ndim() == 3, "expert weights must be (E, K, N), got {}", shape_str(w.shape()));
  MT_CHECK(rows_tensor.ndim() == 2, "expert rows must be a matrix, got {}",
           shape_str(rows_tensor.shape()));
  GroupDims g{w.dim(0), w.dim(1), w.dim(2), rows_tensor.dim(0)};
  for (const auto& [t, name] :
       {std::pair{&rows.offsets, "expert offsets"}, std::pair{&rows.segments, "expert segments"}}) {
    expect_shape(*t, {g.experts + 1}, name);
    expect_dtype(*t, DType::kI64, name);
    MT_CHECK(t->device() == rows_tensor.device(), "{} must be on the rows' device", name);
  }
  if (on_gpu(rows_tensor)) return g;  // the layout was made on the device
  const int64_t* off = rows.offsets.data<int64_t>();
  const int64_t* seg = rows.segments.data<int64_t>();
  MT_CHECK(off[0] == 0 && seg[0] == 0, "expert offsets must start at 0");
  for (int64_t e = 0; e < g.experts; ++e)
    MT_CHECK(
        off[e + 1] >= off[e] && seg[e] + off[e + 1] - off[e] <= seg[e + 1] && seg[e + 1] <= g.m,
        "expert {}: {} rows from row {} do not fit before the next segment ({}) within {} "
        "rows",
        e, off[e + 1] - off[e], seg[e], seg[e + 1], g.m);
  return g;
}

#if MOETRAIN_HAS_CUDA
// The GPU's operands: bf16 in, bf16 or f32 out, all on the GPU, rows of a multiple of 8.
cuda::kernels::ExpertSegments gpu_layout(std::initializer_list<const Tensor*> bf16_operands,
                                         const Tensor& out, const ExpertRows& rows,
                                         const GroupDims& g) {
  for (const Tensor* t : bf16_operands) {
    expect_dtype(*t, DType::kBF16, "grouped gemm operand (the GPU's is bf16)");
    MT_CHECK(t->device() == Device::kCUDA, "grouped gemm operands must be on the GPU");
  }
  MT_CHECK(
      out.device() == Device::kCUDA && (out.dtype() == DType::kBF16 || out.dtype() == DType::kF32),
      "grouped gemm output must be bf16 or f32 on the GPU");
  MT_CHECK(g.k % 8 == 0 && g.n % 8 == 0, "grouped gemm dims {} x {} must be multiples of 8", g.k,
           g.n);
  return cuda::device_segments(rows);
}

void gpu_grouped_gemm(const Tensor& a, const Tensor& w, Transpose tw, const ExpertRows& rows,
                      Tensor& out, const GroupDims& g) {
  const cuda::kernels::ExpertSegments layout = gpu_layout({&a, &w}, out, rows, g);
  const int experts = static_cast<int>(g.experts);
  const int64_t m = g.m, k = g.k, n = g.n;
  const bool forward = tw == Transpose::kNo;
#if MOETRAIN_HAS_CUTLASS
  // CUTLASS's kernels are instantiated for bf16 rows; f32 output takes version 1. Over whole
  // 128-row tiles per expert the fixed-descriptor kernels run the input gradient and the
  // short-K forward (the long-K forward gains nothing there: docs/benchmarks-history.md).
  const bool whole_tiles = rows.align % cuda::kernels::kFixedRowTile == 0;
  if (out.dtype() == DType::kBF16 && whole_tiles &&
      (!forward || k <= cuda::kernels::kCutlassShortK)) {
    Tensor ws =
        cuda::gpu_workspace(forward ? cuda::kernels::cutlass_fixed_forward_workspace(m, n)
                                    : cuda::kernels::cutlass_fixed_input_gradient_workspace(m, k));
    MT_CUDA_CHECK(forward ? cuda::kernels::cutlass_fixed_forward(
                                layout.segments, experts, a.raw(), w.raw(), out.raw(), m, k, n,
                                ws.raw(), ws.nbytes(), cuda::stream())
                          : cuda::kernels::cutlass_fixed_input_gradient(
                                layout.segments, experts, a.raw(), w.raw(), out.raw(), m, k, n,
                                ws.raw(), ws.nbytes(), cuda::stream()));
    return;
  }
  if (out.dtype() == DType::kBF16) {
    Tensor ws = cuda::gpu_workspace(
        forward ? cuda::kernels::cutlass_grouped_forward_workspace(experts)
                : cuda::kernels::cutlass_grouped_input_gradient_workspace(experts));
    MT_CUDA_CHECK(forward ? cuda::kernels::cutlass_grouped_forward(
                                layout, experts, a.raw(), w.raw(), out.raw(), m, k, n, ws.raw(),
                                ws.nbytes(), cuda::stream())
                          : cuda::kernels::cutlass_grouped_input_gradient(
                                layout, experts, a.raw(), w.raw(), out.raw(), m, k, n, ws.raw(),
                                ws.nbytes(), cuda::stream()));
    return;
  }
#endif
  // Forward: inner k, output width n; input gradient: dx (m, k) = dy (m, n) w[e]^T, inner n.
  MT_CUDA_CHECK(cuda::kernels::grouped_gemm_rows(
      a.raw(), w.raw(), layout, experts, m, forward ? k : n, forward ? n : k, !forward, out.raw(),
      out.dtype() == DType::kF32, cuda::stream()));
}
#endif
}  // namespace

void grouped_gemm(const Tensor& a, const Tensor& w, Transpose tw, const ExpertRows& rows,
                  Tensor& out) {
  const GroupDims g = check_group(a, w, rows);
  const bool forward = tw == Transpose::kNo;
  expect_shape(a, {g.m, forward ? g.k : g.n}, forward ? "grouped gemm x" : "grouped gemm dy");
  expect_shape(out, {g.m, forward ? g.n : g.k}, forward ? "grouped gemm out" : "grouped gemm dx");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) {
    const profile::Phase phase(forward ? "gpu.grouped_gemm_forward"
                                       : "gpu.grouped_gemm_backward_input");
    return gpu_grouped_gemm(a, w, tw, rows, out, g);
  }
#endif
  cpu::grouped_gemm(a, w, tw, rows, out);
}

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows, Tensor& out) {
  grouped_gemm(x, w, Transpose::kNo, rows, out);
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                 Tensor& dx) {
  grouped_gemm(dy, w, Transpose::kYes, rows, dx);
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                  Tensor& dw, Accumulate accumulate) {
  const GroupDims g = check_group(x, dw, rows);
  expect_shape(x, {g.m, g.k}, "grouped gemm x");
  expect_shape(dy, {g.m, g.n}, "grouped gemm dy");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.grouped_gemm_backward_weight");
    const cuda::kernels::ExpertSegments layout = gpu_layout({&x, &dy}, dw, rows, g);
    const int experts = static_cast<int>(g.experts);
    const bool acc = accumulate == Accumulate::kYes;
    if (!acc)  // the GEMMs write only experts with rows
      MT_CUDA_CHECK(cuda::kernels::zero_empty_groups(layout.offsets, experts, dw.raw(), g.k * g.n,
                                                     dw.dtype() == DType::kF32, cuda::stream()));
#if MOETRAIN_HAS_CUTLASS
    if (dw.dtype() == DType::kF32) {  // CUTLASS's weight gradient is instantiated for f32
      Tensor ws =
          cuda::gpu_workspace(cuda::kernels::cutlass_grouped_weight_gradient_workspace(experts));
      MT_CUDA_CHECK(cuda::kernels::cutlass_grouped_weight_gradient(
          layout, experts, x.raw(), dy.raw(), dw.raw(), g.m, g.k, g.n, ws.raw(), ws.nbytes(), acc,
          cuda::stream()));
      return;
    }
#endif
    MT_CUDA_CHECK(cuda::kernels::grouped_gemm_weight(x.raw(), dy.raw(), layout, experts, g.k, g.n,
                                                     dw.raw(), dw.dtype() == DType::kF32, acc,
                                                     cuda::stream()));
    return;
  }
#endif
  cpu::grouped_gemm_backward_weight(x, dy, rows, dw, accumulate);
}

}  // namespace mt::ops
