// The dense GEMM's CPU reference (gemm.cpp), called by ops/gemm.h's front door once it has checked
// the arguments: row-parallel loops, accumulation in the compute type, deterministic.
#pragma once
#include "core/tensor.h"
#include "ops/gemm.h"

namespace mt::ops::cpu {

void gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, Tensor& c, Accumulate acc);

}  // namespace mt::ops::cpu
