#include "ops/cpu/rope.h"

#include <cmath>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void rope_apply(const Tensor& x, const Tensor& positions, double theta, int direction, Tensor& y) {
  const int64_t n = x.dim(0), h = x.dim(1), hd = x.dim(2), half = hd / 2;
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      const double pos = positions.data<int32_t>()[t];
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * std::pow(theta, -2.0 * static_cast<double>(i) / hd);
        const double c = std::cos(angle), s = direction * std::sin(angle);
        for (int64_t head = 0; head < h; ++head) {
          const T* xi = x.data<T>() + (t * h + head) * hd;
          T* yi = y.data<T>() + (t * h + head) * hd;
          const double x1 = xi[i], x2 = xi[i + half];
          yi[i] = static_cast<T>(x1 * c - x2 * s);
          yi[i + half] = static_cast<T>(x2 * c + x1 * s);
        }
      }
    }
  });
}

}  // namespace mt::ops::cpu
