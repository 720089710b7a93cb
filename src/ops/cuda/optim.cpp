// The AdamW ops on the GPU (ops/cuda/ops.h): checks with named messages, then optim.cu.
#include <cstring>

#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

Tensor adamw_scalars(const ops::AdamWHyper& h) {
  const ops::AdamWStepTerms terms = ops::adamw_step_terms(h);
  const kernels::AdamWScalars s{
      static_cast<float>(h.beta1),        static_cast<float>(h.beta2),
      static_cast<float>(terms.decay),    static_cast<float>(terms.step_size),
      static_cast<float>(terms.sqrt_bc2), static_cast<float>(h.eps),
      static_cast<float>(h.grad_scale)};
  Tensor host = Tensor::empty({static_cast<int64_t>(sizeof(s))}, DType::kU8);
  std::memcpy(host.raw(), &s, sizeof(s));
  return host.to(Device::kCUDA);
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const ops::AdamWHyper& h,
                Tensor* compute) {
  adamw_step(param, grad, m, v, adamw_scalars(h), compute);
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const Tensor& scalars,
                Tensor* compute) {
  const profile::Phase phase("gpu.adamw_step");
  const int64_t n = param.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v}) {
    expect_dtype(*t, DType::kF32, "adamw buffer (GPU master state is f32)");
    MT_CHECK(t->numel() == n && t->device() == Device::kCUDA, "adamw buffers differ");
  }
  MT_CHECK(scalars.device() == Device::kCUDA && scalars.nbytes() == sizeof(kernels::AdamWScalars),
           "adamw scalars: {} bytes on the GPU expected (cuda::adamw_scalars)",
           sizeof(kernels::AdamWScalars));
  if (compute) {
    expect_dtype(*compute, DType::kBF16, "adamw compute copy (GPU)");
    MT_CHECK(compute->numel() == n && compute->device() == Device::kCUDA,
             "adamw compute copy of {} elements for {} parameters", compute->numel(), n);
  }
  MT_CUDA_CHECK(kernels::adamw(param.data<float>(), grad.data<float>(), m.data<float>(),
                               v.data<float>(), compute ? compute->raw() : nullptr,
                               static_cast<const kernels::AdamWScalars*>(scalars.raw()), n,
                               stream()));
}

}  // namespace mt::cuda
