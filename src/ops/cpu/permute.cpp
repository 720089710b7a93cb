#include "ops/permute.h"

#include <cstring>
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
                             ExpertPermutation& out, int64_t align, int64_t routed) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  MT_CHECK(align >= 1, "expert segments aligned to {} rows", align);
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1), m = n * k;
  MT_CHECK(routed >= -1, "{} routed choices", routed);
  out.align = align;
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index))
    return cuda::make_expert_permutation(expert_index, num_experts, align, routed, out);
#endif
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

void peer_choices(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer,
                  Tensor& out) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1);
  MT_CHECK(peers >= 1 && experts_per_peer >= 1, "{} peers of {} experts", peers, experts_per_peer);
  expect_shape(out, {n, peers}, "peer choices");
  expect_dtype(out, DType::kI32, "peer choices");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index)) return cuda::peer_choices(expert_index, peers, experts_per_peer, out);
#endif
  const int32_t* idx = expert_index.data<int32_t>();
  int32_t* o = out.data<int32_t>();
  std::fill(o, o + n * peers, -1);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = idx[t * k + j] / experts_per_peer;
      MT_CHECK(idx[t * k + j] >= 0 && p < peers, "expert index {} outside [0, {})", idx[t * k + j],
               peers * experts_per_peer);
      o[t * peers + p] = static_cast<int32_t>(p);
    }
}

void peer_counts(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer, Tensor& out) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  expect_shape(out, {peers, experts_per_peer + 1}, "peer counts");
  expect_dtype(out, DType::kI64, "peer counts");
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index)) return cuda::peer_counts(expert_index, peers, experts_per_peer, out);
#endif
  Tensor to_peer = Tensor::empty({n, peers}, DType::kI32);
  peer_choices(expert_index, peers, experts_per_peer, to_peer);
  int64_t* c = out.data<int64_t>();
  std::fill(c, c + out.numel(), int64_t{0});
  const int32_t* idx = expert_index.data<int32_t>();
  for (int64_t i = 0; i < n * k; ++i)
    ++c[idx[i] / experts_per_peer * (experts_per_peer + 1) + idx[i] % experts_per_peer];
  for (int64_t t = 0; t < n; ++t)
    for (int64_t p = 0; p < peers; ++p)
      c[p * (experts_per_peer + 1) + experts_per_peer] +=
          to_peer.data<int32_t>()[t * peers + p] >= 0;
}

void local_choices(const Tensor& expert_index, int64_t rank, int64_t experts_per_peer, Tensor& out,
                   const Tensor* received_counts) {
  expect_dtype(expert_index, DType::kI32, "expert_index");
  expect_shape(out, expert_index.shape(), "local choices");
  expect_dtype(out, DType::kI32, "local choices");
  const int64_t rows = expert_index.dim(0), k = expert_index.dim(1);
  int64_t region = rows;
  if (received_counts) {
    expect_dtype(*received_counts, DType::kI64, "received counts");
    const int64_t peers = received_counts->dim(0);
    MT_CHECK(received_counts->ndim() == 2 && received_counts->dim(1) == experts_per_peer + 1 &&
                 rows % peers == 0,
             "received counts {} for {} rows of {} experts per rank",
             shape_str(received_counts->shape()), rows, experts_per_peer);
    region = rows / peers;
  }
#if MOETRAIN_HAS_CUDA
  if (on_gpu(expert_index))
    return cuda::local_choices(expert_index, rank, experts_per_peer, out, received_counts);
#endif
  const int64_t first = rank * experts_per_peer;
  const int32_t* idx = expert_index.data<int32_t>();
  int32_t* o = out.data<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const bool written =
        !received_counts ||
        r % region <
            received_counts
                ->data<int64_t>()[(r / region) * (experts_per_peer + 1) + experts_per_peer];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t local = idx[r * k + j] - first;
      o[r * k + j] =
          written && local >= 0 && local < experts_per_peer ? static_cast<int32_t>(local) : -1;
    }
  }
}

void peer_slots(const Tensor& to_peer, int64_t region_rows, Tensor& out) {
  expect_dtype(to_peer, DType::kI32, "peer choices");
  MT_CHECK(to_peer.ndim() == 2, "peer choices of shape {}, expected (tokens, peers)",
           shape_str(to_peer.shape()));
  expect_shape(out, to_peer.shape(), "peer slots");
  expect_dtype(out, DType::kI32, "peer slots");
  const int64_t n = to_peer.dim(0), peers = to_peer.dim(1);
  MT_CHECK(peers * std::max<int64_t>(region_rows, n) <= INT32_MAX,
           "peer slots of {} tokens over {} peers ({} rows a region) pass i32", n, peers,
           region_rows);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(to_peer)) return cuda::peer_slots(to_peer, region_rows, out);
