// The grouped GEMM kernels behind ops/grouped_gemm.h: version 1 (grouped_gemm.cu) and CUTLASS's
// Hopper kernels (cutlass/grouped_gemm_sm90*.cu, cutlass/grouped_gemm_fixed_sm90.cu).
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/cuda/expert_tiles.h"  // kFixedRowTile

namespace mt::cuda::kernels {

// Where the experts' rows are, on the device (ops::ExpertRows): expert e has
// offsets[e + 1] - offsets[e] rows from row segments[e] (segments == offsets when dense).
struct ExpertSegments {
  const int64_t* offsets;
  const int64_t* segments;
};

// Grouped GEMM over experts, bf16 operands.
// out (m, n) rows of expert e = a rows (k wide) @ w[e]; w[e] is (k, n) row-major, or with
// b_transposed (n, k) row-major used as its transpose. out is f32 or bf16 (out_f32).
cudaError_t grouped_gemm_rows(const void* a, const void* w, ExpertSegments rows, int experts,
                              int64_t m, int64_t k, int64_t n, bool b_transposed, void* out,
                              bool out_f32, cudaStream_t stream);
// dw[e] (k, n) (+)= x_e^T dy_e over the expert's rows (accumulate: add to dw, else overwrite);
// experts without rows are left alone (see zero_empty_groups).
cudaError_t grouped_gemm_weight(const void* x, const void* dy, ExpertSegments rows, int experts,
                                int64_t k, int64_t n, void* dw, bool out_f32, bool accumulate,
                                cudaStream_t stream);
// Zeroes out[e] (group_elems elements, f32 or bf16) of every group e without rows: what an
// overwriting weight gradient leaves unwritten.
cudaError_t zero_empty_groups(const int64_t* offsets, int experts, void* out, int64_t group_elems,
                              bool out_f32, cudaStream_t stream);

// The same three products through CUTLASS's Hopper grouped kernels (TMA + wgmma), all group
// arguments built on the device from the offsets. lhs/rhs/out as the products' comments in
// cutlass/grouped_gemm_sm90.cuh; out is bf16 (forward, input gradient) or f32 (weight gradient,
// accumulated or overwritten). workspace: device memory of at least *_workspace(experts) bytes.
// The forward's configuration for inner sizes up to this (pingpong square tiles; above it, the
// wide cooperative tile).
inline constexpr int64_t kCutlassShortK = 1024;
// The weight gradient's configuration for gradients of up to this many rows (k; pingpong square
// tiles; above it, the wide cooperative tile).
inline constexpr int64_t kCutlassFewWeightRows = 1024;
#if MOETRAIN_HAS_CUTLASS
size_t cutlass_grouped_forward_workspace(int experts);
size_t cutlass_grouped_input_gradient_workspace(int experts);
size_t cutlass_grouped_weight_gradient_workspace(int experts);
cudaError_t cutlass_grouped_forward(ExpertSegments rows, int experts, const void* lhs,
                                    const void* rhs, void* out, int64_t m, int64_t k, int64_t n,
                                    void* workspace, size_t workspace_size, cudaStream_t stream);
cudaError_t cutlass_grouped_input_gradient(ExpertSegments rows, int experts, const void* lhs,
                                           const void* rhs, void* out, int64_t m, int64_t k,
                                           int64_t n, void* workspace, size_t workspace_size,
                                           cudaStream_t stream);
// The forward (k <= kCutlassShortK) and input-gradient products over a layout whose segments
// start on multiples of 128 rows (ops::ExpertRows, align 128): capacity rows, padding included;
// fixed TMA descriptors, every tile's expert from a table built on the device from the segments.
// The padding's output rows are written and meaningless.
size_t cutlass_fixed_forward_workspace(int64_t capacity, int64_t n);
size_t cutlass_fixed_input_gradient_workspace(int64_t capacity, int64_t k);
cudaError_t cutlass_fixed_forward(const int64_t* segments, int experts, const void* x,
                                  const void* w, void* out, int64_t capacity, int64_t k, int64_t n,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream);
cudaError_t cutlass_fixed_input_gradient(const int64_t* segments, int experts, const void* dy,
                                         const void* w, void* dx, int64_t capacity, int64_t k,
                                         int64_t n, void* workspace, size_t workspace_bytes,
                                         cudaStream_t stream);

cudaError_t cutlass_grouped_weight_gradient(ExpertSegments rows, int experts, const void* lhs,
                                            const void* rhs, void* out, int64_t m, int64_t k,
                                            int64_t n, void* workspace, size_t workspace_size,
                                            bool accumulate, cudaStream_t stream);
#endif

}  // namespace mt::cuda::kernels
