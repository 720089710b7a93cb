// The expert permutation's and the exchange layouts' plain reference: one host loop each, in
// token order (stable within an expert).
#include "ops/cpu/permute.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void make_expert_permutation(const Tensor& expert_index, int64_t num_experts,
                             ExpertPermutation& out, int64_t align, int64_t routed) {
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1), m = n * k;
  out.align = align;
  const int32_t* idx = expert_index.data<int32_t>();
  out.expert_offsets = Tensor::zeros({num_experts + 1}, DType::kI64);
  int64_t* off = out.expert_offsets.data<int64_t>();
  int64_t valid = 0;
  for (int64_t i = 0; i < m; ++i) {
    MT_CHECK(idx[i] < num_experts, "expert index {} outside [0, {})", idx[i], num_experts);
    if (idx[i] < 0) continue;
    off[idx[i] + 1] += 1;
    ++valid;
  }
  MT_CHECK(routed < 0 ? valid == m : valid <= routed,
           "{} routed choices of {}, more than the {} the permutation was sized for", valid, m,
           routed < 0 ? m : routed);
  out.segments = Tensor::zeros({num_experts + 1}, DType::kI64);
  int64_t* seg = out.segments.data<int64_t>();
  for (int64_t e = 0; e < num_experts; ++e) {
    seg[e + 1] = seg[e] + (off[e + 1] + align - 1) / align * align;  // off[e + 1]: e's count here
    off[e + 1] += off[e];
  }
  if (align == 1) out.segments = out.expert_offsets;  // dense: the same rows
  const int64_t* first = out.segments.data<int64_t>();
  std::vector<int64_t> fill(first, first + num_experts);
  out.source_token =
      Tensor::empty({permuted_rows(routed < 0 ? m : routed, num_experts, align)}, DType::kI32);
  std::fill(out.source_token.data<int32_t>(),
            out.source_token.data<int32_t>() + out.source_token.numel(), -1);
  out.row_of_choice = Tensor::empty({m}, DType::kI32);
  for (int64_t i = 0; i < m; ++i) {  // i = t*k + j in token order: stable within an expert
    if (idx[i] < 0) {
      out.row_of_choice.data<int32_t>()[i] = -1;
      continue;
    }
    const int64_t row = fill[idx[i]]++;
    out.source_token.data<int32_t>()[row] = static_cast<int32_t>(i / k);
    out.row_of_choice.data<int32_t>()[i] = static_cast<int32_t>(row);
  }
}

void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp) {
  const int64_t d = x.dim(1), m = p.rows();
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(xp.raw());
  for (int64_t r = 0; r < m; ++r) {
    const int32_t token = p.source_token.data<int32_t>()[r];
    if (token < 0) continue;  // padding
    std::memcpy(dst + r * row_bytes, src + token * row_bytes, row_bytes);
  }
}

void sum_token_rows(const Tensor& rows, const ExpertPermutation& p, const Tensor* residual,
                    Tensor& out) {
  const int64_t n = out.dim(0), d = out.dim(1), k = n == 0 ? 0 : p.row_of_choice.numel() / n;
  dispatch_float(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < n; ++t) {
      T* o = out.data<T>() + t * d;
      if (residual)
        std::copy(residual->data<T>() + t * d, residual->data<T>() + (t + 1) * d, o);
      else
        std::fill(o, o + d, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t row = p.row_of_choice.data<int32_t>()[t * k + j];
        if (row < 0) continue;  // not routed here
        const T* g = rows.data<T>() + static_cast<int64_t>(row) * d;
        for (int64_t c = 0; c < d; ++c) o[c] += g[c];
      }
    }
  });
}

void unpermute_rows(const Tensor& yp, const ExpertPermutation& p, Tensor& y) {
  const int64_t d = yp.dim(1), m = p.row_of_choice.numel();
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(yp.dtype());
  const char* src = static_cast<const char*>(yp.raw());
  char* dst = static_cast<char*>(y.raw());
  for (int64_t i = 0; i < m; ++i) {
    const int32_t row = p.row_of_choice.data<int32_t>()[i];
    if (row < 0)
      std::memset(dst + i * row_bytes, 0, row_bytes);  // not routed here
    else
      std::memcpy(dst + i * row_bytes, src + row * row_bytes, row_bytes);
  }
}

void unpermute_rows_backward(const Tensor& dy, const ExpertPermutation& p, Tensor& dyp) {
  const int64_t d = dyp.dim(1), m = p.row_of_choice.numel();
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(dyp.dtype());
  const char* src = static_cast<const char*>(dy.raw());
  char* dst = static_cast<char*>(dyp.raw());
  for (int64_t i = 0; i < m; ++i) {
    const int32_t row = p.row_of_choice.data<int32_t>()[i];
    if (row >= 0) std::memcpy(dst + row * row_bytes, src + i * row_bytes, row_bytes);
  }
}

}  // namespace mt::ops::cpu
