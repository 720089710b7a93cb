// The element-wise kernels (elementwise.cu) behind ops/elementwise.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace mt::cuda::kernels {

// f32 -> bf16 (round to nearest even) or bf16 -> f32; `from` names the source type.
cudaError_t convert(DType from, const void* src, void* dst, int64_t n, cudaStream_t stream);
// Deterministic sum of x^2 into *result on the host (waits for the stream).
size_t sum_of_squares_workspace();
cudaError_t sum_of_squares(DType s, const void* x, int64_t n, void* workspace, double* result,
                           cudaStream_t stream);
cudaError_t scale(DType s, void* x, float factor, int64_t n, cudaStream_t stream);
cudaError_t add(DType s, const void* a, const void* b, void* out, int64_t n, cudaStream_t stream);

}  // namespace mt::cuda::kernels
