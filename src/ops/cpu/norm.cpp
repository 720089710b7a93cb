#include "ops/cpu/norm.h"

#include <cmath>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const int64_t n = x.dim(0), d = x.dim(1);
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = px + i * d;
      double ss = 0;
      for (int64_t c = 0; c < d; ++c) ss += static_cast<double>(xi[c]) * xi[c];
      const double r = 1.0 / std::sqrt(ss / d + eps);
      rstd.data<T>()[i] = static_cast<T>(r);
      T* yi = y.data<T>() + i * d;
      for (int64_t c = 0; c < d; ++c) yi[c] = static_cast<T>(xi[c] * r * pw[c]);
    }
  });
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw) {
  const int64_t n = x.dim(0), d = x.dim(1);
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pw = w.data<T>();
    // dx = r * (w*dy - xhat * mean(w*dy*xhat)), xhat = x*r; dw += sum_i dy*xhat.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = x.data<T>() + i * d;
      const T* gi = dy.data<T>() + i * d;
      const double r = rstd.data<T>()[i];
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(gi[c]) * pw[c] * xi[c] * r;
      const double mean = dot / d;
      T* dxi = dx.data<T>() + i * d;
      for (int64_t c = 0; c < d; ++c)
        dxi[c] = static_cast<T>(r * (static_cast<double>(gi[c]) * pw[c] - xi[c] * r * mean));
    }
    T* pdw = dw.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const T* xi = x.data<T>() + i * d;
      const T* gi = dy.data<T>() + i * d;
      const double r = rstd.data<T>()[i];
      for (int64_t c = 0; c < d; ++c) pdw[c] += static_cast<T>(gi[c] * xi[c] * r);
    }
  });
}

}  // namespace mt::ops::cpu
