// FP8 blockwise device helpers shared by the quantization kernels (fp8.cu) and the kernels that
// write rows with their FP8 copies (kernels::Fp8RowsOut: SwiGLU, the token permutation). Bit-exact
// with the CPU reference (ops/cpu/fp8.cpp).
#pragma once
#include <cuda_fp8.h>

#include "core/quant_format.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fp8.h"

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

// A lane's P consecutive values of a row quantized in its 1 x 128 block: a block is 128 / P
// consecutive lanes of a warp (16 for bf16 packs, 32 for f32), its amax shuffled among them. Every
// lane of the warp calls it; inactive lanes (past the row, whole blocks of them) contribute
// nothing and get nothing meaningful.
template <int P>
struct Fp8Lane {
  Fp8Scale s;
  uint16_t pairs[P / 2];  // E4M3 bytes, two by two
};
template <int P>
__device__ __forceinline__ Fp8Lane<P> fp8_lane(const float (&v)[P], bool active,
                                               Fp8ScaleRule rule) {
  constexpr int kLanes = kFp8Block / P;
  static_assert(P % 2 == 0 && kLanes <= 32 && 32 % kLanes == 0);
  uint32_t amax = 0;
  if (active)
#pragma unroll
    for (int k = 0; k < P; ++k) amax = max(amax, magnitude(v[k]));
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  Fp8Lane<P> lane{};
  if (!active) return lane;
  lane.s = fp8_scale(rule, amax);
#pragma unroll
  for (int k = 0; k < P / 2; ++k) lane.pairs[k] = fp8x2(v[2 * k], v[2 * k + 1], lane.s);
  return lane;
}
// A lane's P E4M3 bytes stored at out (aligned to P bytes) in one access.
template <int P>
__device__ __forceinline__ void store_fp8_bytes(const Fp8Lane<P>& lane, void* out) {
  static_assert(P == 4 || P == 8);
  if constexpr (P == 8)
    *static_cast<uint2*>(out) = make_uint2(lane.pairs[0] | (uint32_t{lane.pairs[1]} << 16),
                                           lane.pairs[2] | (uint32_t{lane.pairs[3]} << 16));
  else
    *static_cast<uint32_t*>(out) = lane.pairs[0] | (uint32_t{lane.pairs[1]} << 16);
}
// An active lane's bytes into kernels::Fp8RowsOut at (row, col) of rows `width` wide, and its
// block's scale by the block's first lane.
template <int P>
__device__ __forceinline__ void store_fp8_lane(const Fp8Lane<P>& lane, int64_t row, int64_t col,
                                               int64_t width, const kernels::Fp8RowsOut& fp8) {
  store_fp8_bytes<P>(lane, fp8.data + row * width + col);
  if ((threadIdx.x % 32) % (kFp8Block / P) == 0)
    fp8.scales[row * (width / kFp8Block) + col / kFp8Block] = lane.s.scale;
}
// Both: the lane's values into the FP8 rows at (row, col).
template <int P>
__device__ __forceinline__ void fp8_rows_out(const float (&v)[P], bool active, int64_t row,
                                             int64_t col, int64_t width,
                                             const kernels::Fp8RowsOut& fp8) {
  const Fp8Lane<P> lane = fp8_lane<P>(v, active, fp8.rule);
  if (active) store_fp8_lane<P>(lane, row, col, width, fp8);
}

}  // namespace mt::cuda
