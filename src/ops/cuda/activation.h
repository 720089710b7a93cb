// The SwiGLU kernels (activation.cu) behind ops/activation.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "ops/cuda/fp8.h"
#include "ops/cuda/mx.h"

namespace mt::cuda::kernels {

// The expert rows' extras of SwiGLU (ops/activation.h), each nullable: rows whose token is
// negative (padding) are skipped; a = weight[r] * silu(gate) * up; the backward writes
// dweight[r] = <da, silu(gate) * up> (with weight only).
struct SwigluRows {
  const int32_t* token;
  const float* weight;
  float* dweight;
};
// Both return cudaErrorNotSupported, launching nothing, for mx they cannot fuse, and likewise for
// fp8 (rows of a multiple of 128 elements, f for the backward's halves, 16-byte aligned; not with
// mx).
cudaError_t swiglu_forward(DType s, const void* h, void* a, int64_t m, int64_t f, SwigluRows rows,
                           MxValuesOut mx, Fp8RowsOut fp8, cudaStream_t stream);
cudaError_t swiglu_backward(DType s, const void* h, const void* da, void* dh, int64_t m, int64_t f,
                            SwigluRows rows, MxValuesOut mx, Fp8RowsOut fp8, cudaStream_t stream);

}  // namespace mt::cuda::kernels
