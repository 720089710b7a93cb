// Small elementwise helpers the model needs between ops (residual adds, scaling, norms).
#pragma once
#include "core/tensor.h"

namespace mt::ops {

void add_(Tensor& a, const Tensor& b);                    // a += b
void add(const Tensor& a, const Tensor& b, Tensor& out);  // out = a + b
void scale_(Tensor& a, double s);                         // a *= s
void convert(const Tensor& src, Tensor& dst);  // dtype conversion, same numel, same device
double sum_of_squares(const Tensor& a);        // in double

}  // namespace mt::ops
