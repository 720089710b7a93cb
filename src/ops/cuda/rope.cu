// Rotary position embedding, forward and backward (the rotation's direction), fp64 angles.
#include "ops/cuda/rope.h"

#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

// One thread per (token, P consecutive rotation pairs); the angles are computed once in fp64
// (positions reach 10^5 and fp32 would lose 1e-2 rad there) and applied to every head.
template <class T, int P>
__global__ void rope_kernel(const T* x, const int32_t* pos, double theta, int direction, T* y,
                            int64_t n, int64_t heads, int64_t hd) {
  const int64_t half = hd / 2, packs = half / P;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * packs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / packs, k0 = (i % packs) * P;
    float cf[P], sf[P];
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const double angle = pos[t] * pow(theta, -2.0 * static_cast<double>(k0 + j) / hd);
      double s, c;
      sincos(angle, &s, &c);
      cf[j] = static_cast<float>(c);
      sf[j] = static_cast<float>(direction * s);
    }
    for (int64_t head = 0; head < heads; ++head) {
      const int64_t base = (t * heads + head) * hd + k0;
      float x1[P], x2[P], y1[P], y2[P];
      load_n<T, P>(x + base, x1);
      load_n<T, P>(x + base + half, x2);
#pragma unroll
      for (int j = 0; j < P; ++j) {
        y1[j] = x1[j] * cf[j] - x2[j] * sf[j];
        y2[j] = x2[j] * cf[j] + x1[j] * sf[j];
      }
      store_n<T, P>(y + base, y1);
      store_n<T, P>(y + base + half, y2);
    }
  }
}

}  // namespace

namespace kernels {

cudaError_t rope(DType st, const void* x, const int32_t* pos, double theta, int direction, void* y,
                 int64_t n, int64_t heads, int64_t head_dim, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    constexpr int P = Pack<T>::kSize;
    if (packable<T>(head_dim / 2, {x, y}))
      rope_kernel<T, P><<<grid_for(n * head_dim / 2 / P), kBlock, 0, stream>>>(
          xp, pos, theta, direction, yp, n, heads, head_dim);
    else
      rope_kernel<T, 1><<<grid_for(n * head_dim / 2), kBlock, 0, stream>>>(
          xp, pos, theta, direction, yp, n, heads, head_dim);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
