// Reference grouped GEMM: one dense GEMM per expert on row slices.
#include "ops/grouped_gemm.h"

#include <utility>

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
// Checks the layout and returns the dims; start(e) and count(e) read the host tensors.
GroupDims check_group(const Tensor& rows_tensor, const Tensor& w, const ExpertRows& rows) {
  MT_CHECK(w.ndim() == 3, "expert weights must be (E, K, N), got {}", shape_str(w.shape()));
  GroupDims g{w.dim(0), w.dim(1), w.dim(2), rows_tensor.dim(0)};
  for (const auto& [t, name] :
       {std::pair{&rows.offsets, "expert offsets"}, std::pair{&rows.segments, "expert segments"}}) {
    expect_shape(*t, {g.experts + 1}, name);
    expect_dtype(*t, DType::kI64, name);
  }
  const int64_t* off = rows.offsets.data<int64_t>();
  const int64_t* seg = rows.segments.data<int64_t>();
  MT_CHECK(off[0] == 0 && seg[0] == 0, "expert offsets must start at 0");
  for (int64_t e = 0; e < g.experts; ++e)
    MT_CHECK(
        off[e + 1] >= off[e] && seg[e] + off[e + 1] - off[e] <= seg[e + 1] && seg[e + 1] <= g.m,
        "expert {}: {} rows from row {} do not fit before the next segment ({}) within {} "
        "rows",
        e, off[e + 1] - off[e], seg[e], seg[e + 1], g.m);
  return g;
}
int64_t row_count(const ExpertRows& rows, int64_t e) {
  const int64_t* off = rows.offsets.data<int64_t>();
  return off[e + 1] - off[e];
}
// Expert e's rows of t: segments[e] .. segments[e] + its count.
Tensor expert_slice(const Tensor& t, const ExpertRows& rows, int64_t e) {
  const int64_t start = rows.segments.data<int64_t>()[e];
  return t.slice_rows(start, start + row_count(rows, e));
}
Tensor expert_weight(const Tensor& w, int64_t e) {
  return w.view(e * w.dim(1) * w.dim(2), {w.dim(1), w.dim(2)});
}
// Each expert's rows of out = its rows of a times its weight (transposed when asked): the forward
// and the input gradient; padding rows are left as they are.
void expert_products(const Tensor& a, const Tensor& w, Transpose tw, const ExpertRows& rows,
                     Tensor& out) {
  for (int64_t e = 0; e < w.dim(0); ++e) {
    if (row_count(rows, e) == 0) continue;
    Tensor o = expert_slice(out, rows, e);
    gemm(expert_slice(a, rows, e), Transpose::kNo, expert_weight(w, e), tw, o, Accumulate::kNo);
  }
}
}  // namespace

void grouped_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows, Tensor& out) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::grouped_gemm_forward(x, w, rows, out);
#endif
  const GroupDims g = check_group(x, w, rows);
  expect_shape(out, {g.m, g.n}, "grouped gemm out");
  expert_products(x, w, Transpose::kNo, rows, out);
}

void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                 Tensor& dx) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(dy)) return cuda::grouped_gemm_backward_input(dy, w, rows, dx);
#endif
  const GroupDims g = check_group(dy, w, rows);
  expect_shape(dx, {g.m, g.k}, "grouped gemm dx");
  expert_products(dy, w, Transpose::kYes, rows, dx);
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                  Tensor& dw, Accumulate accumulate) {
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::grouped_gemm_backward_weight(x, dy, rows, dw, accumulate);
#endif
  const GroupDims g = check_group(x, dw, rows);
  if (accumulate == Accumulate::kNo) dw.zero_();
  for (int64_t e = 0; e < g.experts; ++e) {
    if (row_count(rows, e) == 0) continue;
    Tensor o = expert_weight(dw, e);
    gemm(expert_slice(x, rows, e), Transpose::kYes, expert_slice(dy, rows, e), Transpose::kNo, o,
         Accumulate::kYes);
  }
}

}  // namespace mt::ops
