// The experts' GEMM recipes (ops/expert_gemm.h) on the CPU: each recipe's three products against
// fp64 math on operands quantized independently (whole-tensor mx_quantize / mx_dequantize, and
// per expert zero-padded matrices for the weight gradient); the expert-rows round trip; the
// recipe's config keys and the MXFP8 dispatch's coupling rule; and a tiny training run per
// recipe.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "core/quant.h"
#include "core/rng.h"
#include "hf_fixture.h"
#include "model/qwen3_moe.h"
#include "moe/moe_layer.h"
#include "mx_cases.h"
#include "ops/expert_gemm.h"
#include "ops/fp8.h"
#include "ops/mx.h"
#include "ops/mx_gemm.h"
#include "testing.h"
#if MOETRAIN_HAS_CUDA
#include "gpu_case.h"
#endif
#include "train/config.h"
#include "train/optimizer.h"
#include "train/trainer.h"

namespace mt {
namespace {

// Three experts: 45 rows (one short block), none, and 70 rows starting on row 64 of a padded
// buffer (rows 45..63 and 134..159 are padding).
struct Layout {
  Tensor offsets = Tensor::empty({4}, DType::kI64);
  Tensor segments = Tensor::empty({4}, DType::kI64);
  int64_t rows = 160;
  Layout() {
    const int64_t off[] = {0, 45, 45, 115}, seg[] = {0, 64, 64, 160};
    for (int i = 0; i < 4; ++i) {
      offsets.data<int64_t>()[i] = off[i];
      segments.data<int64_t>()[i] = seg[i];
    }
  }
  ops::ExpertRows expert_rows() const { return {offsets, segments, 32}; }
  int64_t first(int e) const { return segments.data<int64_t>()[e]; }
  int64_t count(int e) const { return offsets.data<int64_t>()[e + 1] - offsets.data<int64_t>()[e]; }
};

// The tensor after an independent quantize + dequantize along axis (f64 out).
Tensor round_tripped(const Tensor& t, QuantAxis axis) {
  QuantTensor q = QuantTensor::poisoned(t.shape(), QuantBlock::kMx32, axis);
  ops::mx_quantize(t, MxScaleRule::kRceil, q);
  Tensor out = Tensor::poisoned(t.shape(), DType::kF64);
  ops::mx_dequantize(q, out);
  return out;
}

// Expert e's rows of x, zero-padded to whole blocks, quantized down the columns (dim1).
Tensor expert_rows_round_tripped(const Tensor& x, const Layout& l, int e) {
  const int64_t n = l.count(e), k = x.dim(1), padded = (n + kMxBlock - 1) / kMxBlock * kMxBlock;
  Tensor block = Tensor::zeros({padded, k}, DType::kF64);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c) block.set_item(r * k + c, x.item((l.first(e) + r) * k + c));
  return round_tripped(block, QuantAxis::kDim1);
}

double rel(const Tensor& got, const Tensor& want, const Layout& l, int64_t width) {
  double num = 0, den = 0;
  for (int e = 0; e < 3; ++e)
    for (int64_t r = l.first(e); r < l.first(e) + l.count(e); ++r)
      for (int64_t c = 0; c < width; ++c) {
        const double d = got.item(r * width + c) - want.item(r * width + c);
        num += d * d;
        den += want.item(r * width + c) * want.item(r * width + c);
      }
  return std::sqrt(num / den);
}

// Expert e's rows of t as a (count, width) f64 matrix.
Tensor expert_slice(const Tensor& t, const Layout& l, int e) {
  const int64_t w = t.dim(1);
  Tensor out = Tensor::zeros({l.count(e), w}, DType::kF64);
  for (int64_t i = 0; i < l.count(e) * w; ++i) out.set_item(i, t.item(l.first(e) * w + i));
  return out;
}

// The three products by fp64 loops over the operands' values as each product sees them: out
// from xq and wk (both along K), dx from dyq and wn (along N), dw from each expert's rows xe[e]
// and dye[e] (row i of expert e at row i). Rows outside the experts stay as `poison` has them.
struct LoopProducts {
  Tensor out, dx, dw;
};
LoopProducts loop_products(const Layout& l, const Tensor& xq, const Tensor& wk, const Tensor& dyq,
                           const Tensor& wn, const std::vector<Tensor>& xe,
                           const std::vector<Tensor>& dye) {
  const int64_t k = xq.dim(1), n = dyq.dim(1), experts = static_cast<int64_t>(xe.size());
  LoopProducts r{Tensor::poisoned({l.rows, n}, DType::kF64),
                 Tensor::poisoned({l.rows, k}, DType::kF64),
                 Tensor::zeros({experts, k, n}, DType::kF64)};
  for (int e = 0; e < experts; ++e)
    for (int64_t i = 0; i < l.count(e); ++i) {
      const int64_t row = l.first(e) + i;
      for (int64_t c = 0; c < n; ++c) {
        double s = 0;
        for (int64_t j = 0; j < k; ++j) s += xq.item(row * k + j) * wk.item((e * k + j) * n + c);
        r.out.set_item(row * n + c, s);
      }
      for (int64_t j = 0; j < k; ++j) {
        double s = 0;
        for (int64_t c = 0; c < n; ++c) s += dyq.item(row * n + c) * wn.item((e * k + j) * n + c);
        r.dx.set_item(row * k + j, s);
      }
      for (int64_t j = 0; j < k; ++j)
        for (int64_t c = 0; c < n; ++c)
          r.dw.set_item((e * k + j) * n + c, r.dw.item((e * k + j) * n + c) +
                                                 xe[e].item(i * k + j) * dye[e].item(i * n + c));
    }
  return r;
}

// The recipe's three products over the layout's rows (f64), as ops/expert_gemm.h computes them
// (the default precision: the unquantized products).
LoopProducts recipe_products(const Layout& l, const Tensor& x, const Tensor& w, const Tensor& dy,
                             const ops::ExpertPrecision& p) {
  LoopProducts r{Tensor::poisoned({l.rows, w.dim(2)}, DType::kF64),
                 Tensor::poisoned({l.rows, w.dim(1)}, DType::kF64),
                 Tensor::poisoned(w.shape(), DType::kF64)};
  ops::expert_gemm_forward(x, w, l.expert_rows(), p, r.out);
  ops::expert_gemm_backward_input(dy, w, l.expert_rows(), p, r.dx);
  ops::expert_gemm_backward_weight(x, dy, l.expert_rows(), p, r.dw, ops::Accumulate::kNo);
  return r;
}

class Recipes : public ::testing::TestWithParam<ops::ExpertRecipe> {};

TEST_P(Recipes, ProductsEqualFp64MathOnTheQuantizedOperands) {
  const ops::ExpertPrecision p{GetParam(), MxScaleRule::kRceil};
  const Layout l;
  const int64_t k = 64, n = 96, experts = 3;
  const Tensor x = testing::randn({l.rows, k}, 21, 1.0);
  const Tensor w = testing::randn({experts, k, n}, 22, 0.2);
  const Tensor dy = testing::randn({l.rows, n}, 23, 1.0);
  const bool mx = p.mx_forward_and_input();
  // Operands as each product sees them.
  const Tensor xq = mx ? round_tripped(x, QuantAxis::kDim0) : x;     // along K
  const Tensor wk = mx ? round_tripped(w, QuantAxis::kDim1) : w;     // along K
  const Tensor dyq = mx ? round_tripped(dy, QuantAxis::kDim0) : dy;  // along N
  const Tensor wn = mx ? round_tripped(w, QuantAxis::kDim0) : w;     // along N

  const LoopProducts got = recipe_products(l, x, w, dy, p);
  const Tensor &out = got.out, &dx = got.dx, &dw = got.dw;
  std::vector<Tensor> xe, dye;
  for (int e = 0; e < experts; ++e) {
    xe.push_back(p.mx_weight_gradient() ? expert_rows_round_tripped(x, l, e)
                                        : expert_slice(x, l, e));
    dye.push_back(p.mx_weight_gradient() ? expert_rows_round_tripped(dy, l, e)
                                         : expert_slice(dy, l, e));
  }
  const LoopProducts want = loop_products(l, xq, wk, dyq, wn, xe, dye);
  const Tensor &want_out = want.out, &want_dx = want.dx, &want_dw = want.dw;
  EXPECT_LT(rel(out, want_out, l, n), 1e-12);
  EXPECT_LT(rel(dx, want_dx, l, k), 1e-12);
  EXPECT_LT(relative_error(dw, want_dw), 1e-12);

  // The quantization is there, and only where the recipe puts it: against the unquantized
  // products, MX operands move each product by about E4M3's half step (2^-4) over sqrt(k) terms.
  const LoopProducts plain = recipe_products(l, x, w, dy, {});
  const Tensor &plain_out = plain.out, &plain_dw = plain.dw;
  if (mx)
    EXPECT_GT(rel(out, plain_out, l, n), 1e-3);
  else
    EXPECT_LT(rel(out, plain_out, l, n), 1e-15);
  if (p.mx_weight_gradient())
    EXPECT_GT(relative_error(dw, plain_dw), 1e-3);
  else
    EXPECT_LT(relative_error(dw, plain_dw), 1e-15);
}

INSTANTIATE_TEST_SUITE_P(All, Recipes,
                         ::testing::Values(ops::ExpertRecipe::kBf16, ops::ExpertRecipe::kMxfp8,
                                           ops::ExpertRecipe::kMxfp8WgradWithHp),
                         [](const auto& info) {
                           return std::string(ops::expert_recipe_name(info.param));
                         });

// The FP8 blockwise recipes on the CPU: the same three products against fp64 loops over operands
// quantized independently (whole tensors in 1 x 128 rows and 128 x 128 tiles, and each expert's
// rows as a zero-padded matrix blocked down its columns).
class Fp8Recipes : public ::testing::TestWithParam<std::tuple<ops::ExpertRecipe, Fp8ScaleRule>> {};

Tensor fp8_values(const Tensor& t, QuantBlock block, QuantAxis axis, Fp8ScaleRule rule) {
  Tensor out = Tensor::poisoned(t.shape(), DType::kF64);
  ops::fp8_round_trip(t, block, axis, rule, out);
  return out;
}

TEST_P(Fp8Recipes, ProductsEqualFp64MathOnTheQuantizedOperands) {
  ops::ExpertPrecision p;
  p.recipe = std::get<0>(GetParam());
  p.fp8_scale = std::get<1>(GetParam());
  const Layout l;
  const int64_t k = 128, n = 256, experts = 3;
  const Tensor x = testing::randn({l.rows, k}, 41, 1.0);
  const Tensor w = testing::randn({experts, k, n}, 42, 0.2);
  const Tensor dy = testing::randn({l.rows, n}, 43, 1.0);
  const Tensor xq = fp8_values(x, QuantBlock::kRow128, QuantAxis::kDim0, p.fp8_scale);
  const Tensor dyq = fp8_values(dy, QuantBlock::kRow128, QuantAxis::kDim0, p.fp8_scale);
  const Tensor wq = fp8_values(w, QuantBlock::kTile128, QuantAxis::kDim0, p.fp8_scale);
  const LoopProducts got = recipe_products(l, x, w, dy, p);
  const Tensor &out = got.out, &dx = got.dx, &dw = got.dw;
  // Each expert's rows, zero-padded to whole 128-row blocks, quantized down the columns.
  const auto along_tokens = [&](const Tensor& t, int e) {
    const Tensor rows = expert_slice(t, l, e);
    if (!p.fp8_weight_gradient()) return rows;
    const int64_t padded =
        std::max<int64_t>((l.count(e) + kFp8Block - 1) / kFp8Block, 1) * kFp8Block;
    Tensor block = Tensor::zeros({padded, t.dim(1)}, DType::kF64);
    for (int64_t i = 0; i < rows.numel(); ++i) block.set_item(i, rows.item(i));
    return fp8_values(block, QuantBlock::kRow128, QuantAxis::kDim1, p.fp8_scale);
  };
  std::vector<Tensor> xe, dye;
  for (int e = 0; e < experts; ++e) {
    xe.push_back(along_tokens(x, e));
    dye.push_back(along_tokens(dy, e));
  }
  const LoopProducts want = loop_products(l, xq, wq, dyq, wq, xe, dye);
  const Tensor &want_out = want.out, &want_dx = want.dx, &want_dw = want.dw;
  EXPECT_LT(rel(out, want_out, l, n), 1e-12);
  EXPECT_LT(rel(dx, want_dx, l, k), 1e-12);
  EXPECT_LT(relative_error(dw, want_dw), 1e-12);
  // Quantized, and only where the recipe says: the forward moves by FP8's error, the weight
  // gradient of fp8_wgrad_with_hp does not move at all.
  const LoopProducts plain = recipe_products(l, x, w, dy, {});
  const Tensor &plain_out = plain.out, &plain_dw = plain.dw;
  EXPECT_GT(rel(out, plain_out, l, n), 1e-3);
  EXPECT_LT(rel(out, plain_out, l, n), 0.1);
  if (p.fp8_weight_gradient())
    EXPECT_GT(relative_error(dw, plain_dw), 1e-3);
  else
    EXPECT_LT(relative_error(dw, plain_dw), 1e-15);
}

INSTANTIATE_TEST_SUITE_P(All, Fp8Recipes,
                         ::testing::Combine(::testing::Values(ops::ExpertRecipe::kFp8Blockwise,
                                                              ops::ExpertRecipe::kFp8WgradWithHp),
                                            ::testing::Values(Fp8ScaleRule::kFp32,
                                                              Fp8ScaleRule::kPow2)),
                         [](const auto& info) {
                           return std::string(ops::expert_recipe_name(std::get<0>(info.param))) +
                                  "_" + std::string(fp8_scale_rule_name(std::get<1>(info.param)));
                         });

TEST(MxRoundTrip, ExpertRowsBlockFromEachExpertsFirstRowAndLeavePaddingAlone) {
  const Layout l;
  const int64_t k = 64;
  Tensor x = testing::randn({l.rows, k}, 31, 1.0, DType::kF32);
  // A loud row in expert 2 and NaN in the padding: blocks that crossed experts or read padding
  // would show it.
  for (int64_t c = 0; c < k; ++c) {
    x.set_item((l.first(2) + 3) * k + c, 1e6);
    x.set_item(50 * k + c, std::nan(""));
  }
  Tensor out = Tensor::poisoned({l.rows, k}, DType::kF32);
  ops::mx_round_trip_expert_rows(x, l.expert_rows(), MxScaleRule::kRceil, out);
  for (int e = 0; e < 3; ++e) {
    if (l.count(e) == 0) continue;
    const Tensor want = expert_rows_round_tripped(x, l, e);
    for (int64_t i = 0; i < l.count(e); ++i)
      for (int64_t c = 0; c < k; ++c)
        ASSERT_EQ(out.item((l.first(e) + i) * k + c), want.item(i * k + c))
            << "expert " << e << " row " << i << " column " << c;
  }
  for (int64_t r : {int64_t{45}, int64_t{50}, int64_t{63}, int64_t{140}})  // padding: untouched
    EXPECT_TRUE(std::isnan(out.item(r * k)));
  // In place gives the same.
  Tensor y = x.clone();
  ops::mx_round_trip_expert_rows(y, l.expert_rows(), MxScaleRule::kRceil, y);
  for (int64_t i = 0; i < l.count(2); ++i)
    EXPECT_EQ(y.item((l.first(2) + i) * k + 5), out.item((l.first(2) + i) * k + 5));
}

TEST(ExpertRecipeConfig, KeysParseAndBadValuesNameTheValidOnes) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const Config c =
      load_config(tiny, {"model.expert_recipe=mxfp8_wgrad_with_hp", "model.mx_scale_rule=floor"});
  EXPECT_EQ(c.model.expert_precision.recipe, ops::ExpertRecipe::kMxfp8WgradWithHp);
  EXPECT_EQ(c.model.expert_precision.rule, MxScaleRule::kFloor);
  EXPECT_EQ(load_config(tiny, {}).model.expert_precision.recipe, ops::ExpertRecipe::kBf16);
  const std::string bad =
      testing::error_of([&] { load_config(tiny, {"model.expert_recipe=fp8"}); });
  EXPECT_NE(bad.find("valid: bf16, mxfp8, mxfp8_wgrad_with_hp"), std::string::npos) << bad;
  const std::string rule =
      testing::error_of([&] { load_config(tiny, {"model.mx_scale_rule=up"}); });
  EXPECT_NE(rule.find("valid: rceil, floor"), std::string::npos) << rule;
  const std::string dim = testing::error_of([&] {
    load_config(tiny, {"model.expert_recipe=mxfp8", "model.moe_dim=48"});
  });
  EXPECT_NE(dim.find("model.moe_dim = 48 must be a multiple of 32"), std::string::npos) << dim;
  const Config f = load_config(tiny, {"model.expert_recipe=fp8_blockwise", "model.fp8_scale=pow2",
                                      "model.dim=128", "model.moe_dim=256"});
  EXPECT_EQ(f.model.expert_precision.recipe, ops::ExpertRecipe::kFp8Blockwise);
  EXPECT_EQ(f.model.expert_precision.fp8_scale, Fp8ScaleRule::kPow2);
  EXPECT_EQ(load_config(tiny, {}).model.expert_precision.fp8_scale, Fp8ScaleRule::kFp32);
  const std::string fp8_dim = testing::error_of([&] {
    load_config(tiny,
                {"model.expert_recipe=fp8_wgrad_with_hp", "model.dim=128", "model.moe_dim=96"});
  });
  EXPECT_NE(fp8_dim.find("model.moe_dim = 96 must be a multiple of 128"), std::string::npos)
      << fp8_dim;
  const std::string scale = testing::error_of([&] { load_config(tiny, {"model.fp8_scale=e8m0"}); });
  EXPECT_NE(scale.find("valid: fp32, pow2"), std::string::npos) << scale;
  const std::string wire = testing::error_of([&] {
    load_config(tiny, {"model.expert_recipe=fp8_blockwise", "model.dim=128", "model.moe_dim=128",
                       "parallel.ep_dispatch_dtype=mxfp8"});
  });
  EXPECT_NE(wire.find("not model.expert_recipe = \"fp8_blockwise\""), std::string::npos) << wire;
}

