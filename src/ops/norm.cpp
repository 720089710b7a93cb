// The RMSNorm front door (ops/norm.h): the arguments checked once, then the CPU reference
// (ops/cpu/norm.cpp) or the kernels (ops/cuda/norm.cu).
#include "ops/norm.h"

#include "ops/cpu/norm.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/norm.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  MT_CHECK(x.ndim() == 2, "rmsnorm x must be (N, D), got {}", shape_str(x.shape()));
  const int64_t n = x.dim(0), d = x.dim(1);
  expect_shape(w, {d}, "rmsnorm weight");
  expect_shape(y, {n, d}, "rmsnorm y");
  expect_shape(rstd, {n}, "rmsnorm rstd");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.rmsnorm_forward");
    expect_dtype(rstd, DType::kF32, "rmsnorm rstd (GPU)");
    cuda::same_storage_type(x, w, "rmsnorm weight");
    cuda::same_storage_type(x, y, "rmsnorm y");
    MT_CUDA_CHECK(cuda::kernels::rmsnorm_forward(cuda::storage_of(x, "rmsnorm x"), x.raw(), w.raw(),
                                                 static_cast<float>(eps), y.raw(),
                                                 rstd.data<float>(), n, d, cuda::stream()));
    return;
  }
#endif
  cpu::rmsnorm_forward(x, w, eps, y, rstd);
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw) {
  MT_CHECK(x.ndim() == 2, "rmsnorm x must be (N, D), got {}", shape_str(x.shape()));
  const int64_t n = x.dim(0), d = x.dim(1);
  expect_shape(dy, {n, d}, "rmsnorm dy");
  expect_shape(dx, {n, d}, "rmsnorm dx");
  expect_shape(dw, {d}, "rmsnorm dw");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.rmsnorm_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&w, &dy, &dx})
      cuda::same_storage_type(x, *t, "rmsnorm operand");
    MT_CHECK(dw.device() == Device::kCUDA && (dw.dtype() == x.dtype() || dw.dtype() == DType::kF32),
             "rmsnorm dw must be {} or f32 on the GPU", dtype_name(x.dtype()));
    Tensor partial = cuda::gpu_empty({cuda::kernels::rmsnorm_chunks(n), d}, DType::kF32);
    MT_CUDA_CHECK(cuda::kernels::rmsnorm_backward(
        cuda::storage_of(x, "rmsnorm x"), x.raw(), w.raw(), rstd.data<float>(), dy.raw(), dx.raw(),
        dw.raw(), dw.dtype() == DType::kF32, partial.data<float>(), n, d, cuda::stream()));
    return;
  }
#endif
  cpu::rmsnorm_backward(x, w, rstd, dy, dx, dw);
}

}  // namespace mt::ops
