// The MX expert product on the GPU (ops/mx_gemm.h): the fused kernel over 128-row segments
// (cutlass/mx_gemm_sm90.cu), else the definition (dequantize, then the bf16 grouped GEMM).
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void mx_grouped_gemm(const MxTensor& a, const Tensor& b, const ops::ExpertRows& rows, Tensor& out) {
  const profile::Phase phase("gpu.mx_grouped_gemm");
  const int64_t m = a.shape()[0], q = a.shape()[1], experts = b.dim(0), p = b.dim(1);
  MT_CHECK(a.device() == Device::kCUDA && out.device() == Device::kCUDA,
           "mx_grouped_gemm: a, b and out must all be on the GPU");
  expect_dtype(b, DType::kBF16, "mx_grouped_gemm b (the GPU computes in bf16)");
  expect_dtype(out, DType::kBF16, "mx_grouped_gemm out");
  expect_shape(out, {m, p}, "mx_grouped_gemm out");
#if MOETRAIN_HAS_CUTLASS
  if (rows.align % kernels::kFixedRowTile == 0 && p % 8 == 0) {
    expect_dtype(rows.segments, DType::kI64, "expert segments");
    MT_CHECK(rows.segments.device() == Device::kCUDA && rows.segments.numel() == experts + 1,
             "expert segments must be {} i64 on the GPU", experts + 1);
    Tensor ws = gpu_empty({static_cast<int64_t>(kernels::mx_gemm_workspace(m, p))}, DType::kU8);
    MT_CUDA_CHECK(kernels::mx_gemm(rows.segments.data<int64_t>(), static_cast<int>(experts),
                                   static_cast<const uint8_t*>(a.data().raw()),
                                   static_cast<const uint8_t*>(a.scales().raw()), b.raw(),
                                   out.raw(), m, p, q, ws.raw(), ws.nbytes(), stream()));
    return;
  }
#endif
  Tensor values = gpu_empty(a.shape(), DType::kBF16);
  cuda::mx_dequantize(a, values);
  cuda::grouped_gemm_backward_input(values, b, rows, out);
}

}  // namespace mt::cuda
