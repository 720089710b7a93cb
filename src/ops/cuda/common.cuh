// Shared pieces of the CUDA kernels: element conversions, block reductions, dtype dispatch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "core/dtype.h"

namespace mt::cuda {

constexpr int kBlock = 256;  // threads per block for row-wise kernels (8 warps)

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);  // round to nearest even, as mt::to_bf16
}

// 16-byte packs: memory-bound kernels move 8 bf16 or 4 f32 per load and store, the width at
// which the H200 reaches its bandwidth. Callers check `packable` (alignment and length) first.
template <class T>
struct Pack {
  static constexpr int kSize = 16 / sizeof(T);
  float v[kSize];
};

template <class T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  Pack<T> out;
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::kSize; ++i) out.v[i] = to_float(e[i]);
  return out;
}

template <class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& in) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Pack<T>::kSize; ++i) e[i] = from_float<T>(in.v[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// P consecutive elements as floats, P = Pack<T>::kSize (one 16-byte access) or 1 (the fallback
// for unaligned or odd widths): kernels templated on P serve both.
template <class T, int P>
__device__ __forceinline__ void load_n(const T* p, float* v) {
  if constexpr (P == 1) {
    v[0] = to_float(*p);
  } else {
    const Pack<T> pk = load_pack(p);
#pragma unroll
    for (int i = 0; i < P; ++i) v[i] = pk.v[i];
  }
}

template <class T, int P>
__device__ __forceinline__ void store_n(T* p, const float* v) {
  if constexpr (P == 1) {
    *p = from_float<T>(v[0]);
  } else {
    Pack<T> pk;
#pragma unroll
    for (int i = 0; i < P; ++i) pk.v[i] = v[i];
    store_pack(p, pk);
  }
}

// The values a store of v to T holds (bf16: rounded), as floats: what the MX values or FP8 rows
// of a stored output are computed from.
template <class T, int P>
__device__ __forceinline__ void round_to(float (&v)[P]) {
#pragma unroll
  for (int i = 0; i < P; ++i) v[i] = to_float(from_float<T>(v[i]));
}

// True when every pointer is 16-byte aligned and rows of `width` elements keep it so.
template <class T>
inline bool packable(int64_t width, std::initializer_list<const void*> ptrs) {
  if (width % Pack<T>::kSize != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over one block of kBlock threads in double, by a fixed tree (shared memory, halving): the
// same order on every run and every replay, so the device-side loss and aux sums are
// deterministic. Every thread gets the result.
__device__ __forceinline__ double block_sum_fixed_order(double v) {
  __shared__ double partial[kBlock];
  partial[threadIdx.x] = v;
  __syncthreads();
  for (int half = kBlock / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  return partial[0];
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < blockDim.x / 32 ? partial[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Calls f(T{}) with T the element type named by s.
template <class F>
void dispatch_storage(DType s, F&& f) {
  if (s == DType::kF32)
    f(float{});
  else
    f(__nv_bfloat16{});
}

// Multiprocessors of the current GPU (read once: every GPU of a run is the same kind).
inline int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms > 0 ? sms : 132;
  }();
  return count;
}

inline int grid_for(int64_t n, int block = kBlock) {
  return static_cast<int>(std::min<int64_t>((n + block - 1) / block, 65535 * 8));
}

// A block's shared histogram of e bins (dynamic shared memory): zeroed at the start, then added
// to the global counts with one atomic per non-empty bin (many choices on few addresses would
// serialise on global atomics).
__device__ __forceinline__ void zero_block_histogram(int* hist, int e) {
  for (int c = threadIdx.x; c < e; c += blockDim.x) hist[c] = 0;
  __syncthreads();
}

__device__ __forceinline__ void flush_block_histogram(const int* hist, int e, int64_t* counts) {
  __syncthreads();
  for (int c = threadIdx.x; c < e; c += blockDim.x)
    if (hist[c] != 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + c),
                static_cast<unsigned long long>(hist[c]));
}

}  // namespace mt::cuda
