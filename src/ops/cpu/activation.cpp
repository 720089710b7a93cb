#include "ops/activation.h"

#include <cmath>

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {
// The padding marks of a row_token argument (nullptr: none), checked against h's rows and
// device here for both devices (the GPU wrappers pass them on unchecked).
const int32_t* padding_marks(const Tensor* row_token, const Tensor& h) {
  if (!row_token) return nullptr;
  expect_dtype(*row_token, DType::kI32, "swiglu row tokens");
  expect_shape(*row_token, {h.dim(0)}, "swiglu row tokens");
  MT_CHECK(row_token->device() == h.device(), "swiglu row tokens must be on the rows' device");
  return row_token->data<int32_t>();
}
}  // namespace

void swiglu_forward(const Tensor& h, Tensor& a, const Tensor* row_token) {
  const int32_t* token = padding_marks(row_token, h);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(h)) return cuda::swiglu_forward(h, a, token);
#endif
  MT_CHECK(h.ndim() == 2 && h.dim(1) % 2 == 0, "swiglu input {} must be (M, 2F)",
           shape_str(h.shape()));
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(a, {m, f}, "swiglu out");
  dispatch_float(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      if (token && token[r] < 0) continue;
      const T* g = h.data<T>() + r * 2 * f;
      const T* u = g + f;
      T* o = a.data<T>() + r * f;
      for (int64_t c = 0; c < f; ++c) {
        const double sig = 1.0 / (1.0 + std::exp(-static_cast<double>(g[c])));
        o[c] = static_cast<T>(g[c] * sig * u[c]);
      }
    }
  });
}

void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const Tensor* row_token) {
  const int32_t* token = padding_marks(row_token, h);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(h)) return cuda::swiglu_backward(h, da, dh, token);
#endif
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(da, {m, f}, "swiglu da");
  expect_shape(dh, h.shape(), "swiglu dh");
  dispatch_float(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      if (token && token[r] < 0) continue;
      const T* g = h.data<T>() + r * 2 * f;
      const T* u = g + f;
      const T* d = da.data<T>() + r * f;
      T* dg = dh.data<T>() + r * 2 * f;
      T* du = dg + f;
      for (int64_t c = 0; c < f; ++c) {
        const double x = g[c];
        const double sig = 1.0 / (1.0 + std::exp(-x));
        du[c] = static_cast<T>(d[c] * x * sig);
        dg[c] = static_cast<T>(d[c] * u[c] * sig * (1.0 + x * (1.0 - sig)));
      }
    }
  });
}

}  // namespace mt::ops
