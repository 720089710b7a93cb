// The SwiGLU ops on the GPU (ops/cuda/ops.h): checks with named messages, then activation.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

namespace {
// The SwiGLU rows' extras as the kernels take them (f32 weights on the GPU).
kernels::SwigluRows swiglu_rows(const int32_t* row_token, const Tensor* row_weight,
                                Tensor* drow_weight) {
  kernels::SwigluRows rows{row_token, nullptr, nullptr};
  if (row_weight) {
    expect_dtype(*row_weight, DType::kF32, "swiglu row weights (GPU: f32)");
    rows.weight = row_weight->data<float>();
  }
  if (drow_weight) rows.dweight = drow_weight->data<float>();
  return rows;
}
}  // namespace

bool swiglu_forward(const Tensor& h, Tensor& a, const int32_t* row_token, const Tensor* row_weight,
                    const ops::MxValuesOut* mx) {
  const profile::Phase phase("gpu.swiglu_forward");
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(a, {m, f}, "swiglu out");
  same_storage_type(h, a, "swiglu out");
  return launch_row_writer(mx, [&](const ops::MxValuesOut* with) {
    return kernels::swiglu_forward(storage_of(h, "swiglu h"), h.raw(), a.raw(), m, f,
                                   swiglu_rows(row_token, row_weight, nullptr), mx_values_out(with),
                                   stream());
  });
}

bool swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const int32_t* row_token,
                     const Tensor* row_weight, Tensor* drow_weight, const ops::MxValuesOut* mx) {
  const profile::Phase phase("gpu.swiglu_backward");
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(da, {m, f}, "swiglu da");
  expect_shape(dh, h.shape(), "swiglu dh");
  same_storage_type(h, da, "swiglu da");
  same_storage_type(h, dh, "swiglu dh");
  return launch_row_writer(mx, [&](const ops::MxValuesOut* with) {
    return kernels::swiglu_backward(storage_of(h, "swiglu h"), h.raw(), da.raw(), dh.raw(), m, f,
                                    swiglu_rows(row_token, row_weight, drow_weight),
                                    mx_values_out(with), stream());
  });
}

}  // namespace mt::cuda
