// The RoPE ops on the GPU (ops/cuda/ops.h): checks with named messages, then rope.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void rope_apply(const Tensor& x, const Tensor& positions, double theta, int direction, Tensor& y) {
  const profile::Phase phase("gpu.rope_apply");
  same_storage_type(x, y, "rope output");
  MT_CHECK(positions.device() == Device::kCUDA, "rope positions must be on the GPU");
  MT_CUDA_CHECK(kernels::rope(storage_of(x, "rope x"), x.raw(), positions.data<int32_t>(), theta,
                              direction, y.raw(), x.dim(0), x.dim(1), x.dim(2), stream()));
}

}  // namespace mt::cuda
