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

// 128 x 128 tiles (kTile128), one CTA of kTileThreads per tile: the tile's rows are read as packs
// of P consecutive values, a warp's loads covering one (P 4) or two (P 8) whole rows, so each
// thread holds one column range of P elements in 128 / kRowStep rows. Its bytes leave as the dim0
// copy directly and, for the dim1 copy, through a shared tile read back as 4 x 4 blocks of 32-bit
// words, transposed in registers by byte permutes, and written as 16-byte runs of the transposed
// rows. Shared by the quantization kernel (fp8.cu) and AdamW's, which writes a weight's tiles from
// its updated values (optim.cu).
inline constexpr int kTileThreads = 256;

template <int Width>
struct Fp8TileThread {
  static constexpr int P = Width;
  static constexpr int kPacksPerRow = static_cast<int>(kFp8Block) / P;   // 32 (P 4) or 16 (P 8)
  static constexpr int kRowStep = kTileThreads / kPacksPerRow;           // rows between packs
  static constexpr int kPacks = static_cast<int>(kFp8Block) / kRowStep;  // 16 or 8
  static __device__ __forceinline__ int row0() { return threadIdx.x / kPacksPerRow; }
  static __device__ __forceinline__ int col() { return (threadIdx.x % kPacksPerRow) * P; }
};

// The CTA's tile of a (batch, rows, cols) weight: tiles in (b, tr, tc) order, one per CTA.
struct TilePlace {
  int64_t b, tr, tc, rows, cols;
  // The element (tile row r, tile column c) of a (batch, rows, cols) tensor.
  __device__ __forceinline__ int64_t offset(int r, int c) const {
    return (b * rows + tr * kFp8Block + r) * cols + tc * kFp8Block + c;
  }
};
__device__ __forceinline__ TilePlace tile_place(int64_t rows, int64_t cols) {
  const int64_t tiles_c = cols / kFp8Block, tiles_r = rows / kFp8Block;
  return {blockIdx.x / (tiles_r * tiles_c), blockIdx.x / tiles_c % tiles_r, blockIdx.x % tiles_c,
          rows, cols};
}

// The transpose of a 4 x 4 byte block held as four row words: column c's word (rows 0..3 as its
// bytes 0..3) into cols[c].
__device__ __forceinline__ void transpose4x4(const uint32_t (&rows)[4], uint32_t (&cols)[4]) {
  const uint32_t lo01 = __byte_perm(rows[0], rows[1], 0x5140);  // r0.b0 r1.b0 r0.b1 r1.b1
  const uint32_t lo23 = __byte_perm(rows[2], rows[3], 0x5140);
  const uint32_t hi01 = __byte_perm(rows[0], rows[1], 0x7362);  // r0.b2 r1.b2 r0.b3 r1.b3
  const uint32_t hi23 = __byte_perm(rows[2], rows[3], 0x7362);
  cols[0] = __byte_perm(lo01, lo23, 0x5410);
  cols[1] = __byte_perm(lo01, lo23, 0x7632);
  cols[2] = __byte_perm(hi01, hi23, 0x5410);
  cols[3] = __byte_perm(hi01, hi23, 0x7632);
}

// A 128 x 128 byte tile in shared memory, 128 bytes a row, its 4-byte words swizzled: word w of
// row r at w ^ 4 ((r / 16) % 8), so that the transposed read below (eight row groups of a warp
// reading one column quad each) hits 32 banks; runs of 4 words stay whole and 16-byte aligned.
inline constexpr int kTileBytes = static_cast<int>(kFp8Block * kFp8Block);
__device__ __forceinline__ int tile_byte(int r, int c) {
  return r * static_cast<int>(kFp8Block) + ((c >> 2) ^ (((r >> 4) & 7) << 2)) * 4 + (c & 3);
}

