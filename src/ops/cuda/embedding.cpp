// The embedding ops on the GPU (ops/cuda/ops.h): checks with named messages, then the row kernels
// of permute.cu: a gather, and a sum per id.
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void embedding_forward(const Tensor& ids, const Tensor& table, Tensor& out) {
  const profile::Phase phase("gpu.embedding_forward");
  MT_CHECK(ids.device() == Device::kCUDA && ids.dtype() == DType::kI32,
           "ids must be i32 on the GPU");
  gather_rows(table, ids, out);
}

void embedding_backward(const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  const profile::Phase phase("gpu.embedding_backward");
  MT_CHECK(ids.device() == Device::kCUDA && ids.dtype() == DType::kI32,
           "ids must be i32 on the GPU");
  MT_CHECK(dout.dtype() == dtable.dtype() || dtable.dtype() == DType::kF32,
           "embedding gradient {} into a {} table (valid: the same dtype or f32)",
           dtype_name(dout.dtype()), dtype_name(dtable.dtype()));
  // Token positions sorted by id (stable), then each id's rows summed in token order.
  ops::ExpertPermutation by_id;
  cuda::make_expert_permutation(ids.reshape({ids.numel(), 1}), dtable.dim(0), 1, -1, by_id);
  MT_CUDA_CHECK(
      kernels::segment_sum_rows(storage_of(dout), dout.raw(), by_id.source_token.data<int32_t>(),
                                by_id.expert_offsets.data<int64_t>(), dtable.dim(0), dtable.dim(1),
                                dtable.raw(), dtable.dtype() == DType::kF32, stream()));
}

}  // namespace mt::cuda
