// The cross-entropy front door (ops/loss.h): the arguments checked once, then the CPU reference
// (ops/cpu/loss.cpp) or the kernels (ops/cuda/loss.cu).
#include "ops/loss.h"

#include "ops/cpu/loss.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/loss.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {
void check_loss_inputs(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                       const Tensor& lse) {
  MT_CHECK(logits.ndim() == 2, "logits must be (N, V), got {}", shape_str(logits.shape()));
  const int64_t n = logits.dim(0);
  expect_shape(targets, {n}, "targets");
  expect_dtype(targets, DType::kI32, "targets");
  expect_shape(mask, {n}, "loss mask");
  expect_dtype(mask, DType::kU8, "loss mask");
  expect_shape(lse, {n}, "loss lse");
  if (on_gpu(logits)) {
    expect_dtype(lse, DType::kF32, "loss lse (GPU)");
    return;  // ids were range-checked when the data was read
  }
  const int32_t* tg = targets.data<int32_t>();
  const uint8_t* mk = mask.data<uint8_t>();
  for (int64_t i = 0; i < n; ++i)
    MT_CHECK(!mk[i] || (tg[i] >= 0 && tg[i] < logits.dim(1)), "target {} at {} outside [0, {})",
             tg[i], i, logits.dim(1));
}

// One f64 element on `device`: the loss sum and the gradient scale.
void check_scalar(const Tensor& t, Device device, const char* what) {
  MT_CHECK(t.numel() == 1 && t.dtype() == DType::kF64 && t.device() == device,
           "{}: one f64 element on the logits' device ({}), got {} {} on {}", what,
           device == Device::kCPU ? "cpu" : "cuda", dtype_name(t.dtype()), shape_str(t.shape()),
           t.device() == Device::kCPU ? "cpu" : "cuda");
}
}  // namespace

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss) {
  check_loss_inputs(logits, targets, mask, lse);
  check_scalar(loss_sum, logits.device(), "loss sum");
  const int64_t n = logits.dim(0);
  if (token_loss) {
    expect_shape(*token_loss, {n}, "per-token loss");
    MT_CHECK(token_loss->dtype() == lse.dtype() && token_loss->device() == logits.device(),
             "per-token loss is {}, lse {}; both on the logits' device",
             dtype_name(token_loss->dtype()), dtype_name(lse.dtype()));
  }
#if MOETRAIN_HAS_CUDA
  if (on_gpu(logits)) {
    const profile::Phase phase("gpu.cross_entropy_forward");
    // The kernel writes every row's loss before summing them: into token_loss where asked for.
    Tensor loss = token_loss ? *token_loss : cuda::gpu_empty({n}, DType::kF32);
    MT_CUDA_CHECK(cuda::kernels::cross_entropy_forward(
        cuda::storage_of(logits, "logits"), logits.raw(), targets.data<int32_t>(),
        mask.data<uint8_t>(), lse.data<float>(), loss.data<float>(), loss_sum.data<double>(), n,
        logits.dim(1), cuda::stream()));
    return;
  }
#endif
  cpu::cross_entropy_forward(logits, targets, mask, lse, loss_sum, token_loss);
}

double cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                             Tensor& lse) {
  Tensor sum = Tensor::zeros({1}, DType::kF64, logits.device());
  cross_entropy_forward(logits, targets, mask, lse, sum);
  return sum.item(0);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, double grad_scale, Tensor& dlogits,
                            const Fp8RowsOut* fp8) {
  Tensor scale = Tensor::empty({1}, DType::kF64, logits.device());
  scale.set_item(0, grad_scale);
  cross_entropy_backward(logits, targets, mask, lse, scale, dlogits, fp8);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, const Tensor& grad_scale, Tensor& dlogits,
                            const Fp8RowsOut* fp8) {
  check_loss_inputs(logits, targets, mask, lse);
  check_scalar(grad_scale, logits.device(), "loss grad scale");
  expect_shape(dlogits, logits.shape(), "dlogits");
  check_fp8_rows("cross_entropy_backward", dlogits, fp8);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(logits)) {
    const profile::Phase phase("gpu.cross_entropy_backward");
    cuda::same_storage_type(logits, dlogits, "dlogits");
    cuda::launch_with_fp8_rows(fp8, dlogits, [&](cuda::kernels::Fp8RowsOut rows_fp8) {
      return cuda::kernels::cross_entropy_backward(
          cuda::storage_of(logits, "logits"), logits.raw(), targets.data<int32_t>(),
          mask.data<uint8_t>(), lse.data<float>(), grad_scale.data<double>(), dlogits.raw(),
          logits.dim(0), logits.dim(1), rows_fp8, cuda::stream());
    });
    return;
  }
#endif
  cpu::cross_entropy_backward(logits, targets, mask, lse, grad_scale.data<double>()[0], dlogits);
  if (fp8) write_fp8_rows(dlogits, *fp8);
}

}  // namespace mt::ops
