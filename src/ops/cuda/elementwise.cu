// Elementwise kernels: SwiGLU forward/backward and RoPE (grid-stride loops, fp32 math, 16-byte
// packs where aligned).
#include "ops/cuda/common.cuh"
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
// multiple of 32.
template <class T, int P, bool kMx>
__global__ void swiglu_forward_kernel(const T* h, T* a, int64_t m, int64_t f,
                                      kernels::SwigluRows rows, kernels::MxValuesOut mx) {
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
      if constexpr (kMx) {
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
// of 32), as the forward's.
template <class T, int P, bool kMx>
__global__ void swiglu_backward_kernel(const T* h, const T* da, T* dh, int64_t m, int64_t f,
                                       kernels::SwigluRows rows, kernels::MxValuesOut mx) {
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
      if constexpr (kMx) {
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
}  // namespace

cudaError_t swiglu_forward(DType st, const void* h, void* a, int64_t m, int64_t f, SwigluRows rows,
                           MxValuesOut mx, cudaStream_t stream) {
  if (m * f == 0) return cudaSuccess;
  const int blocks = grid_for(m * 32);  // a warp per row
  return launch_swiglu(st, f, {h, a}, mx, [&](auto p, auto fused, auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T, decltype(p)::value, decltype(fused)::value>
        <<<blocks, kBlock, 0, stream>>>(static_cast<const T*>(h), static_cast<T*>(a), m, f, rows,
                                        mx);
  });
}

cudaError_t swiglu_backward(DType st, const void* h, const void* da, void* dh, int64_t m, int64_t f,
                            SwigluRows rows, MxValuesOut mx, cudaStream_t stream) {
  if (m * f == 0) return cudaSuccess;
  const int blocks = grid_for(m * 32);  // a warp per row
  return launch_swiglu(st, f, {h, da, dh}, mx, [&](auto p, auto fused, auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T, decltype(p)::value, decltype(fused)::value>
        <<<blocks, kBlock, 0, stream>>>(static_cast<const T*>(h), static_cast<const T*>(da),
                                        static_cast<T*>(dh), m, f, rows, mx);
  });
}

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
