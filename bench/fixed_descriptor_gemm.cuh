// Expert GEMMs with fixed TMA descriptors: a workbench stage (bench/fixed_descriptor_gemm.cu),
// not used by the ops: in its runs it was no faster than the grouped kernels (docs/benchmarks.md).
//
// CUTLASS's grouped (pointer-array) kernels run the expert products 10-25% slower than its
// plain batched kernels at the same tiles (docs/benchmarks.md): the batched kernels keep one TMA
// descriptor per operand for the whole launch. These run the batched kernels (CUTLASS's
// non-array warp-specialized kernels, unchanged) over expert segments padded to the tile's rows,
// with a scheduler of ours that maps each tile to its expert:
//   - expert e's rows live at [segment[e], segment[e] + count[e]) of a buffer with `capacity`
//     rows, segment[e + 1] - segment[e] = count[e] rounded up to 128 (kSegmentRows); the rows
//     past count[e] are padding (zeros where the weight gradient reads them);
//   - forward and input gradient: tile (m, n) over the padded rows; its expert, found from the
//     segments, is the weights' batch coordinate (the rows' operands have a zero batch stride);
//   - weight gradient: tile (m, n) of expert e's (k, n) output, over e's K range (its padded
//     rows, 64 at a time), so CUTLASS's cooperative kernel (the one with per-tile K ranges).
// The segments stay on the device: the scheduler reads them, the host never does.
#pragma once
#include <cuda_runtime_api.h>

#include <climits>
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

