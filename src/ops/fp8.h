// FP8 blockwise quantization (DeepSeek-V3's recipe, core/quant.h's kRow128 and kTile128
// formats): E4M3 elements with one f32 scale per 1 x 128 block of a row (activations, gradients)
// or per 128 x 128 tile (weights), the scale rule model.fp8_scale picks (core/quant_format.h).
// The CUDA kernels agree with the CPU reference bit for bit.
#pragma once
#include "core/quant.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops {

// out = x quantized in out.block() (kRow128 or kTile128) stored along out.axis(); x f32, bf16
// or f64 (rounded to f32 first) of out's logical shape. On the GPU: kRow128 along dim0, and
// kTile128 (either axis).
void fp8_quantize(const Tensor& x, Fp8ScaleRule rule, QuantTensor& out);

// x (rows, C) quantized in 1 x 128 blocks along its rows: a new kRow128 dim0 tensor.
QuantTensor fp8_rows(const Tensor& x, Fp8ScaleRule rule);

// A second output of the ops that write expert rows (swiglu_forward): the rows they write,
// quantized as fp8_quantize of the output into *rows (kRow128 along dim0, the output's shape and
// device), the operand of the FP8 product that reads them. On the GPU the op's kernel makes them
// as it writes the rows (rows of a multiple of 128 elements, 16-byte aligned; else the two
// steps); padding rows the op skips are left as they are.
struct Fp8RowsOut {
  QuantTensor* rows = nullptr;
  Fp8ScaleRule rule = Fp8ScaleRule::kFp32;
};
// Checks fp8 against the op's output `out` (null fp8: nothing to check).
void check_fp8_rows(const char* op, const Tensor& out, const Fp8RowsOut* fp8);
// The definition every fused Fp8RowsOut is held to: fp8_quantize(out, rule, *rows).
void write_fp8_rows(const Tensor& out, const Fp8RowsOut& fp8);

// A weight's two FP8 copies from one read of w (..., R, C): `dim0` stored as w, `dim1` stored
// transposed, both in 128 x 128 tiles with the same scales (a tile's scale does not depend on the
// layout): the forward's and the input gradient's b operands.
void fp8_quantize_both_axes(const Tensor& w, Fp8ScaleRule rule, QuantTensor& dim0,
                            QuantTensor& dim1);

// A weight's 128 x 128 tiles in the other stored layout: out (kTile128, in's logical shape, along
// the axis in is not stored along) = in's bytes with each matrix transposed, and in's scales (a
// tile's scale does not depend on the layout): bit for bit what the quantization writes along
// out's axis, a byte a weight read and written. What one GPU's held input-gradient tiles give the
// forward (fsdp::gather). On the GPU: 16-byte aligned data.
void fp8_transpose_tiles(const QuantTensor& in, QuantTensor& out);

// out (x's dtype and shape) = x's FP8 values: quantized in `block`s along `axis` and dequantized
// (f64: exact; f32 or bf16: the exact value rounded once). CPU only: the definition the GPU
// products are held to.
void fp8_round_trip(const Tensor& x, QuantBlock block, QuantAxis axis, Fp8ScaleRule rule,
                    Tensor& out);

// out (q's logical shape; f32, bf16 or f64) = from_e4m3(data) * scale, computed exactly in f64
// and rounded once to out's dtype. On the GPU: kRow128 along dim0 into f32 or bf16 (the rows an
// FP8 wire delivered, for the products that take them unquantized).
void fp8_dequantize(const QuantTensor& q, Tensor& out);

// The weight gradient's operands: x (M, C) quantized along the tokens into out of logical shape
// fp8_expert_rows_shape(x) = (M rounded up to 128, C) (kRow128, dim1: data stored (C, M'),
// scales (M' / 128, C)) in 128-row blocks from each expert's first row; rows that belong to no
// expert (a padded layout's padding, the rows past M) are zeros. Needs segments on 128-row
// boundaries (ExpertRows::align a multiple of 128).
Shape fp8_expert_rows_shape(const Tensor& x);
void fp8_quantize_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                              QuantTensor& out);

// The same operands' values for any layout, in x's shape: each expert's rows in 128-row blocks
// from its first row, the last block zero-padded, quantized and dequantized into out (x's shape,
// f32 or f64). Rows outside every segment are left as they are. out may be x. CPU only.
void fp8_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                                Tensor& out);

}  // namespace mt::ops
