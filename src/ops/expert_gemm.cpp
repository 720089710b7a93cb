#include "ops/expert_gemm.h"

#include <fmt/format.h>

#include <array>

#include "core/enum_names.h"
#include "core/profile.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
#include "ops/fp8_gemm.h"
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
void allocate_copy(const Tensor& w, QuantAxis along, DType dtype, Tensor& out) {
  if (!out.defined())
    out = Tensor::empty(along == QuantAxis::kDim1 ? transposed_shape(w.shape()) : w.shape(), dtype,
                        w.device());
}

// w's MX values along `along` as `dtype` holds them, read as stored, into out (allocate_copy).
void mx_weight(const Tensor& w, QuantAxis along, MxScaleRule rule, DType dtype, Tensor& out) {
  allocate_copy(w, along, dtype, out);
  if (along == QuantAxis::kDim0) return mx_round_trip(w, QuantAxis::kDim0, rule, out);
  mx_round_trip_transposed(w, rule, out);
}

Tensor mx_weight(const Tensor& w, QuantAxis along, MxScaleRule rule) {
  const profile::Phase phase("mx.weight_copy");
  Tensor out;
  mx_weight(w, along, rule, w.dtype(), out);
  return out;
}

// The rows' MX values along their width (dim0): what the product multiplies.
Tensor mx_rows(const Tensor& x, MxScaleRule rule) {
  const profile::Phase phase("mx.round_trip_rows");
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  mx_round_trip(x, QuantAxis::kDim0, rule, out);
  return out;
}

// The FP8 recipes' operands, quantized where the product needs them.
QuantTensor fp8_rows(const Tensor& x, Fp8ScaleRule rule) {
  const profile::Phase phase("fp8.quantize_rows");
  QuantTensor q = QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, x.device());
  fp8_quantize(x, rule, q);
  return q;
}

// w (E, K, N) in 128 x 128 tiles stored along `axis`: dim1 (w^T) for the forward, dim0 for the
// input gradient.
QuantTensor fp8_weight(const Tensor& w, QuantAxis axis, Fp8ScaleRule rule) {
  const profile::Phase phase("fp8.quantize_weight");
  QuantTensor q = QuantTensor::empty(w.shape(), QuantBlock::kTile128, axis, w.device());
  fp8_quantize(w, rule, q);
  return q;
}

QuantTensor fp8_along_tokens(const Tensor& t, const ExpertRows& rows, Fp8ScaleRule rule) {
  const profile::Phase phase("fp8.quantize_expert_rows");
  QuantTensor q = QuantTensor::empty(fp8_expert_rows_shape(t), QuantBlock::kRow128,
                                     QuantAxis::kDim1, t.device());
  fp8_quantize_expert_rows(t, rows, rule, q);
  return q;
}

// The weight gradient's operand values in 128-row blocks per expert (any layout; the CPU's).
Tensor fp8_round_trip_rows(const Tensor& t, const ExpertRows& rows, Fp8ScaleRule rule) {
  Tensor out = t.dtype() == DType::kF64 ? t.clone() : t.to(DType::kF32);
  fp8_round_trip_expert_rows(out, rows, rule, out);
  return out;
}

}  // namespace

constexpr std::array<EnumName<ExpertRecipe>, 5> kRecipes{
    {{ExpertRecipe::kBf16, "bf16"},
     {ExpertRecipe::kMxfp8, "mxfp8"},
     {ExpertRecipe::kMxfp8WgradWithHp, "mxfp8_wgrad_with_hp"},
     {ExpertRecipe::kFp8Blockwise, "fp8_blockwise"},
     {ExpertRecipe::kFp8WgradWithHp, "fp8_wgrad_with_hp"}}};
constexpr std::array<EnumName<RowWire>, 3> kRowWires{
    {{RowWire::kAsIs, "bf16"}, {RowWire::kMxfp8, "mxfp8"}, {RowWire::kFp8, "fp8_blockwise"}}};

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

int64_t ExpertPrecision::dim_multiple() const {
  return mx_forward_and_input() ? kMxBlock : fp8_forward_and_input() ? kFp8Block : 1;
}

