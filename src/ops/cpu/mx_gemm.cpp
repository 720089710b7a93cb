#include "ops/mx_gemm.h"

#include "ops/dispatch.h"
#include "ops/mx.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

void mx_grouped_gemm(const MxTensor& a, const Tensor& b, const ExpertRows& rows, Tensor& out) {
  MT_CHECK(a.defined() && a.axis() == MxAxis::kDim0 && a.shape().size() == 2,
           "mx_grouped_gemm: a must be an MX matrix quantized along dim0, got {} along {}",
           shape_str(a.shape()), mx_axis_name(a.axis()));
  MT_CHECK(b.ndim() == 3 && b.dim(2) == a.shape()[1],
           "mx_grouped_gemm: b must be (experts, P, {}) for a {}, got {}", a.shape()[1],
           shape_str(a.shape()), shape_str(b.shape()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(b)) return cuda::mx_grouped_gemm(a, b, rows, out);
#endif
  Tensor values = Tensor::empty(a.shape(), b.dtype(), b.device());
  mx_dequantize(a, values);
  grouped_gemm_backward_input(values, b, rows, out);
}

}  // namespace mt::ops
