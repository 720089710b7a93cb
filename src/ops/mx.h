// MX quantization (core/quant.h): the format's two conversions, exactly as torchao's to_mx and
// to_dtype define them for FP8 E4M3 elements with 32-element blocks. The CUDA kernels agree with
// the CPU reference bit for bit, and the reference with vectors made by torchao 0.18.0
// (tests/fixtures/mx_torchao.safetensors, scripts/make_mx_fixture.py).
#pragma once
#include "core/quant.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops {

// out = x quantized along out.axis() with `rule`; x is f32 or bf16 (f64 is rounded to f32
// first), of out's logical shape. For each block of 32 values with largest magnitude amax:
//   kFloor: s as MxScaleRule says; q = e4m3(clamp(x / max(2^(s-127), 2^-126), +-448))
//   kRceil: s as MxScaleRule says; q = e4m3(clamp(x * r, +-448)) with r = 2^(127-s), except
//           r = 1 when s = 0 (amax <= 448 * 2^-127: every element rounds to zero in E4M3)
// with the product or quotient rounded to f32 first, then to E4M3 (nearest even), as torchao
// does. A block holding a NaN gets s = 0xFF (NaN) and its elements 0x7F or +-0; an infinite
// amax gives the largest scale and +-448 for the infinities.
void mx_quantize(const Tensor& x, MxScaleRule rule, QuantTensor& out);

// out (q's logical shape; f32, bf16 or f64) = from_e4m3(data) * 2^(s - 127), NaN where s is 0xFF.
// The product is exact in f32, so each output is the exact value rounded once to out's dtype.
void mx_dequantize(const QuantTensor& q, Tensor& out);

// The MX products' operands (what the MX GEMM recipes compute with): out = x's values as out's
// dtype holds them (f32, bf16 or f64; f64 is quantized from its f32 rounding), quantized along
// `axis` and dequantized, in x's shape. Every such value is exact in bf16 unless it lies below
// bf16's subnormals (2^-133). out may be x. On the GPU along dim0 one pass (rows of a multiple of
// 32 elements).
void mx_round_trip(const Tensor& x, QuantAxis axis, MxScaleRule rule, Tensor& out);
// The same along dim1, stored transposed: x (..., R, C) -> out (..., C, R), the MX tensor's
// values in its stored layout (the MX copy of a weight quantized along its rows' axis, laid out
// as the product's b operand). One pass on the GPU.
void mx_round_trip_transposed(const Tensor& x, MxScaleRule rule, Tensor& out);
// Both of the above from one read of x (..., R, C): dim0 = mx_round_trip(x, kDim0) in x's shape
// and transposed = mx_round_trip_transposed(x) (..., C, R), of one dtype, bit for bit with the
// two (a weight's MX copies for the forward and the input gradient). R and C multiples of 32.
void mx_round_trip_both_axes(const Tensor& x, MxScaleRule rule, Tensor& dim0, Tensor& transposed);

// A second output of the ops that write expert rows (permute_rows, swiglu_forward,
// swiglu_backward): the rows they write, as their MX values along dim0 (mx_round_trip of the
// output) with `rule`, into *values (the output's shape, dtype and device). `values` may be the
// op's own output, which then holds only the MX values. On the GPU the op's kernel makes them as
// it writes the rows (rows of a multiple of 32 elements, 16-byte aligned; else the two steps).
struct MxValuesOut {
  Tensor* values = nullptr;
  MxScaleRule rule = MxScaleRule::kRceil;
};
// Checks mx against the op's output `out` (null mx: nothing to check).
void check_mx_values(const char* op, const Tensor& out, const MxValuesOut* mx);
// The definition every fused MxValuesOut is held to: *mx.values = mx_round_trip(out) along dim0.
void write_mx_values(const Tensor& out, const MxValuesOut& mx);

// The same along the rows of each expert's segment (x (M, K), the weight gradient's operands):
// blocks of 32 rows start at the segment's first row, the last one zero-padded (torchao pads each
// token group to 32 rows with zeros), so no block mixes two experts or reads padding. Rows outside
// every segment are left as they are. out may be x.
void mx_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, MxScaleRule rule,
                               Tensor& out);

}  // namespace mt::ops
