// The FP8 forward and input-gradient products over a padded row layout as they ship: our kernel
// (fp8_gemm_sm90_fixed.cuh) with tiles 128 or 160 wide.
#include "ops/cuda/cutlass/fp8_gemm_sm90_fixed.cuh"

namespace mt::cuda::kernels {

int fp8_fixed_tile_n(int64_t p) {
  // 160-wide tiles run faster than 128-wide ones but compute up to a tile of columns past P:
  // they pay where that waste is under 2% (P 2048: 2080; bench/fp8_fixed_variants.cu).
  const int64_t padded = (p + 159) / 160 * 160;
  return padded * 50 <= p * 51 ? 160 : 128;
}

size_t fp8_gemm_rows_fixed_workspace(int64_t capacity, int64_t p) {
  return fp8_fixed_sm90::workspace_bytes<128>(capacity, p);  // 128 has the more tiles
}

cudaError_t fp8_gemm_rows_fixed(const int64_t* segments, int experts, const Fp8Operands& ops,
                                Fp8WeightScales b_scales, int64_t capacity, int64_t p, int64_t q,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (fp8_fixed_tile_n(p) == 160)
    return fp8_fixed_sm90::run<160>(segments, experts, ops, b_scales, capacity, p, q, workspace,
                                    workspace_bytes, stream);
  return fp8_fixed_sm90::run<128>(segments, experts, ops, b_scales, capacity, p, q, workspace,
                                  workspace_bytes, stream);
}

}  // namespace mt::cuda::kernels
