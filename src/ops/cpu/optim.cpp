#include "ops/cpu/optim.h"

#include <cmath>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                Tensor* compute) {
  const int64_t n = param.numel();
  const AdamWStepTerms terms = adamw_step_terms(h);
  dispatch_float(param.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = param.data<T>();
    const T* g = grad.data<T>();
    T* pm = m.data<T>();
    T* pv = v.data<T>();
    const T b1 = static_cast<T>(h.beta1), b2 = static_cast<T>(h.beta2);
    const T decay = static_cast<T>(terms.decay);
    const T step_size = static_cast<T>(terms.step_size);
    const T sqrt_bc2 = static_cast<T>(terms.sqrt_bc2);
    const T eps = static_cast<T>(h.eps), gs = static_cast<T>(h.grad_scale);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[i] * gs;
      pm[i] = b1 * pm[i] + (T(1) - b1) * gi;
      pv[i] = b2 * pv[i] + (T(1) - b2) * gi * gi;
      p[i] = p[i] * decay - step_size * pm[i] / (std::sqrt(pv[i]) / sqrt_bc2 + eps);
    }
  });
  if (compute) compute->copy_from(param.to(compute->dtype()));
}

}  // namespace mt::ops::cpu
