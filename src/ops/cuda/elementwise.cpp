// The element-wise ops on the GPU (ops/cuda/ops.h): checks with named messages, then
// elementwise.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

double sum_of_squares(const Tensor& x) {
  const profile::Phase phase("gpu.sum_of_squares");
  Tensor ws = gpu_empty({static_cast<int64_t>(kernels::sum_of_squares_workspace())}, DType::kU8);
  double result = 0;
  MT_CUDA_CHECK(
      kernels::sum_of_squares(storage_of(x), x.raw(), x.numel(), ws.raw(), &result, stream()));
  return result;
}

void scale_(Tensor& x, double factor) {
  const profile::Phase phase("gpu.scale_");
  MT_CUDA_CHECK(
      kernels::scale(storage_of(x), x.raw(), static_cast<float>(factor), x.numel(), stream()));
}

void convert(const Tensor& src, Tensor& dst) {
  const profile::Phase phase("gpu.convert");
  MT_CHECK(src.numel() == dst.numel() && src.dtype() != dst.dtype(), "convert of {} {} into {} {}",
           dtype_name(src.dtype()), shape_str(src.shape()), dtype_name(dst.dtype()),
           shape_str(dst.shape()));
  storage_of(dst);
  MT_CUDA_CHECK(kernels::convert(storage_of(src), src.raw(), dst.raw(), src.numel(), stream()));
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const profile::Phase phase("gpu.add");
  MT_CUDA_CHECK(kernels::add(storage_of(a), a.raw(), b.raw(), out.raw(), a.numel(), stream()));
}

}  // namespace mt::cuda
