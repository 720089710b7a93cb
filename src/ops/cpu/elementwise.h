// The element-wise CPU reference (elementwise.cpp), called by ops/elementwise.h's front door once
// it has checked the arguments.
#pragma once
#include "core/tensor.h"

namespace mt::ops::cpu {

void add(const Tensor& a, const Tensor& b, Tensor& out);
void convert(const Tensor& src, Tensor& dst);
void scale_(Tensor& a, double s);
double sum_of_squares(const Tensor& a);

}  // namespace mt::ops::cpu
