// The cross-entropy kernels (loss.cu) behind ops/loss.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "ops/cuda/fp8.h"

namespace mt::cuda::kernels {

// loss (n floats, scratch) receives each row's loss (0 where masked); *loss_sum (device) += their
// sum. The backward's scale is a device double; dlogits may be logits. fp8 (data null: none) also
// receives dlogits' FP8 rows, quantized from the values as stored (v a multiple of 128, 16-byte
// packs, data 16-byte aligned; else cudaErrorNotSupported, nothing launched).
cudaError_t cross_entropy_forward(DType s, const void* logits, const int32_t* targets,
                                  const uint8_t* mask, float* lse, float* loss, double* loss_sum,
                                  int64_t n, int64_t v, cudaStream_t stream);
cudaError_t cross_entropy_backward(DType s, const void* logits, const int32_t* targets,
                                   const uint8_t* mask, const float* lse, const double* scale,
                                   void* dlogits, int64_t n, int64_t v, Fp8RowsOut fp8,
                                   cudaStream_t stream);

}  // namespace mt::cuda::kernels
