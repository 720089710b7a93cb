// AdamW over flat fp32 buffers (one call per parameter unit, not per tensor), PyTorch's order:
// decoupled decay p *= 1 - lr*wd, then p -= lr * m_hat / (sqrt(v_hat) + eps).
#pragma once
#include <cstdint>

#include "core/tensor.h"

namespace mt::ops {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;         // 1-based, for bias correction
  double grad_scale = 1.0;  // multiplies the gradient first: clipping without its own pass
};

// The step's constants, in double; each backend rounds them to its own type. decay = 1 - lr*wd,
// step_size = lr / (1 - beta1^step), sqrt_bc2 = sqrt(1 - beta2^step).
struct AdamWStepTerms {
  double decay, step_size, sqrt_bc2;
};
AdamWStepTerms adamw_step_terms(const AdamWHyper& h);

// param, grad, m, v: same shape and dtype (f32 master state, or f64 in checks). compute, when
// given, receives the updated params in its own dtype (the bf16 copy the ops read) in the
// same pass.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                Tensor* compute = nullptr);

// The GPU step with its hyper-parameters read on the device: adamw_device_scalars(h) makes the
// bytes the kernel reads (u8 on the GPU), and a captured optimizer step replays with each step's
// values once they are copied over the captured ones. f32 master state, compute bf16 or null.
Tensor adamw_device_scalars(const AdamWHyper& h);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const Tensor& device_scalars, Tensor* compute = nullptr);

}  // namespace mt::ops
