// RMSNorm on the GPU. Forward and dx: one warp per row (16-byte packs when aligned), fp32
// statistics; rows as short as QK-norm's 128 keep every lane busy. dw: a deterministic
// two-pass column reduction (partials per row chunk, then summed in chunk order), so that runs
// and resumes are bit-identical.
#include "ops/cuda/norm.h"

#include "ops/cuda/common.cuh"

namespace mt::cuda {

namespace {

constexpr int kRowsPerBlock = kBlock / 32;  // forward and dx: one warp per row
constexpr int kMaxRowChunks = 1024;         // dw partials: row chunks of at least 256 rows

template <class T, int P>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, float eps, T* y, float* rstd,
                                       int64_t n, int64_t d) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (row >= n) return;  // whole warps: no block-wide barrier below
  const int lane = threadIdx.x % 32;
  const T* xr = x + row * d;
  float ss = 0.f;
  for (int64_t c = lane * P; c < d; c += 32 * P) {
    float v[P];
    load_n<T, P>(xr + c, v);
#pragma unroll
    for (int i = 0; i < P; ++i) ss += v[i] * v[i];
  }
  const float r = rsqrtf(warp_sum(ss) / static_cast<float>(d) + eps);
  if (lane == 0) rstd[row] = r;
  for (int64_t c = lane * P; c < d; c += 32 * P) {
    float v[P], wv[P];
    load_n<T, P>(xr + c, v);
    load_n<T, P>(w + c, wv);
#pragma unroll
    for (int i = 0; i < P; ++i) v[i] = v[i] * r * wv[i];
    store_n<T, P>(y + row * d + c, v);
  }
}

// x, dy and w at columns [c, c + P) of one row: both passes of the dx kernel read all three.
template <class T, int P>
struct DxOperands {
  float x[P], dy[P], w[P];
  __device__ DxOperands(const T* xr, const T* dyr, const T* wr, int64_t c) {
    load_n<T, P>(xr + c, x);
    load_n<T, P>(dyr + c, dy);
    load_n<T, P>(wr + c, w);
  }
};

template <class T, int P>
__global__ void rmsnorm_dx_kernel(const T* x, const T* w, const float* rstd, const T* dy, T* dx,
                                  int64_t n, int64_t d) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / 32;
  if (row >= n) return;
  const int lane = threadIdx.x % 32;
  const float r = rstd[row];
  const T *xr = x + row * d, *dyr = dy + row * d;
  float dot = 0.f;
  for (int64_t c = lane * P; c < d; c += 32 * P) {
    const DxOperands<T, P> o(xr, dyr, w, c);
#pragma unroll
    for (int i = 0; i < P; ++i) dot += o.dy[i] * o.w[i] * o.x[i] * r;
  }
  const float mean = warp_sum(dot) / static_cast<float>(d);
  for (int64_t c = lane * P; c < d; c += 32 * P) {
    const DxOperands<T, P> o(xr, dyr, w, c);
    float out[P];
#pragma unroll
    for (int i = 0; i < P; ++i) out[i] = r * (o.dy[i] * o.w[i] - o.x[i] * r * mean);
    store_n<T, P>(dx + row * d + c, out);
  }
}

int row_blocks(int64_t n) {
  return static_cast<int>((n + kRowsPerBlock - 1) / kRowsPerBlock);
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
  return static_cast<int>(std::clamp<int64_t>(n / 256, 1, kMaxRowChunks));
}

cudaError_t rmsnorm_forward(DType st, const void* x, const void* w, float eps, void* y, float* rstd,
                            int64_t n, int64_t d, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = static_cast<const T*>(x), *wp = static_cast<const T*>(w);
    T* yp = static_cast<T*>(y);
    if (packable<T>(d, {x, w, y}))
      rmsnorm_forward_kernel<T, Pack<T>::kSize>
          <<<row_blocks(n), kBlock, 0, stream>>>(xp, wp, eps, yp, rstd, n, d);
    else
      rmsnorm_forward_kernel<T, 1>
          <<<row_blocks(n), kBlock, 0, stream>>>(xp, wp, eps, yp, rstd, n, d);
  });
  return cudaGetLastError();
}

cudaError_t rmsnorm_backward(DType st, const void* x, const void* w, const float* rstd,
                             const void* dy, void* dx, void* dw, bool dw_f32, float* partial,
                             int64_t n, int64_t d, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int chunks = rmsnorm_chunks(n);
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    const T* dyp = static_cast<const T*>(dy);
    const T* wp = static_cast<const T*>(w);
    T* dxp = static_cast<T*>(dx);
    if (packable<T>(d, {x, w, dy, dx}))
      rmsnorm_dx_kernel<T, Pack<T>::kSize>
          <<<row_blocks(n), kBlock, 0, stream>>>(xp, wp, rstd, dyp, dxp, n, d);
    else
      rmsnorm_dx_kernel<T, 1><<<row_blocks(n), kBlock, 0, stream>>>(xp, wp, rstd, dyp, dxp, n, d);
    const int columns = static_cast<int>(std::min<int64_t>(kBlock, (d + 31) / 32 * 32));
    const dim3 grid(static_cast<unsigned>((d + columns - 1) / columns), chunks);
    rmsnorm_dw_partial_kernel<T><<<grid, columns, 0, stream>>>(xp, rstd, dyp, partial, n, d);
    const int blocks = static_cast<int>((d + kBlock - 1) / kBlock);
    if (dw_f32)  // mixed precision: bf16 activations, f32 gradient buffers
      rmsnorm_dw_sum_kernel<float>
          <<<blocks, kBlock, 0, stream>>>(partial, chunks, static_cast<float*>(dw), d);
    else
      rmsnorm_dw_sum_kernel<T>
          <<<blocks, kBlock, 0, stream>>>(partial, chunks, static_cast<T*>(dw), d);
  });
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