namespace mt::cuda::fixed_sm90 {

using namespace cute;

inline constexpr int64_t kSegmentRows = 128;  // the row tile every segment is padded to

enum class Product { kForward, kInputGradient, kWeightGradient };

// The scheduler: CUTLASS's static persistent scheduler with the tile -> (m, n, expert) mapping
// (and, for the weight gradient, the K range) replaced. Each CTA takes tiles cta, cta + grid, ...
template <Product P>
class ExpertTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct WorkTileInfo : Base::WorkTileInfo {
    int32_t k_start = 0;  // in K tiles (weight gradient)
    int32_t k_count = 0;
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() {
      WorkTileInfo w;
      w.M_idx = w.N_idx = w.L_idx = -1;
      w.is_valid_tile = false;
      return w;
    }
  };
  struct Arguments : Base::Arguments {
    const int64_t* segments = nullptr;  // (experts + 1), on the device
    const int64_t* counts = nullptr;    // (experts), on the device (weight gradient)
    int experts = 0;
    bool rows_fastest = true;  // forward/dx: an expert's tiles m fastest, else n fastest
    // Forward/dx as a plain batched GEMM (every expert M rows of its own batch, no segments):
    // CUTLASS's batched tile order with this scheduler, to tell the scheduler's cost apart.
    bool uniform = false;
    // Optional, forward/dx: per row block {expert, its first block, its block count}, so that a
    // tile's expert is one load instead of a walk over the segments.
    const int4* block_info = nullptr;
  };
  struct Params : Base::Params {
    const int64_t* segments = nullptr;
    const int64_t* counts = nullptr;
    int experts = 0;
    bool rows_fastest = true;
    bool uniform = false;
    const int4* block_info = nullptr;
    cutlass::FastDivmod divmod_tiles_n;
    int tiles_m = 0, tiles_n = 0;  // forward/dx: tiles_n; dw: the (k, n) output's tiles
    int tile_m = 0, tile_n = 0, tile_k = 0;
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
    p.segments = args.segments;
    p.counts = args.counts;
    p.experts = args.experts;
    p.rows_fastest = args.rows_fastest;
    p.uniform = args.uniform;
    p.block_info = args.block_info;
    p.tile_m = size<0>(tile);
    p.tile_n = size<1>(tile);
    p.tile_k = size<2>(tile);
    p.tiles_m = static_cast<int>((get<0>(problem) + p.tile_m - 1) / p.tile_m);
    p.tiles_n = static_cast<int>((get<1>(problem) + p.tile_n - 1) / p.tile_n);
    p.divmod_tiles_n = cutlass::FastDivmod(p.tiles_n);
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

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& w, ProblemShape problem,
                                                       TileShape tile) {
    if constexpr (P == Product::kWeightGradient) return w.k_count;
    return Base::get_work_k_tile_count(w, problem, tile);
  }
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const& w) {
    return P == Product::kWeightGradient ? static_cast<uint32_t>(w.k_start) : 0u;
  }

 private:
  // Linear tile index -> work, in 32-bit arithmetic (every thread of the kernel asks at each
  // tile, so this is on the critical path between tiles). Forward/dx: expert e's tiles are the
  // linear indices [segments[e] / tile_m * tiles_n, segments[e + 1] / tile_m * tiles_n); the
  // expert is found by walking from the last one asked about (a CTA's indices mostly grow, a
  // few experts at a time), its row blocks fastest or its n tiles fastest. Weight gradient:
  // expert-major, the (k, n) output's tiles m fastest.
  CUTLASS_DEVICE WorkTileInfo work_at(uint64_t index) const {
    WorkTileInfo w;
    const int E = params_.experts;
    const int i = static_cast<int>(index);
    if (P == Product::kWeightGradient || params_.uniform) {
      const int per_expert = params_.tiles_m * params_.tiles_n;
      const int e = i / per_expert, local = i - e * per_expert;
      if (index >= uint64_t(per_expert) * E) return WorkTileInfo::invalid_work_tile();
      w.M_idx = local % params_.tiles_m;
      w.N_idx = local / params_.tiles_m;
      w.L_idx = e;
      if constexpr (P == Product::kWeightGradient) {
        w.k_start = static_cast<int32_t>(params_.segments[e] / params_.tile_k);
        w.k_count = static_cast<int32_t>((params_.counts[e] + params_.tile_k - 1) / params_.tile_k);
      }
    } else {
      int block = 0, n_in_block = 0;
      params_.divmod_tiles_n.fast_divmod(block, n_in_block, i);
      const int64_t row = int64_t{block} * params_.tile_m;
      if (index >= uint64_t(INT32_MAX) || block >= params_.tiles_m)
        return WorkTileInfo::invalid_work_tile();
      int e = 0, first = 0, blocks = 0;
      if (params_.block_info) {  // one load: {expert or -1 past the last segment, first, blocks}
        const int4 b = params_.block_info[block];
        if (b.x < 0) return WorkTileInfo::invalid_work_tile();
        e = b.x, first = b.y, blocks = b.z;
      } else {
        if (row >= params_.segments[E]) return WorkTileInfo::invalid_work_tile();
        e = expert_;
        while (params_.segments[e + 1] <= row) ++e;
        while (params_.segments[e] > row) --e;
        expert_ = e;
        first = static_cast<int>(params_.segments[e] / params_.tile_m);
        blocks = static_cast<int>(params_.segments[e + 1] / params_.tile_m) - first;
      }
      if (params_.rows_fastest) {
        const int local = i - first * params_.tiles_n;
        const int n = local / blocks;
        w.M_idx = first + (local - n * blocks);
        w.N_idx = n;
      } else {
        w.M_idx = block;
        w.N_idx = n_in_block;
      }
      w.L_idx = e;
    }
    w.is_valid_tile = true;
    return w;
  }

  Params params_;
  uint64_t linear_ = 0, grid_ = 1;
  mutable int expert_ = 0;  // the expert of the last tile asked about (forward/dx)
};

// Scheduler tags, one per product: the kernels take their scheduler from CUTLASS's selector.
template <Product P>
struct ExpertTiles {};

}  // namespace mt::cuda::fixed_sm90

