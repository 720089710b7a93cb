// The FP8 blockwise conversions' CPU reference (fp8.cpp), called by ops/fp8.h's front door once
// it has checked the arguments.
#pragma once
#include "core/quant.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops::cpu {

void fp8_quantize(const Tensor& x, Fp8ScaleRule rule, QuantTensor& out);
void fp8_dequantize(const QuantTensor& q, Tensor& out);
void fp8_transpose_tiles(const QuantTensor& in, QuantTensor& out);
void fp8_quantize_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                              QuantTensor& out);
void fp8_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                                Tensor& out);

}  // namespace mt::ops::cpu
