// CUTLASS Hopper grouped GEMM (TMA + wgmma, warp-specialized, pointer-array) for the
// expert GEMMs, with every per-group argument built on the device from the experts' row offsets
// and segments (ops::ExpertRows): no count reaches the host. One template, instantiated in three
// .cu files (forward, dx, dw) so that they compile in parallel.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "ops/cuda/cutlass/group_args.cuh"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::grouped_sm90 {

using namespace cute;

// Which product of the experts' rows: the three GEMMs of an expert layer.
enum class Product {
  kForward,         // out_e (rows, n) = x_e (rows, k) @ w_e (k, n)
  kInputGradient,   // dx_e (rows, k) = dy_e (rows, n) @ w_e^T
  kWeightGradient,  // dw_e (k, n) += x_e^T (k, rows) @ dy_e (rows, n), fp32 accumulation buffer
};

// The two schedules of CUTLASS's Hopper kernels. Cooperative: both consumer warpgroups share one
// tile (the wide 128x256 one). Pingpong: each consumer warpgroup owns a tile, so one's epilogue
// overlaps the other's mainloop; it wins where the epilogue is a large share of a tile's time
// (short K: the down projection's 768, the weight gradient's f32 output).
struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
// The shipped tiles, chosen per product on the workbench (bench/grouped_gemm_variants.cu, both
// expert shapes, balanced and ragged rows; figures in docs/benchmarks-history.md). One CTA per
// cluster: 2x1 clusters (weight tiles multicast) measured slower on every product.
using WideTile = Shape<_128, _256, _64>;
using SquareTile = Shape<_128, _128, _64>;
using NoCluster = Shape<_1, _1, _1>;

// The order in which the persistent scheduler walks each group's output tiles: consecutive tiles
// down M (CUTLASS's default for groups) or along N, in bands of `swizzle` tiles across.
struct TileOrder {
  enum class Raster { kAlongM, kAlongN };
  Raster raster = Raster::kAlongM;
  int swizzle = 1;  // 1, 2, 4 or 8
};

template <class LayoutA, class LayoutB, class ElementOut, class Tile, class Cluster, class Schedule>
struct Config {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using ElementIn = cutlass::bfloat16_t;
  using ElementOutput = ElementOut;
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignIn = 8;  // 16 bytes of bf16
  static constexpr int kAlignOut = 16 / sizeof(ElementOut);
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using KernelSchedule = typename Schedule::Kernel;
  using EpilogueSchedule = typename Schedule::Epilogue;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementOut, LayoutC*,
      kAlignOut, ElementOut, LayoutC*, kAlignOut, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn,
      LayoutB*, kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// Device-side arguments of one call, in one allocation carved by `Arguments`.
template <class C>
struct GroupArrays {
  typename C::Shape3* shapes;
  const typename C::ElementIn** a;
  const typename C::ElementIn** b;
  const typename C::ElementOutput** c;
  typename C::ElementOutput** d;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideC* stride_c;
  typename C::StrideD* stride_d;
};

template <Product P, class C>
__global__ void fill_group_arrays(GroupArrays<C> g, kernels::ExpertSegments layout, int experts,
                                  const void* lhs, const void* rhs, void* out, int64_t k, int64_t n,
                                  typename C::StrideA sa, typename C::StrideB sb,
                                  typename C::StrideC sc) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  using In = typename C::ElementIn;
  const int64_t row0 = layout.segments[e], rows = layout.offsets[e + 1] - layout.offsets[e];
  const In* l = static_cast<const In*>(lhs);
  const In* r = static_cast<const In*>(rhs);
  auto* o = static_cast<typename C::ElementOutput*>(out);
  if constexpr (P == Product::kForward) {  // lhs = x (m, k), rhs = w (E, k, n), out (m, n)
    g.shapes[e] =
        typename C::Shape3(static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k));
    g.a[e] = l + row0 * k;
    g.b[e] = r + e * k * n;
    g.d[e] = o + row0 * n;
  } else if constexpr (P == Product::kInputGradient) {  // lhs = dy (m, n), rhs = w, out dx (m, k)
    g.shapes[e] =
        typename C::Shape3(static_cast<int>(rows), static_cast<int>(k), static_cast<int>(n));
    g.a[e] = l + row0 * n;
    g.b[e] = r + e * k * n;
    g.d[e] = o + row0 * k;
  } else {  // lhs = x (m, k), rhs = dy (m, n), out dw (E, k, n) accumulated; no rows: no tiles
    g.shapes[e] = typename C::Shape3(rows == 0 ? 0 : static_cast<int>(k), static_cast<int>(n),
                                     static_cast<int>(rows));
    g.a[e] = l + row0 * k;
    g.b[e] = r + row0 * n;
    g.d[e] = o + e * k * n;
  }
  g.c[e] = g.d[e];
  g.stride_a[e] = sa;
  g.stride_b[e] = sb;
  g.stride_c[e] = sc;
  g.stride_d[e] = sc;
}

