// CUTLASS's Hopper blockwise-scaled FP8 grouped GEMM (TMA + FP8 wgmma, warp-specialized,
// pointer-array; the kernel family of CUTLASS's example 68) for the FP8 expert products
// (ops/fp8_gemm.h). The accumulator is promoted to f32 registers with the operands' block scales
// every 128 of the contraction. Every per-expert argument is built on the device from the experts'
// row offsets and segments: no count reaches the host, and a captured graph replays it.
//
// The grouped kernel derives each expert's scale layout from its problem shape (packed for that
// shape), so the scales are laid out as core/quant.h's FP8 formats store them, which need no row
// count: a's 1 x 128 scales (rows, Q / 128) are K-major; the weight's 128 x 128 scales, in the
// logical orientation (K / 128, N / 128), are MN-major for the forward's b = w^T and K-major for
// the input gradient's b = w; the weight gradient's operands' scales (M / 128, K) and (M / 128, N)
// are MN-major.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "ops/cuda/cutlass/group_args.cuh"
#include "ops/cuda/fp8_gemm.h"

namespace mt::cuda::fp8_sm90 {

using namespace cute;

enum class Product {
  kRows,            // out_e (rows, P) = a_e (rows, Q) b_e^T, b_e (P, Q): forward, input gradient
  kWeightGradient,  // dw_e (K, N) (+)= x_e^T dy_e from x^T (K, M) and dy^T (N, M), f32
};

struct Cooperative {  // both consumer warpgroups on one 128 x 128 tile (64 rows each)
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using Tile = cute::Shape<_128, _128, _128>;
};
struct Pingpong {  // each consumer warpgroup its own 64 x 128 tile, one's epilogue under the
                   // other's
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using Tile = cute::Shape<_64, _128, _128>;
};

using NoCluster = cute::Shape<_1, _1, _1>;

template <Product P, class Schedule, GMMA::Major SfaMajor, GMMA::Major SfbMajor,
          class Cluster = NoCluster>
struct Config {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using ElementIn = cutlass::float_e4m3_t;
  using ElementOut = std::conditional_t<P == Product::kRows, cutlass::bfloat16_t, float>;
  using LayoutA = cutlass::layout::RowMajor;     // K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // K-major (FP8 wgmma reads only K-major)
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignIn = 16;
  static constexpr int kAlignOut = 16 / sizeof(ElementOut);
  using TileShape = typename Schedule::Tile;
  using ClusterShape = Cluster;
  static constexpr int kSfbN = P == Product::kRows ? 128 : 1;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kSfbN, 128, SfaMajor, SfbMajor>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementOut, LayoutC*,
      kAlignOut, ElementOut, LayoutC*, kAlignOut, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignIn, ElementIn, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

// Device-side arguments of one call, in one allocation carved by make_arguments.
template <class C>
struct GroupArrays {
  typename C::Shape3* shapes;
  const typename C::ElementIn** a;
  const typename C::ElementIn** b;
  const float** sfa;
  const float** sfb;
  const typename C::ElementOut** c;
  typename C::ElementOut** d;
  typename C::StrideA* stride_a;
  typename C::StrideB* stride_b;
  typename C::StrideC* stride_c;
  typename C::LayoutSFA* layout_sfa;
  typename C::LayoutSFB* layout_sfb;
};

// The operands of one call (ops/cuda/fp8_gemm.h's Fp8Operands) and the dense sizes: kRows:
// m rows of q, b (E, p, q); kWeightGradient: x^T (k, m), dy^T (n, m), dw (E, k, n).
struct Call {
  kernels::Fp8Operands ops;
  int64_t m, k, n;
};

template <Product P, class C>
__global__ void fill_group_arrays(GroupArrays<C> g, kernels::ExpertSegments layout, int experts,
                                  Call call, typename C::StrideA sa, typename C::StrideB sb,
                                  typename C::StrideC sc) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  using In = typename C::ElementIn;
  const int64_t row0 = layout.segments[e], rows = layout.offsets[e + 1] - layout.offsets[e];
  const In* a = static_cast<const In*>(call.ops.a);
  const In* b = static_cast<const In*>(call.ops.b);
  auto* out = static_cast<typename C::ElementOut*>(call.ops.out);
  typename C::Shape3 shape;
  if constexpr (P == Product::kRows) {  // a (m, q), b (E, p, q), out (m, p); p = call.n, q = call.k
    const int64_t p = call.n, q = call.k;
    shape = typename C::Shape3(static_cast<int>(rows), static_cast<int>(p), static_cast<int>(q));
    g.a[e] = a + row0 * q;
    g.sfa[e] = call.ops.sfa + row0 * (q / 128);
    g.b[e] = b + e * p * q;
    g.sfb[e] = call.ops.sfb + e * (p / 128) * (q / 128);
    g.d[e] = out + row0 * p;
  } else {  // x^T (k, m), dy^T (n, m): columns from row0, the expert's rows rounded up to 128
    const int64_t k = call.k, n = call.n, padded = (rows + 127) / 128 * 128;
    shape = typename C::Shape3(rows == 0 ? 0 : static_cast<int>(k), static_cast<int>(n),
                               static_cast<int>(padded));
    g.a[e] = a + row0;
    g.sfa[e] = call.ops.sfa + row0 / 128 * k;
    g.b[e] = b + row0;
    g.sfb[e] = call.ops.sfb + row0 / 128 * n;
    g.d[e] = out + e * k * n;
  }
  g.shapes[e] = shape;
  g.c[e] = g.d[e];
  g.stride_a[e] = sa;
  g.stride_b[e] = sb;
  g.stride_c[e] = sc;
  g.layout_sfa[e] = C::ScaleConfig::tile_atom_to_shape_SFA(
      make_shape(get<0>(shape), get<1>(shape), get<2>(shape), 1));
  g.layout_sfb[e] = C::ScaleConfig::tile_atom_to_shape_SFB(
      make_shape(get<0>(shape), get<1>(shape), get<2>(shape), 1));
}

// Points g's arrays into one allocation at base (null: none) and returns its bytes.
template <class C>
size_t carve(GroupArrays<C>& g, char* base, int experts) {
  cutlass_groups::Carver carve{base};
  carve.take(g.shapes, experts);
  carve.take(g.a, experts);
  carve.take(g.b, experts);
  carve.take(g.sfa, experts);
  carve.take(g.sfb, experts);
  carve.take(g.c, experts);
  carve.take(g.d, experts);
  carve.take(g.stride_a, experts);
  carve.take(g.stride_b, experts);
  carve.take(g.stride_c, experts);
  carve.take(g.layout_sfa, experts);
  carve.take(g.layout_sfb, experts);
  return carve.used;
}

template <class C>
size_t array_bytes(int experts) {
  GroupArrays<C> g{};
  return carve(g, nullptr, experts);
}

template <class C>
typename C::Gemm::Arguments make_arguments(char* base, int experts, GroupArrays<C>& g,
                                           bool accumulate) {
  carve(g, base, experts);
  const cutlass::KernelHardwareInfo& hw = cutlass_groups::hardware_info<typename C::Kernel>();
  typename C::Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion{};
  cutlass_groups::plain_epilogue(fusion, accumulate);
  args = typename C::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {experts, g.shapes, nullptr},  // the shapes live on the device only
      {g.a, g.stride_a, g.b, g.stride_b, g.sfa, g.layout_sfa, g.sfb, g.layout_sfb},
      {fusion, g.c, g.stride_c, g.d, g.stride_c},
      hw};
  return args;
}

