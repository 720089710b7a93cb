// The MX expert GEMM on Hopper (ops/mx_gemm.h): out (capacity, P) = A_e (capacity, Q) b[e]^T over
// 128-row segments, A in MXFP8 along Q (E4M3 data, an E8M0 scale per 32 values), b (E, P, Q)
// bf16 holding MX values (the weights quantized and dequantized once per step: exact in bf16).
//
// Which way and why (the figures: docs/benchmarks-history.md, "MX grouped GEMM"). sm_90 has no
// block-scaled MMA; the ways to feed it MX operands are
//  1. FP8 wgmma (k = 32: one MX block per instruction) with each partial sum rescaled into an f32
//     accumulator, acc += part * sa[row] * sb[col]: two f32 operations per accumulator per 32 K
//     on the CUDA cores, which then take longer than the FP8 MMA they follow; bound near the bf16
//     rate with no slack (DeepGEMM rescales once per 128 K, its weight scales being per 128 x 128
//     block).
//  2. bf16 wgmma on the exact bf16 values of the MX operands: the bf16 tensor rate, the conversion
//     per operand element rather than per accumulator. CUTLASS's mixed-input mainloop does this
//     but scales per K tile of at least 64 (it refuses 32-element groups).
// This kernel takes 2: A's E4M3 tile comes by TMA into shared memory, each thread converts its
// wgmma A fragment (E4M3 pair -> bf16x2 times the block's 2^(s-127), exactly; see
// e4m3x2_to_bf16x2) in registers for the register-sourced wgmma, whose B operand comes from shared
// memory by TMA. The products accumulate in f32 in the order the bf16 kernels use (k16 steps in
// increasing K): the result is the definition's (dequantize, bf16 GEMM) bit for bit.
//
// Structure: persistent CTAs over a table of (row tile, column tile, expert) built on the device
// from the segments (fixed_gemm_sm90.cuh's); one producer thread (TMA for A and B); two consumer
// warpgroups of 64 rows x 256 columns, each loading its rows' scales a few k tiles ahead and
// running a software pipeline of half stages (one MX block in the tensor cores while the next is
// converted); a ring of stages with full/empty barriers that runs on across tiles, so the next
// tile's loads overlap the epilogue, whose TMA stores leave from shared memory.
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cutlass/grouped_gemm_fixed_sm90.cuh"
#include "ops/cuda/cutlass/warp_specialized_sm90.cuh"
#include "ops/cuda/mx_gemm.h"

