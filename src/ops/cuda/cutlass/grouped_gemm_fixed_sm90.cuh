// Expert GEMMs over a padded row layout with fixed TMA descriptors: the forward and input-gradient
// products when every expert's rows start on a 128-row boundary (ops::ExpertRows, align 128).
//
// CUTLASS's grouped (pointer-array) kernels rewrite a CTA's TMA descriptors whenever its next tile
// belongs to another expert, and walk the groups' shapes to find each tile. Over a padded layout
// neither is needed: the rows are one (capacity, width) matrix whose row tiles each belong to one
// expert, and the weights are one (E, k, n) tensor with the expert as its batch coordinate. These
// kernels are CUTLASS's non-array warp-specialized ones, unchanged, with a tile scheduler of ours
// that reads every tile's {row tile, column tile, expert} from a table built on the device from
// the segments (no count reaches the host). Output rows of the padding are written (from whatever
// the padding holds) and never read. Measured against the grouped kernels in
// docs/benchmarks-history.md.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::fixed_sm90 {

using namespace cute;

inline constexpr int kRowTile = kernels::kFixedRowTile;  // every segment starts on a multiple

// The scheduler: CUTLASS's static persistent one (CTA c takes tiles c, c + grid, ...) with the
// tile -> (row tile, column tile, expert) mapping read from a table. Each tile is one load,
// issued a tile ahead, and no arithmetic: every thread of the kernel asks at every tile, so this
// sits between one tile's mainloop and the next.
class ExpertTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = Base::WorkTileInfo;
  struct Arguments : Base::Arguments {
    const int4* tiles = nullptr;  // {row tile, column tile, expert, 0}; row tile < 0: no tile
    int tile_count = 0;
  };
  struct Params : Base::Params {
    const int4* tiles = nullptr;
    int tile_count = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem, TileShape tile,
                                        ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) =
        Base::to_underlying_arguments(problem, tile, cluster, hw_info, args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    p.tiles = args.tiles;
    p.tile_count = args.tile_count;
    return p;
  }

  ExpertTileScheduler() = default;
  CUTLASS_DEVICE explicit ExpertTileScheduler(Params const& params)
      : Base(params), params_(params) {
#if defined(__CUDA_ARCH__)
    linear_ = blockIdx.x + uint64_t(blockIdx.y) * gridDim.x +
              uint64_t(blockIdx.z) * gridDim.x * gridDim.y;
    grid_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work_at(linear_);
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    return work_at(linear_);
  }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    linear_ += grid_ * count;
  }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    return !work_at(linear_ + grid_ * count).is_valid();
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline&, PipelineState) {
    return fetch_next_work(work);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo work_at(uint64_t index) const {
    WorkTileInfo w;
    w.M_idx = w.N_idx = w.L_idx = -1;
    w.is_valid_tile = false;
    if (index >= uint64_t(params_.tile_count)) return w;
    const int4 t = index == ahead_index_ ? ahead_ : params_.tiles[index];
    const uint64_t next = index + grid_;  // this CTA's next tile: its load starts now
    if (next < uint64_t(params_.tile_count)) {
      ahead_ = params_.tiles[next];
      ahead_index_ = next;
    }
    if (t.x < 0) return w;
    w.M_idx = t.x;
    w.N_idx = t.y;
    w.L_idx = t.z;
    w.is_valid_tile = true;
    return w;
  }

  Params params_;
  uint64_t linear_ = 0, grid_ = 1;
  mutable int4 ahead_{};  // the table entry of this CTA's next tile, loaded a tile ahead
  mutable uint64_t ahead_index_ = ~uint64_t{0};
};

// The scheduler's tag: the kernels take their scheduler from CUTLASS's selector.
struct ExpertTiles {};

}  // namespace mt::cuda::fixed_sm90

template <class TileShape, class ClusterShape, uint32_t Stages>
struct cutlass::gemm::kernel::detail::TileSchedulerSelector<
    mt::cuda::fixed_sm90::ExpertTiles, cutlass::arch::Sm90, TileShape, ClusterShape, Stages> {
  using Scheduler = mt::cuda::fixed_sm90::ExpertTileScheduler;
};

namespace mt::cuda::fixed_sm90 {

struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};

enum class Product { kForward, kInputGradient };

// Strides (M|N, K, L): the rows are one matrix for every expert (zero batch stride, the tile
// picks the rows); the weights w (E, k, n) carry the expert as batch coordinate.
using Rows = Stride<int64_t, _1, _0>;                // (rows, width) row-major: A, and D
using WeightsNMajor = Stride<_1, int64_t, int64_t>;  // w as B (n, k, e): forward
using WeightsKMajor = Stride<int64_t, _1, int64_t>;  // w as B (k, n, e): input gradient

// One of CUTLASS's non-array warp-specialized kernels: the operands' strides, the output type,
// the tile, the schedule and the tile scheduler's tag (void: CUTLASS's own, for plain batched
// GEMMs; bench/batched_gemm_bound.cu).
template <class StrideA, class StrideB, class StrideD, class Out, class Tile, class Schedule,
          class SchedulerTag>
