// The FP8 forward and input-gradient products (ops/fp8_gemm.h) over a padded row layout: out
// (capacity, P) bf16 = A_e (capacity, Q) b[e]^T, A in 1 x 128 blocks along Q (E4M3 data, an f32
// scale per block), b (E, P, Q) E4M3 in 128 x 128 tiles (one f32 scale per tile), every expert's
// rows starting on a 128-row boundary.
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
// persistent CTAs over the tile table; one producer thread issues TMA copies of A's and b's
// 128 x 128 tiles into a ring of stages (full/empty barriers), running on across tiles so the next
// tile's loads overlap the epilogue; two consumer warpgroups of 64 rows x 128 columns each run the
// four k32 FP8 wgmmas of a 128-deep block into a fresh f32 accumulator, then promote it into the
// result with the block's scales, result += partial * (sa[row] * sb): DeepSeek-V3's promotion
// every 128 of the contraction, in f32 registers. A's scales reach each thread from global memory
// (L2) a few blocks ahead of their use; b's one scale per block and tile likewise. The epilogue
// stages bf16 rows in 128-byte-swizzled shared memory and leaves by TMA stores.
//
// Where it stands (docs/benchmarks-history.md, "Our FP8 kernel over the padded layout"): on the
// short contraction of the MoE layer's down forward (Q 768, six blocks) the per-tile costs
// CUTLASS's grouped kernel pays dominate and this kernel is 1.2x faster; on the long ones (Q 1536,
// 2048) CUTLASS's mainloop is faster, and none of two accumulators (a block's promotion under the
// next block's wgmmas), L2 prefetch of the scales, an explicit L2 policy, A multicast across a
// cluster of two or a tile order sharing weight tiles closed the gap. ops/fp8_gemm.cpp runs it
// where it wins.
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cutlass/grouped_gemm_fixed_sm90.cuh"
#include "ops/cuda/cutlass/warp_specialized_sm90.cuh"
#include "ops/cuda/fp8_gemm.h"

