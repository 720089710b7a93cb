// The FP8 weight-gradient product (see fp8_gemm_sm90.cuh), in both schedules.
#include <algorithm>

#include "ops/cuda/cutlass/fp8_gemm_sm90.cuh"

namespace mt::cuda::kernels {

namespace {
using fp8_sm90::Config;
using fp8_sm90::Product;
constexpr auto kMn = cute::GMMA::Major::MN;
template <class S>
using Weight = Config<Product::kWeightGradient, S, kMn, kMn>;
}  // namespace

size_t fp8_gemm_weight_workspace(int experts) {
  return std::max(fp8_sm90::workspace_bytes<Weight<fp8_sm90::Cooperative>>(experts),
                  fp8_sm90::workspace_bytes<Weight<fp8_sm90::Pingpong>>(experts));
}

cudaError_t fp8_gemm_weight(ExpertSegments rows, int experts, const Fp8Operands& ops, int64_t m,
                            int64_t k, int64_t n, bool accumulate, Fp8Schedule schedule,
                            void* workspace, size_t workspace_size, cudaStream_t stream) {
  const fp8_sm90::Call call{ops, m, k, n};
  if (schedule == Fp8Schedule::kCooperative)
    return fp8_sm90::run<Product::kWeightGradient, Weight<fp8_sm90::Cooperative>>(
        rows, experts, call, workspace, workspace_size, accumulate, stream);
  return fp8_sm90::run<Product::kWeightGradient, Weight<fp8_sm90::Pingpong>>(
      rows, experts, call, workspace, workspace_size, accumulate, stream);
}

}  // namespace mt::cuda::kernels
