#include "ops/loss.h"

#include <algorithm>
#include <cmath>

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {
void check_loss_inputs(const Tensor& logits, const Tensor& targets, const Tensor& mask) {
  const int64_t n = logits.dim(0);
  expect_shape(targets, {n}, "targets");
  expect_dtype(targets, DType::kI32, "targets");
  expect_shape(mask, {n}, "loss mask");
  expect_dtype(mask, DType::kU8, "loss mask");
  if (on_gpu(logits)) return;  // ids were range-checked when the data was read
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
  check_loss_inputs(logits, targets, mask);
  check_scalar(loss_sum, logits.device(), "loss sum");
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (token_loss) {
    expect_shape(*token_loss, {n}, "per-token loss");
    MT_CHECK(token_loss->dtype() == lse.dtype() && token_loss->device() == logits.device(),
             "per-token loss is {}, lse {}; both on the logits' device",
             dtype_name(token_loss->dtype()), dtype_name(lse.dtype()));
  }
#if MOETRAIN_HAS_CUDA
  if (on_gpu(logits))
    return cuda::cross_entropy_forward(logits, targets, mask, lse, loss_sum, token_loss);
#endif
  expect_shape(lse, {n}, "loss lse");
  double total = 0;
  dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      const T* l = logits.data<T>() + i * v;
      const double m = *std::max_element(l, l + v);
      double sum = 0;
      for (int64_t c = 0; c < v; ++c) sum += std::exp(l[c] - m);
      const double lse_i = m + std::log(sum);
      lse.data<T>()[i] = static_cast<T>(lse_i);
      const double loss_i = mask.data<uint8_t>()[i] ? lse_i - l[targets.data<int32_t>()[i]] : 0.0;
      if (token_loss) token_loss->data<T>()[i] = static_cast<T>(loss_i);
      total += loss_i;
    }
  });
  loss_sum.data<double>()[0] += total;
}

double cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                             Tensor& lse) {
  Tensor sum = Tensor::zeros({1}, DType::kF64, logits.device());
  cross_entropy_forward(logits, targets, mask, lse, sum);
  return sum.item(0);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, double grad_scale, Tensor& dlogits) {
  Tensor scale = Tensor::empty({1}, DType::kF64, logits.device());
  scale.set_item(0, grad_scale);
  cross_entropy_backward(logits, targets, mask, lse, scale, dlogits);
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, const Tensor& grad_scale_t, Tensor& dlogits) {
  check_loss_inputs(logits, targets, mask);
  check_scalar(grad_scale_t, logits.device(), "loss grad scale");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(logits))
    return cuda::cross_entropy_backward(logits, targets, mask, lse, grad_scale_t, dlogits);
#endif
  const double grad_scale = grad_scale_t.data<double>()[0];
  const int64_t n = logits.dim(0), v = logits.dim(1);
  expect_shape(dlogits, logits.shape(), "dlogits");
  dispatch_float(logits.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T* l = logits.data<T>() + i * v;
      T* d = dlogits.data<T>() + i * v;
      if (!mask.data<uint8_t>()[i]) {
        std::fill(d, d + v, T(0));
        continue;
      }
      const double lse_i = lse.data<T>()[i];
      for (int64_t c = 0; c < v; ++c) d[c] = static_cast<T>(grad_scale * std::exp(l[c] - lse_i));
      d[targets.data<int32_t>()[i]] -= static_cast<T>(grad_scale);
    }
  });
}

}  // namespace mt::ops
