// Tensor-level wrappers of the CUDA kernels: shape and dtype checks with named messages, then
// the raw-pointer launch on the thread's stream (cuda::stream()), its error turned into mt::Error.
#include "ops/cuda/ops.h"

#include <cstring>
#include <utility>

#include "core/cuda_check.h"
#include "core/profile.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/operands.h"

namespace mt::cuda {

namespace {

void same_storage_type(const Tensor& a, const Tensor& b, const char* name) {
  MT_CHECK(a.dtype() == b.dtype() && b.device() == Device::kCUDA,
           "{} is {} on {}, expected {} on the GPU", name, dtype_name(b.dtype()),
           b.device() == Device::kCUDA ? "the GPU" : "the CPU", dtype_name(a.dtype()));
}

}  // namespace

namespace {
// Operands of the grouped GEMMs (v1: bf16 in, bf16 or f32 out, all on the GPU, 16-byte rows);
// the row offsets never leave the device.
kernels::ExpertSegments check_grouped(std::initializer_list<const Tensor*> bf16_operands,
                                      const Tensor& out, const ops::ExpertRows& rows,
                                      int64_t experts, int64_t k, int64_t n) {
  for (const Tensor* t : bf16_operands) {
    expect_dtype(*t, DType::kBF16, "grouped gemm operand (GPU v1 is bf16)");
    MT_CHECK(t->device() == Device::kCUDA, "grouped gemm operands must be on the GPU");
  }
  MT_CHECK(
      out.device() == Device::kCUDA && (out.dtype() == DType::kBF16 || out.dtype() == DType::kF32),
      "grouped gemm output must be bf16 or f32 on the GPU");
  for (const auto& [t, name] :
       {std::pair{&rows.offsets, "expert offsets"}, std::pair{&rows.segments, "expert segments"}}) {
    expect_dtype(*t, DType::kI64, name);
    MT_CHECK(t->device() == Device::kCUDA && t->numel() == experts + 1,
             "{} must be {} i64 on the GPU", name, experts + 1);
  }
  MT_CHECK(k % 8 == 0 && n % 8 == 0, "grouped gemm dims {} x {} must be multiples of 8", k, n);
  return {rows.offsets.data<int64_t>(), rows.segments.data<int64_t>()};
}

#if MOETRAIN_HAS_CUTLASS
// CUTLASS's kernels are instantiated for one output dtype per product (bf16 rows, f32 weight
// gradients); anything else takes version 1.
bool should_use_cutlass_grouped(const Tensor& out, DType instantiated_out) {
  return out.dtype() == instantiated_out;
}

Tensor workspace(size_t bytes) {
  return gpu_empty({static_cast<int64_t>(bytes)}, DType::kU8);
}

// A layout of whole 128-row tiles per expert: the forward and input-gradient products run on
// fixed TMA descriptors (cutlass/fixed_gemm_sm90.cuh; docs/benchmarks.md compares them with the
// grouped kernels).
bool whole_row_tiles(const ops::ExpertRows& rows) {
  return rows.align % kernels::kFixedRowTile == 0;
}
#endif
}  // namespace

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ops::ExpertRows& rows,
                          Tensor& out) {
  const profile::Phase phase("gpu.grouped_gemm_forward");
  const int64_t m = x.dim(0), e = w.dim(0), k = w.dim(1), n = w.dim(2);
  expect_shape(x, {m, k}, "grouped gemm x");
  expect_shape(out, {m, n}, "grouped gemm out");
  const kernels::ExpertSegments layout = check_grouped({&x, &w}, out, rows, e, k, n);
#if MOETRAIN_HAS_CUTLASS
  if (should_use_cutlass_grouped(out, DType::kBF16) && whole_row_tiles(rows) &&
      k <= kernels::kCutlassShortK) {  // the long-K forward gains nothing (docs/benchmarks.md)
    Tensor ws = workspace(kernels::cutlass_fixed_forward_workspace(m, n));
    MT_CUDA_CHECK(kernels::cutlass_fixed_forward(layout.segments, static_cast<int>(e), x.raw(),
                                                 w.raw(), out.raw(), m, k, n, ws.raw(), ws.nbytes(),
                                                 stream()));
    return;
  }
  if (should_use_cutlass_grouped(out, DType::kBF16)) {
    Tensor ws = workspace(kernels::cutlass_grouped_forward_workspace(static_cast<int>(e)));
    MT_CUDA_CHECK(kernels::cutlass_grouped_forward(layout, static_cast<int>(e), x.raw(), w.raw(),
                                                   out.raw(), m, k, n, ws.raw(), ws.nbytes(),
                                                   stream()));
    return;
  }
#endif
  MT_CUDA_CHECK(kernels::grouped_gemm_rows(x.raw(), w.raw(), layout, static_cast<int>(e), m, k, n,
                                           false, out.raw(), out.dtype() == DType::kF32, stream()));
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const ops::ExpertRows& rows,
                                 Tensor& dx) {
  const profile::Phase phase("gpu.grouped_gemm_backward_input");
  const int64_t m = dy.dim(0), e = w.dim(0), k = w.dim(1), n = w.dim(2);
  expect_shape(dy, {m, n}, "grouped gemm dy");
  expect_shape(dx, {m, k}, "grouped gemm dx");
  const kernels::ExpertSegments layout = check_grouped({&dy, &w}, dx, rows, e, k, n);
#if MOETRAIN_HAS_CUTLASS
  if (should_use_cutlass_grouped(dx, DType::kBF16) && whole_row_tiles(rows)) {
    Tensor ws = workspace(kernels::cutlass_fixed_input_gradient_workspace(m, k));
    MT_CUDA_CHECK(kernels::cutlass_fixed_input_gradient(layout.segments, static_cast<int>(e),
                                                        dy.raw(), w.raw(), dx.raw(), m, k, n,
                                                        ws.raw(), ws.nbytes(), stream()));
    return;
  }
  if (should_use_cutlass_grouped(dx, DType::kBF16)) {
    Tensor ws = workspace(kernels::cutlass_grouped_input_gradient_workspace(static_cast<int>(e)));
    MT_CUDA_CHECK(kernels::cutlass_grouped_input_gradient(layout, static_cast<int>(e), dy.raw(),
                                                          w.raw(), dx.raw(), m, k, n, ws.raw(),
                                                          ws.nbytes(), stream()));
    return;
  }
#endif
  // dx (m, k) = dy (m, n) @ w[e]^T: inner n, output width k.
  MT_CUDA_CHECK(kernels::grouped_gemm_rows(dy.raw(), w.raw(), layout, static_cast<int>(e), m, n, k,
                                           true, dx.raw(), dx.dtype() == DType::kF32, stream()));
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ops::ExpertRows& rows,
                                  Tensor& dw, ops::Accumulate acc) {
  const profile::Phase phase("gpu.grouped_gemm_backward_weight");
  const bool accumulate = acc == ops::Accumulate::kYes;
  const int64_t m = x.dim(0), e = dw.dim(0), k = dw.dim(1), n = dw.dim(2);
  expect_shape(x, {m, k}, "grouped gemm x");
  expect_shape(dy, {m, n}, "grouped gemm dy");
  const kernels::ExpertSegments layout = check_grouped({&x, &dy}, dw, rows, e, k, n);
  if (!accumulate)  // the GEMMs write only experts with rows
    MT_CUDA_CHECK(kernels::zero_empty_groups(layout.offsets, static_cast<int>(e), dw.raw(), k * n,
                                             dw.dtype() == DType::kF32, stream()));
#if MOETRAIN_HAS_CUTLASS
  if (should_use_cutlass_grouped(dw, DType::kF32)) {
    Tensor ws = workspace(kernels::cutlass_grouped_weight_gradient_workspace(static_cast<int>(e)));
    MT_CUDA_CHECK(kernels::cutlass_grouped_weight_gradient(layout, static_cast<int>(e), x.raw(),
                                                           dy.raw(), dw.raw(), m, k, n, ws.raw(),
                                                           ws.nbytes(), accumulate, stream()));
    return;
  }
#endif
  MT_CUDA_CHECK(kernels::grouped_gemm_weight(x.raw(), dy.raw(), layout, static_cast<int>(e), k, n,
                                             dw.raw(), dw.dtype() == DType::kF32, accumulate,
                                             stream()));
}

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

void rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const profile::Phase phase("gpu.rmsnorm_forward");
  const int64_t n = x.dim(0), d = x.dim(1);
  expect_shape(w, {d}, "rmsnorm weight");
  expect_shape(y, {n, d}, "rmsnorm y");
  expect_shape(rstd, {n}, "rmsnorm rstd");
  expect_dtype(rstd, DType::kF32, "rmsnorm rstd (GPU)");
  same_storage_type(x, w, "rmsnorm weight");
  same_storage_type(x, y, "rmsnorm y");
  MT_CUDA_CHECK(kernels::rmsnorm_forward(storage_of(x, "rmsnorm x"), x.raw(), w.raw(),
                                         static_cast<float>(eps), y.raw(), rstd.data<float>(), n, d,
                                         stream()));
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw) {
  const profile::Phase phase("gpu.rmsnorm_backward");
  const int64_t n = x.dim(0), d = x.dim(1);
  expect_shape(dy, {n, d}, "rmsnorm dy");
  expect_shape(dx, {n, d}, "rmsnorm dx");
  expect_shape(dw, {d}, "rmsnorm dw");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&w, &dy, &dx})
    same_storage_type(x, *t, "rmsnorm operand");
  MT_CHECK(dw.device() == Device::kCUDA && (dw.dtype() == x.dtype() || dw.dtype() == DType::kF32),
           "rmsnorm dw must be {} or f32 on the GPU", dtype_name(x.dtype()));
  Tensor partial = Tensor::empty({kernels::rmsnorm_chunks(n), d}, DType::kF32, Device::kCUDA);
  MT_CUDA_CHECK(kernels::rmsnorm_backward(
      storage_of(x, "rmsnorm x"), x.raw(), w.raw(), rstd.data<float>(), dy.raw(), dx.raw(),
      dw.raw(), dw.dtype() == DType::kF32, partial.data<float>(), n, d, stream()));
}

