// The AdamW kernel (optim.cu) behind ops/optim.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mt::cuda::kernels {

struct AdamWScalars {
  float beta1, beta2, decay, step_size, sqrt_bc2, eps, grad_scale;
};
// compute_bf16 (nullable) receives the updated parameters rounded to bf16; s points to device
// memory.
cudaError_t adamw(float* p, const float* g, float* m, float* v, void* compute_bf16,
                  const AdamWScalars* s, int64_t n, cudaStream_t stream);

}  // namespace mt::cuda::kernels