// The shared tile written transposed at its place in dim1 ((batch, cols, rows) of at's (batch,
// rows, cols)): thread (row group g = t % 8, column quad cq = t / 8) writes transposed rows
// 4 cq .. 4 cq + 3 at the tile's rows 16 g .. 16 g + 15, from four 4 x 4 blocks read as words and
// turned by byte permutes, one 16-byte run each: eight consecutive threads write one transposed
// row's 128 bytes. All kTileThreads threads call it once the tile is complete.
__device__ __forceinline__ void store_tile_transposed(const uint8_t* tile, const TilePlace& at,
                                                      uint8_t* dim1) {
  constexpr int kB = static_cast<int>(kFp8Block);
  const int g = threadIdx.x % 8, cq = threadIdx.x / 8;
  uint32_t out[4][4];  // [transposed row][16-byte run's word]
#pragma unroll
  for (int blk = 0; blk < 4; ++blk) {
    uint32_t row_words[4], col_words[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      row_words[j] =
          *reinterpret_cast<const uint32_t*>(tile + tile_byte(16 * g + 4 * blk + j, 4 * cq));
    transpose4x4(row_words, col_words);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j][blk] = col_words[j];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<uint4*>(dim1 + (at.b * at.cols + at.tc * kB + 4 * cq + j) * at.rows +
                              at.tr * kB + 16 * g) =
        make_uint4(out[j][0], out[j][1], out[j][2], out[j][3]);
}

// The tile's values as this thread holds them (Fp8TileThread<P>) quantized with the tile's amax:
// E4M3 bytes into dim0 (stored as the weight, (batch, rows, cols)) and dim1 (transposed, (batch,
// cols, rows)), either may be null; the tile's scale into scales[blockIdx.x] and, when given,
// scales_dim1[blockIdx.x] (the two copies' scales are the same). The dim0 bytes leave from
// registers; the dim1 copy's through a shared tile (store_tile_transposed). Every thread of the
// CTA calls it.
template <int P>
__device__ __forceinline__ void store_fp8_tile(const float (&v)[Fp8TileThread<P>::kPacks][P],
                                               Fp8ScaleRule rule, const TilePlace& at,
                                               uint8_t* dim0, uint8_t* dim1, float* scales,
                                               float* scales_dim1 = nullptr) {
  using Tile = Fp8TileThread<P>;
  __shared__ alignas(16) uint8_t tile[kTileBytes];
  __shared__ uint32_t warp_amax[kTileThreads / 32];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < Tile::kPacks; ++i)
#pragma unroll
    for (int j = 0; j < P; ++j) m = max(m, magnitude(v[i][j]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0;
#pragma unroll
  for (int i = 0; i < kTileThreads / 32; ++i) m = max(m, warp_amax[i]);
  const Fp8Scale s = fp8_scale(rule, m);
  if (threadIdx.x == 0) {
    scales[blockIdx.x] = s.scale;
    if (scales_dim1) scales_dim1[blockIdx.x] = s.scale;
  }
  const int r0 = Tile::row0(), c = Tile::col();
#pragma unroll
  for (int i = 0; i < Tile::kPacks; ++i) {
    const int r = r0 + i * Tile::kRowStep;
    uint32_t q[P / 4];
#pragma unroll
    for (int j = 0; j < P / 4; ++j)
      q[j] = fp8x2(v[i][4 * j], v[i][4 * j + 1], s) |
             (static_cast<uint32_t>(fp8x2(v[i][4 * j + 2], v[i][4 * j + 3], s)) << 16);
    // The pack's P bytes into the dim0 copy and the shared tile.
    const auto put = [&](uint8_t* out) {
      if constexpr (P == 8)
        *reinterpret_cast<uint2*>(out) = make_uint2(q[0], q[1]);
      else
        *reinterpret_cast<uint32_t*>(out) = q[0];
    };
    if (dim0) put(dim0 + at.offset(r, c));
    if (dim1) put(tile + tile_byte(r, c));
  }
  if (!dim1) return;
  __syncthreads();
  store_tile_transposed(tile, at, dim1);
}

}  // namespace mt::cuda
