#include "ops/cpu/grouped_gemm.h"

#include "ops/cpu/gemm.h"

namespace mt::ops::cpu {

namespace {
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
}  // namespace

void grouped_gemm(const Tensor& a, const Tensor& w, Transpose tw, const ExpertRows& rows,
                  Tensor& out) {
  for (int64_t e = 0; e < w.dim(0); ++e) {
    if (row_count(rows, e) == 0) continue;
    Tensor o = expert_slice(out, rows, e);
    cpu::gemm(expert_slice(a, rows, e), Transpose::kNo, expert_weight(w, e), tw, o,
              Accumulate::kNo);
  }
}

void grouped_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                  Tensor& dw, Accumulate accumulate) {
  if (accumulate == Accumulate::kNo) dw.zero_();
  for (int64_t e = 0; e < dw.dim(0); ++e) {
    if (row_count(rows, e) == 0) continue;
    Tensor o = expert_weight(dw, e);
    cpu::gemm(expert_slice(x, rows, e), Transpose::kYes, expert_slice(dy, rows, e), Transpose::kNo,
              o, Accumulate::kYes);
  }
}

}  // namespace mt::ops::cpu
