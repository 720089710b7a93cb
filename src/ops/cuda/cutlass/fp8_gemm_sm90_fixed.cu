// The FP8 forward and input-gradient products over a padded row layout as they ship: our kernel
// (fp8_gemm_sm90_fixed.cuh) with tiles of two row tiles by 128 columns, faster than one row tile
// by 128 or 160 columns on every product of the MoE layer (bench/fp8_fixed_variants.cu).
#include "ops/cuda/cutlass/fp8_gemm_sm90_fixed.cuh"

namespace mt::cuda::kernels {

namespace {
// The dense product's one segment, [0, rows), written where the kernel's table reads it.
__global__ void one_segment_kernel(int64_t* segments, int64_t rows) {
  segments[0] = 0;
  segments[1] = rows;
}
constexpr size_t kSegmentBytes = 256;  // the segment, then the fixed kernel's workspace
// A dense product's runs (two row tiles) in bands of 16, 4096 rows: the band's E4M3 rows (8 MiB
// at a contraction of 2048) stay in L2 while it walks the weight's columns, so a weight larger
// than L2 (the LM head's 311 MB) is read from memory once a band, not once a run.
constexpr int kDenseBand = 16;
}  // namespace

size_t fp8_gemm_rows_fixed_workspace(int64_t capacity, int64_t p, int64_t q) {
  return fp8_fixed_sm90::workspace_bytes<128>(capacity, p, q);
}

size_t fp8_gemm_dense_workspace(int64_t m, int64_t p, int64_t q) {
  return kSegmentBytes + fp8_gemm_rows_fixed_workspace(m, p, q);
}

cudaError_t fp8_gemm_dense(const Fp8Operands& ops, Fp8WeightScales b_scales, int64_t m, int64_t p,
                           int64_t q, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (workspace_bytes < fp8_gemm_dense_workspace(m, p, q)) return cudaErrorInvalidValue;
  auto* segments = static_cast<int64_t*>(workspace);
  one_segment_kernel<<<1, 1, 0, stream>>>(segments, m);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return fp8_fixed_sm90::run<128, fp8_fixed_sm90::Probe::kNone, 1, 2>(
      segments, 1, ops, b_scales, m, p, q, static_cast<uint8_t*>(workspace) + kSegmentBytes,
      workspace_bytes - kSegmentBytes, stream, kDenseBand);
}

cudaError_t fp8_gemm_rows_fixed(const int64_t* segments, int experts, const Fp8Operands& ops,
                                Fp8WeightScales b_scales, int64_t capacity, int64_t p, int64_t q,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return fp8_fixed_sm90::run<128, fp8_fixed_sm90::Probe::kNone, 1, 2>(
      segments, experts, ops, b_scales, capacity, p, q, workspace, workspace_bytes, stream);
}

}  // namespace mt::cuda::kernels
