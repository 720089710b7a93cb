// The exchange layouts' plain reference: one host loop each, the tokens in order.
#include "ops/cpu/exchange_layout.h"

#include <algorithm>
#include <cstring>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void peer_choices(const Tensor& expert_index, int64_t peers, int64_t experts_per_peer,
                  Tensor& out) {
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1);
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
  const int64_t n = expert_index.dim(0), k = expert_index.dim(1);
  Tensor to_peer = Tensor::empty({n, peers}, DType::kI32);
  cpu::peer_choices(expert_index, peers, experts_per_peer, to_peer);
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
  const int64_t rows = expert_index.dim(0), k = expert_index.dim(1);
  const int64_t region = received_counts ? rows / received_counts->dim(0) : rows;
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
  const int64_t n = to_peer.dim(0), peers = to_peer.dim(1);
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
  const int64_t peers = received_counts.dim(0), width = received_counts.dim(1);
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

}  // namespace mt::ops::cpu
