// The AdamW front door (ops/optim.h): the arguments checked once, then the CPU reference
// (ops/cpu/optim.cpp) or the kernel (ops/cuda/optim.cu).
#include "ops/optim.h"

#include <cmath>
#include <cstring>

#include "ops/cpu/optim.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/optim.h"
#endif

namespace mt::ops {

AdamWStepTerms adamw_step_terms(const AdamWHyper& h) {
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  return {1.0 - h.lr * h.weight_decay, h.lr / bc1, std::sqrt(bc2)};
}

namespace {
void check_buffers(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v) {
  const int64_t n = param.numel();
  MT_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n, "adamw buffers differ in size");
}
}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                Tensor* compute) {
  check_buffers(param, grad, m, v);
  MT_CHECK(h.step >= 1, "adamw step {} must be >= 1", h.step);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(param)) return adamw_step(param, grad, m, v, adamw_device_scalars(h), compute);
#endif
  cpu::adamw_step(param, grad, m, v, h, compute);
}

#if MOETRAIN_HAS_CUDA
Tensor adamw_device_scalars(const AdamWHyper& h) {
  MT_CHECK(h.step >= 1, "adamw step {} must be >= 1", h.step);
  const AdamWStepTerms terms = adamw_step_terms(h);
  const cuda::kernels::AdamWScalars s{
      static_cast<float>(h.beta1),        static_cast<float>(h.beta2),
      static_cast<float>(terms.decay),    static_cast<float>(terms.step_size),
      static_cast<float>(terms.sqrt_bc2), static_cast<float>(h.eps),
      static_cast<float>(h.grad_scale)};
  Tensor host = Tensor::empty({static_cast<int64_t>(sizeof(s))}, DType::kU8);
  std::memcpy(host.raw(), &s, sizeof(s));
  return host.to(Device::kCUDA);
}

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                const Tensor& device_scalars, Tensor* compute) {
  const profile::Phase phase("gpu.adamw_step");
  check_buffers(param, grad, m, v);
  const int64_t n = param.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v}) {
    expect_dtype(*t, DType::kF32, "adamw buffer (GPU master state is f32)");
    MT_CHECK(t->device() == Device::kCUDA, "adamw buffers must all be on the GPU");
  }
  MT_CHECK(device_scalars.device() == Device::kCUDA &&
               device_scalars.nbytes() == sizeof(cuda::kernels::AdamWScalars),
           "adamw scalars: {} bytes on the GPU expected (ops::adamw_device_scalars)",
           sizeof(cuda::kernels::AdamWScalars));
  if (compute) {
    expect_dtype(*compute, DType::kBF16, "adamw compute copy (GPU)");
    MT_CHECK(compute->numel() == n && compute->device() == Device::kCUDA,
             "adamw compute copy of {} elements for {} parameters", compute->numel(), n);
  }
  MT_CUDA_CHECK(cuda::kernels::adamw(
      param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(),
      compute ? compute->raw() : nullptr,
      static_cast<const cuda::kernels::AdamWScalars*>(device_scalars.raw()), n, cuda::stream()));
}
#else
Tensor adamw_device_scalars(const AdamWHyper&) {
  MT_CHECK(false, "adamw_device_scalars: built without CUDA");
}
void adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&, Tensor*) {
  MT_CHECK(false, "adamw_step with device scalars: built without CUDA");
}
#endif

}  // namespace mt::ops
