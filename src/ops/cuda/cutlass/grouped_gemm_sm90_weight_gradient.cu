// The weight gradient product of the expert GEMMs (see grouped_gemm_sm90.cuh).
#include "ops/cuda/cutlass/grouped_gemm_sm90.cuh"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

namespace {
using C =
    grouped_sm90::Config<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float,
                         grouped_sm90::SquareTile, grouped_sm90::NoCluster, grouped_sm90::Pingpong>;
using P = std::integral_constant<grouped_sm90::Product, grouped_sm90::Product::kWeightGradient>;
}  // namespace

size_t cutlass_grouped_weight_gradient_workspace(int experts) {
  return grouped_sm90::workspace_bytes<P::value, C>(experts);
}

cudaError_t cutlass_grouped_weight_gradient(ExpertSegments rows, int experts, const void* lhs,
                                            const void* rhs, void* out, int64_t m, int64_t k,
                                            int64_t n, void* workspace, size_t workspace_size,
                                            bool accumulate, cudaStream_t stream) {
  return grouped_sm90::run<P::value, C>(rows, experts, lhs, rhs, out, m, k, n, workspace,
                                        workspace_size, stream, accumulate);
}

}  // namespace mt::cuda::kernels
