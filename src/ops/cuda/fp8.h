// The FP8 blockwise quantization kernels (fp8.cu) behind ops/fp8.h, and the FP8 grouped GEMMs
// (cutlass/fp8_gemm_sm90*.cu) behind ops/fp8_gemm.h. Raw pointers, sizes and a stream; each call
// returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/quant_format.h"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

// A row-writing kernel's second output (e.g. swiglu_forward): the rows it writes quantized in 1 x
// 128 blocks along them (kRow128, dim0: data (rows, cols), scales (rows, cols / 128)) from their
// values as stored, bit for bit with fp8_quantize_rows of the output. data null: none.
struct Fp8RowsOut {
  uint8_t* data;
  float* scales;
  Fp8ScaleRule rule;
};
inline constexpr Fp8RowsOut kNoFp8Rows{nullptr, nullptr, Fp8ScaleRule::kFp32};

// x (rows, cols), f32 or bf16, 16-byte aligned, cols a multiple of 128 -> 1 x 128 blocks along
// the rows (core/quant.h's kRow128, dim0): data (rows, cols), scales (rows, cols / 128).
cudaError_t fp8_quantize_rows(DType in, const void* x, int64_t rows, int64_t cols,
                              Fp8ScaleRule rule, uint8_t* data, float* scales, cudaStream_t stream);
// The inverse: 1 x 128 blocks along the rows (data (rows, cols), scales (rows, cols / 128)) ->
// out (rows, cols) of out_dtype (f32 or bf16, 16-byte aligned), each element from_e4m3(q) * scale
// rounded once (bit for bit with the CPU's fp8_dequantize).
cudaError_t fp8_dequantize_rows(const uint8_t* data, const float* scales, int64_t rows,
                                int64_t cols, DType out_dtype, void* out, cudaStream_t stream);
// w (batch, rows, cols), f32 or bf16, 16-byte aligned, rows and cols multiples of 128 -> 128 x
// 128 tiles (kTile128): data stored as w (dim0, may be null) and transposed (dim1, (batch, cols,
// rows), may be null), scales (batch, rows / 128, cols / 128).
cudaError_t fp8_quantize_tiles(DType in, const void* w, int64_t batch, int64_t rows, int64_t cols,
                               Fp8ScaleRule rule, uint8_t* dim0, uint8_t* dim1, float* scales,
                               cudaStream_t stream);
// E4M3 bytes stored (batch, rows, cols), rows and cols multiples of 128, 16-byte aligned ->
// out (batch, cols, rows): a weight's 128 x 128 tiles in the other stored layout (the scales are
// the same).
cudaError_t fp8_transpose_tiles(const uint8_t* in, int64_t batch, int64_t rows, int64_t cols,
                                uint8_t* out, cudaStream_t stream);
// x (m, k), f32 or bf16, 16-byte aligned, m a multiple of 128, k a multiple of 8 -> 1 x 128
// blocks down the columns (kRow128, dim1): data (k, m), scales (m / 128, k). With `rows` (segments
// on 128-row boundaries) only each expert's rows are read, the others written as zeros (scale 1);
// without, every row is.
cudaError_t fp8_quantize_columns(DType in, const void* x, int64_t m, int64_t k,
                                 const ExpertSegments* rows, int experts, Fp8ScaleRule rule,
                                 uint8_t* data, float* scales, cudaStream_t stream);

}  // namespace mt::cuda::kernels