template <class C>
size_t workspace_bytes(int experts) {
  GroupArrays<C> g{};
  return array_bytes<C>(experts) +
         C::Gemm::get_workspace_size(make_arguments<C>(nullptr, experts, g, false));
}

template <Product P, class C>
cudaError_t run(kernels::ExpertSegments layout, int experts, const Call& call, void* workspace,
                size_t workspace_size, bool accumulate, cudaStream_t stream) {
  if (workspace_size < workspace_bytes<C>(experts)) return cudaErrorInvalidValue;
  // The strides do not depend on the experts' row counts: computed once here.
  int M = 0, N = 0, K = 0, lda = 0, ldb = 0;
  if constexpr (P == Product::kRows) {
    M = static_cast<int>(call.m), N = static_cast<int>(call.n), K = static_cast<int>(call.k);
    lda = ldb = K;
  } else {
    M = static_cast<int>(call.k), N = static_cast<int>(call.n), K = static_cast<int>(call.m);
    lda = ldb = static_cast<int>(call.m);
  }
  const auto sa = cutlass::make_cute_packed_stride(typename C::StrideA{}, {M, lda, 1});
  const auto sb = cutlass::make_cute_packed_stride(typename C::StrideB{}, {N, ldb, 1});
  const auto sc = cutlass::make_cute_packed_stride(typename C::StrideC{}, {M, N, 1});
  (void)K;
  GroupArrays<C> g{};
  char* base = static_cast<char*>(workspace);
  const auto args = make_arguments<C>(base, experts, g, accumulate);
  fill_group_arrays<P, C>
      <<<(experts + 127) / 128, 128, 0, stream>>>(g, layout, experts, call, sa, sb, sc);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return cutlass_groups::launch<typename C::Gemm>(args, base + array_bytes<C>(experts), stream);
}

}  // namespace mt::cuda::fp8_sm90
