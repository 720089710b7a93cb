// The FP8 forward and input-gradient products over a padded row layout as they ship: our kernel
// (fp8_gemm_sm90_fixed.cuh) with tiles of two row tiles by 128 columns, faster than one row tile
// by 128 or 160 columns on every product of the MoE layer (bench/fp8_fixed_variants.cu).
#include "ops/cuda/cutlass/fp8_gemm_sm90_fixed.cuh"

namespace mt::cuda::kernels {

size_t fp8_gemm_rows_fixed_workspace(int64_t capacity, int64_t p, int64_t q) {
  return fp8_fixed_sm90::workspace_bytes<128>(capacity, p, q);
}

cudaError_t fp8_gemm_rows_fixed(const int64_t* segments, int experts, const Fp8Operands& ops,
                                Fp8WeightScales b_scales, int64_t capacity, int64_t p, int64_t q,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return fp8_fixed_sm90::run<128, fp8_fixed_sm90::Probe::kNone, 1, 2>(
      segments, experts, ops, b_scales, capacity, p, q, workspace, workspace_bytes, stream);
}

}  // namespace mt::cuda::kernels
