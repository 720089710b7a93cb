// The FP8 forward and input-gradient products (ops/fp8_gemm.h) over a padded row layout: out
// (capacity, P) bf16 = A_e (capacity, Q) b[e]^T, A in 1 x 128 blocks along Q (E4M3 data, an f32
// scale per block), b (E, P, Q) E4M3 in 128 x 128 tiles (one f32 scale per tile), every expert's
// rows starting on a 128-row boundary. fp8_gemm_sm90_fixed.cu instantiates what ships;
// bench/fp8_fixed_variants.cu times the tile widths and the probes.
//
// Why our own kernel. CUTLASS's pointer-array blockwise kernels (fp8_gemm_sm90_rows.cu) rewrite a
// CTA's TMA descriptors whenever its next tile belongs to another expert, walk the groups' shapes
// to find each tile, and load the scales through the same pipeline as the operands. Over a padded
// layout none of that is needed (as for the bf16 products, grouped_gemm_fixed_sm90.cuh): the rows
// are one (capacity, Q) matrix whose row tiles each belong to one expert, the weights one (E, P, Q)
// tensor with the expert as its outer coordinate, and each tile's expert comes from a table built
// on the device from the segments (no count reaches the host; a captured graph replays it).
//
// Structure (the MX kernel's, mx_gemm_sm90.cu, with both operands FP8 in shared memory):
// persistent CTAs over the tile table; the producer warp's first lane issues TMA copies of A's
// 128 x 128 (a box per row tile), b's kTileN x 128 tiles and the block's scales of A's rows into a
// ring of stages (full/empty barriers), running on across tiles so the next tile's loads overlap
// the epilogue; its first two lanes copy the weight tiles' scales with cp.async, completing on the
// stage's full barrier with every lane's arrival. A's scales come from an MN-major copy made
// before the kernel (mn_scales_kernel, a few microseconds): a stage's rows' scales are then one
// TMA box, where from the K-major (rows, Q / 128) layout they were one four-byte copy a row, each
// a separate request to the L1 that the wgmmas read their operands from (5-7% of the product).
// Two consumer warpgroups of 64 rows x kTileN columns each run the four k32 FP8 wgmmas of a
// 128-deep block into a fresh f32 accumulator, then promote it into the result with the block's
// scales, result += partial * (sa[row] * sb): DeepSeek-V3's promotion every 128 of the
// contraction, in f32 registers. The epilogue stages bf16 rows in swizzled shared memory and
// leaves by TMA stores. What bounds it (docs/benchmarks-history.md, "What bounds our FP8 kernel",
// "Two row tiles a CTA"): the operands' loads.
//
// Two row tiles a CTA (kWaves 2, what ships): a CTA's tile is a run of up to two row tiles of one
// expert (256 rows) by 128 columns. Each consumer warpgroup takes its 64 rows of each row tile in
// turn with one accumulator (the wave's MMAs, then its promotion into that wave's result: 3 x 64
// f32 registers a thread), so each weight tile crosses from L2 into shared memory once for 256
// rows instead of 128: a stage is 48 KB against 32, three fit, and the loads per MMA drop by a
// quarter. Each wave stores through its own staging, so that its store waits only for the same
// wave's of the tile before. The table lists each expert's row tiles in runs of two from its
// first; an odd count ends in a run of one, whose second wave is neither loaded, computed nor
// stored. (docs/benchmarks-history.md, "Two row tiles a CTA".)
//
// Tile widths (one wave; the workbench's). kTileN 128 is one weight tile; a wider tile that is not
// a multiple of 128 (160: fewer tiles, and each b row read from shared memory serves more of the
// MMA's work) spans two weight tiles, whose boundary falls at a multiple of 32 columns into it: the
// promotion takes the first tile's scale left of it and the second's right of it, the boundary a
// template argument chosen per tile (four cases at most). Columns past P are computed from whatever
// b rows follow (the next expert's, or TMA's zeros) and never stored.
//
// Clusters (kCluster 2 or 4; the workbench's, the product runs 1): the CTAs of a cluster take one
// run's next column tiles, each loads its share of the run's rows and multicasts it to all, and a
// stage is free once every CTA's consumers have read it. A crosses from L2 once per cluster; on
// H100s that made the loads alone faster and the product slower, with one wave or two (the CTAs
// wait on each other at every stage; docs/benchmarks-history.md, "Two designs that did not pay"
// and "Two row tiles a CTA").
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cutlass/grouped_gemm_fixed_sm90.cuh"
#include "ops/cuda/cutlass/warp_specialized_sm90.cuh"
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/tile_walk.h"
// After mma_sm90_gmma.hpp (through warp_specialized_sm90.cuh): the n160 wgmma.
#include "cute/arch/mma_sm90_gmma_ext.hpp"

