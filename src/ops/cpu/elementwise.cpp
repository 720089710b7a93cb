#include "ops/cpu/elementwise.h"

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = pa[i] + pb[i];
  });
}

void convert(const Tensor& src, Tensor& dst) {
  for (int64_t i = 0; i < src.numel(); ++i) dst.set_item(i, src.item(i));
}

void scale_(Tensor& a, double s) {
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = a.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) p[i] = static_cast<T>(p[i] * s);
  });
}

double sum_of_squares(const Tensor& a) {
  double s = 0;
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = a.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  });
  return s;
}

}  // namespace mt::ops::cpu
