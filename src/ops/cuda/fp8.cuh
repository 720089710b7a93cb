// FP8 blockwise device helpers shared by the quantization kernels (fp8.cu) and the kernels that
// will write rows with their FP8 copies. Bit-exact with the CPU reference (ops/cpu/fp8.cpp).
#pragma once
#include <cuda_fp8.h>

#include "core/quant_format.h"
#include "ops/cuda/common.cuh"

namespace mt::cuda {

// A block's f32 scale and the factor its elements are multiplied by (core/quant_format.h's
// Fp8ScaleRule), from its amax as magnitude bits (|x|'s bits: an integer max over a block is its
// amax, NaN and infinity above every finite value). Non-finite: NaN for both.
struct Fp8Scale {
  float scale, factor;
};

__device__ __forceinline__ Fp8Scale fp8_scale(Fp8ScaleRule rule, uint32_t amax_bits) {
  if (amax_bits >= 0x7F800000u) {
    const float nan = __uint_as_float(0x7FC00000u);
    return {nan, nan};
  }
  const float a = fmaxf(__uint_as_float(amax_bits), kFp8AmaxFloor);
  if (rule == Fp8ScaleRule::kFp32) return {__fdiv_rn(a, 448.0f), __fdiv_rn(448.0f, a)};
  // a / 448 is a normal float (a >= 1e-12): ceil(log2) from its exponent and mantissa fields.
  const uint32_t d = __float_as_uint(__fdiv_rn(a, 448.0f));
  const int c = static_cast<int>(d >> 23) - 127 + ((d & 0x7FFFFFu) != 0 ? 1 : 0);
  return {__uint_as_float(static_cast<uint32_t>(c + 127) << 23),
          __uint_as_float(static_cast<uint32_t>(127 - c) << 23)};
}

// Two elements of one block as E4M3 bytes (x * factor rounded to f32, then saturated to +-448
// and rounded to nearest even; a non-finite block's elements are 0x7F).
__device__ __forceinline__ uint16_t fp8x2(float a, float b, const Fp8Scale& s) {
  if (isnan(s.factor)) return 0x7F7Fu;
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, s.factor), __fmul_rn(b, s.factor)),
                                  __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint32_t magnitude(float x) {
  return __float_as_uint(x) & 0x7FFFFFFFu;
}

}  // namespace mt::cuda
