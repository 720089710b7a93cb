// The forward product of the expert GEMMs (see grouped_gemm_sm90.cuh), in two configurations
// chosen by the inner size: the wide cooperative tile for long K (gate|up, K = dim), pingpong
// square tiles for short K (down, K = expert dim), where the epilogue is a large share of a tile.
#include <algorithm>

#include "ops/cuda/cutlass/grouped_gemm_sm90.cuh"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

namespace {
using cutlass::layout::RowMajor;
using grouped_sm90::Config;
using grouped_sm90::Product;
using LongK = Config<RowMajor, RowMajor, cutlass::bfloat16_t, grouped_sm90::WideTile,
                     grouped_sm90::NoCluster, grouped_sm90::Cooperative>;
using ShortK = Config<RowMajor, RowMajor, cutlass::bfloat16_t, grouped_sm90::SquareTile,
                      grouped_sm90::NoCluster, grouped_sm90::Pingpong>;
// The tile by K, as the workbench measured it (docs/benchmarks-history.md, grouped GEMM configuration).
constexpr int64_t kShortK = kCutlassShortK;
}  // namespace

size_t cutlass_grouped_forward_workspace(int experts) {
  return std::max(grouped_sm90::workspace_bytes<Product::kForward, LongK>(experts),
                  grouped_sm90::workspace_bytes<Product::kForward, ShortK>(experts));
}

cudaError_t cutlass_grouped_forward(ExpertSegments rows, int experts, const void* lhs,
                                    const void* rhs, void* out, int64_t m, int64_t k, int64_t n,
                                    void* workspace, size_t workspace_size, cudaStream_t stream) {
  if (k <= kShortK)
    return grouped_sm90::run<Product::kForward, ShortK>(rows, experts, lhs, rhs, out, m, k, n,
                                                        workspace, workspace_size, stream);
  return grouped_sm90::run<Product::kForward, LongK>(rows, experts, lhs, rhs, out, m, k, n,
                                                     workspace, workspace_size, stream);
}

}  // namespace mt::cuda::kernels
