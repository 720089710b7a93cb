// Element-wise kernels over whole tensors: f32 <-> bf16 conversion, the deterministic sum of
// squares, scaling and addition (grid-stride loops, fp32 math, 16-byte packs where aligned).
#include "ops/cuda/elementwise.h"

#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

__global__ void convert_kernel_f32_bf16(const float* src, __nv_bfloat16* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

__global__ void convert_kernel_bf16_f32(const __nv_bfloat16* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}

// Deterministic sum of squares: per-block partials over fixed ranges, then one block adds them
// in order (in double).
constexpr int kSquareBlocks = 1024;

template <class T>
__global__ void sum_squares_partial_kernel(const T* x, int64_t n, float* partial) {
  const int64_t per_block = (n + gridDim.x - 1) / gridDim.x;
  const int64_t begin = blockIdx.x * per_block, end = min(n, begin + per_block);
  float s = 0.f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = to_float(x[i]);
    s += v * v;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(const float* partial, int count, double* out) {
  if (threadIdx.x != 0) return;
  double s = 0;
  for (int i = 0; i < count; ++i) s += partial[i];
  *out = s;
}

template <class T>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    x[i] = from_float<T>(to_float(x[i]) * s);
}

// Packs over the first `packs` x P elements, then single elements.
template <class T>
__global__ void add_kernel(const T* a, const T* b, T* out, int64_t n, int64_t packs) {
  constexpr int P = Pack<T>::kSize;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = first; i < packs; i += stride) {
    float x[P], y[P];
    load_n<T, P>(a + i * P, x);
    load_n<T, P>(b + i * P, y);
#pragma unroll
    for (int k = 0; k < P; ++k) x[k] += y[k];
    store_n<T, P>(out + i * P, x);
  }
  for (int64_t i = packs * P + first; i < n; i += stride)
    out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

}  // namespace

namespace kernels {

cudaError_t convert(DType from, const void* src, void* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (from == DType::kF32)
    convert_kernel_f32_bf16<<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<const float*>(src), static_cast<__nv_bfloat16*>(dst), n);
  else
    convert_kernel_bf16_f32<<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(src), static_cast<float*>(dst), n);
  return cudaGetLastError();
}

size_t sum_of_squares_workspace() {
  return sizeof(float) * kSquareBlocks + sizeof(double);
}

cudaError_t sum_of_squares(DType s, const void* x, int64_t n, void* workspace, double* result,
                           cudaStream_t stream) {
  auto* partial = static_cast<float*>(workspace);
  auto* out = reinterpret_cast<double*>(partial + kSquareBlocks);
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    sum_squares_partial_kernel<T>
        <<<kSquareBlocks, kBlock, 0, stream>>>(static_cast<const T*>(x), n, partial);
  });
  sum_partials_kernel<<<1, 32, 0, stream>>>(partial, kSquareBlocks, out);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return cudaMemcpyAsync(result, out, sizeof(double), cudaMemcpyDeviceToHost, stream) == cudaSuccess
             ? cudaStreamSynchronize(stream)
             : cudaGetLastError();
}

cudaError_t scale(DType s, void* x, float factor, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    scale_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(x), factor, n);
  });
  return cudaGetLastError();
}

cudaError_t add(DType s, const void* a, const void* b, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(s, [&](auto tag) {
    using T = decltype(tag);
    const int64_t packs = packable<T>(Pack<T>::kSize, {a, b, out}) ? n / Pack<T>::kSize : 0;
    add_kernel<T><<<grid_for(std::max<int64_t>(packs, 1)), kBlock, 0, stream>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out), n, packs);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
