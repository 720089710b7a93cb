#include "ops/embedding.h"

#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {
void check_ids(const Tensor& ids, int64_t vocab) {
  expect_dtype(ids, DType::kI32, "embedding ids");
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    MT_CHECK(id[i] >= 0 && id[i] < vocab, "token id {} at {} outside [0, {})", id[i], i, vocab);
}
}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(table)) return cuda::embedding_forward(ids, table, out);
#endif
  const int64_t n = ids.numel(), d = table.dim(1);
  check_ids(ids, table.dim(0));
  expect_shape(out, {n, d}, "embedding out");
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
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dtable)) return cuda::embedding_backward(ids, dout, dtable);
#endif
  const int64_t n = ids.numel(), d = dtable.dim(1);
  check_ids(ids, dtable.dim(0));
  expect_shape(dout, {n, d}, "embedding dout");
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

}  // namespace mt::ops