namespace mt::cuda::fp8_fixed_sm90 {

// What a run leaves out, to time the rest (bench/fp8_fixed_variants.cu); kNone is the product.
enum class Probe : uint8_t {
  kNone,
  kNoPromotion,   // one accumulator over the whole contraction, no per-block scaling
  kNoMma,         // no wgmmas: loads, barriers and promotion only
  kNoScaleLoads,  // A's scales not loaded (the slots keep whatever they hold): their loads' cost
};

constexpr int kTileM = 128;    // = fixed_sm90::kRowTile: a row tile is one expert's
constexpr int kTileK = 128;    // one scale block deep
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
static_assert(kTileM == fixed_sm90::kRowTile);

// A CTA's tile: kWaves row tiles of one expert (kTileM rows each) by kTileN columns.
template <int kTileN, int kWaves = 1>
struct Shape {
  static_assert(kTileN == 128 || kTileN == 160);
  static_assert(kWaves == 1 || (kWaves == 2 && kTileN == 128));  // registers: see the kernel
  static constexpr int kRows = kWaves * kTileM;
  static constexpr uint32_t kStageBytesA = kRows * kTileK;
  static constexpr uint32_t kStageBytesB = kTileN * kTileK;
  struct alignas(1024) Stage {
    uint8_t a[kStageBytesA];  // (kRows, 128) E4M3, 128-byte swizzle (1024-byte aligned)
    uint8_t b[kStageBytesB];  // (kTileN, 128) E4M3, 128-byte swizzle
  };
  // A stage's scales: the rows' kRows of A (one TMA box), the one or two weight tiles' (b0, b1).
  static constexpr uint32_t kScaleBytesA = kRows * sizeof(float);
  // As many stages as fit beside the epilogue's staging (at most 6: more did not pay at 128).
  static constexpr int kStages =
      std::min<int>(6, (227 * 1024 - 2048 - kWaves * sizeof(ws_sm90::OutStaging<kTileN>)) /
                           (sizeof(Stage) + kScaleBytesA + 2 * sizeof(float)));
  struct SharedStorage {
    Stage stages[kStages];
    ws_sm90::OutStaging<kTileN> out[kWaves];  // a wave's store need not wait for the other's
    alignas(128) float sfa[kStages][kRows];   // TMA's destination: 128-byte aligned
    float sfb[kStages][2];
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };
  static constexpr int kAcc = kTileN / 2;  // f32 accumulator registers per thread
};

struct Params {
  const float* sfb;   // (E, P / 128, Q / 128) or (E, Q / 128, P / 128): see sfb_k, sfb_n
  const int4* tiles;  // {row tile, column tile, expert, row tiles}; row tile < 0: none
  int tile_count;
  int k_blocks;        // Q / 128
  int n_blocks;        // P / 128
  int64_t sfb_expert;  // (P / 128) (Q / 128)
  int sfb_k, sfb_n;    // strides of a tile's scale along the contraction and along P
  int p_rows;          // P: b's rows per expert
  int64_t capacity;    // rows; the last row tile may run past them (TMA reads zeros there)
};

template <int N>
struct Wgmma;
template <>
struct Wgmma<128> {
  using Op = cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct Wgmma<160> {
  using Op = cute::SM90::GMMA::MMA_64x160x32_F32E4M3E4M3_SS_TN<>;
};

template <int N, size_t... I>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float (&acc)[N / 2],
                                      cute::GMMA::ScaleOut scale, std::index_sequence<I...>) {
  Wgmma<N>::Op::fma(desc_a, desc_b, acc[I]..., scale);
}

// One block's scales for a consumer thread: its rows r0 and r1 of A, the weight tile under the
// tile's first columns (b0) and the one right of the boundary (b1; 0 where there is none).
struct BlockScales {
  float a0, a1, b0, b1;
};

// result += acc * scale, expanded over an index sequence as ws_sm90::fence: acc[4 i + {0, 1}]
// belong to row r0, acc[4 i + {2, 3}] to r1; columns 8 i .. 8 i + 7 lie left of the weight tiles'
// boundary when i < kSplit (scales s0, s1) and right of it otherwise (t0, t1).
template <int kSplit, int N, size_t... I>
__device__ __forceinline__ void promote(const float (&acc)[N], float s0, float s1, float t0,
                                        float t1, float (&result)[N], std::index_sequence<I...>) {
  ((result[I] = fmaf(acc[I], I / 4 < kSplit ? ((I % 4) < 2 ? s0 : s1) : ((I % 4) < 2 ? t0 : t1),
                     result[I])),
   ...);
}

// The promotion of one block with the split a run-time value (a multiple of 4 groups of 8
// columns, uniform over the tile): one branch per possible split.
template <int kTileN>
__device__ __forceinline__ void promote_block(const float (&acc)[kTileN / 2], const BlockScales& sc,
                                              int split, float (&result)[kTileN / 2]) {
  const float s0 = sc.a0 * sc.b0, s1 = sc.a1 * sc.b0;
  constexpr auto seq = std::make_index_sequence<kTileN / 2>{};
  if constexpr (kTileN == 128) {
    promote<16>(acc, s0, s1, s0, s1, result, seq);
  } else {
    const float t0 = sc.a0 * sc.b1, t1 = sc.a1 * sc.b1;
    switch (split) {
      case 4:
        promote<4>(acc, s0, s1, t0, t1, result, seq);
        break;
      case 8:
        promote<8>(acc, s0, s1, t0, t1, result, seq);
        break;
      case 12:
        promote<12>(acc, s0, s1, t0, t1, result, seq);
        break;
      default:
        promote<16>(acc, s0, s1, t0, t1, result, seq);
        break;
    }
  }
}

template <size_t... I, int N>
__device__ __forceinline__ void set(float (&x)[N], float v, std::index_sequence<I...>) {
  ((x[I] = v), ...);
}
template <size_t... I, int N>
__device__ __forceinline__ void copy_to(const float (&x)[N], float (&y)[N],
                                        std::index_sequence<I...>) {
  ((y[I] = x[I]), ...);
}

// dst = *src (4 bytes) by the async copy unit, or 0 where !valid (src not read).
__device__ __forceinline__ void copy_f32_async(float* dst, const float* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}

template <int kTileN, Probe kProbe, int kCluster, int kWaves>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_gemm_fixed_kernel(const __grid_constant__ CUtensorMap map_a,
                          const __grid_constant__ CUtensorMap map_a_run,
                          const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_sfa,
                          const __grid_constant__ CUtensorMap map_out, const Params p) {
  using S = Shape<kTileN, kWaves>;
  // Without the promotion one accumulator holds a row tile's whole contraction: one row tile.
  static_assert(kProbe != Probe::kNoPromotion || kWaves == 1);
  constexpr int kStages = S::kStages;
  constexpr int kAcc = S::kAcc;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& s = ws_sm90::aligned_storage<typename S::SharedStorage>(smem_raw);
  using ws_sm90::Empty;
  using ws_sm90::Full;
  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  // A stage is full when its TMA bytes have landed (the first lane's arrival) and each lane of the
  // producer warp has arrived once its async copies have (32 more; the first two copy the weight
  // tiles' scales). It is free when both consumer warpgroups of every CTA of the cluster have
  // read it (each CTA's A tile is the cluster's: see below).
  ws_sm90::init_ring(s.full, s.empty, kStages, 2 * kCluster, 1 + 32);
  // In a cluster the CTAs share the run and take the next column tiles: each loads its share of
  // the run's rows and multicasts it to all, so that A crosses from L2 once per cluster. The peer's
  // barriers must be ready before anything arrives at them.
  static_assert(kCluster == 1 || kCluster == 2 || kCluster == 4);
  const int rank = kCluster == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());
  if constexpr (kCluster > 1) cute::cluster_sync();

