#include "ops/elementwise.h"

#include <cmath>

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

void add_(Tensor& a, const Tensor& b) {
  add(a, b, a);
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  MT_CHECK(a.numel() == b.numel() && a.numel() == out.numel() && a.dtype() == b.dtype() &&
               a.dtype() == out.dtype(),
           "add of {} and {} into {}", shape_str(a.shape()), shape_str(b.shape()),
           shape_str(out.shape()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) return cuda::add(a, b, out);
#endif
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = pa[i] + pb[i];
  });
}

void convert(const Tensor& src, Tensor& dst) {
  MT_CHECK(src.numel() == dst.numel(), "convert of {} elements into {}", src.numel(), dst.numel());
#if MOETRAIN_HAS_CUDA
  if (on_gpu(src)) return cuda::convert(src, dst);
#endif
  for (int64_t i = 0; i < src.numel(); ++i) dst.set_item(i, src.item(i));
}

void scale_(Tensor& a, double s) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) return cuda::scale_(a, s);
#endif
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = a.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) p[i] = static_cast<T>(p[i] * s);
  });
}

double sum_of_squares(const Tensor& a) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) return cuda::sum_of_squares(a);
#endif
  double s = 0;
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = a.data<T>();
    for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  });
  return s;
}

bool has_non_finite(const Tensor& a) {
  bool bad = false;
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = a.data<T>();
    for (int64_t i = 0; i < a.numel() && !bad; ++i) bad = !std::isfinite(p[i]);
  });
  return bad;
}

}  // namespace mt::ops
