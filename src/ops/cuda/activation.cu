// SwiGLU forward and backward over rows (a warp per row, fp32 math, 16-byte packs where
// aligned), with the expert rows' routing weights and optionally the output's MX values.
#include "ops/cuda/activation.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8.cuh"
#include "ops/cuda/mx.cuh"

namespace mt::cuda {

namespace {

// SwiGLU runs a warp per row (grid-stride over rows), P consecutive columns per lane and step (a
// 16-byte pack when f and the pointers allow, else 1): a row's mark and weight are read once.
// Calls row(r, weight) for every row of this warp that is not padding.
template <class RowFn>
__device__ __forceinline__ void for_each_swiglu_row(int64_t m, const kernels::SwigluRows& rows,
                                                    RowFn&& row) {
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x / 32);
  for (int64_t r = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32; r < m; r += warps) {
    if (rows.token && rows.token[r] < 0) continue;  // padding (the whole warp skips it)
    row(r, rows.weight ? rows.weight[r] : 1.f);
  }
}

// With kMx, also the output's MX values along the row (kernels::MxValuesOut): every lane runs
// every step (the block's amax is shuffled among its four lanes), P is a 16-byte pack and f a
// multiple of 32. With kFp8, the output's FP8 rows (fp8_rows_out) likewise, f a multiple of 128.
template <class T, int P, bool kMx, bool kFp8 = false>
__global__ void swiglu_forward_kernel(const T* h, T* a, int64_t m, int64_t f,
                                      kernels::SwigluRows rows, kernels::MxValuesOut mx,
                                      kernels::Fp8RowsOut fp8 = {}) {
  const int lane = threadIdx.x % 32;
  for_each_swiglu_row(m, rows, [&](int64_t r, float w) {
    const T* gate = h + r * 2 * f;
    const T* up = gate + f;
    T* out = a + r * f;
    for (int64_t c0 = 0; c0 < f; c0 += 32 * P) {
      const int64_t c = c0 + lane * P;
      const bool active = c < f;
      float g[P], u[P];
      if (active) {
        load_n<T, P>(gate + c, g);
        load_n<T, P>(up + c, u);
#pragma unroll
        for (int k = 0; k < P; ++k) g[k] = w * (g[k] / (1.f + __expf(-g[k])) * u[k]);
        if (!kMx || mx.values != a) store_n<T, P>(out + c, g);
      }
      if constexpr (kFp8) {
        if (active) round_to<T>(g);  // the values as stored: what fp8_quantize of a reads
        fp8_rows_out<P>(g, active, r, c, f, fp8);
      } else if constexpr (kMx) {
        round_to<T>(g);
        mx_round_trip_lanes<P>(g, mx.rule, active);
        if (active) store_n<T, P>(static_cast<T*>(mx.values) + r * f + c, g);
      } else if (!active) {
        break;
      }
    }
  });
}

// The row weight's gradient is a sum over the row, reduced in the warp.
// With kMx, also dh's MX values along the row, the gate and up halves' blocks apart (f a multiple
// of 32), as the forward's; with kFp8 (P a pack, f a multiple of 128), dh's FP8 rows likewise.
template <class T, int P, bool kMx, bool kFp8 = false>
__global__ void swiglu_backward_kernel(const T* h, const T* da, T* dh, int64_t m, int64_t f,
                                       kernels::SwigluRows rows, kernels::MxValuesOut mx,
                                       kernels::Fp8RowsOut fp8 = {}) {
  const int lane = threadIdx.x % 32;
  for_each_swiglu_row(m, rows, [&](int64_t r, float w) {
    const T* gate = h + r * 2 * f;
    const T* up = gate + f;
    const T* d_out = da + r * f;
    T* d_gate = dh + r * 2 * f;
    T* d_up = d_gate + f;
    float dot = 0.f;  // <da, silu(gate) * up>
    for (int64_t c0 = 0; c0 < f; c0 += 32 * P) {
      const int64_t c = c0 + lane * P;
      const bool active = c < f;
      float g[P], u[P], d[P];
      if (active) {
        load_n<T, P>(gate + c, g);
        load_n<T, P>(up + c, u);
        load_n<T, P>(d_out + c, d);
#pragma unroll
        for (int k = 0; k < P; ++k) {
          const float sig = 1.f / (1.f + __expf(-g[k]));
          const float silu = g[k] * sig;
          dot += d[k] * silu * u[k];
          const float du = w * d[k] * silu;
          g[k] = w * d[k] * u[k] * sig * (1.f + g[k] * (1.f - sig));
          u[k] = du;
        }
        if (!kMx || mx.values != dh) {
          store_n<T, P>(d_gate + c, g);
          store_n<T, P>(d_up + c, u);
        }
      }
      if constexpr (kFp8) {
        if (active) {
          round_to<T>(g);  // the values as stored: what fp8_quantize of dh reads
          round_to<T>(u);
        }
        fp8_rows_out<P>(g, active, r, c, 2 * f, fp8);
        fp8_rows_out<P>(u, active, r, f + c, 2 * f, fp8);
      } else if constexpr (kMx) {
        T* values = static_cast<T*>(mx.values) + r * 2 * f;
        round_to<T>(g);
        round_to<T>(u);
        mx_round_trip_lanes<P>(g, mx.rule, active);
        mx_round_trip_lanes<P>(u, mx.rule, active);
        if (active) {
          store_n<T, P>(values + c, g);
          store_n<T, P>(values + f + c, u);
        }
      } else if (!active) {
        break;
      }
    }
    if (rows.dweight) {
      dot = warp_sum(dot);
      if (lane == 0) rows.dweight[r] = dot;
    }
  });
}

}  // namespace