namespace mt::cuda::kernels {

namespace {

constexpr int kTileM = 128;  // = fixed_sm90::kRowTile: a row tile is one expert's
constexpr int kTileN = 256;
constexpr int kTileK = 64;  // two MX blocks
constexpr int kStages = 4;
constexpr int kThreads = 384;                       // producer warpgroup + two consumer warpgroups
constexpr uint32_t kStageBytesA = kTileM * kTileK;  // E4M3
constexpr uint32_t kStageBytesB = kTileN * kTileK * 2;  // bf16
static_assert(kTileM == fixed_sm90::kRowTile);

struct alignas(1024) Stage {
  uint8_t b[kStageBytesB];  // (256, 64) bf16, 128-byte swizzle (1024-byte aligned)
  uint8_t a[kStageBytesA];  // (128, 64) E4M3, 64-byte swizzle
};

// A's scales reach each consumer thread straight from global memory (L2: a tile's are 128 x
// Q / 32 bytes), this many k tiles ahead of their use: the producer then issues nothing but TMA.
constexpr int kScalesAhead = 3;

struct SharedStorage {
  Stage stages[kStages];
  ws_sm90::OutStaging<kTileN> out;
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

struct Params {
  const uint8_t* scales;  // (capacity, Q / 32)
  __nv_bfloat16* out;     // (capacity, P)
  const int4* tiles;      // {row tile, column tile, expert, 0}; row tile < 0: none
  int tile_count;
  int k_tiles;       // ceil(Q / 64)
  int q_blocks;      // Q / 32
  int64_t p;         // output width
  int64_t capacity;  // rows; the last row tile may run past them (TMA reads zeros there)
};

// The conversion avoids the conversion instructions (F2FP: e4m3 -> f16, f32 -> bf16), which the
// probes of docs/benchmarks-history.md found to be this kernel's largest cost. An E4M3 byte's 7
// magnitude bits shifted left by 4 are the bf16 of its value times 2^-120, normal or subnormal
// alike (exponent field E, mantissa M << 4; with E = 0 a bf16 subnormal M 2^-129 = M 2^-9 2^-120),
// and the sign bit lands on bf16's: one byte permute (each byte beside a copy of its sign), one
// shift, one mask per pair. Multiplying by 2^120 and by the block's 2^(s-127) then gives the exact
// value rounded once, as mx_dequantize.

// A block's multipliers as bf16x2 (both halves equal): m1 m2 = 2^(s - 7), one factor when it is
// representable (s <= 134), else 2^120 and 2^(s - 127); NaN for s = 0xFF.
struct Multipliers {
  uint32_t m1, m2;
};
__device__ __forceinline__ Multipliers multipliers_of(uint32_t s) {
  const uint32_t one = 0x3F80u;
  uint32_t m1, m2;
  if (s == 0xFF) {
    m1 = 0x7FC0u;
    m2 = one;
  } else if (s <= 134) {
    m1 = (s + 120) << 7;
    m2 = one;
  } else {
    m1 = 247u << 7;
    m2 = s << 7;
  }
  return {m1 | (m1 << 16), m2 | (m2 << 16)};
}

// Two E4M3 values (low byte first) times their block's scale -> bf16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t pair, Multipliers m) {
  uint32_t z;  // bytes: b0, sign(b0) replicated, b1, sign(b1) replicated
  asm("prmt.b32 %0, %1, 0, 0x9180;" : "=r"(z) : "r"(static_cast<uint32_t>(pair)));
  const uint32_t scaled_down = (z << 4) & 0x87F087F0u;  // value 2^-120 per half
  uint32_t out;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(scaled_down), "r"(m.m1));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(out), "r"(m.m2));
  return out;
}

// The byte offset of (row, byte) in a stage's A tile: rows of 64 bytes, 16-byte chunks XOR-ed
// with bits 1-2 of the row (TMA's 64-byte swizzle: address bits [4, 6) ^= bits [7, 9)).
__device__ __forceinline__ uint32_t a_offset(uint32_t row, uint32_t byte) {
  const uint32_t linear = row * kTileK + byte;
  return linear ^ (((linear >> 7) & 3) << 4);
}

template <size_t... I>
__device__ __forceinline__ void wgmma_rs(const uint32_t (&a)[4], uint64_t desc, float (&acc)[128],
                                         cute::GMMA::ScaleOut scale, std::index_sequence<I...>) {
  cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::K>::fma(
      a[0], a[1], a[2], a[3], desc, acc[I]..., scale);
}