  if (warpgroup == 0) {  // the producer: its first warp (56 registers: 40 spill at kTileN 160)
    if (threadIdx.x == 0) {
      if (kWaves > 1) cute::prefetch_tma_descriptor(&map_a_run);
      cute::prefetch_tma_descriptor(&map_sfa);
    }
    ws_sm90::produce<kStages, 32, 56, kCluster>(
        map_a, map_b, map_out, p.tiles, p.tile_count, p.k_blocks, s.full, s.empty,
        kTileM * kTileK + S::kStageBytesB + (kProbe == Probe::kNoScaleLoads ? 0 : S::kScaleBytesA),
        [&](int stage, int4 tile, int kb) {
          const int column_tile = tile.y * kCluster + rank;
          const int waves = kWaves == 1 ? 1 : tile.w;
          if (lane == 0) {
            auto& st = s.stages[stage];
            if constexpr (kCluster == 1) {
              // A whole run in one box of kWaves row tiles (map_a_run), a shorter one in a box of
              // one (map_a): it loads no rows of the next expert. produce armed the barrier for
              // one row tile; the lanes' pending arrivals keep the phase open until the rest
              // counts.
              if (waves == kWaves && kWaves > 1) {
                Full::expect_transaction(&s.full[stage], (kWaves - 1) * kTileM * kTileK);
                cute::SM90_TMA_LOAD_2D::copy(&map_a_run, &s.full[stage], ws_sm90::kEvictNormal,
                                             st.a, kb * kTileK, tile.x * kTileM);
              } else {
                cute::SM90_TMA_LOAD_2D::copy(&map_a, &s.full[stage], ws_sm90::kEvictNormal, st.a,
                                             kb * kTileK, tile.x * kTileM);
              }
            } else {  // this CTA's share of the run's rows (the boxes: 1 / kCluster of each)
              const bool whole = waves == kWaves && kWaves > 1;
              const int rows = (whole ? kWaves * kTileM : kTileM) / kCluster;
              if (whole) Full::expect_transaction(&s.full[stage], (kWaves - 1) * kTileM * kTileK);
              cute::SM90_TMA_LOAD_MULTICAST_2D::copy(whole ? &map_a_run : &map_a, &s.full[stage],
                                                     (1 << kCluster) - 1, ws_sm90::kEvictNormal,
                                                     st.a + rank * rows * kTileK, kb * kTileK,
                                                     tile.x * kTileM + rank * rows);
            }
            cute::SM90_TMA_LOAD_2D::copy(&map_b, &s.full[stage], ws_sm90::kEvictNormal, st.b,
                                         kb * kTileK, tile.z * p.p_rows + column_tile * kTileN);
            // The run's rows' scales of this block: one box of kRows from the MN-major copy
            // (rows past the capacity read as 0; those of a run's missing row tile go unread).
            if constexpr (kProbe != Probe::kNoScaleLoads)
              cute::SM90_TMA_LOAD_2D::copy(&map_sfa, &s.full[stage], ws_sm90::kEvictNormal,
                                           s.sfa[stage], tile.x * kTileM, kb);
          }
          // The weight tiles' scales by the first two lanes' async copies, completing on the full
          // barrier with every lane's arrival. A weight tile past P takes scale 0 (in a cluster a
          // whole column tile can lie past P: computed, never stored).
          const int nb = column_tile * kTileN / 128;  // the weight tile under its first column
          const bool first = nb < p.n_blocks;
          const bool second = kTileN % 128 != 0 && nb + 1 < p.n_blocks;
          const float* sfb = p.sfb + tile.z * p.sfb_expert + int64_t{kb} * p.sfb_k;
          if (lane == 0)
            copy_f32_async(&s.sfb[stage][0], first ? sfb + int64_t{nb} * p.sfb_n : sfb, first);
          if (lane == 1)
            copy_f32_async(&s.sfb[stage][1], second ? sfb + int64_t{nb + 1} * p.sfb_n : sfb,
                           second);
          cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[stage]);
        });
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<224>();
  const auto [consumer, q, r0, r1] = ws_sm90::consumer_thread();
  int stage = 0;  // the next stage to wait for
  uint32_t phase = 0;
  // Each wave w < kWaves has its own result; one accumulator serves them in turn (the registers:
  // 3 x 64 a thread at kTileN 128 and two waves).
  float acc[kAcc], result[kWaves][kAcc];
  constexpr auto seq = std::make_index_sequence<kAcc>{};
  if constexpr (kProbe == Probe::kNoMma) set(acc, 1.0f, seq);
  for (int t = blockIdx.x / kCluster; t < p.tile_count; t += gridDim.x / kCluster) {
    const int4 tile = p.tiles[t];
    if (tile.x < 0) break;
    const int waves = kWaves == 1 ? 1 : tile.w;  // the row tiles of this entry: 1 .. kWaves
    const int column_tile = tile.y * kCluster + rank;
    // Groups of 8 columns left of the weight tiles' boundary (>= 16: none in the tile).
    const int split = ((column_tile * kTileN / 128 + 1) * 128 - column_tile * kTileN) / 8;
#pragma unroll
    for (int w = 0; w < kWaves; ++w) set(result[w], 0.0f, seq);
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      Full::wait(&s.full[stage], phase);
      const float* sfa = s.sfa[stage];
      BlockScales sc[kWaves];
#pragma unroll
      for (int w = 0; w < kWaves; ++w)
        sc[w] = {sfa[r0 + w * kTileM], sfa[r1 + w * kTileM], s.sfb[stage][0], s.sfb[stage][1]};
      const auto& st = s.stages[stage];
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        if (w > 0 && w >= waves) break;  // uniform over the CTA
        if constexpr (kProbe != Probe::kNoMma) {
          ws_sm90::fence(acc);
          cute::warpgroup_arrive();
#pragma unroll
          for (int j = 0; j < kTileK / 32; ++j)
            wgmma<kTileN>(
                ws_sm90::swizzle128_descriptor(st.a + (w * kTileM + consumer * 64) * kTileK, j),
                ws_sm90::swizzle128_descriptor(st.b, j), acc,
                j == 0 && (kProbe != Probe::kNoPromotion || kb == 0) ? cute::GMMA::ScaleOut::Zero
                                                                     : cute::GMMA::ScaleOut::One,
                seq);
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<0>();
          ws_sm90::fence(acc);
        } else {
          // Without wgmmas nothing keeps the warpgroup's warps together: its first thread must
          // not free a stage another warp still waits on (the stage could fill again before that
          // warp sees the first fill, and that warp would wait for the third).
          cutlass::arch::NamedBarrier::sync(128, 3 + consumer);
        }
        if (w == waves - 1 && threadIdx.x % 128 == 0) {  // the stage's last read
          Empty::arrive(&s.empty[stage]);
#pragma unroll
          for (int peer = 1; peer < kCluster; ++peer)
            Empty::arrive(&s.empty[stage], (rank + peer) % kCluster, true);
        }
        if constexpr (kProbe != Probe::kNoPromotion)
          promote_block<kTileN>(acc, sc[w], split, result[w]);
      }
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
#pragma unroll
    for (int w = 0; w < kWaves; ++w) {
      if (w > 0 && w >= waves) break;
      if constexpr (kProbe == Probe::kNoPromotion) copy_to(acc, result[w], seq);
      ws_sm90::store_bf16<kTileN, kWaves - 1>(result[w], s.out[w].warpgroup[consumer], map_out,
                                              consumer, r0 - consumer * 64, q, column_tile * kTileN,
                                              (tile.x + w) * kTileM + consumer * 64);
    }
  }
  if (threadIdx.x % 128 == 0) cute::tma_store_wait<0>();
}

