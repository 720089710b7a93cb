// The dense GEMM's front door (ops/gemm.h): the shapes checked once, then the CPU reference
// (ops/cpu/gemm.cpp) or cuBLASLt (ops/cuda/gemm.cpp). The linear layers are GEMMs.
#include "ops/gemm.h"

#include "core/profile.h"
#include "ops/cpu/gemm.h"
#include "ops/dispatch.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/gemm.h"
#include "ops/cuda/operands.h"
#endif

namespace mt::ops {

namespace {
struct GemmDims {
  int64_t m, n, k;
};

GemmDims check_gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, const Tensor& c) {
  MT_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm needs 2-d tensors, got {} {} {}",
           shape_str(a.shape()), shape_str(b.shape()), shape_str(c.shape()));
  const int64_t m = ta == Transpose::kNo ? a.dim(0) : a.dim(1);
  const int64_t k = ta == Transpose::kNo ? a.dim(1) : a.dim(0);
  const int64_t kb = tb == Transpose::kNo ? b.dim(0) : b.dim(1);
  const int64_t n = tb == Transpose::kNo ? b.dim(1) : b.dim(0);
  MT_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, "gemm shapes {}{} x {}{} -> {}",
           shape_str(a.shape()), ta == Transpose::kYes ? "^T" : "", shape_str(b.shape()),
           tb == Transpose::kYes ? "^T" : "", shape_str(c.shape()));
  MT_CHECK(a.device() == b.device() && a.device() == c.device(),
           "gemm operands on different devices");
  return {m, n, k};
}

#if MOETRAIN_HAS_CUDA
// d = op(a) op(b) + beta c on the GPU: bf16 or f32 operands, d of their dtype or f32; c (null:
// d itself) read by the epilogue.
void gpu_gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, const Tensor* c,
              Tensor& d, float beta, const GemmDims& g) {
  const profile::Phase phase("gpu.gemm");
  MT_CHECK(a.dtype() == b.dtype(), "GPU gemm operands differ: {} vs {}", dtype_name(a.dtype()),
           dtype_name(b.dtype()));
  MT_CHECK(d.dtype() == a.dtype() || d.dtype() == DType::kF32,
           "GPU gemm output {} for {} operands (valid: the operands' dtype or f32)",
           dtype_name(d.dtype()), dtype_name(a.dtype()));
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // cuBLAS takes no empty inner dimension: d = beta c
    if (c) return d.copy_from(*c);
    if (beta == 0.0f) d.zero_();
    return;
  }
  cuda::kernels::gemm(cuda::storage_of(a, "gemm a"), a.raw(), ta, b.raw(), tb, d.dtype(),
                      c ? c->raw() : d.raw(), d.raw(), g.m, g.n, g.k, beta, cuda::stream());
}
#endif
}  // namespace

void gemm(const Tensor& a, Transpose ta, const Tensor& b, Transpose tb, Tensor& c, Accumulate acc) {
  [[maybe_unused]] const GemmDims g = check_gemm(a, ta, b, tb, c);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(a))
    return gpu_gemm(a, ta, b, tb, nullptr, c, acc == Accumulate::kYes ? 1.0f : 0.0f, g);
#endif
  MT_CHECK(a.dtype() == b.dtype() && a.dtype() == c.dtype(), "gemm dtypes differ");
  cpu::gemm(a, ta, b, tb, c, acc);
}

void linear_forward(const Tensor& x, const Tensor& w, Tensor& y) {
  gemm(x, Transpose::kNo, w, Transpose::kNo, y, Accumulate::kNo);
}

void linear_forward_residual(const Tensor& x, const Tensor& w, const Tensor& residual, Tensor& y) {
  MT_CHECK(
      residual.shape() == y.shape() && residual.dtype() == y.dtype() && residual.raw() != y.raw(),
      "linear residual {} {} for output {} {} (same shape and dtype, another buffer)",
      dtype_name(residual.dtype()), shape_str(residual.shape()), dtype_name(y.dtype()),
      shape_str(y.shape()));
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    const GemmDims g = check_gemm(x, Transpose::kNo, w, Transpose::kNo, y);
    return gpu_gemm(x, Transpose::kNo, w, Transpose::kNo, &residual, y, 1.0f, g);
  }
#endif
  y.copy_from(residual);
  gemm(x, Transpose::kNo, w, Transpose::kNo, y, Accumulate::kYes);
}

void linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor& dx, Tensor& dw,
                     Accumulate dx_accumulate, Transpose tw) {
  {
    const profile::Phase phase("linear_backward.dx");
    gemm(dy, Transpose::kNo, w, tw == Transpose::kYes ? Transpose::kNo : Transpose::kYes, dx,
         dx_accumulate);
  }
  linear_backward_weight(x, dy, dw, tw);
}

void linear_backward_weight(const Tensor& x, const Tensor& dy, Tensor& dw, Transpose tw) {
  const profile::Phase phase("linear_backward.dw");
  if (tw == Transpose::kYes)
    gemm(dy, Transpose::kYes, x, Transpose::kNo, dw, Accumulate::kYes);
  else
    gemm(x, Transpose::kYes, dy, Transpose::kNo, dw, Accumulate::kYes);
}

}  // namespace mt::ops
