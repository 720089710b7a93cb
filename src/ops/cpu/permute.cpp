#include "ops/permute.h"

#include <vector>

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {
int64_t choices_per_token(const ExpertPermutation& p, int64_t n) {
  return n == 0 ? 0 : p.row_of_choice.numel() / n;
}
}  // namespace

void make_expert_permutation(const Tensor& expert_index, int64_t num_experts,
                             ExpertPermutation& out, int64_t align) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  MT_CHECK(align >= 1, "expert segments aligned to {} rows", align);
  out.align = align;
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index))
    return cuda::make_expert_permutation(expert_index, num_experts, align, out);
#endif
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1), m = n * k;
  const int32_t* idx = expert_index.data<int32_t>();
  out.expert_offsets = Tensor::zeros({num_experts + 1}, DType::kI64);
  int64_t* off = out.expert_offsets.data<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    MT_CHECK(idx[i] >= 0 && idx[i] < num_experts, "expert index {} outside [0, {})", idx[i],
             num_experts);
    off[idx[i] + 1] += 1;
  }
  out.segments = Tensor::zeros({num_experts + 1}, DType::kI64);
  int64_t* seg = out.segments.data<int64_t>();
  for (int64_t e = 0; e < num_experts; ++e) {
    seg[e + 1] = seg[e] + (off[e + 1] + align - 1) / align * align;  // off[e + 1]: e's count here
    off[e + 1] += off[e];
  }
  if (align == 1) out.segments = out.expert_offsets;  // dense: the same rows
  const int64_t* first = out.segments.data<int64_t>();
  std::vector<int64_t> fill(first, first + num_experts);
  out.source_token = Tensor::empty({permuted_rows(m, num_experts, align)}, DType::kI32);
  std::fill(out.source_token.data<int32_t>(),
            out.source_token.data<int32_t>() + out.source_token.numel(), -1);
  out.row_of_choice = Tensor::empty({m}, DType::kI32);
  for (int64_t i = 0; i < m; ++i) {  // i = t*k + j in token order: stable within an expert
    const int64_t row = fill[idx[i]]++;
    out.source_token.data<int32_t>()[row] = static_cast<int32_t>(i / k);
    out.row_of_choice.data<int32_t>()[i] = static_cast<int32_t>(row);
  }
}

void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp) {
  const int64_t d = x.dim(1), m = p.rows();
  expect_shape(xp, {m, d}, "permuted rows");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    if (x.dim(0) == 0) return;
    return cuda::scatter_token_rows(x, p.row_of_choice, choices_per_token(p, x.dim(0)), xp);
  }
#endif
  dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < m; ++r) {
      const int32_t token = p.source_token.data<int32_t>()[r];
      if (token < 0) continue;  // padding
      const T* src = x.data<T>() + static_cast<int64_t>(token) * d;
      std::copy(src, src + d, xp.data<T>() + r * d);
    }
  });
}

namespace {
// out[t] = residual[t] (or 0) + sum_j rows[row_of_choice[t*k + j]], in token order over the k
// copies: deterministic, no scatter races.
void sum_token_rows(const Tensor& rows, const ExpertPermutation& p, const Tensor* residual,
                    Tensor& out) {
  const int64_t n = out.dim(0), d = out.dim(1), k = choices_per_token(p, n);
  MT_CHECK(p.row_of_choice.numel() == n * k, "{} tokens for a permutation of {} choices", n,
           p.row_of_choice.numel());
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) return cuda::sum_token_rows(rows, p.row_of_choice, residual, k, out);
#endif
  dispatch_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < n; ++t) {
      T* o = out.data<T>() + t * d;
      if (residual)
        std::copy(residual->data<T>() + t * d, residual->data<T>() + (t + 1) * d, o);
      else
        std::fill(o, o + d, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const T* g =
            rows.data<T>() + static_cast<int64_t>(p.row_of_choice.data<int32_t>()[t * k + j]) * d;
        for (int64_t c = 0; c < d; ++c) o[c] += g[c];
      }
    }
  });
}
}  // namespace

void permute_rows_backward(const Tensor& dxp, const ExpertPermutation& p, Tensor& dx) {
  sum_token_rows(dxp, p, nullptr, dx);
}

void unpermute_rows(const Tensor& yp, const ExpertPermutation& p, Tensor& y) {
  const int64_t d = yp.dim(1), m = p.row_of_choice.numel();
  MT_CHECK(y.numel() == m * d, "unpermuted rows {} for {} rows of {}", shape_str(y.shape()), m, d);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(yp)) {
    Tensor rows = y.reshape({m, d});
    return cuda::gather_rows(yp, p.row_of_choice, rows);
  }
#endif
  dispatch_float(yp.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < m; ++i) {
      const T* src = yp.data<T>() + static_cast<int64_t>(p.row_of_choice.data<int32_t>()[i]) * d;
      std::copy(src, src + d, y.data<T>() + i * d);
    }
  });
}

void unpermute_rows_backward(const Tensor& dy, const ExpertPermutation& p, Tensor& dyp) {
  const int64_t d = dyp.dim(1), m = p.row_of_choice.numel();
  MT_CHECK(dy.numel() == m * d, "unpermuted gradient {} for {} rows of {}", shape_str(dy.shape()),
           m, d);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dyp)) return cuda::scatter_token_rows(dy.reshape({m, d}), p.row_of_choice, 1, dyp);
#endif
  dispatch_float(dyp.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < m; ++i) {
      const T* g = dy.data<T>() + i * d;
      std::copy(g, g + d,
                dyp.data<T>() + static_cast<int64_t>(p.row_of_choice.data<int32_t>()[i]) * d);
    }
  });
}

void combine_forward(const Tensor& yp, const ExpertPermutation& p, Tensor& out,
                     const Tensor* residual) {
  MT_CHECK(
      yp.ndim() == 2 && out.ndim() == 2 && yp.dim(1) == out.dim(1) && yp.dtype() == out.dtype(),
      "combine of {} {} rows into {} {}", dtype_name(yp.dtype()), shape_str(yp.shape()),
      dtype_name(out.dtype()), shape_str(out.shape()));
  if (residual) {
    expect_shape(*residual, out.shape(), "combine residual");
    MT_CHECK(residual->dtype() == out.dtype(), "combine residual {} for output {}",
             dtype_name(residual->dtype()), dtype_name(out.dtype()));
  }
  sum_token_rows(yp, p, residual, out);
}

}  // namespace mt::ops