std::string ExpertPrecision::invalid_combination() const {
  if (dispatch == RowWire::kMxfp8 && !mx_forward_and_input())
    return fmt::format(
        "parallel.ep_dispatch_dtype = \"mxfp8\" needs an MX expert recipe (the expert GEMMs take "
        "the rows as they arrive), not model.expert_recipe = \"{}\": set \"mxfp8_wgrad_with_hp\" "
        "or \"mxfp8\"",
        expert_recipe_name(recipe));
  if (dispatch == RowWire::kFp8 && !fp8_forward_and_input())
    return fmt::format(
        "parallel.ep_dispatch_dtype = \"fp8_blockwise\" needs an FP8 expert recipe (the expert "
        "GEMMs take the rows as they arrive), not model.expert_recipe = \"{}\": set "
        "\"fp8_wgrad_with_hp\" or \"fp8_blockwise\"",
        expert_recipe_name(recipe));
  const bool quantized_twice = (dispatch == RowWire::kMxfp8 && recipe == ExpertRecipe::kMxfp8) ||
                               (dispatch == RowWire::kFp8 && recipe == ExpertRecipe::kFp8Blockwise);
  if (quantized_twice && !requant_dim1)
    return fmt::format(
        "parallel.ep_dispatch_dtype = \"{}\" with model.expert_recipe = \"{}\": the rows arrive "
        "quantized along the hidden dimension (dim0), and the weight gradient needs them quantized "
        "along the tokens (dim1), which they can no longer give as the original bf16 would; use "
        "model.expert_recipe = \"{}_wgrad_with_hp\" (weight gradient in bf16 from the "
        "dequantized rows), or model.requant_dim1 = true (re-quantize the dequantized rows along "
        "dim1; docs/numerics.md measures the difference)",
        dispatch_dtype_name(dispatch), expert_recipe_name(recipe),
        recipe == ExpertRecipe::kMxfp8 ? "mxfp8" : "fp8");
  if (requant_dim1 && !quantized_twice)
    return "model.requant_dim1 = true applies only with parallel.ep_dispatch_dtype = \"mxfp8\" and "
           "model.expert_recipe = \"mxfp8\", or \"fp8_blockwise\" with \"fp8_blockwise\" (it "
           "re-quantizes rows that arrived quantized)";
  return {};
}

namespace {

// w's FP8 tiles for `use`, from w as the products read it (rounded to `dtype` first).
void make_fp8_copies(const Tensor& w, Fp8ScaleRule rule, DType dtype, CopyUse use,
                     WeightCopies& out) {
  Tensor rounded = w;
  if (w.dtype() != dtype) {
    rounded = Tensor::empty(w.shape(), dtype, w.device());
    convert(w, rounded);
  }
  const auto tiles = [&](QuantTensor& q, QuantAxis axis) {
    if (!q.defined()) q = QuantTensor::empty(w.shape(), QuantBlock::kTile128, axis, w.device());
  };
  if (use != CopyUse::kBackward) tiles(out.fp8_forward, QuantAxis::kDim1);
  if (use != CopyUse::kForward) tiles(out.fp8_input, QuantAxis::kDim0);
  if (use == CopyUse::kBoth)  // one read of w for both
    return fp8_quantize_both_axes(rounded, rule, out.fp8_input, out.fp8_forward);
  if (use == CopyUse::kForward) return fp8_quantize(rounded, rule, out.fp8_forward);
  fp8_quantize(rounded, rule, out.fp8_input);
}

}  // namespace

void make_weight_copies(const Tensor& w, const ExpertPrecision& p, DType dtype, CopyUse use,
                        WeightCopies& out) {
  if (p.fp8_forward_and_input()) {
    const profile::Phase phase("fp8.weight_copies");
    return make_fp8_copies(w, p.fp8_scale, dtype, use, out);
  }
  MT_CHECK(p.mx_forward_and_input(), "weight copies for the {} recipe, which reads none",
           expert_recipe_name(p.recipe));
  const profile::Phase phase("mx.weight_copies");
  if (use == CopyUse::kBoth) {  // one read of w for both
    allocate_copy(w, QuantAxis::kDim1, dtype, out.along_k);
    allocate_copy(w, QuantAxis::kDim0, dtype, out.along_n);
    return mx_round_trip_both_axes(w, p.rule, out.along_n, out.along_k);
  }
  if (use != CopyUse::kBackward) mx_weight(w, QuantAxis::kDim1, p.rule, dtype, out.along_k);
  if (use != CopyUse::kForward) mx_weight(w, QuantAxis::kDim0, p.rule, dtype, out.along_n);
}