// A's scales MN-major, as the kernel loads them (a stage's rows in one TMA box): (Q / 128, stride)
// f32, the stride the capacity rounded up to 4 (TMA's strides are multiples of 16 bytes).
inline int64_t mn_scales_stride(int64_t capacity) {
  return (capacity + 3) / 4 * 4;
}
inline size_t mn_scales_bytes(int64_t capacity, int64_t q) {
  return (sizeof(float) * mn_scales_stride(capacity) * (q / kTileK) + 255) / 256 * 256;
}

// Workspace for any kWaves (runs <= row tiles) and any width from 128: the tile table, then A's
// scales MN-major.
template <int kTileN>
size_t workspace_bytes(int64_t capacity, int64_t p, int64_t q) {
  return fixed_sm90::table_bytes(fixed_sm90::tile_count(capacity, p, kTileN)) +
         mn_scales_bytes(capacity, q);
}

// out (k_blocks, stride) = in (rows, k_blocks)^T: each CTA 128 rows, 32 blocks at a time through
// shared memory (reads along the rows' blocks, writes along the rows, both coalesced). Internal
// linkage, as fixed_sm90's table kernel.
static __global__ void mn_scales_kernel(const float* in, int64_t rows, int k_blocks, int64_t stride,
                                        float* out) {
  constexpr int kRowsPerCta = 128, kChunk = 32;
  __shared__ float tile[kChunk][kRowsPerCta + 1];
  const int64_t row0 = int64_t{blockIdx.x} * kRowsPerCta;
  const int n_rows = static_cast<int>(std::min<int64_t>(kRowsPerCta, rows - row0));
  for (int kb0 = 0; kb0 < k_blocks; kb0 += kChunk) {
    const int n = std::min(kChunk, k_blocks - kb0);
    for (int i = threadIdx.x; i < n_rows * n; i += blockDim.x)
      tile[i % n][i / n] = in[(row0 + i / n) * k_blocks + kb0 + i % n];
    __syncthreads();
    for (int i = threadIdx.x; i < kRowsPerCta * n; i += blockDim.x)
      if (i % kRowsPerCta < n_rows)
        out[(kb0 + i / kRowsPerCta) * stride + row0 + i % kRowsPerCta] =
            tile[i / kRowsPerCta][i % kRowsPerCta];
    __syncthreads();
  }
}

