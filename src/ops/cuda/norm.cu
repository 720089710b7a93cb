// RMSNorm on the GPU. Forward and dx: one block per row, fp32 statistics. dw: a deterministic
// two-pass column reduction (partials per row chunk, then summed in chunk order), so that runs
// and resumes are bit-identical.
#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kRowChunks = 64;  // row chunks of the dw reduction: enough blocks to fill 132 SMs

template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, float eps, T* y, float* rstd,
                                       int64_t d) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * d;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    const float v = to_float(xr[c]);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / static_cast<float>(d) + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
    y[row * d + c] = from_float<T>(to_float(xr[c]) * r * to_float(w[c]));
}

template <class T>
__global__ void rmsnorm_dx_kernel(const T* x, const T* w, const float* rstd, const T* dy, T* dx,
                                  int64_t d) {
  const int64_t row = blockIdx.x;
  const float r = rstd[row];
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x)
    dot += to_float(dy[row * d + c]) * to_float(w[c]) * to_float(x[row * d + c]) * r;
  const float mean = block_sum(dot) / static_cast<float>(d);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    const float xv = to_float(x[row * d + c]);
    dx[row * d + c] =
        from_float<T>(r * (to_float(dy[row * d + c]) * to_float(w[c]) - xv * r * mean));
  }
}

// partial[chunk, c] = sum over the chunk's rows of dy * x * rstd.
template <class T>
__global__ void rmsnorm_dw_partial_kernel(const T* x, const float* rstd, const T* dy,
                                          float* partial, int64_t n, int64_t d) {
  const int64_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  const int64_t rows = (n + gridDim.y - 1) / gridDim.y;
  const int64_t begin = blockIdx.y * rows, end = min(n, begin + rows);
  float s = 0.f;
  for (int64_t i = begin; i < end; ++i)
    s += to_float(dy[i * d + c]) * to_float(x[i * d + c]) * rstd[i];
  partial[blockIdx.y * d + c] = s;
}

template <class T>
__global__ void rmsnorm_dw_sum_kernel(const float* partial, int chunks, T* dw, int64_t d) {
  const int64_t c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= d) return;
  float s = to_float(dw[c]);  // dw accumulates, as on the CPU
  for (int k = 0; k < chunks; ++k) s += partial[k * d + c];
  dw[c] = from_float<T>(s);
}

}  // namespace

namespace kernels {

int rmsnorm_chunks(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kRowChunks, std::max<int64_t>(n, 1)));
}

cudaError_t rmsnorm_forward(Storage st, const void* x, const void* w, float eps, void* y,
                            float* rstd, int64_t n, int64_t d, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward_kernel<T><<<n, kBlock, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), eps, static_cast<T*>(y), rstd, d);
  });
  return cudaGetLastError();
}

cudaError_t rmsnorm_backward(Storage st, const void* x, const void* w, const float* rstd,
                             const void* dy, void* dx, void* dw, bool dw_f32, float* partial,
                             int64_t n, int64_t d, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int chunks = rmsnorm_chunks(n);
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    const T* dyp = static_cast<const T*>(dy);
    rmsnorm_dx_kernel<T>
        <<<n, kBlock, 0, stream>>>(xp, static_cast<const T*>(w), rstd, dyp, static_cast<T*>(dx), d);
    const dim3 grid((d + kBlock - 1) / kBlock, chunks);
    rmsnorm_dw_partial_kernel<T><<<grid, kBlock, 0, stream>>>(xp, rstd, dyp, partial, n, d);
    const int blocks = static_cast<int>((d + kBlock - 1) / kBlock);
    if (dw_f32)  // mixed precision: bf16 activations, f32 gradient buffers
      rmsnorm_dw_sum_kernel<float><<<blocks, kBlock, 0, stream>>>(partial, chunks,
                                                                  static_cast<float*>(dw), d);
    else
      rmsnorm_dw_sum_kernel<T><<<blocks, kBlock, 0, stream>>>(partial, chunks, static_cast<T*>(dw), d);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