template <mt::cuda::fixed_sm90::Product P, class TileShape, class ClusterShape, uint32_t Stages>
struct cutlass::gemm::kernel::detail::TileSchedulerSelector<
    mt::cuda::fixed_sm90::ExpertTiles<P>, cutlass::arch::Sm90, TileShape, ClusterShape, Stages> {
  using Scheduler = mt::cuda::fixed_sm90::ExpertTileScheduler<P>;
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

// Strides (M|N, K, L) of each product's operands; a zero batch stride: the operand is one
// buffer of rows shared by every expert (the scheduler picks the rows).
using RowsKMajor = Stride<int64_t, _1, _0>;  // (rows, k) row-major rows: A of forward/dx
using RowsMMajor = Stride<_1, int64_t, _0>;  // rows as K, the other dim contiguous: dw's A, B
using WeightsNMajor = Stride<_1, int64_t, int64_t>;  // w (E, k, n) as B (n, k, e): forward
using WeightsKMajor = Stride<int64_t, _1, int64_t>;  // w (E, k, n) as B (k, n, e): dx
using OutRows = Stride<int64_t, _1, _0>;             // (rows, n) output of forward/dx
using OutPerExpert = Stride<int64_t, _1, int64_t>;   // (E, k, n) output of dw

// One of CUTLASS's non-array warp-specialized kernels: the operands' strides, the output type,
// the tile, the schedule and the tile scheduler's tag (void: CUTLASS's own, for plain batched
// GEMMs).
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

// Product P over padded expert segments, its tiles from ExpertTileScheduler.
template <Product P, class StrideA, class StrideB, class StrideD, class Out, class Tile,
          class Schedule>
struct Config : KernelConfig<StrideA, StrideB, StrideD, Out, Tile, Schedule, ExpertTiles<P>> {
  static_assert(std::is_same_v<typename Config::Kernel::TileScheduler, ExpertTileScheduler<P>>);
};

// One call. Forward: out (capacity, n) = x (capacity, k) @ w_e; dx: out (capacity, k) =
// dy (capacity, n) @ w_e^T; dw: out (E, k, n) = x^T dy over each expert's rows (beta 0).
// `segments` and `counts` on the device; capacity a multiple of kSegmentRows.
template <class C, Product P>
cudaError_t run(const int64_t* segments, const int64_t* counts, int experts, const void* lhs,
                const void* rhs, void* out, int64_t capacity, int64_t k, int64_t n, void* workspace,
                size_t workspace_size, cudaStream_t stream, bool rows_fastest = true,
                const int4* block_info = nullptr) {
  using In = typename C::ElementIn;
  using O = typename C::ElementOutput;
  int M, N, K;
  typename C::Kernel::StrideA sa{};
  typename C::Kernel::StrideB sb{};
  typename C::Kernel::StrideD sd{};
  if constexpr (P == Product::kForward) {
    M = capacity, N = n, K = k;
    sa = {k, _1{}, _0{}};
    sb = {_1{}, n, k * n};
    sd = {n, _1{}, _0{}};
  } else if constexpr (P == Product::kInputGradient) {
    M = capacity, N = k, K = n;
    sa = {n, _1{}, _0{}};
    sb = {n, _1{}, k * n};
    sd = {k, _1{}, _0{}};
  } else {
    M = k, N = n, K = capacity;
    sa = {_1{}, k, _0{}};
    sb = {_1{}, n, _0{}};
    sd = {n, _1{}, k * n};
  }
  typename C::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kBatched,
      {M, N, K, experts},
      {static_cast<const In*>(lhs), sa, static_cast<const In*>(rhs), sb},
      {{1.0f, 0.0f}, static_cast<O*>(out), sd, static_cast<O*>(out), sd}};
  static const cutlass::KernelHardwareInfo hw =
      cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename C::Kernel>(0);
  args.hw_info = hw;
  args.scheduler.segments = segments;
  args.scheduler.counts = counts;
  args.scheduler.experts = experts;
  args.scheduler.rows_fastest = rows_fastest;
  args.scheduler.block_info = block_info;
  typename C::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  if (C::Gemm::get_workspace_size(args) > workspace_size) return cudaErrorInvalidValue;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess)
    return cudaErrorInvalidValue;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

}  // namespace mt::cuda::fixed_sm90
