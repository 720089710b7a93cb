// MX device helpers shared by the quantization kernels (mx.cu) and the kernels that write rows
// together with their MX values (ops::MxValuesOut: the permutation and SwiGLU). Every helper is
// bit-exact with the CPU reference (ops/cpu/mx.cpp), which follows torchao's to_mx.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/quant_format.h"
#include "ops/cuda/common.cuh"

namespace mt::cuda {

// |x| as ordered bits: unsigned comparison orders magnitudes, and every NaN is above infinity,
// so an integer max over a block is its amax with NaN propagated.
__device__ __forceinline__ uint32_t magnitude_bits(float x) {
  return __float_as_uint(x) & 0x7FFFFFFFu;
}

__device__ __forceinline__ float pow2(int k) {  // 2^k for k in [-127, 127], exact
  return k >= -126 ? __uint_as_float(static_cast<uint32_t>(k + 127) << 23)
                   : __uint_as_float(0x00400000u);
}

// The block's biased E8M0 exponent and the factor its elements are multiplied by (the CPU
// reference's floor_scale / rceil_scale / element_factor).
struct BlockScale {
  uint8_t s;
  float factor;
};

// RCEIL's scale of biased exponent s (in [0, 254]) and the factor its elements take: 2^(127-s),
// or 1 for s = 0 (every element then rounds to zero in E4M3).
__device__ __forceinline__ BlockScale from_exponent(int s) {
  return {static_cast<uint8_t>(s), s == 0 ? 1.0f : pow2(127 - s)};
}

__device__ __forceinline__ BlockScale block_scale(MxScaleRule rule, uint32_t amax_bits) {
  const float amax = __uint_as_float(amax_bits);
  if (rule == MxScaleRule::kFloor) {
    if (isnan(amax)) return {0xFF, 0.0f};
    const int field = static_cast<int>(amax_bits >> 23);
    const int unbiased = min(max(field - 127 - 8, -127), 128);
    const uint8_t s = static_cast<uint8_t>(unbiased + 127);
    return {s, pow2(127 - max(static_cast<int>(s), 1))};  // divisor clamped to >= 2^-126
  }
  // RCEIL without the division: for amax = M * 2^j (M in [1, 2)) whose quotient by 448 = 1.75 * 2^8
  // is a normal float, fl32(amax / 448) is a power of two only when M = 1.75 exactly (the values
  // next to 1.75 * 2^j lie over half an ulp of the quotient away from 2^(j - 8)), so its ceil(log2)
  // is j - 8, plus one when M > 1.75. Smaller, infinite and NaN amax take the division below.
  const uint32_t field = amax_bits >> 23;
  if (field >= 16 && field < 255)
    return from_exponent(static_cast<int>(field) - 8 +
                         ((amax_bits & 0x7FFFFFu) > 0x600000u ? 1 : 0));
  const float descale = __fdiv_rn(amax, 448.0f);
  if (isnan(descale)) return {0xFF, descale};
  if (isinf(descale)) return {0xFE, pow2(-127)};
  const uint32_t bits = __float_as_uint(descale);
  const uint32_t q_field = bits >> 23, mantissa = bits & 0x7FFFFFu;
  int s;
  if (q_field == 0)
    s = mantissa > 0x400000u ? 1 : 0;  // zero or subnormal: above 2^-127 rounds up to 2^-126
  else
    s = min(static_cast<int>(q_field) + (mantissa != 0 ? 1 : 0), 254);
  return from_exponent(s);
}

// The E4M3 NaN byte of x * factor when that is NaN, signed as the reference's quantize_element
// signs it (the GPU's own NaN results are canonical, positive): positive for a NaN factor
// (RCEIL's NaN block), else x's own sign for a NaN x, negative for inf x 0 (FLOOR's NaN block).
__device__ __forceinline__ uint16_t e4m3_nan(float x, float factor) {
  return isnan(factor) ? 0x7F : isnan(x) ? (signbit(x) ? 0xFF : 0x7F) : 0xFF;
}

// Two products rounded to f32, then to E4M3 with saturation and round-to-nearest-even: the
// reference's quantize_element (NaN bytes signed as it signs them).
__device__ __forceinline__ uint16_t e4m3x2(float a, float b, float factor) {
  const float pa = __fmul_rn(a, factor), pb = __fmul_rn(b, factor);
  uint16_t q = __nv_cvt_float2_to_fp8x2(make_float2(pa, pb), __NV_SATFINITE, __NV_E4M3);
  if (isnan(pa)) q = (q & 0xFF00u) | e4m3_nan(a, factor);
  if (isnan(pb)) q = (q & 0x00FFu) | (e4m3_nan(b, factor) << 8);
  return q;
}

__device__ __forceinline__ float e8m0_value(uint8_t s) {
  return s == 0xFF ? __uint_as_float(0x7FC00000u) : pow2(static_cast<int>(s) - 127);
}

// The MX value of two elements of one block: quantized with the block's factor (rounded to f32,
// then to E4M3 with saturation, nearest even) and dequantized with its scale (exact in f32).
__device__ __forceinline__ float2 mx_values2(float a, float b, const BlockScale& bs, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(e4m3x2(a, b, bs.factor), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return make_float2(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
}

// v's P consecutive elements of a row replaced by their MX values along the row (dim0). A block's
// 32 elements are held by kMxBlock / P consecutive lanes of the warp; every lane of the warp calls
// this (the shuffles need them all), those past the row's end with active = false (their blocks
// are wholly outside: the row length is a multiple of 32).
template <int P>
__device__ __forceinline__ void mx_round_trip_lanes(float (&v)[P], MxScaleRule rule, bool active) {
  static_assert(P % 2 == 0 && kMxBlock % P == 0, "whole pairs of one block");
  uint32_t m = 0;
  if (active) {
#pragma unroll
    for (int i = 0; i < P; ++i) m = max(m, magnitude_bits(v[i]));
  }
#pragma unroll
  for (int o = 1; o < kMxBlock / P; o <<= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!active) return;
  const BlockScale bs = block_scale(rule, m);
  const float scale = e8m0_value(bs.s);
#pragma unroll
  for (int i = 0; i < P; i += 2) {
    const float2 q = mx_values2(v[i], v[i + 1], bs, scale);
    v[i] = q.x;
    v[i + 1] = q.y;
  }
}

// P values stored as T at p with the widest accesses their bytes allow (16 or 8 bytes; p aligned
// to them).
template <class T, int P>
__device__ __forceinline__ void store_run(T* p, const float* v) {
  constexpr int kBytes = P * static_cast<int>(sizeof(T));
  static_assert(kBytes % 8 == 0, "whole 8-byte accesses");
  alignas(16) T e[P];
#pragma unroll
  for (int i = 0; i < P; ++i) e[i] = from_float<T>(v[i]);
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int b = 0; b < kBytes / 16; ++b)
      reinterpret_cast<uint4*>(p)[b] = reinterpret_cast<const uint4*>(e)[b];
  } else {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(e);
  }
}

}  // namespace mt::cuda