TEST(ExpertRecipeConfig, Mxfp8DispatchNeedsAnMxRecipeAndRequantForMxfp8) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::string coupled = testing::error_of([&] {
    load_config(tiny, {"parallel.ep_dispatch_dtype=mxfp8", "model.expert_recipe=mxfp8"});
  });
  EXPECT_NE(coupled.find("model.requant_dim1 = true"), std::string::npos) << coupled;
  EXPECT_NE(coupled.find("mxfp8_wgrad_with_hp"), std::string::npos) << coupled;
  const std::string plain =
      testing::error_of([&] { load_config(tiny, {"parallel.ep_dispatch_dtype=mxfp8"}); });
  EXPECT_NE(plain.find("needs an MX expert recipe"), std::string::npos) << plain;
  const std::string stray =
      testing::error_of([&] { load_config(tiny, {"model.requant_dim1=true"}); });
  EXPECT_NE(stray.find("applies only with"), std::string::npos) << stray;
  const std::string bad =
      testing::error_of([&] { load_config(tiny, {"parallel.ep_dispatch_dtype=fp8"}); });
  EXPECT_NE(bad.find("(valid: bf16, mxfp8, fp8_blockwise)"), std::string::npos) << bad;
  for (const std::vector<std::string>& ok :
       {std::vector<std::string>{"parallel.ep_dispatch_dtype=mxfp8",
                                 "model.expert_recipe=mxfp8_wgrad_with_hp"},
        std::vector<std::string>{"parallel.ep_dispatch_dtype=mxfp8", "model.expert_recipe=mxfp8",
                                 "model.requant_dim1=true"}})
    EXPECT_EQ(testing::error_of([&] { load_config(tiny, ok); }), "no error");
}

