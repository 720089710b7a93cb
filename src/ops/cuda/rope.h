// The rotary-embedding kernel (rope.cu) behind ops/rope.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace mt::cuda::kernels {

cudaError_t rope(DType s, const void* x, const int32_t* pos, double theta, int direction, void* y,
                 int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream);

}  // namespace mt::cuda::kernels
