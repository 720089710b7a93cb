// The element-wise front door (ops/elementwise.h): the arguments checked once, then the CPU
// reference (ops/cpu/elementwise.cpp) or the kernels (ops/cuda/elementwise.cu).
#include "ops/elementwise.h"

#include "ops/cpu/elementwise.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

void add_(Tensor& a, const Tensor& b) {
  add(a, b, a);
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  MT_CHECK(a.numel() == b.numel() && a.numel() == out.numel() && a.dtype() == b.dtype() &&
               a.dtype() == out.dtype(),
           "add of {} and {} into {}", shape_str(a.shape()), shape_str(b.shape()),
           shape_str(out.shape()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) {
    const profile::Phase phase("gpu.add");
    MT_CUDA_CHECK(cuda::kernels::add(cuda::storage_of(a), a.raw(), b.raw(), out.raw(), a.numel(),
                                     cuda::stream()));
    return;
  }
#endif
  cpu::add(a, b, out);
}

void convert(const Tensor& src, Tensor& dst) {
  MT_CHECK(src.numel() == dst.numel(), "convert of {} elements into {}", src.numel(), dst.numel());
#if MOETRAIN_HAS_CUDA
  if (on_gpu(src)) {
    const profile::Phase phase("gpu.convert");
    MT_CHECK(src.dtype() != dst.dtype(), "convert of {} {} into {} {}", dtype_name(src.dtype()),
             shape_str(src.shape()), dtype_name(dst.dtype()), shape_str(dst.shape()));
    cuda::storage_of(dst);
    MT_CUDA_CHECK(cuda::kernels::convert(cuda::storage_of(src), src.raw(), dst.raw(), src.numel(),
                                         cuda::stream()));
    return;
  }
#endif
  cpu::convert(src, dst);
}

void scale_(Tensor& a, double s) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) {
    const profile::Phase phase("gpu.scale_");
    MT_CUDA_CHECK(cuda::kernels::scale(cuda::storage_of(a), a.raw(), static_cast<float>(s),
                                       a.numel(), cuda::stream()));
    return;
  }
#endif
  cpu::scale_(a, s);
}

double sum_of_squares(const Tensor& a) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) {
    const profile::Phase phase("gpu.sum_of_squares");
    Tensor ws = cuda::gpu_workspace(cuda::kernels::sum_of_squares_workspace());
    double result = 0;
    MT_CUDA_CHECK(cuda::kernels::sum_of_squares(cuda::storage_of(a), a.raw(), a.numel(), ws.raw(),
                                                &result, cuda::stream()));
    return result;
  }
#endif
  return cpu::sum_of_squares(a);
}

}  // namespace mt::ops