// The FP8 wire follows the same rules with the FP8 recipes: an FP8 recipe, and requant_dim1 with
// fp8_blockwise (its weight gradient re-quantizes the arrived rows along the tokens).
TEST(ExpertRecipeConfig, Fp8DispatchNeedsAnFp8RecipeAndRequantForFp8Blockwise) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const std::vector<std::string> dims = {"model.dim=128", "model.moe_dim=128"};
  auto with = [&](std::vector<std::string> keys) {
    keys.insert(keys.end(), dims.begin(), dims.end());
    return testing::error_of([&] { load_config(tiny, keys); });
  };
  const std::string coupled =
      with({"parallel.ep_dispatch_dtype=fp8_blockwise", "model.expert_recipe=fp8_blockwise"});
  EXPECT_NE(coupled.find("model.requant_dim1 = true"), std::string::npos) << coupled;
  EXPECT_NE(coupled.find("\"fp8_wgrad_with_hp\""), std::string::npos) << coupled;
  const std::string plain = with({"parallel.ep_dispatch_dtype=fp8_blockwise"});
  EXPECT_NE(plain.find("needs an FP8 expert recipe"), std::string::npos) << plain;
  const std::string mx =
      with({"parallel.ep_dispatch_dtype=fp8_blockwise", "model.expert_recipe=mxfp8"});
  EXPECT_NE(mx.find("not model.expert_recipe = \"mxfp8\""), std::string::npos) << mx;
  const std::string stray =
      with({"parallel.ep_dispatch_dtype=fp8_blockwise", "model.expert_recipe=fp8_wgrad_with_hp",
            "model.requant_dim1=true"});
  EXPECT_NE(stray.find("applies only with"), std::string::npos) << stray;
  const Config c = load_config(
      tiny, {"parallel.ep_dispatch_dtype=fp8_blockwise", "model.expert_recipe=fp8_blockwise",
             "model.requant_dim1=true", dims[0], dims[1]});
  EXPECT_EQ(c.parallel.ep_dispatch_dtype, RowWire::kFp8);
  EXPECT_EQ(
      with({"parallel.ep_dispatch_dtype=fp8_blockwise", "model.expert_recipe=fp8_wgrad_with_hp"}),
      "no error");
}

