#include "ops/cpu/embedding.h"

#include "ops/dispatch.h"

namespace mt::ops::cpu {

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const int64_t n = ids.numel(), d = table.dim(1);
  dispatch_float(table.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* id = ids.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = table.data<T>() + static_cast<int64_t>(id[i]) * d;
      T* o = out.data<T>() + i * d;
      for (int64_t c = 0; c < d; ++c) o[c] = row[c];
    }
  });
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const int64_t n = ids.numel(), d = dtable.dim(1);
  dispatch_float(dtable.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* id = ids.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      T* row = dtable.data<T>() + static_cast<int64_t>(id[i]) * d;
      const T* g = dout.data<T>() + i * d;
      for (int64_t c = 0; c < d; ++c) row[c] += g[c];
    }
  });
}

}  // namespace mt::ops::cpu