// The table of runs of up to kWaves row tiles (kernels::expert_run_entry). One CTA: its first
// thread counts each expert's runs into shared memory, then every thread fills entries.
// Entries in bands of `band` runs walked column by column (kernels::banded_entry).
template <int kWaves>
__global__ void run_table_kernel(const int64_t* segments, int experts, int tiles_n, int64_t count,
                                 int band, int4* table) {
  extern __shared__ int64_t first_run[];  // experts + 1: the runs before each expert
  if (threadIdx.x == 0) kernels::count_expert_runs(segments, experts, kWaves, first_run);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const int64_t entry = kernels::banded_entry(i, first_run[experts], tiles_n, band);
    const kernels::ExpertRun r =
        kernels::expert_run_entry(segments, first_run, experts, kWaves, tiles_n, entry);
    table[i] = make_int4(r.row_tile, r.column, r.expert, r.row_tiles);
  }
}

// The table for kWaves row tiles a CTA: fixed_sm90's (one entry per row tile and column tile) or
// the runs' (run_table_kernel), at the head of the workspace.
template <int kWaves>
fixed_sm90::TileTable tile_table(void* workspace, size_t workspace_size, const int64_t* segments,
                                 int experts, int64_t capacity, int64_t p, int tile_n, int band,
                                 cudaStream_t stream) {
  if constexpr (kWaves == 1) {
    return fixed_sm90::tile_table_in(workspace, workspace_size, segments, experts, capacity, p,
                                     tile_n, stream);
  } else {
    const int64_t count =
        kernels::expert_run_entries(capacity, experts, kWaves, (p + tile_n - 1) / tile_n);
    const size_t counts_bytes = (experts + 1) * sizeof(int64_t);  // the kernel's shared memory
    if (workspace_size < fixed_sm90::table_bytes(count) || counts_bytes > 48 * 1024)
      return {nullptr, 0, cudaErrorInvalidValue};
    auto* table = static_cast<int4*>(workspace);
    if (count > 0)
      run_table_kernel<kWaves><<<1, 1024, counts_bytes, stream>>>(
          segments, experts, static_cast<int>((p + tile_n - 1) / tile_n), count, band, table);
    return {table, count, cudaGetLastError()};
  }
}

