#include "ops/activation.h"

#include <cmath>

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {
// The padding marks and row weights of a SwigluRows, checked against h's rows and device here for
// both devices (the GPU wrappers check only their dtype); null where absent.
struct CheckedRows {
  const int32_t* token = nullptr;
  const Tensor* weight = nullptr;
};

CheckedRows checked_rows(const SwigluRows& rows, const Tensor& h) {
  MT_CHECK(h.ndim() == 2 && h.dim(1) % 2 == 0, "swiglu input {} must be (M, 2F)",
           shape_str(h.shape()));
  CheckedRows c;
  if (rows.token) {
    expect_dtype(*rows.token, DType::kI32, "swiglu row tokens");
    expect_shape(*rows.token, {h.dim(0)}, "swiglu row tokens");
    MT_CHECK(rows.token->device() == h.device(), "swiglu row tokens must be on the rows' device");
    c.token = rows.token->data<int32_t>();
  }
  if (rows.weight) {
    expect_shape(*rows.weight, {h.dim(0)}, "swiglu row weights");
    MT_CHECK(rows.weight->device() == h.device(), "swiglu row weights must be on the rows' device");
    if (h.device() == Device::kCPU) expect_dtype(*rows.weight, h.dtype(), "swiglu row weights");
    c.weight = rows.weight;
  }
  return c;
}

// The gradient of the row weights exists exactly when the weights do.
void check_weight_gradient(const CheckedRows& rows, const Tensor* dweight) {
  MT_CHECK((rows.weight == nullptr) == (dweight == nullptr),
           "swiglu backward: row weights and their gradient go together (weights {}, gradient {})",
           rows.weight ? "given" : "absent", dweight ? "given" : "absent");
  if (dweight) {
    expect_shape(*dweight, rows.weight->shape(), "swiglu row-weight gradient");
    expect_dtype(*dweight, rows.weight->dtype(), "swiglu row-weight gradient");
    MT_CHECK(dweight->device() == rows.weight->device(),
             "swiglu row-weight gradient must be on the weights' device");
  }
}
}  // namespace

void swiglu_forward(const Tensor& h, Tensor& a, const SwigluRows& rows, const MxValuesOut* mx) {
  const CheckedRows checked = checked_rows(rows, h);
  check_mx_values("swiglu_forward", a, mx);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(h)) {
    if (!cuda::swiglu_forward(h, a, checked.token, checked.weight, mx) && mx)
      write_mx_values(a, *mx);
    return;
  }
#endif
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(a, {m, f}, "swiglu out");
  dispatch_float(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* token = checked.token;
    const T* weight = checked.weight ? checked.weight->data<T>() : nullptr;
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
  if (mx) write_mx_values(a, *mx);
}

void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const SwigluRows& rows,
                     Tensor* dweight, const MxValuesOut* mx) {
  const CheckedRows checked = checked_rows(rows, h);
  check_weight_gradient(checked, dweight);
  check_mx_values("swiglu_backward", dh, mx);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(h)) {
    if (!cuda::swiglu_backward(h, da, dh, checked.token, checked.weight, dweight, mx) && mx)
      write_mx_values(dh, *mx);
    return;
  }
#endif
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(da, {m, f}, "swiglu da");
  expect_shape(dh, h.shape(), "swiglu dh");
  dispatch_float(h.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* token = checked.token;
    const T* weight = checked.weight ? checked.weight->data<T>() : nullptr;
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
  if (mx) write_mx_values(dh, *mx);
}

}  // namespace mt::ops
