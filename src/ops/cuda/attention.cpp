// The attention ops on the GPU (ops/cuda/ops.h): checks with named messages, then attention.cu,
// else cuDNN's SDPA (cudnn/sdpa.cpp).
#include "core/cuda/check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"
#include "ops/cuda/ops.h"

namespace mt::cuda {

void reference_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const ops::Documents& docs, double scale, Tensor& out,
                                 Tensor& lse) {
  const profile::Phase phase("gpu.reference_attention_forward");
  const Tensor& cu_seqlens = docs.cu_seqlens;
  const int64_t n = q.dim(0);
  expect_shape(out, {n, q.dim(1), v.dim(2)}, "attention out");
  expect_shape(lse, {n, q.dim(1)}, "attention lse");
  expect_dtype(lse, DType::kF32, "attention lse (GPU)");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out})
    same_storage_type(q, *t, "attention operand");
  MT_CUDA_CHECK(kernels::attention_forward(
      storage_of(q, "attention q"), q.raw(), k.raw(), v.raw(), cu_seqlens.data<int32_t>(),
      static_cast<int>(cu_seqlens.numel() - 1), n, static_cast<int>(q.dim(1)),
      static_cast<int>(k.dim(1)), static_cast<int>(q.dim(2)), static_cast<int>(v.dim(2)),
      static_cast<float>(scale), out.raw(), lse.data<float>(), stream()));
}

void reference_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  const ops::Documents& docs, double scale, Tensor& dq, Tensor& dk,
                                  Tensor& dv) {
  const profile::Phase phase("gpu.reference_attention_backward");
  const Tensor& cu_seqlens = docs.cu_seqlens;
  const int64_t n = q.dim(0);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out, &dout, &dq, &dk, &dv})
    same_storage_type(q, *t, "attention operand");
  Tensor delta = Tensor::empty({n, q.dim(1)}, DType::kF32, Device::kCUDA);
  MT_CUDA_CHECK(kernels::attention_backward(
      storage_of(q, "attention q"), q.raw(), k.raw(), v.raw(), out.raw(), lse.data<float>(),
      dout.raw(), cu_seqlens.data<int32_t>(), static_cast<int>(cu_seqlens.numel() - 1), n,
      static_cast<int>(q.dim(1)), static_cast<int>(k.dim(1)), static_cast<int>(q.dim(2)),
      static_cast<int>(v.dim(2)), static_cast<float>(scale), delta.data<float>(), dq.raw(),
      dk.raw(), dv.raw(), stream()));
}

namespace {
bool use_cudnn_attention(const Tensor& q, const Tensor& v) {
  return cudnn_attention_available() && cudnn_attention_supports(q, v);
}
}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       const ops::Documents& docs, double scale, Tensor& out, Tensor& lse) {
  if (use_cudnn_attention(q, v)) return cudnn_attention_forward(q, k, v, docs, scale, out, lse);
  reference_attention_forward(q, k, v, docs, scale, out, lse);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, const ops::Documents& docs,
                        double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  // Deterministic: a resumed run must repeat the uninterrupted one bit for bit.
  if (use_cudnn_attention(q, v))
    return cudnn_attention_backward(q, k, v, out, lse, dout, docs, scale, true, dq, dk, dv);
  reference_attention_backward(q, k, v, out, lse, dout, docs, scale, dq, dk, dv);
}

#if !MOETRAIN_HAS_CUDNN
bool cudnn_attention_available() {
  return false;
}
bool cudnn_attention_supports(const Tensor&, const Tensor&) {
  return false;
}
void cudnn_attention_forward(const Tensor&, const Tensor&, const Tensor&, const ops::Documents&,
                             double, Tensor&, Tensor&) {
  MT_CHECK(false, "built without the cuDNN frontend (scripts/setup.sh installs it)");
}
void cudnn_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, const ops::Documents&, double, bool,
                              Tensor&, Tensor&, Tensor&, int64_t) {
  MT_CHECK(false, "built without the cuDNN frontend (scripts/setup.sh installs it)");
}
#endif

}  // namespace mt::cuda
