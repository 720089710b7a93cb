// The RMSNorm CPU reference (norm.cpp): plain loops in the compute type (f32, or f64 for gradient
// checks), called by ops/norm.h's front door once it has checked the arguments.
#pragma once
#include "core/tensor.h"

namespace mt::ops::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw);

}  // namespace mt::ops::cpu