// The MX product's front door names what is wrong with its operands.
// Each recipe trains the tiny model: the loss falls as far as bf16's within a small margin.
TEST(ExpertRecipeTraining, EveryRecipeLearnsTheTinyLanguages) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  std::vector<double> final_loss;
  const std::vector<std::vector<std::string>> runs = {
      {"model.expert_recipe=bf16"},
      {"model.expert_recipe=mxfp8"},
      {"model.expert_recipe=mxfp8_wgrad_with_hp"},
      {"model.expert_recipe=mxfp8_wgrad_with_hp", "parallel.ep_dispatch_dtype=mxfp8"},
      {"model.expert_recipe=mxfp8", "parallel.ep_dispatch_dtype=mxfp8", "model.requant_dim1=true"}};
  for (std::vector<std::string> sets : runs) {
    const std::string recipe = sets.back();
    sets.push_back("train.steps=60");
    sets.push_back("train.warmup_steps=5");
    const Config c = load_config(tiny, sets);
    Trainer t(c);
    const auto m = t.run({});
    ASSERT_EQ(m.size(), 60u);
    EXPECT_TRUE(std::isfinite(m.back().loss)) << recipe;
    EXPECT_LT(m.back().loss, m.front().loss - 1.0) << recipe;
    final_loss.push_back(m.back().loss);
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    EXPECT_NE(final_loss[i], final_loss[0]) << i;  // the recipe changed the arithmetic
    EXPECT_NEAR(final_loss[i], final_loss[0], 0.1) << i;
  }
  EXPECT_NE(final_loss[3], final_loss[2]);  // the wire's quantization reached the GEMMs
}

