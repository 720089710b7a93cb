// Cross-entropy with a per-token loss mask (u8: 1 = counts). The caller divides by the number of
// counted tokens of the whole step (all micro-batches), passed in as grad_scale.
#pragma once
#include "core/tensor.h"
#include "ops/fp8.h"

namespace mt::ops {

// logits (N, V), targets i32 (N), mask u8 (N); lse (N) saved. Adds the sum of
// lse - logit[target] over masked tokens to loss_sum (one f64 element on the logits' device: on
// the GPU the sum never visits the host, so a step can be captured in a CUDA graph).
// token_loss (N, lse's dtype), where given, receives each token's lse - logit[target] (0 where
// the mask is 0): evaluation's per-token losses.
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss = nullptr);
// The same sum, returned (waits for the device).
double cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                             Tensor& lse);
// dlogits (N, V) overwritten: grad_scale * mask * (softmax - onehot(target)); grad_scale is one
// f64 element on the logits' device (read there, so a captured step replays with each step's).
// dlogits may be logits (each element is read before it is written): the head's backward keeps
// one (N, V) buffer. fp8, where given, also receives dlogits' FP8 rows (ops::Fp8RowsOut: the
// operand of the head's FP8 input gradient), written by the same kernel on the GPU.
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, const Tensor& grad_scale, Tensor& dlogits,
                            const Fp8RowsOut* fp8 = nullptr);
void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, double grad_scale, Tensor& dlogits,
                            const Fp8RowsOut* fp8 = nullptr);

}  // namespace mt::ops
