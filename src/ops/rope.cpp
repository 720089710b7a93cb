// The rotary-embedding front door (ops/rope.h): the arguments checked once, then the CPU
// reference (ops/cpu/rope.cpp) or the kernel (ops/cuda/rope.cu).
#include "ops/rope.h"

#include "ops/cpu/rope.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/rope.h"
#endif

namespace mt::ops {

namespace {
// direction +1 rotates forward, -1 applies the transpose (the backward).
void rope_apply(const Tensor& x, const Tensor& positions, double theta, int direction, Tensor& y) {
  MT_CHECK(x.ndim() == 3 && x.dim(2) % 2 == 0, "rope input {} must be (N, H, even head_dim)",
           shape_str(x.shape()));
  expect_shape(positions, {x.dim(0)}, "rope positions");
  expect_dtype(positions, DType::kI32, "rope positions");
  expect_shape(y, x.shape(), "rope output");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const profile::Phase phase("gpu.rope_apply");
    cuda::same_storage_type(x, y, "rope output");
    MT_CHECK(positions.device() == Device::kCUDA, "rope positions must be on the GPU");
    MT_CUDA_CHECK(cuda::kernels::rope(cuda::storage_of(x, "rope x"), x.raw(),
                                      positions.data<int32_t>(), theta, direction, y.raw(),
                                      x.dim(0), x.dim(1), x.dim(2), cuda::stream()));
    return;
  }
#endif
  cpu::rope_apply(x, positions, theta, direction, y);
}
}  // namespace

void rope_forward(const Tensor& x, const Tensor& positions, double theta, Tensor& y) {
  rope_apply(x, positions, theta, +1, y);
}

void rope_backward(const Tensor& dy, const Tensor& positions, double theta, Tensor& dx) {
  rope_apply(dy, positions, theta, -1, dx);
}

}  // namespace mt::ops