// The FP8 blockwise recipes train the tiny model with expert dims of 128 (their blocks' size) as
// far as bf16 does at the same dims.
TEST(ExpertRecipeTraining, Fp8RecipesLearnTheTinyLanguages) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  std::vector<double> final_loss;
  for (const char* recipe : {"bf16", "fp8_blockwise", "fp8_wgrad_with_hp"}) {
    const Config c = load_config(
        tiny, {"model.dim=128", "model.moe_dim=128", std::string("model.expert_recipe=") + recipe,
               "train.steps=60", "train.warmup_steps=5"});
    Trainer t(c);
    const auto m = t.run({});
    ASSERT_EQ(m.size(), 60u);
    EXPECT_TRUE(std::isfinite(m.back().loss)) << recipe;
    EXPECT_LT(m.back().loss, m.front().loss - 1.0) << recipe;
    final_loss.push_back(m.back().loss);
  }
  for (size_t i = 1; i < final_loss.size(); ++i) {
    EXPECT_NE(final_loss[i], final_loss[0]) << i;  // the recipe changed the arithmetic
    EXPECT_NEAR(final_loss[i], final_loss[0], 0.1) << i;
  }
  EXPECT_NE(final_loss[1], final_loss[2]);  // the weight gradient's quantization counts
}

// The quantized copies FSDP makes for a pass (ParamGroup::copies, fsdp::gather: MX values, or
// FP8 tiles) are those of the weights the optimizer just wrote: training with them equals, bit for
// bit and step after step, training where each product quantizes the current weights itself (the
// same model with the groups' copies switched off). Copies left from an earlier step would part
// the two from the second step on. None outlive the pass, and the expert matrices keep no compute
// copy under an MX recipe (FP8 tiles are made from it). With a full checkpointing policy the
// backward reruns the forward's products, and its gather makes the forward's copies too.
struct CopiesCase {
  const char* recipe;
  const char* checkpoint;
};
class QuantCopies : public ::testing::TestWithParam<CopiesCase> {};

