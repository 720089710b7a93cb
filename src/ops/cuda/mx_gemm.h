// The MX expert product's kernel (cutlass/mx_gemm_sm90.cu) behind ops/mx_gemm.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mt::cuda::kernels {

#if MOETRAIN_HAS_CUTLASS
// The MX expert product (ops/mx_gemm.h) over segments starting on multiples of 128 rows:
// out (capacity, p) bf16 = A_e b[e]^T with A's E4M3 data (capacity, q) and E8M0 scales
// (capacity, q / 32), b (E, p, q) bf16; q a multiple of 32, p of 8; 16-byte aligned rows of
// a (q) and b (2 q bytes) for TMA. cutlass/mx_gemm_sm90.cu.
size_t mx_gemm_workspace(int64_t capacity, int64_t p);
cudaError_t mx_gemm(const int64_t* segments, int experts, const uint8_t* a_data,
                    const uint8_t* a_scales, const void* b, void* out, int64_t capacity, int64_t p,
                    int64_t q, void* workspace, size_t workspace_bytes, cudaStream_t stream);
#endif

}  // namespace mt::cuda::kernels