__global__ void __launch_bounds__(kThreads, 1)
    mx_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                   const __grid_constant__ CUtensorMap map_b,
                   const __grid_constant__ CUtensorMap map_out, const Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& s = ws_sm90::aligned_storage<SharedStorage>(smem_raw);
  using ws_sm90::Empty;
  using ws_sm90::Full;
  const int warpgroup = threadIdx.x / 128;
  ws_sm90::init_ring(s.full, s.empty, kStages, 2);

  if (warpgroup == 0) {  // the producer
    ws_sm90::produce<kStages>(
        map_a, map_b, map_out, p.tiles, p.tile_count, p.k_tiles, s.full, s.empty,
        kStageBytesA + kStageBytesB, [&](int stage, int4 tile, int kt) {
          Stage& st = s.stages[stage];
          cute::SM90_TMA_LOAD_2D::copy(&map_a, &s.full[stage], ws_sm90::kEvictNormal, st.a,
                                       kt * kTileK, tile.x * kTileM);
          cute::SM90_TMA_LOAD_3D::copy(&map_b, &s.full[stage], ws_sm90::kEvictNormal, st.b,
                                       kt * kTileK, tile.y * kTileN, tile.z);
        });
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const auto [consumer, q, r0, r1] = ws_sm90::consumer_thread();
  // This thread's scales of k tile kt of the tile at row tile `row_tile`, packed {row r0: block
  // 2 kt, 2 kt + 1; row r1: the same}. Past Q or the last row the data is TMA's zeros; any
  // finite scale keeps them so.
  auto scales_of = [&](int row_tile, int kt) {
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = int64_t{row_tile} * kTileM + (i < 2 ? r0 : r1);
      const int block = 2 * kt + i % 2;
      const uint32_t e = row < p.capacity && block < p.q_blocks
                             ? __ldg(p.scales + row * p.q_blocks + block)
                             : uint32_t{127};
      packed |= e << (8 * i);
    }
    return packed;
  };
  uint32_t ahead[kScalesAhead];
  auto fill_ahead = [&](int row_tile) {
#pragma unroll
    for (int i = 0; i < kScalesAhead; ++i) ahead[i] = i < p.k_tiles ? scales_of(row_tile, i) : 0;
  };
  int stage = 0;  // the next stage to wait for
  uint32_t phase = 0;
  auto next_full = [&] {
    Full::wait(&s.full[stage], phase);
    const int got = stage;
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
    return got;
  };
  auto release = [&](int st) {
    if (threadIdx.x % 128 == 0) Empty::arrive(&s.empty[st]);
  };
  // A half stage is one MX block (32 K, two k16 steps): its A fragments, converted with the
  // block's scale of rows r0 and r1 (scale0, scale1).
  auto convert_half = [&](uint32_t(&a)[2][4], const Stage& st, int half, Multipliers scale0,
                          Multipliers scale1) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const uint32_t k = (2 * half + jj) * 16 + 2 * q;
      a[jj][0] =
          e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(st.a + a_offset(r0, k)), scale0);
      a[jj][1] =
          e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(st.a + a_offset(r1, k)), scale1);
      a[jj][2] =
          e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(st.a + a_offset(r0, k + 8)), scale0);
      a[jj][3] =
          e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(st.a + a_offset(r1, k + 8)), scale1);
    }
  };
  float acc[128];
  uint32_t a[2][2][4];  // two half stages: one in the tensor cores, the next being converted
  int t = blockIdx.x;
  int4 tile = t < p.tile_count ? p.tiles[t] : make_int4(-1, 0, 0, 0);
  if (tile.x >= 0) fill_ahead(tile.x);
  while (tile.x >= 0) {
    // The next tile's entry and (after the main loop) its first scales load during this one.
    const int next_t = t + gridDim.x;
    const int4 next = next_t < p.tile_count ? p.tiles[next_t] : make_int4(-1, 0, 0, 0);
    // The software pipeline over half stages h = 0 .. 2 k_tiles - 1: issue h, wait for h - 1
    // (the tensor cores keep h), convert h + 1 while they work.
    uint32_t packed = 0;
    auto next_scales = [&](int kt) {
      packed = ahead[0];
#pragma unroll
      for (int i = 0; i + 1 < kScalesAhead; ++i) ahead[i] = ahead[i + 1];
      ahead[kScalesAhead - 1] =
          kt + kScalesAhead < p.k_tiles ? scales_of(tile.x, kt + kScalesAhead) : 0;
    };
    auto scale_of = [&](int half, int row) {  // row 0: r0, 1: r1
      return multipliers_of((packed >> (8 * (2 * row + half))) & 0xFF);
    };
    const int halves = 2 * p.k_tiles;
    next_scales(0);
    int issue_stage = next_full(), convert_stage = issue_stage, prev_stage = -1;
    convert_half(a[0], s.stages[convert_stage], 0, scale_of(0, 0), scale_of(0, 1));
    for (int kt = 0; kt < p.k_tiles; ++kt) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // unrolled: the register sets are named statically
        const int h = 2 * kt + hh;
        ws_sm90::fence(acc);
        cute::warpgroup_arrive();
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
          wgmma_rs(a[hh][jj], ws_sm90::swizzle128_descriptor(s.stages[issue_stage].b, 2 * hh + jj),
                   acc, h == 0 && jj == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
                   std::make_index_sequence<128>{});
        cute::warpgroup_commit_batch();
        cute::warpgroup_wait<1>();  // half h - 1 done: its registers are free, maybe its stage
        ws_sm90::fence(acc);
        if (hh == 0 && prev_stage >= 0) release(prev_stage);
        if (h + 1 < halves) {
          const int half = 1 - hh;
          if (half == 0) {
            next_scales(kt + 1);
            convert_stage = next_full();
          }
          convert_half(a[half], s.stages[convert_stage], half, scale_of(half, 0),
                       scale_of(half, 1));
          if (half == 0) {
            prev_stage = issue_stage;
            issue_stage = convert_stage;
          }
        }
      }
    }
    cute::warpgroup_wait<0>();
    ws_sm90::fence(acc);
    release(issue_stage);
    if (next.x >= 0) fill_ahead(next.x);

    ws_sm90::store_bf16<kTileN>(acc, s.out.warpgroup[consumer], map_out, consumer,
                                r0 - consumer * 64, q, tile.y * kTileN,
                                tile.x * kTileM + consumer * 64);
    tile = next;
    t = next_t;
  }
  if (threadIdx.x % 128 == 0) cute::tma_store_wait<0>();
}

}  // namespace

