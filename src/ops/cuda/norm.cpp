// The RMSNorm ops on the GPU (ops/cuda/ops.h): checks with named messages, then norm.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const profile::Phase phase("gpu.rmsnorm_forward");
  const int64_t n = x.dim(0), d = x.dim(1);
  expect_shape(w, {d}, "rmsnorm weight");
  expect_shape(y, {n, d}, "rmsnorm y");
  expect_shape(rstd, {n}, "rmsnorm rstd");
  expect_dtype(rstd, DType::kF32, "rmsnorm rstd (GPU)");
  same_storage_type(x, w, "rmsnorm weight");
  same_storage_type(x, y, "rmsnorm y");
  MT_CUDA_CHECK(kernels::rmsnorm_forward(storage_of(x, "rmsnorm x"), x.raw(), w.raw(),
                                         static_cast<float>(eps), y.raw(), rstd.data<float>(), n, d,
                                         stream()));
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw) {
  const profile::Phase phase("gpu.rmsnorm_backward");
  const int64_t n = x.dim(0), d = x.dim(1);
  expect_shape(dy, {n, d}, "rmsnorm dy");
  expect_shape(dx, {n, d}, "rmsnorm dx");
  expect_shape(dw, {d}, "rmsnorm dw");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&w, &dy, &dx})
    same_storage_type(x, *t, "rmsnorm operand");
  MT_CHECK(dw.device() == Device::kCUDA && (dw.dtype() == x.dtype() || dw.dtype() == DType::kF32),
           "rmsnorm dw must be {} or f32 on the GPU", dtype_name(x.dtype()));
  Tensor partial = Tensor::empty({kernels::rmsnorm_chunks(n), d}, DType::kF32, Device::kCUDA);
  MT_CUDA_CHECK(kernels::rmsnorm_backward(
      storage_of(x, "rmsnorm x"), x.raw(), w.raw(), rstd.data<float>(), dy.raw(), dx.raw(),
      dw.raw(), dw.dtype() == DType::kF32, partial.data<float>(), n, d, stream()));
}

}  // namespace mt::cuda