struct KernelConfig {
  using ElementIn = cutlass::bfloat16_t;
  using ElementOutput = Out;
  static constexpr int kAlignOut = 16 / sizeof(Out);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Shape<_1, _1, _1>,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out, StrideD, kAlignOut, Out,
      StrideD, kAlignOut, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Out, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, StrideA, 8, ElementIn,
      StrideB, 8, float, Tile, Shape<_1, _1, _1>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      SchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Product P over 128-row segments: bf16 in and out, f32 accumulation, our scheduler.
template <Product P, class Tile, class Schedule>
struct Config
    : KernelConfig<Rows, std::conditional_t<P == Product::kForward, WeightsNMajor, WeightsKMajor>,
                   Rows, cutlass::bfloat16_t, Tile, Schedule, ExpertTiles> {
  using StrideB = std::conditional_t<P == Product::kForward, WeightsNMajor, WeightsKMajor>;
  static_assert(std::is_same_v<typename Config::Kernel::TileScheduler, ExpertTileScheduler>);
  static constexpr int kTileN = size<1>(Tile{});
};

// Tiles of the table: one per (row tile, column tile) of the capacity, the column tiles of a row
// tile consecutive (they share the rows, which stay in L2).
inline int64_t tile_count(int64_t capacity, int64_t out_width, int tile_n) {
  return (capacity + kRowTile - 1) / kRowTile * ((out_width + tile_n - 1) / tile_n);
}

// Bytes of the tile table (the workspace's head), rounded to 256.
inline size_t table_bytes(int64_t count) {
  return (sizeof(int4) * count + 255) / 256 * 256;
}

// Bytes of workspace one call needs: the tile table, then CUTLASS's own (none for this scheduler
// and schedules; checked at the call).
inline size_t workspace_bytes(int64_t capacity, int64_t out_width, int tile_n) {
  return table_bytes(tile_count(capacity, out_width, tile_n)) + 256;
}

// Every tile of the capacity: {row tile, column tile, expert of the row tile, 0}, or row tile -1
// past the last segment. The expert of row tile r is the last e with segments[e] <= 128 r (an
// expert without rows shares its start with the next one).
// Internal linkage: each translation unit that launches it has its own copy.
static __global__ void tile_table_kernel(const int64_t* segments, int experts, int tiles_n,
                                         int64_t count, int4* table) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= count) return;
  const int block = static_cast<int>(i / tiles_n);
  const int col = static_cast<int>(i - int64_t{block} * tiles_n);
  const int64_t row = int64_t{block} * kRowTile;
  int4 t = make_int4(-1, 0, 0, 0);
  if (row < segments[experts])
    t = make_int4(block, col, kernels::last_start_at_or_before(segments, experts, row), 0);
  table[i] = t;
}

// Writes the table of the tiles of (capacity, out_width) in tile_n-wide columns: `count` =
// tile_count(capacity, out_width, tile_n) entries.
inline cudaError_t make_tile_table(const int64_t* segments, int experts, int64_t out_width,
                                   int tile_n, int64_t count, int4* table, cudaStream_t stream) {
  if (count > 0)
    tile_table_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, stream>>>(
        segments, experts, static_cast<int>((out_width + tile_n - 1) / tile_n), count, table);
  return cudaGetLastError();
}

// The table of a kernel whose workspace is the table alone (our warp-specialized kernels): made
// at the head of `workspace` on the stream. err: cudaErrorInvalidValue when the workspace holds
// less than table_bytes of the tile count, else the launch's; count 0: no tile, nothing launched.
struct TileTable {
  const int4* tiles;
  int64_t count;
  cudaError_t err;
};
inline TileTable tile_table_in(void* workspace, size_t workspace_bytes, const int64_t* segments,
                               int experts, int64_t capacity, int64_t out_width, int tile_n,
                               cudaStream_t stream) {
  const int64_t count = tile_count(capacity, out_width, tile_n);
  if (workspace_bytes < table_bytes(count)) return {nullptr, 0, cudaErrorInvalidValue};
  auto* table = static_cast<int4*>(workspace);
  return {table, count,
          count == 0 ? cudaSuccess
                     : make_tile_table(segments, experts, out_width, tile_n, count, table, stream)};
}

// One call. Forward: out (capacity, n) = x (capacity, k) @ w_e; input gradient: out (capacity, k)
// = dy (capacity, n) @ w_e^T; the rows of row tile r multiply the weights of its expert.
template <Product P, class C>
cudaError_t run(const int64_t* segments, int experts, const void* lhs, const void* rhs, void* out,
                int64_t capacity, int64_t k, int64_t n, void* workspace, size_t workspace_size,
                cudaStream_t stream) {
  using In = typename C::ElementIn;
  const int64_t out_width = P == Product::kForward ? n : k, inner = P == Product::kForward ? k : n;
  if (workspace_size < workspace_bytes(capacity, out_width, C::kTileN))
    return cudaErrorInvalidValue;
  const int64_t count = tile_count(capacity, out_width, C::kTileN);
  auto* table = static_cast<int4*>(workspace);
  const size_t table_size = table_bytes(count);
  if (cudaError_t err =
          make_tile_table(segments, experts, out_width, C::kTileN, count, table, stream);
      err != cudaSuccess)
    return err;
  typename C::StrideB sb{};
  if constexpr (P == Product::kForward)
    sb = {_1{}, n, k * n};
  else
    sb = {n, _1{}, k * n};
  const Rows sa{inner, _1{}, _0{}}, sd{out_width, _1{}, _0{}};
  typename C::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kBatched,
      {static_cast<int>(capacity), static_cast<int>(out_width), static_cast<int>(inner), experts},
      {static_cast<const In*>(lhs), sa, static_cast<const In*>(rhs), sb},
      {{1.0f, 0.0f}, static_cast<In*>(out), sd, static_cast<In*>(out), sd}};
  // One GPU per process: the SM count is read once.
  static const cutlass::KernelHardwareInfo hw =
      cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename C::Kernel>(0);
  args.hw_info = hw;
  args.scheduler.tiles = table;
  args.scheduler.tile_count = static_cast<int>(count);
  typename C::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (C::Gemm::get_workspace_size(args) > workspace_size - table_size) return cudaErrorInvalidValue;
  if (gemm.initialize(args, static_cast<char*>(workspace) + table_size, stream) !=
      cutlass::Status::kSuccess)
    return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

}  // namespace mt::cuda::fixed_sm90
