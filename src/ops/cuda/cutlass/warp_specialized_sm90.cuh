// What our own warp-specialized Hopper kernels share (mx_gemm_sm90.cu, fp8_gemm_sm90_fixed.cu): the
// 1024-aligned view of dynamic shared memory, the stage ring's barriers, K-major 128-byte-swizzle
// wgmma descriptors, the bf16 epilogue through swizzled shared memory and TMA stores, and TMA
// descriptors. Each kernel: persistent CTAs over a tile table, a producer thread (or warp)
// issuing copies into a ring of stages, two consumer warpgroups of 64 rows each.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <utility>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cuda_host_adapter.hpp"

namespace mt::cuda::ws_sm90 {

using Full = cutlass::arch::ClusterTransactionBarrier;  // the producer's arrival + TMA's bytes
using Empty = cutlass::arch::ClusterBarrier;            // one arrival per consumer warpgroup

// Dynamic shared memory as S, aligned to 1024 bytes (the 128-byte swizzle's atom) by pointer
// arithmetic on the shared array (not through an integer), so that the compiler knows every access
// through it to be to shared memory.
template <class S>
__device__ __forceinline__ S& aligned_storage(uint8_t* smem_raw) {
  const uint32_t misalignment = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) % 1024;
  return *reinterpret_cast<S*>(smem_raw + (1024 - misalignment) % 1024);
}
template <class S>
constexpr size_t storage_bytes() {
  return sizeof(S) + 1024;  // + the alignment
}

// Thread 0 initializes the ring's barriers (full: the producer's arrivals, one unless said;
// empty: one per consumer warpgroup); every thread of the CTA then waits for it.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages,
                                          uint32_t consumers, uint32_t producers = 1) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      Full::init(&full[i], producers);
      Empty::init(&empty[i], consumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// The L2 policy of every TMA load (CUTLASS's default; a zero policy word is not one).
inline constexpr uint64_t kEvictNormal =
    static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// Warpgroup 0's part: it gives its registers to the consumers (keeping kRegisters), and its first
// kLanes threads walk this CTA's tiles of the table (t = blockIdx.x / kCluster, then every
// gridDim.x / kCluster: the CTAs of a cluster walk the same tiles; tiles
// past the last segment come last, so the first of them ends the walk): for each of a tile's
// k_blocks they wait for a free stage, thread 0 arms its full barrier with stage_bytes, and each
// calls load(stage, tile, k) to issue the copies (with kLanes > 1 the full barrier counts their
// arrivals beside thread 0's: init_ring's producers).
template <int kStages, int kLanes = 1, int kRegisters = 40, int kCluster = 1, class Load>
__device__ __forceinline__ void produce(const CUtensorMap& map_a, const CUtensorMap& map_b,
                                        const CUtensorMap& map_out, const int4* tiles,
                                        int tile_count, int k_blocks, uint64_t* full,
                                        uint64_t* empty, uint32_t stage_bytes, Load load) {
  static_assert(kLanes == 1 || kLanes == 32);
  cutlass::arch::warpgroup_reg_dealloc<kRegisters>();
  if (threadIdx.x >= kLanes) return;
  const bool first = threadIdx.x == 0;
  if (first) {
    cute::prefetch_tma_descriptor(&map_a);
    cute::prefetch_tma_descriptor(&map_b);
    cute::prefetch_tma_descriptor(&map_out);
  }
  int stage = 0;
  uint32_t phase = 0;
  const auto advance = [&] {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  };
  for (int t = blockIdx.x / kCluster; t < tile_count; t += gridDim.x / kCluster) {
    const int4 tile = tiles[t];
    if (tile.x < 0) break;
    for (int k = 0; k < k_blocks; ++k) {
      Empty::wait(&empty[stage], phase ^ 1);
      if (first) Full::arrive_and_expect_tx(&full[stage], stage_bytes);
      load(stage, tile, k);
      advance();
    }
  }
  // In a cluster the peer's consumers free this CTA's stages (they read what this CTA multicast)
  // and its multicasts land here: wait until every stage is free again, so that nothing arrives
  // at a barrier or into shared memory of a CTA that has exited.
  if constexpr (kCluster > 1)
    for (int i = 0; i < kStages; ++i) {
      Empty::wait(&empty[stage], phase ^ 1);
      advance();
    }
}

// A consumer thread's place (warpgroups 1 and 2; warpgroup 0 produces): its warpgroup's rows
// 64 c .. 64 c + 63 of the tile, and in wgmma's m64nN accumulator layout its two rows r0 and
// r1 = r0 + 8 of the tile and its column pair's index q within each 8 columns.
struct Consumer {
  int index;
  int q;
  uint32_t r0, r1;
};
__device__ __forceinline__ Consumer consumer_thread() {
  const int index = static_cast<int>(threadIdx.x / 128) - 1;
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const uint32_t r0 = index * 64 + warp * 16 + lane / 4;
  return {index, lane % 4, r0, r0 + 8};
}

// warpgroup_fence_operand over a whole accumulator, expanded over an index sequence rather than a
// loop: an accumulator stays in registers only if every access to it has a constant index, and
// unrolling is a heuristic.
template <int N, size_t... I>
__device__ __forceinline__ void fence(float (&acc)[N], std::index_sequence<I...>) {
  (cute::warpgroup_fence_operand(acc[I]), ...);
}
template <int N>
__device__ __forceinline__ void fence(float (&acc)[N]) {
  fence(acc, std::make_index_sequence<N>{});
}

// The wgmma descriptor of step j of a K-major tile of 128-byte rows in 128-byte swizzle (as TMA's
// SWIZZLE_128B writes it, 1024-byte aligned): 8-row groups 1024 bytes apart, each step 32 bytes
// further along the swizzled rows (k16 of bf16, k32 of E4M3).
__device__ __forceinline__ uint64_t swizzle128_descriptor(const uint8_t* tile, int j) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) + j * 32;
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(1) << 16;          // leading byte offset (unused when swizzled)
  d |= static_cast<uint64_t>(1024 >> 4) << 32;  // stride byte offset
  d |= static_cast<uint64_t>(1) << 62;          // 128-byte swizzle
  return d;
}

