// Multi-tensor AdamW: one launch per flat parameter buffer (a whole unit's group), fp32 master
// weights and moments, PyTorch's update order (as the CPU reference).
#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v,
                             __nv_bfloat16* compute, kernels::AdamWScalars s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float gi = g[i] * s.grad_scale;
    const float mi = s.beta1 * m[i] + (1.f - s.beta1) * gi;
    const float vi = s.beta2 * v[i] + (1.f - s.beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i] * s.decay - s.step_size * mi / (sqrtf(vi) / s.sqrt_bc2 + s.eps);
    p[i] = pi;
    if (compute) compute[i] = __float2bfloat16_rn(pi);
  }
}

}  // namespace

namespace kernels {

cudaError_t adamw(float* p, const float* g, float* m, float* v, void* compute_bf16,
                  AdamWScalars s, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  adamw_kernel<<<grid_for(n), kBlock, 0, stream>>>(
      p, g, m, v, static_cast<__nv_bfloat16*>(compute_bf16), s, n);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