void rope_apply(const Tensor& x, const Tensor& positions, double theta, int direction, Tensor& y) {
  const profile::Phase phase("gpu.rope_apply");
  same_storage_type(x, y, "rope output");
  MT_CHECK(positions.device() == Device::kCUDA, "rope positions must be on the GPU");
  MT_CUDA_CHECK(kernels::rope(storage_of(x, "rope x"), x.raw(), positions.data<int32_t>(), theta,
                              direction, y.raw(), x.dim(0), x.dim(1), x.dim(2), stream()));
}

namespace {
// The SwiGLU rows' extras as the kernels take them (f32 weights on the GPU).
kernels::SwigluRows swiglu_rows(const int32_t* row_token, const Tensor* row_weight,
                                Tensor* drow_weight) {
  kernels::SwigluRows rows{row_token, nullptr, nullptr};
  if (row_weight) {
    expect_dtype(*row_weight, DType::kF32, "swiglu row weights (GPU: f32)");
    rows.weight = row_weight->data<float>();
  }
  if (drow_weight) rows.dweight = drow_weight->data<float>();
  return rows;
}
}  // namespace

bool swiglu_forward(const Tensor& h, Tensor& a, const int32_t* row_token, const Tensor* row_weight,
                    const ops::MxValuesOut* mx) {
  const profile::Phase phase("gpu.swiglu_forward");
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(a, {m, f}, "swiglu out");
  same_storage_type(h, a, "swiglu out");
  return launch_row_writer(mx, [&](const ops::MxValuesOut* with) {
    return kernels::swiglu_forward(storage_of(h, "swiglu h"), h.raw(), a.raw(), m, f,
                                   swiglu_rows(row_token, row_weight, nullptr), mx_values_out(with),
                                   stream());
  });
}

bool swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const int32_t* row_token,
                     const Tensor* row_weight, Tensor* drow_weight, const ops::MxValuesOut* mx) {
  const profile::Phase phase("gpu.swiglu_backward");
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(da, {m, f}, "swiglu da");
  expect_shape(dh, h.shape(), "swiglu dh");
  same_storage_type(h, da, "swiglu da");
  same_storage_type(h, dh, "swiglu dh");
  return launch_row_writer(mx, [&](const ops::MxValuesOut* with) {
    return kernels::swiglu_backward(storage_of(h, "swiglu h"), h.raw(), da.raw(), dh.raw(), m, f,
                                    swiglu_rows(row_token, row_weight, drow_weight),
                                    mx_values_out(with), stream());
  });
}

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                           Tensor& lse, Tensor& loss_sum, Tensor* token_loss) {
  const profile::Phase phase("gpu.cross_entropy_forward");
  const int64_t n = logits.dim(0), v = logits.dim(1);
  expect_shape(lse, {n}, "loss lse");
  expect_dtype(lse, DType::kF32, "loss lse (GPU)");
  expect_dtype(loss_sum, DType::kF64, "loss sum (GPU)");
  // The kernel writes every row's loss before summing them: into token_loss where asked for.
  Tensor loss = token_loss ? *token_loss : gpu_empty({n}, DType::kF32);
  MT_CUDA_CHECK(kernels::cross_entropy_forward(
      storage_of(logits, "logits"), logits.raw(), targets.data<int32_t>(), mask.data<uint8_t>(),
      lse.data<float>(), loss.data<float>(), loss_sum.data<double>(), n, v, stream()));
}

void cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& mask,
                            const Tensor& lse, const Tensor& grad_scale, Tensor& dlogits) {
  const profile::Phase phase("gpu.cross_entropy_backward");
  expect_shape(dlogits, logits.shape(), "dlogits");
  same_storage_type(logits, dlogits, "dlogits");
  expect_dtype(grad_scale, DType::kF64, "loss grad scale (GPU)");
  MT_CUDA_CHECK(kernels::cross_entropy_backward(
      storage_of(logits, "logits"), logits.raw(), targets.data<int32_t>(), mask.data<uint8_t>(),
      lse.data<float>(), grad_scale.data<double>(), dlogits.raw(), logits.dim(0), logits.dim(1),
      stream()));
}

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
