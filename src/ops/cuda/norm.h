// The RMSNorm kernels (norm.cu) behind ops/norm.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace mt::cuda::kernels {

// Element-wise kernels take their storage as a DType: f32 or bf16 (dtype_info(t).kernel_storage),
// math in fp32.
cudaError_t rmsnorm_forward(DType s, const void* x, const void* w, float eps, void* y, float* rstd,
                            int64_t n, int64_t d, cudaStream_t stream);
// dx overwritten; dw accumulated through `partial` (chunks x d floats, chunks = rmsnorm_chunks(n)).
int rmsnorm_chunks(int64_t n);
cudaError_t rmsnorm_backward(DType s, const void* x, const void* w, const float* rstd,
                             const void* dy, void* dx, void* dw, bool dw_f32, float* partial,
                             int64_t n, int64_t d, cudaStream_t stream);

}  // namespace mt::cuda::kernels
