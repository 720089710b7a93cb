#include "ops/cpu/activation.h"

#include <cmath>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void swiglu_forward(const Tensor& h, Tensor& a, const SwigluRows& rows) {
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  dispatch_float(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* token = rows.token ? rows.token->data<int32_t>() : nullptr;
    const T* weight = rows.weight ? rows.weight->data<T>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      if (token && token[r] < 0) continue;
      const T* g = h.data<T>() + r * 2 * f;
      const T* u = g + f;
      T* o = a.data<T>() + r * f;
      const double w = weight ? static_cast<double>(weight[r]) : 1.0;
      for (int64_t c = 0; c < f; ++c) {
        const double sig = 1.0 / (1.0 + std::exp(-static_cast<double>(g[c])));
        o[c] = static_cast<T>(w * g[c] * sig * u[c]);
      }
    }
  });
}

void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const SwigluRows& rows,
                     Tensor* dweight) {
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  dispatch_float(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* token = rows.token ? rows.token->data<int32_t>() : nullptr;
    const T* weight = rows.weight ? rows.weight->data<T>() : nullptr;
    T* dw = dweight ? dweight->data<T>() : nullptr;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      if (token && token[r] < 0) continue;
      const T* g = h.data<T>() + r * 2 * f;
      const T* u = g + f;
      const T* d = da.data<T>() + r * f;
      T* dg = dh.data<T>() + r * 2 * f;
      T* du = dg + f;
      const double w = weight ? static_cast<double>(weight[r]) : 1.0;
      double dot = 0;  // <da, silu(gate) * up>: the row weight's gradient
      for (int64_t c = 0; c < f; ++c) {
        const double x = g[c];
        const double sig = 1.0 / (1.0 + std::exp(-x));
        dot += d[c] * x * sig * u[c];
        du[c] = static_cast<T>(w * d[c] * x * sig);
        dg[c] = static_cast<T>(w * d[c] * u[c] * sig * (1.0 + x * (1.0 - sig)));
      }
      if (dw) dw[r] = static_cast<T>(dot);
    }
  });
}

}  // namespace mt::ops::cpu
