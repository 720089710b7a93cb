// The SwiGLU CPU reference (activation.cpp), called by ops/activation.h's front door once it has
// checked the arguments; the MX values of an output are the front door's.
#pragma once
#include "core/tensor.h"
#include "ops/activation.h"

namespace mt::ops::cpu {

void swiglu_forward(const Tensor& h, Tensor& a, const SwigluRows& rows);
void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const SwigluRows& rows,
                     Tensor* dweight);

}  // namespace mt::ops::cpu