namespace mt::cuda::kernels {

namespace {

constexpr int kTileM = 128;  // = fixed_sm90::kRowTile: a row tile is one expert's
constexpr int kTileN = 128;  // one weight tile wide: one b scale per tile and block
constexpr int kTileK = 128;  // one scale block deep
constexpr int kStages = 6;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr uint32_t kStageBytesA = kTileM * kTileK;
constexpr uint32_t kStageBytesB = kTileN * kTileK;
static_assert(kTileM == fixed_sm90::kRowTile);

struct alignas(1024) Stage {
  uint8_t a[kStageBytesA];  // (128, 128) E4M3, 128-byte swizzle (1024-byte aligned)
  uint8_t b[kStageBytesB];  // (128, 128) E4M3, 128-byte swizzle
};

constexpr int kScalesAhead = 2;  // blocks of scales in flight ahead of their use

// The epilogue's tile on its way to TMA stores (ws_sm90::store_bf16), per consumer warpgroup.
struct alignas(1024) Epilogue {
  uint8_t chunk[2][kTileN / ws_sm90::kOutChunk][ws_sm90::kChunkBytes];
};

struct SharedStorage {
  Stage stages[kStages];
  Epilogue out;
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

struct Params {
  const float* sfa;   // (capacity, Q / 128)
  const float* sfb;   // (E, P / 128, Q / 128) or (E, Q / 128, P / 128): see sfb_k, sfb_n
  const int4* tiles;  // {row tile, column tile, expert, 0}; row tile < 0: none
  int tile_count;
  int k_blocks;        // Q / 128
  int64_t sfb_expert;  // (P / 128) (Q / 128)
  int sfb_k, sfb_n;    // strides of a tile's scale along the contraction and along P
  int p_rows;          // P: b's rows per expert
  int64_t capacity;    // rows; the last row tile may run past them (TMA reads zeros there)
};

// The promotion, expanded over index sequences as ws_sm90::fence: result (=|+=) acc * the scale of
// the element's row: acc[4 i + {0, 1}] belong to row r0 (s0), acc[4 i + {2, 3}] to row r1 (s1).
template <size_t... I>
__device__ __forceinline__ void promote_first(const float (&acc)[64], float s0, float s1,
                                              float (&result)[64], std::index_sequence<I...>) {
  ((result[I] = acc[I] * ((I % 4) < 2 ? s0 : s1)), ...);
}
template <size_t... I>
__device__ __forceinline__ void promote_add(const float (&acc)[64], float s0, float s1,
                                            float (&result)[64], std::index_sequence<I...>) {
  ((result[I] = fmaf(acc[I], (I % 4) < 2 ? s0 : s1, result[I])), ...);
}

template <size_t... I>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float (&acc)[64],
                                      cute::GMMA::ScaleOut scale, std::index_sequence<I...>) {
  cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>::fma(desc_a, desc_b, acc[I]..., scale);
}

// One block's scales for this thread: rows r0 and r1 of A, and b's tile.
struct BlockScales {
  float a0, a1, b;
};

__global__ void __launch_bounds__(kThreads, 1)
    fp8_gemm_fixed_kernel(const __grid_constant__ CUtensorMap map_a,
                          const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_out, const Params p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  auto& s = ws_sm90::aligned_storage<SharedStorage>(smem_raw);
  using ws_sm90::Empty;
  using ws_sm90::Full;
  const int warpgroup = threadIdx.x / 128;
  const int lane = threadIdx.x % 32;
  ws_sm90::init_ring(s.full, s.empty, kStages, 2);

  if (warpgroup == 0) {  // the producer
    ws_sm90::produce<kStages>(
        map_a, map_b, map_out, p.tiles, p.tile_count, p.k_blocks, s.full, s.empty,
        kStageBytesA + kStageBytesB, [&](int stage, int4 tile, int kb) {
          Stage& st = s.stages[stage];
          cute::SM90_TMA_LOAD_2D::copy(&map_a, &s.full[stage], ws_sm90::kEvictNormal, st.a,
                                       kb * kTileK, tile.x * kTileM);
          cute::SM90_TMA_LOAD_2D::copy(&map_b, &s.full[stage], ws_sm90::kEvictNormal, st.b,
                                       kb * kTileK, tile.z * p.p_rows + tile.y * kTileN);
        });
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  const int consumer = warpgroup - 1;       // rows 64 c .. 64 c + 63 of the tile
  const int warp = (threadIdx.x / 32) % 4;  // within the warpgroup
  const int q = lane % 4;
  const uint32_t r0 = consumer * 64 + warp * 16 + lane / 4, r1 = r0 + 8;
  // Block kb's scales of this thread's rows in the tile. Rows past the capacity (TMA's zeros)
  // take scale 0.
  auto scales_of = [&](int4 tile, int kb) {
    BlockScales sc;
    const int64_t row = int64_t{tile.x} * kTileM;
    sc.a0 = row + r0 < p.capacity ? __ldg(p.sfa + (row + r0) * p.k_blocks + kb) : 0.0f;
    sc.a1 = row + r1 < p.capacity ? __ldg(p.sfa + (row + r1) * p.k_blocks + kb) : 0.0f;
    sc.b = __ldg(p.sfb + tile.z * p.sfb_expert + int64_t{kb} * p.sfb_k + int64_t{tile.y} * p.sfb_n);
    return sc;
  };
  BlockScales ahead[kScalesAhead];
  auto fill_ahead = [&](int4 tile) {
#pragma unroll
    for (int i = 0; i < kScalesAhead; ++i)
      if (i < p.k_blocks) ahead[i] = scales_of(tile, i);
  };
  int stage = 0;  // the next stage to wait for
  uint32_t phase = 0;
  float acc[64], result[64];
  int t = blockIdx.x;
  int4 tile = t < p.tile_count ? p.tiles[t] : make_int4(-1, 0, 0, 0);
  if (tile.x >= 0) fill_ahead(tile);
  while (tile.x >= 0) {
    const int next_t = t + gridDim.x;
    const int4 next = next_t < p.tile_count ? p.tiles[next_t] : make_int4(-1, 0, 0, 0);
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const BlockScales sc = ahead[0];
#pragma unroll
      for (int i = 0; i + 1 < kScalesAhead; ++i) ahead[i] = ahead[i + 1];
      if (kb + kScalesAhead < p.k_blocks)
        ahead[kScalesAhead - 1] = scales_of(tile, kb + kScalesAhead);
      Full::wait(&s.full[stage], phase);
      const Stage& st = s.stages[stage];
      ws_sm90::fence(acc);
      cute::warpgroup_arrive();
#pragma unroll
      for (int j = 0; j < kTileK / 32; ++j)
        wgmma(ws_sm90::swizzle128_descriptor(st.a + consumer * 64 * kTileK, j),
              ws_sm90::swizzle128_descriptor(st.b, j), acc,
              j == 0 ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One,
              std::make_index_sequence<64>{});
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      ws_sm90::fence(acc);
      if (threadIdx.x % 128 == 0) Empty::arrive(&s.empty[stage]);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
      const float s0 = sc.a0 * sc.b, s1 = sc.a1 * sc.b;
      if (kb == 0)
        promote_first(acc, s0, s1, result, std::make_index_sequence<64>{});
      else
        promote_add(acc, s0, s1, result, std::make_index_sequence<64>{});
    }
    if (next.x >= 0) fill_ahead(next);

    ws_sm90::store_bf16<kTileN>(result, s.out.chunk[consumer][0], map_out, consumer,
                                r0 - consumer * 64, q, tile.y * kTileN,
                                tile.x * kTileM + consumer * 64);
    tile = next;
    t = next_t;
  }
  if (threadIdx.x % 128 == 0) cute::tma_store_wait<0>();
}

// A row-major (outer, inner) matrix's TMA descriptor, box (box_outer, box_inner), 128-byte
// swizzle.
CUresult encode(CUtensorMap* map, CUtensorMapDataType type, const void* base, cuuint64_t inner,
                cuuint64_t outer, cuuint64_t row_bytes, cuuint32_t box_inner,
                cuuint32_t box_outer) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  return ws_sm90::encode_tma(map, type, 2, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

}  // namespace

size_t fp8_gemm_rows_fixed_workspace(int64_t capacity, int64_t p) {
  return fixed_sm90::table_bytes(fixed_sm90::tile_count(capacity, p, kTileN));
}

cudaError_t fp8_gemm_rows_fixed(const int64_t* segments, int experts, const Fp8Operands& ops,
                                Fp8WeightScales b_scales, int64_t capacity, int64_t p, int64_t q,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (q % kTileK != 0 || p % kTileN != 0) return cudaErrorInvalidValue;
  if (workspace_bytes < fp8_gemm_rows_fixed_workspace(capacity, p)) return cudaErrorInvalidValue;
  const int64_t count = fixed_sm90::tile_count(capacity, p, kTileN);
  if (count == 0) return cudaSuccess;
  auto* table = static_cast<int4*>(workspace);
  if (cudaError_t err =
          fixed_sm90::make_tile_table(segments, experts, p, kTileN, count, table, stream);
      err != cudaSuccess)
    return err;
  CUtensorMap map_a, map_b, map_out;
  const auto u64 = [](int64_t v) { return static_cast<cuuint64_t>(v); };
  if (encode(&map_a, CU_TENSOR_MAP_DATA_TYPE_UINT8, ops.a, u64(q), u64(capacity), u64(q), kTileK,
             kTileM) != CUDA_SUCCESS ||
      encode(&map_b, CU_TENSOR_MAP_DATA_TYPE_UINT8, ops.b, u64(q), u64(experts * p), u64(q), kTileK,
             kTileN) != CUDA_SUCCESS ||
      encode(&map_out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, ops.out, u64(p), u64(capacity), u64(p * 2),
             ws_sm90::kOutChunk, 64) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const int pb = static_cast<int>(p / 128), qb = static_cast<int>(q / 128);
  // The weight's 128 x 128 scales, (K / 128, N / 128): b = w^T (the forward) reads them along
  // its rows (P = N), b = w (the input gradient) along its contraction (Q = N).
  const bool mn = b_scales == Fp8WeightScales::kMnMajor;
  const Params params{
      ops.sfa,          ops.sfb,     table,       static_cast<int>(count), qb,
      int64_t{pb} * qb, mn ? pb : 1, mn ? 1 : qb, static_cast<int>(p),     capacity};
  constexpr size_t smem = ws_sm90::storage_bytes<SharedStorage>();
  static const cudaError_t configured = cudaFuncSetAttribute(
      fp8_gemm_fixed_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (configured != cudaSuccess) return configured;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(count, sm_count()));
  fp8_gemm_fixed_kernel<<<grid, kThreads, smem, stream>>>(map_a, map_b, map_out, params);
  return cudaGetLastError();
}

}  // namespace mt::cuda::kernels
