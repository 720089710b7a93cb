// The AdamW kernel (optim.cu) behind ops/optim.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/quant_format.h"

namespace mt::cuda::kernels {

struct AdamWScalars {
  float beta1, beta2, decay, step_size, sqrt_bc2, eps, grad_scale;
};
// compute_bf16 (nullable) receives the updated parameters rounded to bf16; s points to device
// memory.
cudaError_t adamw(float* p, const float* g, float* m, float* v, void* compute_bf16,
                  const AdamWScalars* s, int64_t n, cudaStream_t stream);
// The same update of a weight (batch, rows, cols), rows and cols multiples of 128, 16-byte
// aligned, that also writes its FP8 tiles (kTile128) from the updated values rounded to
// `tiles_from` (f32 or bf16: as the products read them): E4M3 bytes stored as the weight (dim0) and
// transposed (dim1, (batch, cols, rows)), either may be null, and the tiles' scales (batch, rows /
// 128, cols / 128) into scales0 and, when not null, scales1. Bit for bit with adamw, then
// fp8_quantize_tiles of the (rounded) weight.
cudaError_t adamw_fp8_tiles(float* p, const float* g, float* m, float* v, const AdamWScalars* s,
                            int64_t batch, int64_t rows, int64_t cols, DType tiles_from,
                            Fp8ScaleRule rule, uint8_t* dim0, uint8_t* dim1, float* scales0,
                            float* scales1, cudaStream_t stream);

}  // namespace mt::cuda::kernels
