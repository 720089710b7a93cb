// Cross-entropy with a per-token loss mask (u8: 1 = counts). The caller divides by the number of
// counted tokens of the whole step (all micro-batches), passed in as grad_scale.
#pragma once
#include "core/tensor.h"

namespace mt::ops {

// logits (N, V), targets i32 (N), mask u8 (N); lse (N) saved. Returns the sum of
// lse - logit[target] over masked tokens, in double.
double cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                             Tensor& lse);
// dlogits (N, V) overwritten: grad_scale * mask * (softmax - onehot(target)).
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, double grad_scale, Tensor& dlogits);

}  // namespace mt::ops
