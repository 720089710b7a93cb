// The MX expert product's front door (ops/mx_gemm.h): the shapes checked once, then on the GPU
// over 128-row segments the fused kernel (ops/cuda/cutlass/mx_gemm_sm90.cu), else the definition
// on either device: a dequantized, then the grouped GEMM a b[e]^T.
#include "ops/mx_gemm.h"

#include "ops/dispatch.h"
#include "ops/mx.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/grouped_gemm.h"
#include "ops/cuda/mx_gemm.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

void mx_grouped_gemm(const QuantTensor& a, const Tensor& b, const ExpertRows& rows, Tensor& out) {
  MT_CHECK(a.defined() && a.block() == QuantBlock::kMx32 && a.axis() == QuantAxis::kDim0 &&
               a.shape().size() == 2,
           "mx_grouped_gemm: a must be an MX matrix quantized along dim0, got {} along {}",
           shape_str(a.shape()), quant_axis_name(a.axis()));
  MT_CHECK(b.ndim() == 3 && b.dim(2) == a.shape()[1],
           "mx_grouped_gemm: b must be (experts, P, {}) for a {}, got {}", a.shape()[1],
           shape_str(a.shape()), shape_str(b.shape()));
  const int64_t m = a.shape()[0], p = b.dim(1);
  expect_shape(out, {m, p}, "mx_grouped_gemm out");
  MT_CHECK(a.device() == b.device() && out.device() == b.device(),
           "mx_grouped_gemm: a, b and out must be on one device");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(b)) {
    const profile::Phase phase("gpu.mx_grouped_gemm");
    expect_dtype(b, DType::kBF16, "mx_grouped_gemm b (the GPU computes in bf16)");
    expect_dtype(out, DType::kBF16, "mx_grouped_gemm out");
#if MOETRAIN_HAS_CUTLASS
    if (rows.align % cuda::kernels::kFixedRowTile == 0 && p % 8 == 0) {
      const int64_t q = a.shape()[1], experts = b.dim(0);
      expect_dtype(rows.segments, DType::kI64, "expert segments");
      MT_CHECK(rows.segments.device() == Device::kCUDA && rows.segments.numel() == experts + 1,
               "expert segments must be {} i64 on the GPU", experts + 1);
      Tensor ws = cuda::gpu_workspace(cuda::kernels::mx_gemm_workspace(m, p));
      MT_CUDA_CHECK(cuda::kernels::mx_gemm(rows.segments.data<int64_t>(), static_cast<int>(experts),
                                           static_cast<const uint8_t*>(a.data().raw()),
                                           static_cast<const uint8_t*>(a.scales().raw()), b.raw(),
                                           out.raw(), m, p, q, ws.raw(), ws.nbytes(),
                                           cuda::stream()));
      return;
    }
#endif
  }
#endif
  Tensor values = Tensor::empty(a.shape(), b.dtype(), b.device());
  mx_dequantize(a, values);
  grouped_gemm(values, b, Transpose::kYes, rows, out);
}

}  // namespace mt::ops
