#include "ops/expert_gemm.h"

#include <array>

#include "core/enum_names.h"
#include "core/profile.h"
#include "ops/mx.h"
#include "ops/mx_gemm.h"

namespace mt::ops {

namespace {

Tensor round_trip_rows(const Tensor& t, const ExpertRows& rows, MxScaleRule rule) {
  const profile::Phase phase("mx.round_trip_expert_rows");
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  mx_round_trip_expert_rows(t, rows, rule, out);
  return out;
}

// w quantized along `along` and read as stored, into out (allocated when undefined): along K
// (dim1) gives w^T (E, N, K), along N (dim0) w (E, K, N).
void mx_weight(const Tensor& w, MxAxis along, MxScaleRule rule, Tensor& out) {
  MxTensor q = MxTensor::empty(w.shape(), along, w.device());
  mx_quantize(w, rule, q);
  const MxTensor stored = q.stored_as_dim0();
  if (!out.defined()) out = Tensor::empty(stored.shape(), w.dtype(), w.device());
  mx_dequantize(stored, out);
}

Tensor mx_weight(const Tensor& w, MxAxis along, MxScaleRule rule) {
  const profile::Phase phase("mx.weight_copy");
  Tensor out;
  mx_weight(w, along, rule, out);
  return out;
}

// The rows quantized along their width (dim0): the MX product's a.
MxTensor mx_rows(const Tensor& x, MxScaleRule rule) {
  const profile::Phase phase("mx.quantize_rows");
  MxTensor q = MxTensor::empty(x.shape(), MxAxis::kDim0, x.device());
  mx_quantize(x, rule, q);
  return q;
}

}  // namespace

constexpr std::array<EnumName<ExpertRecipe>, 3> kRecipes{
    {{ExpertRecipe::kBf16, "bf16"},
     {ExpertRecipe::kMxfp8, "mxfp8"},
     {ExpertRecipe::kMxfp8WgradWithHp, "mxfp8_wgrad_with_hp"}}};
constexpr std::array<EnumName<DispatchDtype>, 2> kDispatchDtypes{
    {{DispatchDtype::kBf16, "bf16"}, {DispatchDtype::kMxfp8, "mxfp8"}}};

std::string_view expert_recipe_name(ExpertRecipe r) {
  return enum_name(kRecipes, r);
}

bool parse_expert_recipe(std::string_view name, ExpertRecipe* out) {
  return parse_enum(kRecipes, name, out);
}

std::string_view dispatch_dtype_name(DispatchDtype d) {
  return enum_name(kDispatchDtypes, d);
}

bool parse_dispatch_dtype(std::string_view name, DispatchDtype* out) {
  return parse_enum(kDispatchDtypes, name, out);
}

std::string ExpertPrecision::invalid_combination() const {
  if (dispatch == DispatchDtype::kMxfp8 && recipe == ExpertRecipe::kBf16)
    return "parallel.ep_dispatch_dtype = \"mxfp8\" needs an MX expert recipe (the expert GEMMs "
           "take "
           "the rows as they arrive): set model.expert_recipe = \"mxfp8_wgrad_with_hp\" or "
           "\"mxfp8\"";
  if (dispatch == DispatchDtype::kMxfp8 && recipe == ExpertRecipe::kMxfp8 && !requant_dim1)
    return "parallel.ep_dispatch_dtype = \"mxfp8\" with model.expert_recipe = \"mxfp8\": the rows "
           "arrive quantized along the hidden dimension (dim0), and the weight gradient needs them "
           "quantized along the tokens (dim1), which they can no longer give as the original bf16 "
           "would; use model.expert_recipe = \"mxfp8_wgrad_with_hp\" (weight gradient in bf16 from "
           "the dequantized rows), or model.requant_dim1 = true (re-quantize the dequantized rows "
           "along dim1; docs/numerics.md measures the difference)";
  if (requant_dim1 && (dispatch != DispatchDtype::kMxfp8 || recipe != ExpertRecipe::kMxfp8))
    return "model.requant_dim1 = true applies only with parallel.ep_dispatch_dtype = \"mxfp8\" and "
           "model.expert_recipe = \"mxfp8\" (it re-quantizes rows that arrived in MXFP8)";
  return {};
}

void make_mx_weight_copies(const Tensor& w, MxScaleRule rule, MxWeightCopies& out) {
  const profile::Phase phase("mx.weight_copies");
  mx_weight(w, MxAxis::kDim1, rule, out.along_k);
  mx_weight(w, MxAxis::kDim0, rule, out.along_n);
}

void dispatched_rows(const ExpertPrecision& p, Tensor& rows) {
  if (p.dispatch != DispatchDtype::kMxfp8) return;
  const profile::Phase phase("mx.dispatch_wire");
  mx_round_trip(rows, MxAxis::kDim0, p.rule, rows);
}

void expert_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows,
                         const ExpertPrecision& p, Tensor& out, const MxWeightCopies* copies) {
  if (!p.mx_forward_and_input()) return grouped_gemm_forward(x, w, rows, out);
  mx_grouped_gemm(mx_rows(x, p.rule),
                  copies ? copies->along_k : mx_weight(w, MxAxis::kDim1, p.rule), rows, out);
}

void expert_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                const ExpertPrecision& p, Tensor& dx,
                                const MxWeightCopies* copies) {
  if (!p.mx_forward_and_input()) return grouped_gemm_backward_input(dy, w, rows, dx);
  mx_grouped_gemm(mx_rows(dy, p.rule),
                  copies ? copies->along_n : mx_weight(w, MxAxis::kDim0, p.rule), rows, dx);
}

void expert_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                 const ExpertPrecision& p, Tensor& dw, Accumulate accumulate) {
  if (!p.mx_weight_gradient()) return grouped_gemm_backward_weight(x, dy, rows, dw, accumulate);
  grouped_gemm_backward_weight(round_trip_rows(x, rows, p.rule), round_trip_rows(dy, rows, p.rule),
                               rows, dw, accumulate);
}

}  // namespace mt::ops
