// Reference GEMM: row-parallel loops, accumulation in the compute type, deterministic (each
// output row is computed by one thread in a fixed order).
#include "ops/gemm.h"

#include <vector>

#include "core/profile.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {

// c (M, N) [+]= a (M, K) @ b, b read as (K, N) or, transposed, as (N, K).
template <class T>
void gemm_rows(const T* a, const T* b, Transpose tb, T* c, int64_t m, int64_t n, int64_t k,
               Accumulate acc) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    T* ci = c + i * n;
    const T* ai = a + i * k;
    if (acc == Accumulate::kNo)
      for (int64_t j = 0; j < n; ++j) ci[j] = T(0);
    if (tb == Transpose::kNo) {
      for (int64_t p = 0; p < k; ++p) {
        const T aip = ai[p];
        const T* bp = b + p * n;
        for (int64_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T* bj = b + j * k;
        T s = T(0);
        for (int64_t p = 0; p < k; ++p) s += ai[p] * bj[p];
        ci[j] += s;
      }
    }
  }
}

template <class T>
std::vector<T> transposed(const T* a, int64_t rows, int64_t cols) {
  std::vector<T> t(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

}  // namespace

void gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, Tensor& c, Accumulate acc) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a)) return cuda::gemm(a, ta, b, tb, c, acc);
#endif
  expect_cpu(a, "gemm a");
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm needs 2-d tensors, got {} {} {}",
           shape_str(a.shape()), shape_str(b.shape()), shape_str(c.shape()));
  const int64_t m = ta == Transpose::kNo ? a.dim(0) : a.dim(1);
  const int64_t k = ta == Transpose::kNo ? a.dim(1) : a.dim(0);
  const int64_t kb = tb == Transpose::kNo ? b.dim(0) : b.dim(1);
  const int64_t n = tb == Transpose::kNo ? b.dim(1) : b.dim(0);
  MT_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, "gemm shapes {}{} x {}{} -> {}",
           shape_str(a.shape()), ta == Transpose::kYes ? "^T" : "", shape_str(b.shape()),
           tb == Transpose::kYes ? "^T" : "", shape_str(c.shape()));
  MT_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype(), "gemm dtypes differ");
  dispatch_float(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if (ta == Transpose::kNo) {
      gemm_rows<T>(a.data<T>(), b.data<T>(), tb, c.data<T>(), m, n, k, acc);
    } else {
      std::vector<T> at = transposed(a.data<T>(), a.dim(0), a.dim(1));
      gemm_rows<T>(at.data(), b.data<T>(), tb, c.data<T>(), m, n, k, acc);
    }
  });
}

void linear_forward(const Tensor& x, const Tensor& w, Tensor& y) {
  gemm(x, Transpose::kNo, w, Transpose::kNo, y, Accumulate::kNo);
}

void linear_forward_residual(const Tensor& x, const Tensor& w, const Tensor& residual, Tensor& y) {
  MT_CHECK(
      residual.shape() == y.shape() && residual.dtype() == y.dtype() && residual.raw() != y.raw(),
      "linear residual {} {} for output {} {} (same shape and dtype, another buffer)",
      dtype_name(residual.dtype()), shape_str(residual.shape()), dtype_name(y.dtype()),
      shape_str(y.shape()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::gemm_residual(x, w, residual, y);
#endif
  y.copy_from(residual);
  gemm(x, Transpose::kNo, w, Transpose::kNo, y, Accumulate::kYes);
}

void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw,
                     Accumulate dx_accumulate) {
  {
    const profile::Phase phase("linear_backward.dx");
    gemm(dy, Transpose::kNo, w, Transpose::kYes, dx, dx_accumulate);
  }
  const profile::Phase phase("linear_backward.dw");
  gemm(x, Transpose::kYes, dy, Transpose::kNo, dw, Accumulate::kYes);
}

}  // namespace mt::ops
