// Cross-entropy on the GPU: one block per token row; the wrapper sums the per-row losses on the
// host in row order (deterministic). Chunking over the vocabulary (never materialising fp32 logits
// of every token) comes with the fused LM-head kernel.
#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

template <class T>
__global__ void cross_entropy_forward_kernel(const T* logits, const int32_t* targets,
                                             const uint8_t* mask, float* lse, float* loss,
                                             int64_t v) {
  const int64_t row = blockIdx.x;
  const T* l = logits + row * v;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) m = fmaxf(m, to_float(l[c]));
  m = block_max(m);
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) s += __expf(to_float(l[c]) - m);
  s = block_sum(s);
  if (threadIdx.x == 0) {
    const float lse_row = m + __logf(s);
    lse[row] = lse_row;
    loss[row] = mask[row] ? lse_row - to_float(l[targets[row]]) : 0.f;
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* logits, const int32_t* targets,
                                              const uint8_t* mask, const float* lse, float scale,
                                              T* dlogits, int64_t v) {
  const int64_t row = blockIdx.x;
  const float g = mask[row] ? scale : 0.f;
  const float lse_row = lse[row];
  const int32_t target = targets[row];
  for (int64_t c = threadIdx.x; c < v; c += blockDim.x) {
    const float p = g == 0.f ? 0.f : __expf(to_float(logits[row * v + c]) - lse_row);
    dlogits[row * v + c] = from_float<T>(g * (p - (c == target ? 1.f : 0.f)));
  }
}

}  // namespace

namespace kernels {

cudaError_t cross_entropy_forward(Storage st, const void* logits, const int32_t* targets,
                                  const uint8_t* mask, float* lse, float* loss, int64_t n,
                                  int64_t v, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_forward_kernel<T>
        <<<n, kBlock, 0, stream>>>(static_cast<const T*>(logits), targets, mask, lse, loss, v);
  });
  return cudaGetLastError();
}

cudaError_t cross_entropy_backward(Storage st, const void* logits, const int32_t* targets,
                                   const uint8_t* mask, const float* lse, float scale,
                                   void* dlogits, int64_t n, int64_t v, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_backward_kernel<T><<<n, kBlock, 0, stream>>>(
        static_cast<const T*>(logits), targets, mask, lse, scale, static_cast<T*>(dlogits), v);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
