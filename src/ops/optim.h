// AdamW over flat fp32 buffers (one call per parameter unit, not per tensor), PyTorch's order:
// decoupled decay p *= 1 - lr*wd, then p -= lr * m_hat / (sqrt(v_hat) + eps).
#pragma once
#include <cstdint>

#include "core/quant.h"
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

// What the update writes beside the master weights, from the updated values in the same pass.
struct AdamWCopies {
  // The whole buffer in the compute copy's dtype (the bf16 copy the ops read).
  Tensor* compute = nullptr;
  // The weight's FP8 tiles, param (..., R, C) with R and C multiples of 128: 128 x 128 tiles
  // stored as the weight (dim0) and, when given, transposed (dim1; ops::fp8_quantize_both_axes),
  // made from the updated values rounded to `tiles_from` (f32 or bf16, as the products read the
  // weight) with `rule`. dim1 only beside dim0.
  QuantTensor* tiles_dim0 = nullptr;
  QuantTensor* tiles_dim1 = nullptr;
  DType tiles_from = DType::kBF16;
  Fp8ScaleRule rule = Fp8ScaleRule::kFp32;
  bool writes_tiles() const { return tiles_dim0 != nullptr; }
};

// param, grad, m, v: same shape and dtype (f32 master state, or f64 in checks). The copies in
// `out` are written as the unfused sequence would: the update, then the cast (compute) and
// fp8_quantize (fp8_quantize_both_axes) of the rounded weights (tiles); the GPU in the same pass.
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                const AdamWCopies& out = {});

// The GPU step with its hyper-parameters read on the device: adamw_device_scalars(h) makes the
// bytes the kernel reads (u8 on the GPU), and a captured optimizer step replays with each step's
// values once they are copied over the captured ones. f32 master state, compute bf16 or null,
// tiles on 16-byte aligned weights.
Tensor adamw_device_scalars(const AdamWHyper& h);
void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const Tensor& device_scalars, const AdamWCopies& out = {});

}  // namespace mt::ops
