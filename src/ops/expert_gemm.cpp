#include "ops/expert_gemm.h"

#include <array>

#include "core/enum_names.h"
#include "core/profile.h"
#include "ops/mx.h"

namespace mt::ops {

namespace {

Tensor round_trip_rows(const Tensor& t, const ExpertRows& rows, MxScaleRule rule) {
  const profile::Phase phase("mx.round_trip_expert_rows");
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  mx_round_trip_expert_rows(t, rows, rule, out);
  return out;
}

// Allocates out, when undefined, as w's MX copy along `along` is stored: along K (dim1) w^T
// (E, N, K), along N (dim0) w (E, K, N).
void allocate_copy(const Tensor& w, MxAxis along, DType dtype, Tensor& out) {
  if (!out.defined())
    out = Tensor::empty(along == MxAxis::kDim1 ? transposed_shape(w.shape()) : w.shape(), dtype,
                        w.device());
}

// w's MX values along `along` as `dtype` holds them, read as stored, into out (allocate_copy).
void mx_weight(const Tensor& w, MxAxis along, MxScaleRule rule, DType dtype, Tensor& out) {
  allocate_copy(w, along, dtype, out);
  if (along == MxAxis::kDim0) return mx_round_trip(w, MxAxis::kDim0, rule, out);
  mx_round_trip_transposed(w, rule, out);
}

Tensor mx_weight(const Tensor& w, MxAxis along, MxScaleRule rule) {
  const profile::Phase phase("mx.weight_copy");
  Tensor out;
  mx_weight(w, along, rule, w.dtype(), out);
  return out;
}

// The rows' MX values along their width (dim0): what the product multiplies.
Tensor mx_rows(const Tensor& x, MxScaleRule rule) {
  const profile::Phase phase("mx.round_trip_rows");
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  mx_round_trip(x, MxAxis::kDim0, rule, out);
  return out;
}

}  // namespace

constexpr std::array<EnumName<ExpertRecipe>, 3> kRecipes{
    {{ExpertRecipe::kBf16, "bf16"},
     {ExpertRecipe::kMxfp8, "mxfp8"},
     {ExpertRecipe::kMxfp8WgradWithHp, "mxfp8_wgrad_with_hp"}}};
constexpr std::array<EnumName<RowWire>, 2> kRowWires{
    {{RowWire::kAsIs, "bf16"}, {RowWire::kMxfp8, "mxfp8"}}};

std::string_view expert_recipe_name(ExpertRecipe r) {
  return enum_name(kRecipes, r);
}

bool parse_expert_recipe(std::string_view name, ExpertRecipe* out) {
  return parse_enum(kRecipes, name, out);
}

std::string_view dispatch_dtype_name(RowWire d) {
  return enum_name(kRowWires, d);
}

bool parse_dispatch_dtype(std::string_view name, RowWire* out) {
  return parse_enum(kRowWires, name, out);
}

std::string ExpertPrecision::invalid_combination() const {
  if (dispatch == RowWire::kMxfp8 && recipe == ExpertRecipe::kBf16)
    return "parallel.ep_dispatch_dtype = \"mxfp8\" needs an MX expert recipe (the expert GEMMs "
           "take "
           "the rows as they arrive): set model.expert_recipe = \"mxfp8_wgrad_with_hp\" or "
           "\"mxfp8\"";
  if (dispatch == RowWire::kMxfp8 && recipe == ExpertRecipe::kMxfp8 && !requant_dim1)
    return "parallel.ep_dispatch_dtype = \"mxfp8\" with model.expert_recipe = \"mxfp8\": the rows "
           "arrive quantized along the hidden dimension (dim0), and the weight gradient needs them "
           "quantized along the tokens (dim1), which they can no longer give as the original bf16 "
           "would; use model.expert_recipe = \"mxfp8_wgrad_with_hp\" (weight gradient in bf16 from "
           "the dequantized rows), or model.requant_dim1 = true (re-quantize the dequantized rows "
           "along dim1; docs/numerics.md measures the difference)";
  if (requant_dim1 && (dispatch != RowWire::kMxfp8 || recipe != ExpertRecipe::kMxfp8))
    return "model.requant_dim1 = true applies only with parallel.ep_dispatch_dtype = \"mxfp8\" and "
           "model.expert_recipe = \"mxfp8\" (it re-quantizes rows that arrived in MXFP8)";
  return {};
}

void make_mx_weight_copies(const Tensor& w, MxScaleRule rule, DType dtype, MxCopyUse use,
                           MxWeightCopies& out) {
  const profile::Phase phase("mx.weight_copies");
  if (use == MxCopyUse::kBoth) {  // one read of w for both
    allocate_copy(w, MxAxis::kDim1, dtype, out.along_k);
    allocate_copy(w, MxAxis::kDim0, dtype, out.along_n);
    return mx_round_trip_both_axes(w, rule, out.along_n, out.along_k);
  }
  if (use != MxCopyUse::kBackward) mx_weight(w, MxAxis::kDim1, rule, dtype, out.along_k);
  if (use != MxCopyUse::kForward) mx_weight(w, MxAxis::kDim0, rule, dtype, out.along_n);
}

// The copy a product reads: the one made beforehand, else made now from w.
Tensor weight_copy(const MxOperands& made, Tensor MxWeightCopies::*copy, const Tensor& w,
                   MxAxis along, MxScaleRule rule, const char* product) {
  if (!made.weight) return mx_weight(w, along, rule);
  const Tensor& t = made.weight->*copy;
  MT_CHECK(t.defined(),
           "the {} MX product was given the weight's copies without the one it reads (a gather "
           "for another pass made them: fsdp::gather's use)",
           product);
  return t;
}

// out = a b^T over the experts' rows, with b (E, P, Q): grouped_gemm_backward_input's product.
void expert_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows,
                         const ExpertPrecision& p, Tensor& out, const MxOperands& made) {
  if (!p.mx_forward_and_input()) return grouped_gemm_forward(x, w, rows, out);
  grouped_gemm_backward_input(
      made.rows ? *made.rows : mx_rows(x, p.rule),
      weight_copy(made, &MxWeightCopies::along_k, w, MxAxis::kDim1, p.rule, "forward"), rows, out);
}

void expert_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                const ExpertPrecision& p, Tensor& dx, const MxOperands& made) {
  if (!p.mx_forward_and_input()) return grouped_gemm_backward_input(dy, w, rows, dx);
  grouped_gemm_backward_input(
      made.rows ? *made.rows : mx_rows(dy, p.rule),
      weight_copy(made, &MxWeightCopies::along_n, w, MxAxis::kDim0, p.rule, "input-gradient"), rows,
      dx);
}

void expert_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                 const ExpertPrecision& p, Tensor& dw, Accumulate accumulate) {
  if (!p.mx_weight_gradient()) return grouped_gemm_backward_weight(x, dy, rows, dw, accumulate);
  grouped_gemm_backward_weight(round_trip_rows(x, rows, p.rule), round_trip_rows(dy, rows, p.rule),
                               rows, dw, accumulate);
}

}  // namespace mt::ops
