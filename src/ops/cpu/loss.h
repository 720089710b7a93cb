// The cross-entropy CPU reference (loss.cpp), called by ops/loss.h's front door once it has
// checked the arguments.
#pragma once
#include "core/tensor.h"

namespace mt::ops::cpu {

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, double grad_scale, Tensor& dlogits);

}  // namespace mt::ops::cpu
