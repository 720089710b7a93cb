// Reference grouped GEMM: one dense GEMM per expert on row slices.
#include "ops/grouped_gemm.h"

#include "ops/dispatch.h"
#include "ops/gemm.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {
struct GroupDims {
  int64_t experts, k, n, m;
};
GroupDims check_group(const Tensor& rows, const Tensor& w, const Tensor& offsets) {
  MT_CHECK(w.ndim() == 3, "expert weights must be (E, K, N), got {}", shape_str(w.shape()));
  GroupDims g{w.dim(0), w.dim(1), w.dim(2), rows.dim(0)};
  expect_shape(offsets, {g.experts + 1}, "expert offsets");
  expect_dtype(offsets, DType::kI64, "expert offsets");
  const int64_t* off = offsets.data<int64_t>();
  MT_CHECK(off[0] == 0 && off[g.experts] == g.m, "expert offsets must run from 0 to {}", g.m);
  return g;
}
Tensor expert_weight(const Tensor& w, int64_t e) {
  return w.view(e * w.dim(1) * w.dim(2), {w.dim(1), w.dim(2)});
}
}  // namespace

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, Tensor& out) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::grouped_gemm_forward(x, w, offsets, out);
#endif
  const GroupDims g = check_group(x, w, offsets);
  expect_shape(out, {g.m, g.n}, "grouped gemm out");
  const int64_t* off = offsets.data<int64_t>();
  for (int64_t e = 0; e < g.experts; ++e) {
    if (off[e + 1] == off[e]) continue;
    Tensor o = out.slice_rows(off[e], off[e + 1]);
    gemm(x.slice_rows(off[e], off[e + 1]), Transpose::kNo, expert_weight(w, e), Transpose::kNo, o,
         Accumulate::kNo);
  }
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets,
                                 Tensor& dx) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dy)) return cuda::grouped_gemm_backward_input(dy, w, offsets, dx);
#endif
  const GroupDims g = check_group(dy, w, offsets);
  expect_shape(dx, {g.m, g.k}, "grouped gemm dx");
  const int64_t* off = offsets.data<int64_t>();
  for (int64_t e = 0; e < g.experts; ++e) {
    if (off[e + 1] == off[e]) continue;
    Tensor o = dx.slice_rows(off[e], off[e + 1]);
    gemm(dy.slice_rows(off[e], off[e + 1]), Transpose::kNo, expert_weight(w, e), Transpose::kYes, o,
         Accumulate::kNo);
  }
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const Tensor& offsets,
                                  Tensor& dw, Accumulate accumulate) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x))
    return cuda::grouped_gemm_backward_weight(x, dy, offsets, dw, accumulate == Accumulate::kYes);
#endif
  const GroupDims g = check_group(x, dw, offsets);
  if (accumulate == Accumulate::kNo) dw.zero_();
  const int64_t* off = offsets.data<int64_t>();
  for (int64_t e = 0; e < g.experts; ++e) {
    if (off[e + 1] == off[e]) continue;
    Tensor o = expert_weight(dw, e);
    gemm(x.slice_rows(off[e], off[e + 1]), Transpose::kYes, dy.slice_rows(off[e], off[e + 1]),
         Transpose::kNo, o, Accumulate::kYes);
  }
}

}  // namespace mt::ops
