// The AdamW front door (ops/optim.h): the arguments checked once, then the CPU reference
// (ops/cpu/optim.cpp) or the kernel (ops/cuda/optim.cu).
#include "ops/optim.h"

#include <cmath>
#include <cstring>

#include "ops/cpu/optim.h"
#include "ops/dispatch.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
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
void check_buffers(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                   const AdamWCopies& out) {
  const int64_t n = param.numel();
  MT_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n, "adamw buffers differ in size");
  if (out.compute)
    MT_CHECK(out.compute->numel() == n && out.compute->device() == param.device(),
             "adamw compute copy of {} elements for {} parameters (on their device)",
             out.compute->numel(), n);
  MT_CHECK(out.tiles_dim0 != nullptr || out.tiles_dim1 == nullptr,
           "adamw writes a weight's transposed FP8 tiles (dim1) only beside its dim0 tiles");
  if (!out.writes_tiles()) return;
  const Shape& s = param.shape();
  MT_CHECK(s.size() >= 2 && s[s.size() - 2] % kFp8Block == 0 && s[s.size() - 1] % kFp8Block == 0,
           "adamw's FP8 tiles need a weight of 128 x 128 tiles, got {}", shape_str(s));
  for (const auto& [q, axis] :
       {std::pair{out.tiles_dim0, QuantAxis::kDim0}, std::pair{out.tiles_dim1, QuantAxis::kDim1}})
    MT_CHECK(
        q == nullptr || (q->defined() && q->shape() == s && q->block() == QuantBlock::kTile128 &&
                         q->axis() == axis && q->device() == param.device()),
        "adamw's FP8 tiles of {}: 128 x 128 tiles of that shape along dim{} on the weight's "
        "device expected",
        shape_str(s), axis == QuantAxis::kDim0 ? 0 : 1);
}
}  // namespace

void adamw_step(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWHyper& h,
                const AdamWCopies& out) {
  check_buffers(param, grad, m, v, out);
  MT_CHECK(h.step >= 1, "adamw step {} must be >= 1", h.step);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(param)) return adamw_step(param, grad, m, v, adamw_device_scalars(h), out);
#endif
  cpu::adamw_step(param, grad, m, v, h, out.compute);
  if (!out.writes_tiles()) return;
  // The definition the GPU's fused pass is held to: the weights as the products read them,
  // quantized in the layouts asked for.
  Tensor rounded = param;
  if (param.dtype() != out.tiles_from) {
    rounded = Tensor::empty(param.shape(), out.tiles_from, param.device());
    convert(param, rounded);
  }
  if (!out.tiles_dim1) return fp8_quantize(rounded, out.rule, *out.tiles_dim0);
  fp8_quantize_both_axes(rounded, out.rule, *out.tiles_dim0, *out.tiles_dim1);
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
                const Tensor& device_scalars, const AdamWCopies& out) {
  const profile::Phase phase("gpu.adamw_step");
  check_buffers(param, grad, m, v, out);
  const int64_t n = param.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v}) {
    expect_dtype(*t, DType::kF32, "adamw buffer (GPU master state is f32)");
    MT_CHECK(t->device() == Device::kCUDA, "adamw buffers must all be on the GPU");
  }
  MT_CHECK(device_scalars.device() == Device::kCUDA &&
               device_scalars.nbytes() == sizeof(cuda::kernels::AdamWScalars),
           "adamw scalars: {} bytes on the GPU expected (ops::adamw_device_scalars)",
           sizeof(cuda::kernels::AdamWScalars));
  const auto* scalars = static_cast<const cuda::kernels::AdamWScalars*>(device_scalars.raw());
  if (out.writes_tiles()) {
    MT_CHECK(!out.compute, "adamw on the GPU writes a compute copy or FP8 tiles, not both");
    MT_CHECK(out.tiles_from == DType::kF32 || out.tiles_from == DType::kBF16,
             "adamw on the GPU makes FP8 tiles from f32 or bf16 weights, not {}",
             dtype_name(out.tiles_from));
    for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v})
      MT_CHECK(reinterpret_cast<uintptr_t>(t->raw()) % 16 == 0,
               "adamw with FP8 tiles on the GPU needs 16-byte aligned buffers");
    const Shape& s = param.shape();
    const int64_t rows = s[s.size() - 2], cols = s[s.size() - 1];
    MT_CUDA_CHECK(cuda::kernels::adamw_fp8_tiles(
        param.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), scalars,
        n / (rows * cols), rows, cols, out.tiles_from, out.rule,
        static_cast<uint8_t*>(out.tiles_dim0->data().raw()),
        out.tiles_dim1 ? static_cast<uint8_t*>(out.tiles_dim1->data().raw()) : nullptr,
        out.tiles_dim0->scales().data<float>(),
        out.tiles_dim1 ? out.tiles_dim1->scales().data<float>() : nullptr, cuda::stream()));
    return;
  }
  if (out.compute) expect_dtype(*out.compute, DType::kBF16, "adamw compute copy (GPU)");
  MT_CUDA_CHECK(cuda::kernels::adamw(param.data<float>(), grad.data<float>(), m.data<float>(),
                                     v.data<float>(), out.compute ? out.compute->raw() : nullptr,
                                     scalars, n, cuda::stream()));
}
#else
Tensor adamw_device_scalars(const AdamWHyper&) {
  MT_CHECK(false, "adamw_device_scalars: built without CUDA");
}
void adamw_step(Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&, const AdamWCopies&) {
  MT_CHECK(false, "adamw_step with device scalars: built without CUDA");
}
#endif

}  // namespace mt::ops
