// Elementwise kernels: SwiGLU forward/backward and RoPE (grid-stride loops, fp32 math).
#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

template <class T>
__global__ void swiglu_forward_kernel(const T* h, T* a, int64_t m, int64_t f) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * f;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / f, c = i % f;
    const float g = to_float(h[r * 2 * f + c]), u = to_float(h[r * 2 * f + f + c]);
    a[i] = from_float<T>(g / (1.f + __expf(-g)) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* h, const T* da, T* dh, int64_t m, int64_t f) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < m * f;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / f, c = i % f;
    const float g = to_float(h[r * 2 * f + c]), u = to_float(h[r * 2 * f + f + c]);
    const float d = to_float(da[i]);
    const float sig = 1.f / (1.f + __expf(-g));
    dh[r * 2 * f + f + c] = from_float<T>(d * g * sig);
    dh[r * 2 * f + c] = from_float<T>(d * u * sig * (1.f + g * (1.f - sig)));
  }
}

// One thread per (token, rotation pair); the angle is computed once in fp64 (positions reach
// 10^5 and fp32 would lose 1e-2 rad there) and applied to every head.
template <class T>
__global__ void rope_kernel(const T* x, const int32_t* pos, double theta, int direction, T* y,
                            int64_t n, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * half;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / half, k = i % half;
    const double angle = pos[t] * pow(theta, -2.0 * static_cast<double>(k) / hd);
    double s, c;
    sincos(angle, &s, &c);
    const float cf = static_cast<float>(c), sf = static_cast<float>(direction * s);
    for (int64_t head = 0; head < heads; ++head) {
      const int64_t base = (t * heads + head) * hd;
      const float x1 = to_float(x[base + k]), x2 = to_float(x[base + k + half]);
      y[base + k] = from_float<T>(x1 * cf - x2 * sf);
      y[base + k + half] = from_float<T>(x2 * cf + x1 * sf);
    }
  }
}

}  // namespace

namespace kernels {

cudaError_t swiglu_forward(Storage st, const void* h, void* a, int64_t m, int64_t f,
                           cudaStream_t stream) {
  if (m * f == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<grid_for(m * f), kBlock, 0, stream>>>(static_cast<const T*>(h),
                                                                     static_cast<T*>(a), m, f);
  });
  return cudaGetLastError();
}

cudaError_t swiglu_backward(Storage st, const void* h, const void* da, void* dh, int64_t m,
                            int64_t f, cudaStream_t stream) {
  if (m * f == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_for(m * f), kBlock, 0, stream>>>(
        static_cast<const T*>(h), static_cast<const T*>(da), static_cast<T*>(dh), m, f);
  });
  return cudaGetLastError();
}

cudaError_t rope(Storage st, const void* x, const int32_t* pos, double theta, int direction,
                 void* y, int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<grid_for(n * head_dim / 2), kBlock, 0, stream>>>(
        static_cast<const T*>(x), pos, theta, direction, static_cast<T*>(y), n, heads, head_dim);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
