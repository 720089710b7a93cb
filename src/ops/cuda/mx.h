// The MX quantization kernels (mx.cu) behind ops/mx.h.
// Raw pointers, sizes and a stream (DeepEP's habit): the .cu files need neither Tensor nor fmt;
// each call returns its launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>

#include "core/dtype.h"
#include "core/quant_format.h"
#include "ops/cuda/grouped_gemm.h"

namespace mt::cuda::kernels {

// A second output of a row-writing kernel (ops::MxValuesOut): what it writes, quantized and
// dequantized along the rows (dim0), in the output's storage type; `values` may be the output
// itself (then only the MX values are written). Null: none. Given only where
// can_fuse_mx_values holds (the front door decides; a kernel given one it cannot fuse returns
// cudaErrorNotSupported, launching nothing).
struct MxValuesOut {
  void* values;
  MxScaleRule rule;
};
inline constexpr MxValuesOut kNoMxValues{nullptr, MxScaleRule::kRceil};
// Whether a row-writing kernel can write rows of `width` elements of `storage` (f32 or bf16) and
// their MX values in one pass: whole 32-element blocks in 16-byte packs, every pointer aligned.
inline bool can_fuse_mx_values(DType storage, int64_t width,
                               std::initializer_list<const void*> ptrs) {
  if ((storage != DType::kF32 && storage != DType::kBF16) || width % kMxBlock != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// MX quantization (ops/mx.h): x (batch, rows, cols), f32 or bf16, 16-byte aligned -> E4M3 data
// and E8M0 scales in core/quant.h's layout for `axis`, and back to f32 or bf16 in the logical
// layout (16-byte aligned). dim1 needs rows of a multiple of 16 bytes (cols * element size).
cudaError_t mx_quantize(DType in, const void* x, QuantAxis axis, MxScaleRule rule, int64_t batch,
                        int64_t rows, int64_t cols, uint8_t* data, uint8_t* scales,
                        cudaStream_t stream);
cudaError_t mx_dequantize(DType out, const uint8_t* data, const uint8_t* scales, QuantAxis axis,
                          int64_t batch, int64_t rows, int64_t cols, void* dst,
                          cudaStream_t stream);
// x (batch, rows, cols) quantized and dequantized (ops::mx_round_trip) in one pass, x's values
// first rounded to `out`'s type; 16-byte aligned. dim0: out in x's layout (may be x); dim1: out
// (batch, cols, rows), the values transposed into the quantized data's stored layout
// (ops::mx_round_trip_transposed), rows of a multiple of 16 bytes.
cudaError_t mx_round_trip(DType in, const void* x, QuantAxis axis, MxScaleRule rule, int64_t batch,
                          int64_t rows, int64_t cols, DType out, void* dst, cudaStream_t stream);
// Both of mx_round_trip's outputs from one read of x: dim0 in x's layout and the dim1 values
// transposed (ops::mx_round_trip_both_axes); rows and cols multiples of 32, rows of a multiple of
// 16 bytes, 16-byte aligned.
cudaError_t mx_round_trip_both_axes(DType in, const void* x, MxScaleRule rule, int64_t batch,
                                    int64_t rows, int64_t cols, DType out, void* dim0,
                                    void* transposed, cudaStream_t stream);
// x (m, k) -> out: each expert's rows quantized and dequantized in 32-row blocks from its first
// row (ops::mx_round_trip_expert_rows); block_prefix: device scratch of experts + 1 i64.
cudaError_t mx_round_trip_expert_rows(DType t, const void* x, int64_t m, int64_t k,
                                      ExpertSegments rows, int experts, int64_t* block_prefix,
                                      MxScaleRule rule, void* out, cudaStream_t stream);

}  // namespace mt::cuda::kernels
