// The cross-entropy ops on the GPU (ops/cuda/ops.h): checks with named messages, then loss.cu.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss) {
  const profile::Phase phase("gpu.cross_entropy_forward");
  const int64_t n = logits.dim(0), v = logits.dim(1);
  expect_shape(lse, {n}, "loss lse");
  expect_dtype(lse, DType::kF32, "loss lse (GPU)");
  expect_dtype(loss_sum, DType::kF64, "loss sum (GPU)");
  // The kernel writes every row's loss before summing them: into token_loss where asked for.
  Tensor loss = token_loss ? *token_loss : gpu_empty({n}, DType::kF32);
  MT_CUDA_CHECK(kernels::cross_entropy_forward(
      storage_of(logits, "logits"), logits.raw(), targets.data<int32_t>(), mask.data<uint8_t>(),
      lse.data<float>(), loss.data<float>(), loss_sum.data<double>(), n, v, stream()));
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, const Tensor& grad_scale, Tensor& dlogits) {
  const profile::Phase phase("gpu.cross_entropy_backward");
  expect_shape(dlogits, logits.shape(), "dlogits");
  same_storage_type(logits, dlogits, "dlogits");
  expect_dtype(grad_scale, DType::kF64, "loss grad scale (GPU)");
  MT_CUDA_CHECK(kernels::cross_entropy_backward(
      storage_of(logits, "logits"), logits.raw(), targets.data<int32_t>(), mask.data<uint8_t>(),
      lse.data<float>(), grad_scale.data<double>(), dlogits.raw(), logits.dim(0), logits.dim(1),
      stream()));
}

}  // namespace mt::cuda