// Points g's arrays into one allocation at base (null: none) and returns its bytes.
template <class C>
size_t carve(GroupArrays<C>& g, char* base, int experts) {
  cutlass_groups::Carver carve{base};
  carve.take(g.shapes, experts);
  carve.take(g.a, experts);
  carve.take(g.b, experts);
  carve.take(g.c, experts);
  carve.take(g.d, experts);
  carve.take(g.stride_a, experts);
  carve.take(g.stride_b, experts);
  carve.take(g.stride_c, experts);
  carve.take(g.stride_d, experts);
  return carve.used;
}

// Device bytes for the group arrays of `experts` groups.
template <class C>
size_t array_bytes(int experts) {
  GroupArrays<C> g{};
  return carve(g, nullptr, experts);
}

template <Product P, class C>
typename C::Gemm::Arguments make_arguments(char* base, int experts, GroupArrays<C>& g,
                                           bool accumulate, TileOrder order = {}) {
  carve(g, base, experts);
  const cutlass::KernelHardwareInfo& hw = cutlass_groups::hardware_info<typename C::Kernel>();
  typename C::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion{};
  cutlass_groups::plain_epilogue(fusion, accumulate);
  args = typename C::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {experts, g.shapes, nullptr},  // no host copy of the shapes: they live on the device
      {g.a, g.stride_a, g.b, g.stride_b},
      {fusion, g.c, g.stride_c, g.d, g.stride_d},
      hw};
  using RasterOptions = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order =
      order.raster == TileOrder::Raster::kAlongN ? RasterOptions::AlongN : RasterOptions::AlongM;
  args.scheduler.max_swizzle_size = order.swizzle;
  return args;
}

// Workspace bytes run() needs for `experts` groups: the group arrays and CUTLASS's own.
template <Product P, class C>
size_t workspace_bytes(int experts) {
  GroupArrays<C> g{};
  return array_bytes<C>(experts) +
         C::Gemm::get_workspace_size(make_arguments<P, C>(nullptr, experts, g, false));
}

// Runs product P over `experts` groups; m is the total row count, k and n the dense sizes.
template <Product P, class C>
cudaError_t run(kernels::ExpertSegments layout, int experts, const void* lhs, const void* rhs,
                void* out, int64_t m, int64_t k, int64_t n, void* workspace, size_t workspace_size,
                cudaStream_t stream, bool accumulate = false, TileOrder order = {}) {
  if (workspace_size < workspace_bytes<P, C>(experts)) return cudaErrorInvalidValue;
  // The strides do not depend on the ragged dimension: computed once here, written per group.
  int M = 0, N = 0, K = 0;
  if constexpr (P == Product::kForward) {
    M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  } else if constexpr (P == Product::kInputGradient) {
    M = static_cast<int>(m), N = static_cast<int>(k), K = static_cast<int>(n);
  } else {
    M = static_cast<int>(k), N = static_cast<int>(n), K = static_cast<int>(m);
  }
  const auto sa = cutlass::make_cute_packed_stride(typename C::StrideA{}, {M, K, 1});
  const auto sb = cutlass::make_cute_packed_stride(typename C::StrideB{}, {N, K, 1});
  const auto sc = cutlass::make_cute_packed_stride(typename C::StrideC{}, {M, N, 1});
  GroupArrays<C> g{};
  char* base = static_cast<char*>(workspace);
  const auto args = make_arguments<P, C>(base, experts, g, accumulate, order);
  fill_group_arrays<P, C><<<(experts + 127) / 128, 128, 0, stream>>>(g, layout, experts, lhs, rhs,
                                                                     out, k, n, sa, sb, sc);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return cutlass_groups::launch<typename C::Gemm>(args, base + array_bytes<C>(experts), stream);
}

}  // namespace mt::cuda::grouped_sm90
