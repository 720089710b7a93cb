// The dense GEMM on the GPU (gemm.cpp, cuBLASLt) behind ops/gemm.h.
// Raw pointers, sizes and a stream; cuBLAS errors are thrown as mt::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "ops/gemm.h"

namespace mt::cuda::kernels {

// Row-major d (m, n) = op(a) (m, k) op(b) (k, n) + beta c through cuBLASLt with fp32
// accumulation: a and b of `in` (f32 or bf16), c and d of `out` (in, or f32); c may be d
// (accumulation) or another buffer, read by the epilogue (a residual). m, n, k > 0.
void gemm(DType in, const void* a, ops::Transpose ta, const void* b, ops::Transpose tb, DType out,
          const void* c, void* d, int64_t m, int64_t n, int64_t k, float beta, cudaStream_t stream);

}  // namespace mt::cuda::kernels