// The epilogue's staging: a consumer warpgroup's 64 rows in chunks of kChunkCols columns, each
// chunk's rows swizzled as TMA's SWIZZLE_128B (64 columns, 128-byte rows) or SWIZZLE_64B (32
// columns, 64-byte rows) lays them out: conflict-free stores, whole lines out by TMA. A width that
// is a multiple of 64 takes 64-column chunks, any other multiple of 32 takes 32-column ones.
template <int kCols>
inline constexpr int kOutChunkFor = kCols % 64 == 0 ? 64 : 32;
template <int kChunkCols>
inline constexpr CUtensorMapSwizzle kOutSwizzle =
    kChunkCols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;

// The epilogue's shared memory: each consumer warpgroup's 64 x kCols bf16 tile in its chunks.
template <int kCols>
struct alignas(1024) OutStaging {
  uint8_t warpgroup[2][64 * kCols * 2];
};

// One consumer warpgroup's 64 x kCols f32 accumulator (wgmma's m64nN layout: acc[4 i + {0, 1}] is
// row `row`, columns 8 i + 2 q + {0, 1}; acc[4 i + {2, 3}] row `row` + 8) out as bf16 at (col0,
// row0) of map_out (box kOutChunkFor<kCols> x 64, swizzle kOutSwizzle of it): into the chunks,
// then TMA stores by the warpgroup's first thread, one bulk group. The stores that last used these
// chunks must have left them first: waited for here, with up to kLater groups committed after
// them still pending (a warpgroup that stages through kLater + 1 buffers in turn). Named barrier
// 1 + consumer.
template <int kCols, int kLater = 0>
__device__ __forceinline__ void store_bf16(const float (&acc)[kCols / 2], uint8_t* chunks,
                                           const CUtensorMap& map_out, int consumer, uint32_t row,
                                           int q, int col0, int row0) {
  constexpr int kChunkCols = kOutChunkFor<kCols>;
  constexpr int kRowBytes = kChunkCols * 2, kUnits = kRowBytes / 16;  // 16-byte units per row
  constexpr int kBytes = 64 * kRowBytes;
  static_assert(kCols % kChunkCols == 0);
  // The swizzle XORs a row's 16-byte unit with address bits 7.. of its row: row % 8 for 128-byte
  // rows, (row / 2) % 4 for 64-byte ones ((row + 8) gives the same).
  const uint32_t mask = kChunkCols == 64 ? row % 8 : (row / 2) % 4;
  const int id = consumer + 1;
  const bool leader = threadIdx.x % 128 == 0;
  if (leader) cute::tma_store_wait<kLater>();
  cutlass::arch::NamedBarrier::sync(128, id);
#pragma unroll
  for (int i = 0; i < kCols / 8; ++i) {
    uint8_t* chunk = chunks + (i / kUnits) * kBytes;
    const uint32_t in_row = (((i % kUnits) ^ mask) * 16) + 4 * q;
    *reinterpret_cast<__nv_bfloat162*>(chunk + row * kRowBytes + in_row) =
        __floats2bfloat162_rn(acc[4 * i], acc[4 * i + 1]);
    *reinterpret_cast<__nv_bfloat162*>(chunk + (row + 8) * kRowBytes + in_row) =
        __floats2bfloat162_rn(acc[4 * i + 2], acc[4 * i + 3]);
  }
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(128, id);
  if (leader) {
    for (int c = 0; c < kCols / kChunkCols; ++c)
      cute::SM90_TMA_STORE_2D::copy(&map_out, chunks + c * kBytes, col0 + c * kChunkCols, row0);
    cute::tma_store_arrive();
  }
}

// A TMA descriptor of a rank-`rank` tensor (dims and box innermost first, strides in bytes of the
// outer dimensions), 256-byte L2 promotion, no fill.
inline CUresult encode_tma(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                           const void* base, const cuuint64_t* dims, const cuuint64_t* strides,
                           const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return cutlass::call_cuTensorMapEncodeTiled(
      map, type, rank, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// The TMA descriptor of a row-major (rows, cols) bf16 output as store_bf16<kCols> writes it.
template <int kCols>
inline CUresult encode_out(CUtensorMap* map, void* out, int64_t cols, int64_t rows) {
  constexpr int kChunkCols = kOutChunkFor<kCols>;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * 2)};
  const cuuint32_t box[2] = {kChunkCols, 64};
  return encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out, dims, strides, box,
                    kOutSwizzle<kChunkCols>);
}

}  // namespace mt::cuda::ws_sm90