// The product with tiles kTileN wide (P, Q multiples of 128) on clusters of kCluster CTAs (the
// column tiles of a row tile taken kCluster at a time), each CTA's tile up to kWaves row tiles of
// one expert, leaving out what kProbe says; with kWaves > 1 the runs taken in bands of `band`
// (kernels::banded_entry; 1: row-major).
template <int kTileN, Probe kProbe = Probe::kNone, int kCluster = 1, int kWaves = 1>
cudaError_t run(const int64_t* segments, int experts, const kernels::Fp8Operands& ops,
                kernels::Fp8WeightScales b_scales, int64_t capacity, int64_t p, int64_t q,
                void* workspace, size_t workspace_size, cudaStream_t stream, int band = 1) {
  if (q % kTileK != 0 || p % 128 != 0) return cudaErrorInvalidValue;
  // The workspace: the tile table (sized for the most tiles), then A's scales MN-major.
  const size_t table_size = fixed_sm90::table_bytes(fixed_sm90::tile_count(capacity, p, 128));
  if (workspace_size < table_size + mn_scales_bytes(capacity, q)) return cudaErrorInvalidValue;
  const fixed_sm90::TileTable table = tile_table<kWaves>(
      workspace, table_size, segments, experts, capacity, p, kTileN * kCluster, band, stream);
  if (table.err != cudaSuccess || table.count == 0) return table.err;
  const int64_t stride = mn_scales_stride(capacity);
  float* sfa = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + table_size);
  mn_scales_kernel<<<static_cast<unsigned>((capacity + 127) / 128), 256, 0, stream>>>(
      ops.sfa, capacity, static_cast<int>(q / kTileK), stride, sfa);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  // A row-major (outer, inner) E4M3 matrix's TMA descriptor, box (box_outer, 128), 128-byte
  // swizzle.
  const auto encode_fp8 = [](CUtensorMap* map, const void* base, int64_t inner, int64_t outer,
                             cuuint32_t box_outer) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(inner)};
    const cuuint32_t box[2] = {kTileK, box_outer};
    return ws_sm90::encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box,
                               CU_TENSOR_MAP_SWIZZLE_128B);
  };
  // A's scales: (Q / 128, capacity) f32 with rows `stride` apart, box (1, kRows).
  const auto encode_sfa = [&](CUtensorMap* map) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(capacity),
                                static_cast<cuuint64_t>(q / kTileK)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride * sizeof(float))};
    const cuuint32_t box[2] = {Shape<kTileN, kWaves>::kRows, 1};
    return ws_sm90::encode_tma(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, sfa, dims, strides, box,
                               CU_TENSOR_MAP_SWIZZLE_NONE);
  };
  CUtensorMap map_a, map_a_run, map_b, map_sfa, map_out;
  if (encode_fp8(&map_a, ops.a, q, capacity, kTileM / kCluster) != CUDA_SUCCESS ||
      encode_sfa(&map_sfa) != CUDA_SUCCESS ||
      encode_fp8(&map_a_run, ops.a, q, capacity, kWaves * kTileM / kCluster) != CUDA_SUCCESS ||
      encode_fp8(&map_b, ops.b, q, experts * p, kTileN) != CUDA_SUCCESS ||
      ws_sm90::encode_out<kTileN>(&map_out, ops.out, p, capacity) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const int pb = static_cast<int>(p / 128), qb = static_cast<int>(q / 128);
  // The weight's 128 x 128 scales, (K / 128, N / 128): b = w^T (the forward) reads them along
  // its rows (P = N), b = w (the input gradient) along its contraction (Q = N).
  const bool mn = b_scales == kernels::Fp8WeightScales::kMnMajor;
  const Params params{
      ops.sfb,     table.tiles, static_cast<int>(table.count), qb,      pb, int64_t{pb} * qb,
      mn ? pb : 1, mn ? 1 : qb, static_cast<int>(p),           capacity};
  constexpr size_t smem = ws_sm90::storage_bytes<typename Shape<kTileN, kWaves>::SharedStorage>();
  constexpr auto kernel = fp8_gemm_fixed_kernel<kTileN, kProbe, kCluster, kWaves>;
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim = {static_cast<unsigned>(kCluster), 1, 1};
  config.blockDim = kThreads;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  // Persistent CTAs: as many clusters as can run at once, at most one a tile.
  static const std::pair<cudaError_t, int> resident = [&] {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    int clusters = sm_count() / kCluster;
    if (err == cudaSuccess && kCluster > 1) {
      config.gridDim = static_cast<unsigned>(clusters * kCluster);
      err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    }
    return std::pair{err, clusters};
  }();
  if (resident.first != cudaSuccess) return resident.first;
  config.gridDim =
      static_cast<unsigned>(kCluster * std::min<int64_t>(table.count, resident.second));
  return cudaLaunchKernelEx(&config, kernel, map_a, map_a_run, map_b, map_sfa, map_out, params);
}

}  // namespace mt::cuda::fp8_fixed_sm90
