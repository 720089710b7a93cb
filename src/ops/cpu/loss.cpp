#include "ops/cpu/loss.h"

#include <algorithm>
#include <cmath>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss) {
  const int64_t n = logits.dim(0), v = logits.dim(1);
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

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, double grad_scale, Tensor& dlogits) {
  const int64_t n = logits.dim(0), v = logits.dim(1);
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

}  // namespace mt::ops::cpu
