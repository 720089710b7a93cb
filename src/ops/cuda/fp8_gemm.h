// The FP8 blockwise grouped GEMMs behind ops/fp8_gemm.h: our warp-specialized kernel for the
// forward and input-gradient products over a padded layout (cutlass/fp8_gemm_sm90_fixed.cuh), and
// CUTLASS's Hopper blockwise-scaled pointer-array kernels for any layout and the weight gradient
// (cutlass/fp8_gemm_sm90.cuh). Raw pointers, sizes and a stream; each call returns its launch's
// cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

// E4M3 operands with their f32 scales (core/quant.h's layouts) and the output.
struct Fp8Operands {
  const void* a;
  const float* sfa;
  const void* b;
  const float* sfb;
  void* out;
};

// Which CUTLASS schedule runs a product: cooperative 128 x 128 tiles, or pingpong 64 x 128 tiles
// (one warpgroup's epilogue under the other's mainloop).
enum class Fp8Schedule : uint8_t { kCooperative, kPingpong };
// How b's 128 x 128 scales are read: the forward's b = w^T (w's dim1 copy) reads the weight's
// (K / 128, N / 128) scales along its N (MN-major), the input gradient's b = w (its dim0 copy)
// along its contraction N (K-major).
enum class Fp8WeightScales : uint8_t { kMnMajor, kKMajor };

#if MOETRAIN_HAS_CUTLASS
// out (m, p) bf16 = a_e (m, q) b[e]^T (b (E, p, q)) over each expert's rows; p, q multiples of
// 128. workspace: at least fp8_gemm_rows_workspace(experts) bytes of device memory.
size_t fp8_gemm_rows_workspace(int experts);
cudaError_t fp8_gemm_rows(ExpertSegments rows, int experts, const Fp8Operands& ops,
                          Fp8WeightScales b_scales, int64_t m, int64_t p, int64_t q,
                          Fp8Schedule schedule, void* workspace, size_t workspace_size,
                          cudaStream_t stream);
// The same product over a layout whose segments start on multiples of 128 rows (ops::ExpertRows,
// align 128): capacity rows, padding included (its output rows are written and meaningless); one
// TMA descriptor per operand, every tile's expert from a table built on the device from the
// segments, each CTA's tile up to two row tiles of one expert by 128 columns. workspace: at least
// fp8_gemm_rows_fixed_workspace(capacity, p, q) bytes. Faster than CUTLASS's grouped kernel on each
// of the MoE layer's products (docs/benchmarks.md); the front door runs it on padded layouts.
size_t fp8_gemm_rows_fixed_workspace(int64_t capacity, int64_t p, int64_t q);
cudaError_t fp8_gemm_rows_fixed(const int64_t* segments, int experts, const Fp8Operands& ops,
                                Fp8WeightScales b_scales, int64_t capacity, int64_t p, int64_t q,
                                void* workspace, size_t workspace_size, cudaStream_t stream);
// One matrix's product (model.dense_recipe): out (m, p) bf16 = a (m, q) b^T, b (p, q), any m;
// the fixed kernel over one segment of m rows, the segment written on the device (nothing from
// the host: graph-capturable). workspace: at least fp8_gemm_dense_workspace(m, p, q) bytes.
size_t fp8_gemm_dense_workspace(int64_t m, int64_t p, int64_t q);
cudaError_t fp8_gemm_dense(const Fp8Operands& ops, Fp8WeightScales b_scales, int64_t m, int64_t p,
                           int64_t q, void* workspace, size_t workspace_size, cudaStream_t stream);
// dw (E, k, n) f32 (+)= x_e^T dy_e from x^T (k, m) and dy^T (n, m) with scales (m / 128, k) and
// (m / 128, n), segments on 128-row boundaries (the padding rows zeros); experts with no rows
// are left alone (zero_empty_groups).
size_t fp8_gemm_weight_workspace(int experts);
cudaError_t fp8_gemm_weight(ExpertSegments rows, int experts, const Fp8Operands& ops, int64_t m,
                            int64_t k, int64_t n, bool accumulate, Fp8Schedule schedule,
                            void* workspace, size_t workspace_size, cudaStream_t stream);
#endif

}  // namespace mt::cuda::kernels
