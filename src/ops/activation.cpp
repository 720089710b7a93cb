// The SwiGLU front door (ops/activation.h): the arguments checked once, then the CPU reference
// (ops/cpu/activation.cpp) or the kernels (ops/cuda/activation.cu); the output's MX values fused
// into the GPU kernel where it can write them, else written after it (ops::write_mx_values).
#include "ops/activation.h"

#include "ops/cpu/activation.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "core/profile.h"
#include "ops/cuda/activation.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {
// The padding marks and row weights of a SwigluRows against h's rows and device.
void check_rows(const SwigluRows& rows, const Tensor& h) {
  MT_CHECK(h.ndim() == 2 && h.dim(1) % 2 == 0, "swiglu input {} must be (M, 2F)",
           shape_str(h.shape()));
  if (rows.token) {
    expect_dtype(*rows.token, DType::kI32, "swiglu row tokens");
    expect_shape(*rows.token, {h.dim(0)}, "swiglu row tokens");
    MT_CHECK(rows.token->device() == h.device(), "swiglu row tokens must be on the rows' device");
  }
  if (rows.weight) {
    expect_shape(*rows.weight, {h.dim(0)}, "swiglu row weights");
    MT_CHECK(rows.weight->device() == h.device(), "swiglu row weights must be on the rows' device");
    expect_dtype(*rows.weight, on_gpu(h) ? DType::kF32 : h.dtype(),
                 on_gpu(h) ? "swiglu row weights (GPU: f32)" : "swiglu row weights");
  }
}

// The gradient of the row weights exists exactly when the weights do.
void check_weight_gradient(const SwigluRows& rows, const Tensor* dweight) {
  MT_CHECK((rows.weight == nullptr) == (dweight == nullptr),
           "swiglu backward: row weights and their gradient go together (weights {}, gradient {})",
           rows.weight ? "given" : "absent", dweight ? "given" : "absent");
  if (dweight) {
    expect_shape(*dweight, rows.weight->shape(), "swiglu row-weight gradient");
    expect_dtype(*dweight, rows.weight->dtype(), "swiglu row-weight gradient");
    MT_CHECK(dweight->device() == rows.weight->device(),
             "swiglu row-weight gradient must be on the weights' device");
  }
}

#if MOETRAIN_HAS_CUDA
// The rows' extras as the kernels take them (f32 weights on the GPU, checked above).
cuda::kernels::SwigluRows kernel_rows(const SwigluRows& rows, Tensor* dweight) {
  return {rows.token ? rows.token->data<int32_t>() : nullptr,
          rows.weight ? rows.weight->data<float>() : nullptr,
          dweight ? dweight->data<float>() : nullptr};
}
#endif
}  // namespace

void swiglu_forward(const Tensor& h, Tensor& a, const SwigluRows& rows, const MxValuesOut* mx,
                    const Fp8RowsOut* fp8) {
  check_rows(rows, h);
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(a, {m, f}, "swiglu out");
  check_mx_values("swiglu_forward", a, mx);
  check_fp8_rows("swiglu_forward", a, fp8);
  MT_CHECK(!(mx && fp8), "swiglu_forward: MX values or FP8 rows, not both");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(h)) {
    const profile::Phase phase("gpu.swiglu_forward");
    cuda::same_storage_type(h, a, "swiglu out");
    const DType st = cuda::storage_of(h, "swiglu h");
    const auto fused = cuda::fused_mx_values(mx, st, f, {h.raw(), a.raw()});
    cuda::launch_with_fp8_rows(fp8, a, [&](cuda::kernels::Fp8RowsOut rows_fp8) {
      return cuda::kernels::swiglu_forward(st, h.raw(), a.raw(), m, f, kernel_rows(rows, nullptr),
                                           fused, rows_fp8, cuda::stream());
    });
    if (mx && !fused.values) write_mx_values(a, *mx);
    return;
  }
#endif
  cpu::swiglu_forward(h, a, rows);
  if (mx) write_mx_values(a, *mx);
  if (fp8) write_fp8_rows(a, *fp8);
}

void swiglu_backward(const Tensor& h, const Tensor& da, Tensor& dh, const SwigluRows& rows,
                     Tensor* dweight, const MxValuesOut* mx, const Fp8RowsOut* fp8) {
  check_rows(rows, h);
  check_weight_gradient(rows, dweight);
  const int64_t m = h.dim(0), f = h.dim(1) / 2;
  expect_shape(da, {m, f}, "swiglu da");
  expect_shape(dh, h.shape(), "swiglu dh");
  check_mx_values("swiglu_backward", dh, mx);
  check_fp8_rows("swiglu_backward", dh, fp8);
  MT_CHECK(!(mx && fp8), "swiglu_backward: MX values or FP8 rows, not both");
#if MOETRAIN_HAS_CUDA
  if (on_gpu(h)) {
    const profile::Phase phase("gpu.swiglu_backward");
    cuda::same_storage_type(h, da, "swiglu da");
    cuda::same_storage_type(h, dh, "swiglu dh");
    const DType st = cuda::storage_of(h, "swiglu h");
    // The fused kernel reads and writes rows of f elements in packs: dh's two halves as h's.
    const auto fused = cuda::fused_mx_values(mx, st, f, {h.raw(), da.raw(), dh.raw()});
    cuda::launch_with_fp8_rows(fp8, dh, [&](cuda::kernels::Fp8RowsOut rows_fp8) {
      return cuda::kernels::swiglu_backward(st, h.raw(), da.raw(), dh.raw(), m, f,
                                            kernel_rows(rows, dweight), fused, rows_fp8,
                                            cuda::stream());
    });
    if (mx && !fused.values) write_mx_values(dh, *mx);
    return;
  }
#endif
  cpu::swiglu_backward(h, da, dh, rows, dweight);
  if (mx) write_mx_values(dh, *mx);
  if (fp8) write_fp8_rows(dh, *fp8);
}

}  // namespace mt::ops