#endif
  const int32_t* to = to_peer.data<int32_t>();
  int32_t* o = out.data<int32_t>();
  for (int64_t p = 0; p < peers; ++p) {
    int64_t next = 0;
    for (int64_t t = 0; t < n; ++t)
      o[t * peers + p] =
          to[t * peers + p] < 0 ? -1 : static_cast<int32_t>(p * region_rows + next++);
  }
}

void region_slots(const Tensor& received_counts, int64_t capacity, Tensor& out) {
  expect_dtype(received_counts, DType::kI64, "received counts");
  const int64_t peers = received_counts.dim(0), width = received_counts.dim(1);
  expect_shape(out, {peers * capacity, peers}, "region slots");
  expect_dtype(out, DType::kI32, "region slots");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(received_counts)) return cuda::region_slots(received_counts, capacity, out);
#endif
  int32_t* o = out.data<int32_t>();
  std::fill(o, o + out.numel(), -1);
  for (int64_t p = 0; p < peers; ++p) {
    const int64_t tokens = received_counts.data<int64_t>()[p * width + width - 1];
    MT_CHECK(tokens >= 0 && tokens <= capacity, "{} tokens from rank {} for {} places", tokens, p,
             capacity);
    for (int64_t s = 0; s < tokens; ++s)
      o[(p * capacity + s) * peers + p] = static_cast<int32_t>(s);
  }
}

void place_rows(const Tensor& x, const Tensor& slot, int64_t capacity, Tensor& out) {
  const int64_t n = x.dim(0), width = x.dim(1);
  const int64_t peers = slot.ndim() == 2 ? slot.dim(1) : -1;
  expect_shape(slot, {n, peers}, "place_rows slots");
  expect_dtype(slot, DType::kI32, "place_rows slots");
  expect_shape(out, {peers * capacity, width}, "placed rows");
  MT_CHECK(x.dtype() == out.dtype(), "place_rows of {} rows into {}", dtype_name(x.dtype()),
           dtype_name(out.dtype()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::place_rows(x, slot, capacity, out);
#endif
  const size_t row_bytes = static_cast<size_t>(width) * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(out.raw());
  const int32_t* s = slot.data<int32_t>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t p = 0; p < peers; ++p) {
      const int32_t at = s[t * peers + p];
      if (at < 0) continue;
      MT_CHECK(at < capacity, "slot {} of row {} for rank {}: {} places per rank", at, t, p,
               capacity);
      std::memcpy(dst + (p * capacity + at) * row_bytes, src + t * row_bytes, row_bytes);
    }
}

void permute_rows(const Tensor& x, const ExpertPermutation& p, Tensor& xp, const MxValuesOut* mx) {
  const int64_t d = x.dim(1), m = p.rows();
  expect_shape(xp, {m, d}, "permuted rows");
  MT_CHECK(x.dtype() == xp.dtype(), "permute of {} rows into {}", dtype_name(x.dtype()),
           dtype_name(xp.dtype()));
  check_mx_values("permute_rows", xp, mx);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    if (x.dim(0) == 0) return;
    if (!cuda::scatter_token_rows(x, p.row_of_choice, choices_per_token(p, x.dim(0)), xp, mx) && mx)
      write_mx_values(xp, *mx);
    return;
  }
#endif
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw());
  char* dst = static_cast<char*>(xp.raw());
  for (int64_t r = 0; r < m; ++r) {
    const int32_t token = p.source_token.data<int32_t>()[r];
    if (token < 0) continue;  // padding
    std::memcpy(dst + r * row_bytes, src + token * row_bytes, row_bytes);
  }
  if (mx) write_mx_values(xp, *mx);
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
        const int32_t row = p.row_of_choice.data<int32_t>()[t * k + j];
        if (row < 0) continue;  // not routed here
        const T* g = rows.data<T>() + static_cast<int64_t>(row) * d;
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
  MT_CHECK(y.numel() == m * d && y.dtype() == yp.dtype(), "unpermuted {} rows {} for {} rows of {}",
           dtype_name(y.dtype()), shape_str(y.shape()), m, d);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(yp)) {
    Tensor rows = y.reshape({m, d});
    return cuda::gather_rows(yp, p.row_of_choice, rows);
  }
#endif
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
  MT_CHECK(dy.numel() == m * d && dy.dtype() == dyp.dtype(),
           "unpermuted {} gradient {} for {} rows of {}", dtype_name(dy.dtype()),
           shape_str(dy.shape()), m, d);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dyp)) {
    cuda::scatter_token_rows(dy.reshape({m, d}), p.row_of_choice, 1, dyp);
    return;
  }
#endif
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(dyp.dtype());
  const char* src = static_cast<const char*>(dy.raw());
  char* dst = static_cast<char*>(dyp.raw());
  for (int64_t i = 0; i < m; ++i) {
    const int32_t row = p.row_of_choice.data<int32_t>()[i];
    if (row >= 0) std::memcpy(dst + row * row_bytes, src + i * row_bytes, row_bytes);
  }
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
