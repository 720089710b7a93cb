// Cross-entropy on the GPU: one block per token row, one pass over the logits (online softmax,
// 16-byte packs); the per-row losses are summed on the device in a fixed order (deterministic)
// into a double accumulator, so that no step waits for the host.
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8.cuh"
#include "ops/cuda/loss.h"

namespace mt::cuda {

namespace {

// One pass over the row: each thread keeps a running max and a sum of exp relative to it
// (online softmax), merged across the block at the end.
template <class T, int P>
__global__ void cross_entropy_forward_kernel(const T* logits, const int32_t* targets,
                                             const uint8_t* mask, float* lse, float* loss,
                                             int64_t v) {
  const int64_t row = blockIdx.x;
  const T* l = logits + row * v;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x * P; c < v; c += blockDim.x * P) {
    float x[P];
    load_n<T, P>(l + c, x);
    float local = x[0];
#pragma unroll
    for (int i = 1; i < P; ++i) local = fmaxf(local, x[i]);
    if (local > m) {
      s *= __expf(m - local);
      m = local;
    }
#pragma unroll
    for (int i = 0; i < P; ++i) s += __expf(x[i] - m);
  }
  const float row_max = block_max(m);
  s = block_sum(m == -INFINITY ? 0.f : s * __expf(m - row_max));
  if (threadIdx.x == 0) {
    const float lse_row = row_max + __logf(s);
    lse[row] = lse_row;
    loss[row] = mask[row] ? lse_row - to_float(l[targets[row]]) : 0.f;
  }
}

// sum += the n row losses, by one block: strided partial sums in double, then a fixed tree.
// One block of kBlock threads.
__global__ void sum_rows_kernel(const float* loss, int64_t n, double* sum) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kBlock) s += loss[i];
  s = block_sum_fixed_order(s);
  if (threadIdx.x == 0) *sum += s;
}

// The scale is read from device memory: a captured CUDA graph replays with each step's value.
// Each thread reads its pack before writing it, so dlogits may be logits. With kFp8 every lane of
// a warp runs every step (a 1 x 128 block is 128 / P consecutive lanes, its amax shuffled among
// them) and quantizes the values as stored (fp8_rows_out).
template <class T, int P, bool kFp8>
__global__ void cross_entropy_backward_kernel(const T* logits, const int32_t* targets,
                                              const uint8_t* mask, const float* lse,
                                              const double* scale, T* dlogits, int64_t v,
                                              kernels::Fp8RowsOut fp8) {
  const int64_t row = blockIdx.x;
  const float g = mask[row] ? static_cast<float>(*scale) : 0.f;
  const float lse_row = lse[row];
  const int32_t target = targets[row];
  for (int64_t c0 = 0; c0 < v; c0 += blockDim.x * P) {
    const int64_t c = c0 + threadIdx.x * P;
    const bool active = c < v;
    float x[P];
    if (active) {
      load_n<T, P>(logits + row * v + c, x);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const float p = g == 0.f ? 0.f : __expf(x[i] - lse_row);
        x[i] = g * (p - (c + i == target ? 1.f : 0.f));
      }
      store_n<T, P>(dlogits + row * v + c, x);
    }
    if constexpr (kFp8) {
      if (active) round_to<T>(x);
      fp8_rows_out<P>(x, active, row, c, v, fp8);
    } else if (!active) {
      break;
    }
  }
}

}  // namespace

namespace kernels {

cudaError_t cross_entropy_forward(DType st, const void* logits, const int32_t* targets,
                                  const uint8_t* mask, float* lse, float* loss, double* loss_sum,
                                  int64_t n, int64_t v, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    const T* l = static_cast<const T*>(logits);
    if (packable<T>(v, {logits}))
      cross_entropy_forward_kernel<T, Pack<T>::kSize>
          <<<n, kBlock, 0, stream>>>(l, targets, mask, lse, loss, v);
    else
      cross_entropy_forward_kernel<T, 1><<<n, kBlock, 0, stream>>>(l, targets, mask, lse, loss, v);
  });
  sum_rows_kernel<<<1, kBlock, 0, stream>>>(loss, n, loss_sum);
  return cudaGetLastError();
}

cudaError_t cross_entropy_backward(DType st, const void* logits, const int32_t* targets,
                                   const uint8_t* mask, const float* lse, const double* scale,
                                   void* dlogits, int64_t n, int64_t v, Fp8RowsOut fp8,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    const T* l = static_cast<const T*>(logits);
    T* dl = static_cast<T*>(dlogits);
    const bool packs = packable<T>(v, {logits, dlogits});
    if (fp8.data) {
      if (!packs || v % kFp8Block != 0 || reinterpret_cast<uintptr_t>(fp8.data) % 16 != 0)
        err = cudaErrorNotSupported;
      else
        cross_entropy_backward_kernel<T, Pack<T>::kSize, true>
            <<<n, kBlock, 0, stream>>>(l, targets, mask, lse, scale, dl, v, fp8);
    } else if (packs) {
      cross_entropy_backward_kernel<T, Pack<T>::kSize, false>
          <<<n, kBlock, 0, stream>>>(l, targets, mask, lse, scale, dl, v, fp8);
    } else {
      cross_entropy_backward_kernel<T, 1, false>
          <<<n, kBlock, 0, stream>>>(l, targets, mask, lse, scale, dl, v, fp8);
    }
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kernels
}  // namespace mt::cuda
