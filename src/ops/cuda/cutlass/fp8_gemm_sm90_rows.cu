// The FP8 forward and input-gradient products (see fp8_gemm_sm90.cuh): four instantiations, the
// two schedules by the two orientations of the weight's scales.
#include <algorithm>

#include "ops/cuda/cutlass/fp8_gemm_sm90.cuh"

namespace mt::cuda::kernels {

namespace {
using fp8_sm90::Config;
using fp8_sm90::Product;
constexpr auto kK = cute::GMMA::Major::K;
constexpr auto kMn = cute::GMMA::Major::MN;
template <class S, cute::GMMA::Major SfbMajor>
using Rows = Config<Product::kRows, S, kK, SfbMajor>;

template <class S, cute::GMMA::Major SfbMajor>
cudaError_t run_rows(ExpertSegments rows, int experts, const fp8_sm90::Call& call, void* ws,
                     size_t ws_size, cudaStream_t stream) {
  return fp8_sm90::run<Product::kRows, Rows<S, SfbMajor>>(rows, experts, call, ws, ws_size, false,
                                                          stream);
}
}  // namespace

size_t fp8_gemm_rows_workspace(int experts) {
  return std::max({fp8_sm90::workspace_bytes<Rows<fp8_sm90::Cooperative, kK>>(experts),
                   fp8_sm90::workspace_bytes<Rows<fp8_sm90::Cooperative, kMn>>(experts),
                   fp8_sm90::workspace_bytes<Rows<fp8_sm90::Pingpong, kK>>(experts),
                   fp8_sm90::workspace_bytes<Rows<fp8_sm90::Pingpong, kMn>>(experts)});
}

cudaError_t fp8_gemm_rows(ExpertSegments rows, int experts, const Fp8Operands& ops,
                          Fp8WeightScales b_scales, int64_t m, int64_t p, int64_t q,
                          Fp8Schedule schedule, void* workspace, size_t workspace_size,
                          cudaStream_t stream) {
  const fp8_sm90::Call call{ops, m, q, p};
  const bool mn = b_scales == Fp8WeightScales::kMnMajor;
  if (schedule == Fp8Schedule::kCooperative)
    return mn ? run_rows<fp8_sm90::Cooperative, kMn>(rows, experts, call, workspace, workspace_size,
                                                     stream)
              : run_rows<fp8_sm90::Cooperative, kK>(rows, experts, call, workspace, workspace_size,
                                                    stream);
  return mn ? run_rows<fp8_sm90::Pingpong, kMn>(rows, experts, call, workspace, workspace_size,
                                                stream)
            : run_rows<fp8_sm90::Pingpong, kK>(rows, experts, call, workspace, workspace_size,
                                               stream);
}

}  // namespace mt::cuda::kernels
