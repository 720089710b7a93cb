// The MX conversions' CPU reference (mx.cpp), called by ops/mx.h's front door once it has checked
// the arguments; the round trips are compositions of these, made there.
#pragma once
#include "core/quant.h"
#include "core/tensor.h"
#include "ops/grouped_gemm.h"

namespace mt::ops::cpu {

void mx_quantize(const Tensor& x, MxScaleRule rule, QuantTensor& out);
void mx_dequantize(const QuantTensor& q, Tensor& out);
void mx_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, MxScaleRule rule,
                               Tensor& out);

}  // namespace mt::ops::cpu