TEST_P(QuantCopies, AreMadeFromEachStepsWeights) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  std::vector<std::string> sets = {
      std::string("model.expert_recipe=") + GetParam().recipe,
      std::string("model.checkpoint=\"") + GetParam().checkpoint + "\""};
  if (std::string(GetParam().recipe).rfind("fp8", 0) == 0) {  // 128 x 128 tiles
    sets.push_back("model.dim=128");
    sets.push_back("model.moe_dim=128");
  }
  const Config cfg = load_config(tiny, sets);
  Qwen3Moe with_copies(cfg.model, 3), own_copies(cfg.model, 3);
  int switched_off = 0;
  for (auto& u : own_copies.units())
    for (auto& g : u.groups)
      for (ParamSpec& spec : g.specs) {
        switched_off += spec.quant_copies ? 1 : 0;
        spec.quant_copies = false;
      }
  EXPECT_EQ(switched_off, 2 * cfg.model.n_layers);
  AdamW opt_a(with_copies.units(), cfg.train), opt_b(own_copies.units(), cfg.train);
  Tensor tokens = Tensor::empty({17}, DType::kI64);  // one document of 16 targets
  const CounterRng rng{5, 1};
  for (int64_t i = 0; i < tokens.numel(); ++i)
    tokens.data<int64_t>()[i] = static_cast<int64_t>(rng.below(i, cfg.model.vocab_size));
  const Batch b = testing::reference_batch(tokens);
  const LossScale scale{1.0 / static_cast<double>(b.masked_tokens()), cfg.model.aux_loss_coef};
  std::vector<double> losses;
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    with_copies.zero_grad();
    own_copies.zero_grad();
    const double loss = with_copies.forward_backward(b, scale).ce_sum;
    EXPECT_EQ(loss, own_copies.forward_backward(b, scale).ce_sum);
    losses.push_back(loss);
    for (size_t u = 0; u < with_copies.units().size(); ++u)
      for (size_t k = 0; k < with_copies.units()[u].groups.size(); ++k) {
        const ParamGroup& g = with_copies.units()[u].groups[k];
        EXPECT_TRUE(testing::same_bytes(g.grad_shard, own_copies.units()[u].groups[k].grad_shard))
            << g.specs.front().name;
        // One rank holds the input gradient's FP8 tiles across passes (AdamW rewrites them), the
        // forward's only while its pass runs; other copies live only for their pass. Either way
        // the quantized matrices keep no compute copy.
        if (g.holds_fp8_tiles()) {
          EXPECT_TRUE(g.copies_made()) << g.specs.front().name << ": held tiles dropped";
          for (size_t i = 0; i < g.specs.size(); ++i) {
            if (!g.specs[i].quant_copies) continue;
            EXPECT_TRUE(g.copies[i].fp8_input.defined()) << g.specs[i].name;
            EXPECT_FALSE(g.copies[i].fp8_forward.defined())
                << g.specs[i].name << ": the forward's tiles outlive the pass";
          }
        } else {
          EXPECT_TRUE(g.copies.empty()) << g.specs.front().name << ": copies outlive the pass";
        }
        if (g.wants_quant_copies()) {
          EXPECT_FALSE(g.compute.defined()) << g.specs.front().name;
        }
      }
    opt_a.step(1e-2, step);
    opt_b.step(1e-2, step);
    // The held tiles after the update are the updated weights' (the next pass reads them).
    for (auto& u : with_copies.units())
      for (auto& g : u.groups)
        for (size_t i = 0; g.holds_fp8_tiles() && i < g.specs.size(); ++i) {
          if (!g.specs[i].quant_copies) continue;
          ops::WeightCopies fresh;
          ops::make_weight_copies(g.param(i), g.precision, g.compute_dtype, ops::CopyUse::kBackward,
                                  fresh);
          EXPECT_TRUE(testing::same_quant(g.copies[i].fp8_input, fresh.fp8_input))
              << g.specs[i].name;
        }
  }
  EXPECT_NE(losses[1], losses[0]);  // the weights moved between the steps
  EXPECT_NE(losses[2], losses[1]);
}

INSTANTIATE_TEST_SUITE_P(RecipeCheckpoint, QuantCopies,
                         ::testing::Values(CopiesCase{"mxfp8_wgrad_with_hp", "none"},
                                           CopiesCase{"mxfp8_wgrad_with_hp", "full"},
                                           CopiesCase{"fp8_wgrad_with_hp", "none"},
                                           CopiesCase{"fp8_blockwise", "full"}),
                         [](const auto& info) {
                           return std::string(info.param.recipe) + "_" + info.param.checkpoint;
                         });

