// The embedding front door (ops/embedding.h): the arguments checked once, then the CPU reference
// (ops/cpu/embedding.cpp) or, on the GPU, the row kernels of ops/cuda/permute.cu: a gather, and
// a sum per id.
#include "ops/embedding.h"

#include "ops/cpu/embedding.h"
#include "ops/dispatch.h"
#include "ops/permute.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/permute.h"
#endif

namespace mt::ops {

namespace {
void check_ids(const Tensor& ids, int64_t vocab) {
  expect_dtype(ids, DType::kI32, "embedding ids");
  if (on_gpu(ids)) return;  // ids were range-checked when the data was read
  const int32_t* id = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    MT_CHECK(id[i] >= 0 && id[i] < vocab, "token id {} at {} outside [0, {})", id[i], i, vocab);
}

void check_table(const Tensor& table, const char* name) {
  MT_CHECK(table.ndim() == 2, "{} must be (V, D), got {}", name, shape_str(table.shape()));
}
}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  check_table(table, "embedding table");
  check_ids(ids, table.dim(0));
  expect_shape(out, {ids.numel(), table.dim(1)}, "embedding out");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(table)) {
    const profile::Phase phase("gpu.embedding_forward");
    MT_CHECK(ids.device() == Device::kCUDA, "ids must be on the GPU");
    cuda::gather_rows(table, ids, out);
    return;
  }
#endif
  cpu::embedding_forward(ids, table, out);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  check_table(dtable, "embedding gradient");
  check_ids(ids, dtable.dim(0));
  expect_shape(dout, {ids.numel(), dtable.dim(1)}, "embedding dout");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dtable)) {
    const profile::Phase phase("gpu.embedding_backward");
    MT_CHECK(ids.device() == Device::kCUDA, "ids must be on the GPU");
    MT_CHECK(dout.dtype() == dtable.dtype() || dtable.dtype() == DType::kF32,
             "embedding gradient {} into a {} table (valid: the same dtype or f32)",
             dtype_name(dout.dtype()), dtype_name(dtable.dtype()));
    // Token positions sorted by id (stable), then each id's rows summed in token order.
    ExpertPermutation by_id;
    make_expert_permutation(ids.reshape({ids.numel(), 1}), dtable.dim(0), by_id);
    MT_CUDA_CHECK(cuda::kernels::segment_sum_rows(
        cuda::storage_of(dout), dout.raw(), by_id.source_token.data<int32_t>(),
        by_id.expert_offsets.data<int64_t>(), dtable.dim(0), dtable.dim(1), dtable.raw(),
        dtable.dtype() == DType::kF32, cuda::stream()));
    return;
  }
#endif
  cpu::embedding_backward(ids, dout, dtable);
}

}  // namespace mt::ops
