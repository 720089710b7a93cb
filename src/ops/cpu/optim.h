// The AdamW CPU reference (optim.cpp), called by ops/optim.h's front door once it has checked the
// arguments.
#pragma once
#include "core/tensor.h"
#include "ops/optim.h"

namespace mt::ops::cpu {

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                Tensor* compute);

}  // namespace mt::ops::cpu