// Under each MX recipe the checkpointing policies give the same gradients bit for bit: a forward
// whose rows the backward makes again writes only their MX values, in place (ForwardRows); the
// backward's rows and products are the same either way.
TEST(ExpertRecipeTraining, CheckpointPoliciesGiveIdenticalGradientsUnderMxRecipes) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  Tensor tokens = Tensor::empty({33}, DType::kI64);
  const CounterRng rng{9, 1};
  for (const std::vector<std::string>& recipe : std::vector<std::vector<std::string>>{
           {"model.expert_recipe=mxfp8_wgrad_with_hp"},
           {"model.expert_recipe=mxfp8_wgrad_with_hp", "parallel.ep_dispatch_dtype=mxfp8"},
           {"model.expert_recipe=mxfp8"}}) {
    SCOPED_TRACE(recipe.back());
    std::vector<std::vector<Tensor>> grads;
    for (const char* policy : {"none", "selective", "full"}) {
      std::vector<std::string> sets = recipe;
      sets.push_back(std::string("model.checkpoint=\"") + policy + "\"");
      const Config cfg = load_config(tiny, sets);
      for (int64_t i = 0; i < tokens.numel(); ++i)
        tokens.data<int64_t>()[i] = static_cast<int64_t>(rng.below(i, cfg.model.vocab_size));
      const Batch b = testing::reference_batch(tokens);
      Qwen3Moe model(cfg.model, 3);
      model.zero_grad();
      model.forward_backward(
          b, {1.0 / static_cast<double>(b.masked_tokens()), cfg.model.aux_loss_coef});
      std::vector<Tensor> g;
      for (auto& u : model.units())
        for (auto& grp : u.groups) g.push_back(grp.grad_shard.clone());
      grads.push_back(std::move(g));
    }
    for (size_t p = 1; p < grads.size(); ++p)
      for (size_t i = 0; i < grads[0].size(); ++i)
        EXPECT_TRUE(testing::same_bytes(grads[p][i], grads[0][i]))
            << "policy " << p << " group " << i;
    EXPECT_GT(relative_error(grads[0].back(),
                             Tensor::zeros(grads[0].back().shape(), grads[0].back().dtype())),
              0.5);  // not trivially zero
  }
}

// A product given the weight's copies without the one it reads (a gather made them for the other
// pass) says so, rather than reading an empty tensor.
TEST(ExpertGemm, AMissingCopyIsNamed) {
  const Tensor w = testing::randn({2, 64, 32}, 3, 0.1, DType::kF64);
  const ops::ExpertPrecision prec{ops::ExpertRecipe::kMxfp8WgradWithHp, MxScaleRule::kRceil};
  ops::WeightCopies backward_only;
  ops::make_weight_copies(w, prec, DType::kF64, ops::CopyUse::kBackward, backward_only);
  EXPECT_FALSE(backward_only.along_k.defined());
  ASSERT_TRUE(backward_only.along_n.defined());
  ops::ExpertPermutation p;
  Tensor index = Tensor::empty({4, 1}, DType::kI32);
  for (int32_t t = 0; t < 4; ++t) index.data<int32_t>()[t] = t % 2;
  ops::make_expert_permutation(index, 2, p);
  const Tensor x = testing::randn({4, 64}, 4, 1.0, DType::kF64);
  Tensor out = Tensor::zeros({4, 32}, DType::kF64);
  const std::string e = testing::error_of(
      [&] { ops::expert_gemm_forward(x, w, p.expert_rows(), prec, out, {&backward_only}); });
  EXPECT_NE(e.find("forward MX product"), std::string::npos) << e;
  EXPECT_NE(e.find("fsdp::gather's use"), std::string::npos) << e;
  // The FP8 recipes' tiles likewise.
  ops::ExpertPrecision fp8 = prec;
  fp8.recipe = ops::ExpertRecipe::kFp8WgradWithHp;
  const Tensor w8 = testing::randn({2, 128, 128}, 5, 0.1, DType::kF64);
  ops::WeightCopies forward_only;
  ops::make_weight_copies(w8, fp8, DType::kF64, ops::CopyUse::kForward, forward_only);
  EXPECT_TRUE(forward_only.fp8_forward.defined());
  EXPECT_FALSE(forward_only.fp8_input.defined());
  EXPECT_FALSE(forward_only.along_k.defined());
  const Tensor dy = testing::randn({4, 128}, 6, 1.0, DType::kF64);
  Tensor dx = Tensor::zeros({4, 128}, DType::kF64);
  const std::string e8 = testing::error_of(
      [&] { ops::expert_gemm_backward_input(dy, w8, p.expert_rows(), fp8, dx, {&forward_only}); });
  EXPECT_NE(e8.find("input-gradient FP8 product"), std::string::npos) << e8;
}

// The expert-operands tap (bench_expert_gemm_error's) sees every expert matrix's operands, down
// then gate|up per layer, last layer first, with matching rows and the layer's own weight (the
// same tensor the model holds); unset, it sees nothing.
TEST(ExpertRecipeTraining, ExpertOperandsTapSeesEveryProductsOperands) {
  const std::string tiny = std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml";
  const Config cfg = load_config(tiny, {});
  Qwen3Moe model(cfg.model, 3);
  Tensor tokens = Tensor::empty({17}, DType::kI64);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int64_t>()[i] = (7 * i) % 64;
  const Batch b = testing::reference_batch(tokens);
  const LossScale scale{1.0 / static_cast<double>(b.masked_tokens()), cfg.model.aux_loss_coef};
  std::vector<std::string> seen;
  moe::set_expert_operands_tap([&](std::string_view product, const Tensor& x, const Tensor& dy,
                                   const Tensor& w, const ops::ExpertRows& rows) {
    seen.emplace_back(product);
    EXPECT_EQ(w.shape(), (Shape{cfg.model.n_experts, x.dim(1), dy.dim(1)})) << product;
    EXPECT_EQ(x.dim(0), dy.dim(0));
    EXPECT_EQ(rows.offsets.numel(), cfg.model.n_experts + 1);
    const bool gate_up = product == "gate_up";
    EXPECT_EQ(x.dim(1), gate_up ? cfg.model.dim : cfg.model.moe_dim) << product;
    EXPECT_EQ(dy.dim(1), gate_up ? 2 * cfg.model.moe_dim : cfg.model.dim) << product;
  });
  model.zero_grad();
  model.forward_backward(b, scale);
  moe::set_expert_operands_tap(nullptr);
  ASSERT_EQ(seen.size(), static_cast<size_t>(2 * cfg.model.n_layers));
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], i % 2 == 0 ? "down" : "gate_up");
  model.forward_backward(b, scale);  // unset: nothing more
  EXPECT_EQ(seen.size(), static_cast<size_t>(2 * cfg.model.n_layers));
}

