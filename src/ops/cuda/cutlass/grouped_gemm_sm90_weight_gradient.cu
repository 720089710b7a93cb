// The weight gradient product of the expert GEMMs (see grouped_gemm_sm90.cuh), in two
// configurations chosen by the gradient's rows (k): pingpong square tiles where they are few
// (down, k = expert dim), the wide cooperative tile walked along N where they are many (gate|up,
// k = dim). There the square tiles in flight span more of each expert's operands than L2 keeps:
// they read them from memory about three times over, the wide tile about once
// (docs/benchmarks-history.md, "The weight gradient's tiles and L2").
#include <algorithm>

#include "ops/cuda/cutlass/grouped_gemm_sm90.cuh"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

namespace {
using cutlass::layout::ColumnMajor;
using cutlass::layout::RowMajor;
using grouped_sm90::Config;
using grouped_sm90::Product;
using grouped_sm90::TileOrder;
using FewRows = Config<ColumnMajor, RowMajor, float, grouped_sm90::SquareTile,
                       grouped_sm90::NoCluster, grouped_sm90::Pingpong>;
using ManyRows = Config<ColumnMajor, RowMajor, float, grouped_sm90::WideTile,
                        grouped_sm90::NoCluster, grouped_sm90::Cooperative>;
constexpr TileOrder kManyRowsOrder{TileOrder::Raster::kAlongN, 1};
}  // namespace

size_t cutlass_grouped_weight_gradient_workspace(int experts) {
  return std::max(grouped_sm90::workspace_bytes<Product::kWeightGradient, FewRows>(experts),
                  grouped_sm90::workspace_bytes<Product::kWeightGradient, ManyRows>(experts));
}

cudaError_t cutlass_grouped_weight_gradient(ExpertSegments rows, int experts, const void* lhs,
                                            const void* rhs, void* out, int64_t m, int64_t k,
                                            int64_t n, void* workspace, size_t workspace_size,
                                            bool accumulate, cudaStream_t stream) {
  if (k <= kCutlassFewWeightRows)
    return grouped_sm90::run<Product::kWeightGradient, FewRows>(
        rows, experts, lhs, rhs, out, m, k, n, workspace, workspace_size, stream, accumulate);
  return grouped_sm90::run<Product::kWeightGradient, ManyRows>(rows, experts, lhs, rhs, out, m, k,
                                                               n, workspace, workspace_size, stream,
                                                               accumulate, kManyRowsOrder);
}

}  // namespace mt::cuda::kernels