namespace kernels {

namespace {
// The SwiGLU launches: P a 16-byte pack when f and the pointers allow it, else 1; the fused MX
// values need the pack and whole blocks (kernels::MxValuesOut).
template <class Launch>
cudaError_t launch_swiglu(DType st, int64_t f, std::initializer_list<const void*> ptrs,
                          const kernels::MxValuesOut& mx, Launch&& launch) {
  cudaError_t err = cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    constexpr int P = Pack<T>::kSize;
    const bool pack = packable<T>(f, ptrs) && (!mx.values || packable<T>(f, {mx.values}));
    if (mx.values && !(pack && f % kMxBlock == 0))
      err = cudaErrorNotSupported;
    else if (mx.values)
      launch(std::integral_constant<int, P>{}, std::true_type{}, tag);
    else if (pack)
      launch(std::integral_constant<int, P>{}, std::false_type{}, tag);
    else
      launch(std::integral_constant<int, 1>{}, std::false_type{}, tag);
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}
// The fused FP8 rows' launches: 16-byte packs, f a multiple of 128, not with MX values; else
// cudaErrorNotSupported, launching nothing.
template <class Launch>
cudaError_t launch_swiglu_fp8(DType st, int64_t f, std::initializer_list<const void*> ptrs,
                              const kernels::MxValuesOut& mx, const kernels::Fp8RowsOut& fp8,
                              Launch&& launch) {
  if (mx.values || f % kFp8Block != 0 || reinterpret_cast<uintptr_t>(fp8.data) % 16 != 0)
    return cudaErrorNotSupported;
  cudaError_t err = cudaSuccess;
  dispatch_storage(st, [&](auto tag) {
    using T = decltype(tag);
    if (!packable<T>(f, ptrs))
      err = cudaErrorNotSupported;
    else
      launch(std::integral_constant<int, Pack<T>::kSize>{}, tag);
  });
  return err != cudaSuccess ? err : cudaGetLastError();
}
}  // namespace

cudaError_t swiglu_forward(DType st, const void* h, void* a, int64_t m, int64_t f, SwigluRows rows,
                           MxValuesOut mx, Fp8RowsOut fp8, cudaStream_t stream) {
  if (m * f == 0) return cudaSuccess;
  const int blocks = grid_for(m * 32);  // a warp per row
  if (fp8.data)
    return launch_swiglu_fp8(st, f, {h, a}, mx, fp8, [&](auto p, auto tag) {
      using T = decltype(tag);
      swiglu_forward_kernel<T, decltype(p)::value, false, true><<<blocks, kBlock, 0, stream>>>(
          static_cast<const T*>(h), static_cast<T*>(a), m, f, rows, mx, fp8);
    });
  return launch_swiglu(st, f, {h, a}, mx, [&](auto p, auto fused, auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T, decltype(p)::value, decltype(fused)::value>
        <<<blocks, kBlock, 0, stream>>>(static_cast<const T*>(h), static_cast<T*>(a), m, f, rows,
                                        mx);
  });
}

cudaError_t swiglu_backward(DType st, const void* h, const void* da, void* dh, int64_t m, int64_t f,
                            SwigluRows rows, MxValuesOut mx, Fp8RowsOut fp8, cudaStream_t stream) {
  if (m * f == 0) return cudaSuccess;
  const int blocks = grid_for(m * 32);  // a warp per row
  if (fp8.data)
    return launch_swiglu_fp8(st, f, {h, da, dh}, mx, fp8, [&](auto p, auto tag) {
      using T = decltype(tag);
      swiglu_backward_kernel<T, decltype(p)::value, false, true>
          <<<blocks, kBlock, 0, stream>>>(static_cast<const T*>(h), static_cast<const T*>(da),
                                          static_cast<T*>(dh), m, f, rows, mx, fp8);
    });
  return launch_swiglu(st, f, {h, da, dh}, mx, [&](auto p, auto fused, auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T, decltype(p)::value, decltype(fused)::value>
        <<<blocks, kBlock, 0, stream>>>(static_cast<const T*>(h), static_cast<const T*>(da),
                                        static_cast<T*>(dh), m, f, rows, mx);
  });
}

}  // namespace kernels
}  // namespace mt::cuda
