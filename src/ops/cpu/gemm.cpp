// Reference GEMM: row-parallel loops, accumulation in the compute type, deterministic (each
// output row is computed by one thread in a fixed order).
#include "ops/cpu/gemm.h"

#include <vector>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

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
  const int64_t m = c.dim(0), n = c.dim(1);
  const int64_t k = ta == Transpose::kNo ? a.dim(1) : a.dim(0);
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

}  // namespace mt::ops::cpu