size_t mx_gemm_workspace(int64_t capacity, int64_t p) {
  return fixed_sm90::table_bytes(fixed_sm90::tile_count(capacity, p, kTileN));
}

cudaError_t mx_gemm(const int64_t* segments, int experts, const uint8_t* a_data,
                    const uint8_t* a_scales, const void* b, void* out, int64_t capacity, int64_t p,
                    int64_t q, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (q % 32 != 0 || p % 8 != 0) return cudaErrorInvalidValue;
  const fixed_sm90::TileTable table = fixed_sm90::tile_table_in(
      workspace, workspace_bytes, segments, experts, capacity, p, kTileN, stream);
  if (table.err != cudaSuccess || table.count == 0) return table.err;

  CUtensorMap map_a, map_b;
  {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(q), static_cast<cuuint64_t>(capacity)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(q)};
    const cuuint32_t box[2] = {kTileK, kTileM};
    if (ws_sm90::encode_tma(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a_data, dims, strides, box,
                            CU_TENSOR_MAP_SWIZZLE_64B) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(q), static_cast<cuuint64_t>(p),
                                static_cast<cuuint64_t>(experts)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(q * 2),
                                   static_cast<cuuint64_t>(p * q * 2)};
    const cuuint32_t box[3] = {kTileK, kTileN, 1};
    if (ws_sm90::encode_tma(&map_b, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, b, dims, strides, box,
                            CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS)
      return cudaErrorInvalidValue;
  }
  CUtensorMap map_out;
  if (ws_sm90::encode_out<kTileN>(&map_out, out, p, capacity) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  constexpr size_t smem = ws_sm90::storage_bytes<SharedStorage>();
  static const cudaError_t configured = cudaFuncSetAttribute(
      mx_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (configured != cudaSuccess) return configured;
  Params params{a_scales,
                static_cast<__nv_bfloat16*>(out),
                table.tiles,
                static_cast<int>(table.count),
                static_cast<int>((q + kTileK - 1) / kTileK),
                static_cast<int>(q / 32),
                p,
                capacity};
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(table.count, sm_count()));
  mx_gemm_kernel<<<grid, kThreads, smem, stream>>>(map_a, map_b, map_out, params);
  return cudaGetLastError();
}

}  // namespace mt::cuda::kernels