namespace {

// The copy a product reads: the one made beforehand (a gather for another pass may have made
// only the other), else made now from w.
const char* kMissingCopy =
    "the {} product was given the weight's copies without the one it reads (a gather for another "
    "pass made them: fsdp::gather's use)";

Tensor weight_copy(const QuantOperands& made, Tensor WeightCopies::*copy, const Tensor& w,
                   QuantAxis along, MxScaleRule rule, const char* product) {
  if (!made.weight) return mx_weight(w, along, rule);
  const Tensor& t = made.weight->*copy;
  MT_CHECK(t.defined(), fmt::runtime(kMissingCopy), product);
  return t;
}

QuantTensor fp8_weight_copy(const QuantOperands& made, QuantTensor WeightCopies::*copy,
                            const Tensor& w, QuantAxis axis, Fp8ScaleRule rule,
                            const char* product) {
  if (!made.weight) return fp8_weight(w, axis, rule);
  const QuantTensor& q = made.weight->*copy;
  MT_CHECK(q.defined(), fmt::runtime(kMissingCopy), product);
  return q;
}

// The rows' FP8 operand a product reads: the one made beforehand (ops::Fp8RowsOut, of x's shape),
// else quantized now from x.
QuantTensor fp8_rows_copy(const QuantOperands& made, const Tensor& x, Fp8ScaleRule rule,
                          const char* op) {
  if (!made.fp8_rows) return fp8_rows(x, rule);
  MT_CHECK(made.fp8_rows->shape() == x.shape(), "{}: the FP8 rows given are {}, the rows {}", op,
           shape_str(made.fp8_rows->shape()), shape_str(x.shape()));
  return *made.fp8_rows;
}

}  // namespace

// out = a b^T over the experts' rows, with b (E, P, Q): grouped_gemm_backward_input's product.
void expert_gemm_forward(const Tensor& x, const Tensor& w, const ExpertRows& rows,
                         const ExpertPrecision& p, Tensor& out, const QuantOperands& made) {
  if (p.fp8_forward_and_input())
    return fp8_grouped_gemm(fp8_rows_copy(made, x, p.fp8_scale, "expert_gemm_forward"),
                            fp8_weight_copy(made, &WeightCopies::fp8_forward, w, QuantAxis::kDim1,
                                            p.fp8_scale, "forward FP8"),
                            rows, out);
  if (!p.mx_forward_and_input()) return grouped_gemm_forward(x, w, rows, out);
  grouped_gemm_backward_input(
      made.rows ? *made.rows : mx_rows(x, p.rule),
      weight_copy(made, &WeightCopies::along_k, w, QuantAxis::kDim1, p.rule, "forward MX"), rows,
      out);
}

void expert_gemm_backward_input(const Tensor& dy, const Tensor& w, const ExpertRows& rows,
                                const ExpertPrecision& p, Tensor& dx, const QuantOperands& made) {
  if (p.fp8_forward_and_input())
    return fp8_grouped_gemm(fp8_rows_copy(made, dy, p.fp8_scale, "expert_gemm_backward_input"),
                            fp8_weight_copy(made, &WeightCopies::fp8_input, w, QuantAxis::kDim0,
                                            p.fp8_scale, "input-gradient FP8"),
                            rows, dx);
  if (!p.mx_forward_and_input()) return grouped_gemm_backward_input(dy, w, rows, dx);
  grouped_gemm_backward_input(
      made.rows ? *made.rows : mx_rows(dy, p.rule),
      weight_copy(made, &WeightCopies::along_n, w, QuantAxis::kDim0, p.rule, "input-gradient MX"),
      rows, dx);
}

void expert_gemm_backward_weight(const Tensor& x, const Tensor& dy, const ExpertRows& rows,
                                 const ExpertPrecision& p, Tensor& dw, Accumulate accumulate) {
  if (p.fp8_weight_gradient()) {
    if (rows.align % kFp8Block == 0)  // whole 128-row blocks per expert: the FP8 product
      return fp8_grouped_gemm_weight(fp8_along_tokens(x, rows, p.fp8_scale),
                                     fp8_along_tokens(dy, rows, p.fp8_scale), rows, dw, accumulate);
    MT_CHECK(x.device() == Device::kCPU,
             "the FP8 weight gradient on the GPU needs the experts' rows on 128-row segments "
             "(ExpertRows::align {}): the MoE layer's padded layout",
             rows.align);
    return grouped_gemm_backward_weight(fp8_round_trip_rows(x, rows, p.fp8_scale),
                                        fp8_round_trip_rows(dy, rows, p.fp8_scale), rows, dw,
                                        accumulate);
  }
  if (!p.mx_weight_gradient()) return grouped_gemm_backward_weight(x, dy, rows, dw, accumulate);
  grouped_gemm_backward_weight(round_trip_rows(x, rows, p.rule), round_trip_rows(dy, rows, p.rule),
                               rows, dw, accumulate);
}

}  // namespace mt::ops