#if MOETRAIN_HAS_CUDA
// The recipes on the GPU (bf16 operands, fp32 accumulation) against the CPU's f32 emulation of
// the same operands: the weight gradient (f32) to f32 accuracy; the bf16 outputs to bf16's, and
// much farther from the unquantized products than that, so the test sees the quantization.
TEST(GpuExpertGemm, MxRecipesMatchTheCpuEmulation) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t experts = 8, k = 256, n = 384;
  const ops::ExpertPermutation p = random_expert_rows(1024, experts, 128, seed);
  const ops::ExpertRows rows = p.expert_rows(), rows_cpu = on_cpu(rows);
  const int64_t m = p.rows();
  const Tensor x = testing::randn({m, k}, seed + 1, 1.0, DType::kF32).to(DType::kBF16);
  const Tensor w = testing::randn({experts, k, n}, seed + 2, 0.05, DType::kF32).to(DType::kBF16);
  const Tensor dy = testing::randn({m, n}, seed + 3, 1.0, DType::kF32).to(DType::kBF16);
  const Tensor xf = x.to(DType::kF32), wf = w.to(DType::kF32), dyf = dy.to(DType::kF32);
  // Compares the rows of the experts only (padding rows are never read).
  auto expert_rows_error = [&](const Tensor& got, const Tensor& want) {
    const Tensor g = got.to(Device::kCPU).to(DType::kF64), r = want.to(DType::kF64);
    const int64_t width = got.dim(1);
    double num = 0, den = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = rows_cpu.segments.data<int64_t>()[e];
      const int64_t count =
          rows_cpu.offsets.data<int64_t>()[e + 1] - rows_cpu.offsets.data<int64_t>()[e];
      for (int64_t i = first * width; i < (first + count) * width; ++i) {
        num += (g.item(i) - r.item(i)) * (g.item(i) - r.item(i));
        den += r.item(i) * r.item(i);
      }
    }
    return std::sqrt(num / den);
  };
  for (ops::ExpertRecipe recipe :
       {ops::ExpertRecipe::kMxfp8, ops::ExpertRecipe::kMxfp8WgradWithHp}) {
    SCOPED_TRACE(std::string(ops::expert_recipe_name(recipe)));
    const ops::ExpertPrecision prec{recipe, MxScaleRule::kRceil};
    const ops::ExpertPrecision none{};
    Tensor out = Tensor::poisoned({m, n}, DType::kBF16, Device::kCUDA);
    Tensor dx = Tensor::poisoned({m, k}, DType::kBF16, Device::kCUDA);
    Tensor dw = Tensor::poisoned({experts, k, n}, DType::kF32, Device::kCUDA);
    ops::expert_gemm_forward(x.to(Device::kCUDA), w.to(Device::kCUDA), rows, prec, out);
    ops::expert_gemm_backward_input(dy.to(Device::kCUDA), w.to(Device::kCUDA), rows, prec, dx);
    ops::expert_gemm_backward_weight(x.to(Device::kCUDA), dy.to(Device::kCUDA), rows, prec, dw,
                                     ops::Accumulate::kNo);
    Tensor want_out = Tensor::zeros({m, n}, DType::kF32), plain_out = want_out.clone();
    Tensor want_dx = Tensor::zeros({m, k}, DType::kF32);
    Tensor want_dw = Tensor::zeros({experts, k, n}, DType::kF32), plain_dw = want_dw.clone();
    ops::expert_gemm_forward(xf, wf, rows_cpu, prec, want_out);
    ops::expert_gemm_forward(xf, wf, rows_cpu, none, plain_out);
    ops::expert_gemm_backward_input(dyf, wf, rows_cpu, prec, want_dx);
    ops::expert_gemm_backward_weight(xf, dyf, rows_cpu, prec, want_dw, ops::Accumulate::kNo);
    ops::expert_gemm_backward_weight(xf, dyf, rows_cpu, none, plain_dw, ops::Accumulate::kNo);
    const double out_err = expert_rows_error(out, want_out);
    EXPECT_LT(out_err, 4e-3);
    EXPECT_GT(expert_rows_error(out, plain_out), 4 * out_err);
    EXPECT_LT(expert_rows_error(dx, want_dx), 4e-3);
    EXPECT_LT(relative_error(dw.to(Device::kCPU), want_dw), 1e-5);
    if (recipe == ops::ExpertRecipe::kMxfp8)
      EXPECT_GT(relative_error(dw.to(Device::kCPU), plain_dw), 1e-3);
    else
      EXPECT_LT(relative_error(dw.to(Device::kCPU), plain_dw), 1e-5);
  }
}
#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
