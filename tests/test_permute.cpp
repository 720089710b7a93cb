// The expert permutation, the combine and the exchange layouts (ops/permute.h): the CPU reference
// (hand-checked cases, fp64 finite-difference gradients of L = sum(out * G) with a fixed random G)
// and, in the Gpu* cases (ctest label `gpu`), the CUDA kernels against it (tests/gpu_case.h).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <tuple>

#include "op_testing.h"
#include "ops/grouped_gemm.h"
#include "ops/permute.h"
#include "ops/route.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

struct PermCase {
  Tensor index;
  ops::ExpertPermutation p;
};

PermCase perm_case() {
  // 5 tokens, top-2 over 4 experts; expert 2 receives nothing.
  PermCase c;
  c.index = i32({3, 0, 1, 3, 0, 1, 3, 1, 0, 3});
  c.index = c.index.reshape({5, 2});
  ops::make_expert_permutation(c.index, 4, c.p);
  return c;
}

TEST(Permute, ExpertMajorLayoutIsStable) {
  PermCase c = perm_case();
  const std::vector<int64_t> offsets = {0, 3, 6, 6, 10};
  for (int e = 0; e < 5; ++e) EXPECT_EQ(c.p.expert_offsets.item(e), offsets[e]);
  const std::vector<int> source = {0, 2, 4, 1, 2, 3, 0, 1, 3, 4};  // token order within experts
  for (int i = 0; i < 10; ++i) EXPECT_EQ(c.p.source_token.item(i), source[i]);
  Tensor x = randn({5, 3}, 1), xp = Tensor::poisoned({10, 3}, DType::kF64);
  ops::permute_rows(x, c.p, xp);
  Tensor back = Tensor::poisoned({5, 2, 3}, DType::kF64);
  ops::unpermute_rows(xp, c.p, back);
  for (int t = 0; t < 5; ++t)
    for (int j = 0; j < 2; ++j)
      for (int d = 0; d < 3; ++d) EXPECT_EQ(back.item((t * 2 + j) * 3 + d), x.item(t * 3 + d));
}

TEST(Permute, Gradients) {
  PermCase c = perm_case();
  Tensor x = randn({5, 3}, 1), g = randn({10, 3}, 2), xp = like(g);
  auto loss = [&] {
    ops::permute_rows(x, c.p, xp);
    return dot(xp, g);
  };
  Tensor dx = like(x);
  ops::permute_rows_backward(g, c.p, dx);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);

  Tensor yp = randn({10, 3}, 3), gy = randn({5, 2, 3}, 4), y = like(gy);
  auto uloss = [&] {
    ops::unpermute_rows(yp, c.p, y);
    return dot(y, gy);
  };
  Tensor dyp = like(yp);
  ops::unpermute_rows_backward(gy, c.p, dyp);
  EXPECT_LT(gradcheck(uloss, yp, dyp), kGradTol);
}

TEST(Combine, SumsTheCopiesAndGradients) {
  PermCase c = perm_case();
  Tensor yp = randn({10, 3}, 1), g = randn({5, 3}, 3);
  Tensor out = Tensor::poisoned({5, 3}, DType::kF64);
  ops::combine_forward(yp, c.p, out);
  // Token 1 chose experts (1, 3): row 3 (first of expert 1) and row 7 (second of expert 3).
  for (int d = 0; d < 3; ++d)
    EXPECT_NEAR(out.item(3 + d), yp.item(3 * 3 + d) + yp.item(7 * 3 + d), 1e-14);
  auto loss = [&] {
    ops::combine_forward(yp, c.p, out);
    return dot(out, g);
  };
  // Its backward is the permutation: each copy receives its token's gradient.
  Tensor dyp = like(yp);
  ops::permute_rows(g, c.p, dyp);
  EXPECT_LT(gradcheck(loss, yp, dyp), kGradTol);
  // The residual folded into the same pass: out + residual.
  const Tensor r = randn({5, 3}, 4);
  Tensor with = Tensor::poisoned({5, 3}, DType::kF64);
  ops::combine_forward(yp, c.p, out);
  ops::combine_forward(yp, c.p, with, &r);
  for (int64_t i = 0; i < with.numel(); ++i)
    EXPECT_NEAR(with.item(i), out.item(i) + r.item(i), 1e-14) << i;
  // A residual of another shape is refused, naming it.
  const Tensor short_residual = randn({4, 3}, 5);
  const std::string e = error_of([&] { ops::combine_forward(yp, c.p, with, &short_residual); });
  EXPECT_NE(e.find("combine residual"), std::string::npos) << e;
}

// Choices of another rank (-1) get no row: the layout holds the routed ones in the same stable
// order, unpermute gives them zeros, the sums skip them; a larger `routed` leaves rows that name
// no token, a smaller one is refused.
TEST(Permute, ChoicesNotRoutedHereGetNoRow) {
  Tensor index = i32({3, -1, -1, 1, 0, 1, -1, -1, 0, 3});
  index = index.reshape({5, 2});
  ops::ExpertPermutation p;
  ops::make_expert_permutation(index, 4, p, 1, 6);
  ASSERT_EQ(p.rows(), 6);
  const std::vector<int64_t> offsets = {0, 2, 4, 4, 6};
  for (int e = 0; e < 5; ++e) EXPECT_EQ(p.expert_offsets.item(e), offsets[e]);
  const std::vector<int> source = {2, 4, 1, 2, 0, 4};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(p.source_token.item(i), source[i]) << i;
  const std::vector<int> rows = {4, -1, -1, 2, 0, 3, -1, -1, 1, 5};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(p.row_of_choice.item(i), rows[i]) << i;
  // Gradients of the moves with skipped choices (the sums' adjoints).
  Tensor x = randn({5, 3}, 1), g = randn({6, 3}, 2), xp = like(g);
  auto loss = [&] {
    ops::permute_rows(x, p, xp);
    return dot(xp, g);
  };
  Tensor dx = Tensor::poisoned({5, 3}, DType::kF64);
  ops::permute_rows_backward(g, p, dx);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);
  for (int d = 0; d < 3; ++d) EXPECT_EQ(dx.item(3 * 3 + d), 0.0);  // token 3: no choice here
  Tensor yp = randn({6, 3}, 3), gy = randn({5, 2, 3}, 4),
         y = Tensor::poisoned({5, 2, 3}, DType::kF64);
  auto uloss = [&] {
    ops::unpermute_rows(yp, p, y);
    return dot(y, gy);
  };
  Tensor dyp = Tensor::poisoned({6, 3}, DType::kF64);
  ops::unpermute_rows_backward(gy, p, dyp);
  EXPECT_LT(gradcheck(uloss, yp, dyp), kGradTol);
  ops::unpermute_rows(yp, p, y);
  for (int d = 0; d < 3; ++d) EXPECT_EQ(y.item(1 * 3 + d), 0.0);  // (token 0, choice 1)
  // More rows than routed choices: the extra rows name no token.
  ops::ExpertPermutation wide;
  ops::make_expert_permutation(index, 4, wide, 1, 9);
  ASSERT_EQ(wide.rows(), 9);
  for (int64_t i = 6; i < 9; ++i) EXPECT_EQ(wide.source_token.item(i), -1) << i;
  ops::ExpertPermutation narrow;
  const std::string e = error_of([&] { ops::make_expert_permutation(index, 4, narrow, 1, 5); });
  EXPECT_NE(e.find("6 routed choices of 10"), std::string::npos) << e;
}

// Segments aligned to 4 rows: each expert's rows from a multiple of 4, in the dense order, the
// padding naming no token; rows moved through the padded layout come back unchanged.
TEST(Permute, PaddedSegmentsKeepTheDenseOrder) {
  PermCase c = perm_case();
  ops::ExpertPermutation p;
  ops::make_expert_permutation(c.index, 4, p, 4);
  EXPECT_EQ(p.rows(), 10 + 4 * 3);
  const std::vector<int64_t> offsets = {0, 3, 6, 6, 10}, segments = {0, 4, 8, 8, 12};
  for (int e = 0; e < 5; ++e) {
    EXPECT_EQ(p.expert_offsets.item(e), offsets[e]);
    EXPECT_EQ(p.segments.item(e), segments[e]);
  }
  const std::vector<int> source = {0, 2, 4, -1, 1, 2, 3, -1, 0, 1, 3, 4};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(p.source_token.item(i), source[i]) << i;
  for (int64_t i = 12; i < p.rows(); ++i) EXPECT_EQ(p.source_token.item(i), -1) << i;
  Tensor x = randn({5, 3}, 1), xp = Tensor::zeros({p.rows(), 3}, DType::kF64);
  ops::permute_rows(x, p, xp);
  Tensor back = Tensor::poisoned({5, 2, 3}, DType::kF64);
  ops::unpermute_rows(xp, p, back);
  for (int t = 0; t < 5; ++t)
    for (int j = 0; j < 2; ++j)
      for (int d = 0; d < 3; ++d) EXPECT_EQ(back.item((t * 2 + j) * 3 + d), x.item(t * 3 + d));
}

// FP8 rows move as rows do: each expert row holds its token's bytes and scales, so the moved rows'
// values are the moved values of the rows; FP8 rows of another format are refused.
TEST(Permute, Fp8RowsMoveWithTheirScales) {
  PermCase c = perm_case();
  ops::ExpertPermutation p;
  ops::make_expert_permutation(c.index, 4, p, 4);
  Tensor x = randn({5, 256}, 3);
  for (int64_t i = 0; i < x.numel(); ++i) x.set_item(i, x.item(i) * std::ldexp(1.0, int(i % 7)));
  QuantTensor q = QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
  ops::fp8_quantize(x, Fp8ScaleRule::kFp32, q);
  QuantTensor qp = QuantTensor::poisoned({p.rows(), 256}, QuantBlock::kRow128, QuantAxis::kDim0);
  ops::permute_rows(q, p, qp);
  Tensor values = Tensor::empty(x.shape(), DType::kF64);
  ops::fp8_dequantize(q, values);
  Tensor want = Tensor::poisoned({p.rows(), 256}, DType::kF64);
  ops::permute_rows(values, p, want);
  Tensor got = Tensor::empty({p.rows(), 256}, DType::kF64);
  ops::fp8_dequantize(qp, got);
  int64_t rows = 0;
  for (int64_t r = 0; r < p.rows(); ++r) {
    if (p.source_token.data<int32_t>()[r] < 0) continue;
    ++rows;
    for (int64_t d = 0; d < 256; ++d) ASSERT_EQ(got.item(r * 256 + d), want.item(r * 256 + d));
  }
  EXPECT_EQ(rows, 10);
  QuantTensor narrow = QuantTensor::empty({p.rows(), 128}, QuantBlock::kRow128, QuantAxis::kDim0);
  const std::string e = testing::error_of([&] { ops::permute_rows(q, p, narrow); });
  EXPECT_NE(e.find("permute_rows of FP8 rows: (5, 256) into"), std::string::npos) << e;
}

#if MOETRAIN_HAS_CUDA

struct GpuPermute : GpuCase {};

// One routing configuration, GPU against CPU: choices and counts exactly, scores, weights, score
// sums and the router backward to f32 rounding.
struct RoutingCase {
  int64_t n, e, k;
  bool norm_topk, bias;
  ops::RoutingMode mode;
  bool ties;  // logits (and bias) on a coarse grid: equal scores, so the tie order is checked
};

// The GPU ranks the biased scores in fp32, the CPU in fp64 from its own fp32 scores: two keys
// within float rounding of each other (seen: a relative gap of 1.1e-7 among 257 x 1000) may be
// ordered either way, and either choice is right. Rows of logits whose top k + 1 keys on the CPU
// are not apart by more than 1e-5 (relative) are drawn again, so that the choices compared
// exactly are well defined; exact ties stay (the "ties" cases: equal fp32 scores on both sides,
// ordered by expert index).
void separate_near_ties(Tensor& logits, const Tensor& bias, const ops::RouterOptions& opt,
                        uint64_t seed) {
  const int64_t n = logits.dim(0), e = logits.dim(1), k = opt.top_k;
  for (int attempt = 1;; ++attempt) {
    ops::Routing r;
    ops::router_forward(logits, bias, opt, r);
    int64_t redrawn = 0;
    std::vector<double> key(e);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < e; ++c)
        key[c] = static_cast<double>(r.scores.data<float>()[t * e + c]) +
                 (bias.defined() ? bias.data<float>()[c] : 0.0);
      std::partial_sort(key.begin(), key.begin() + std::min(k + 1, e), key.end(), std::greater<>());
      bool near = false;
      for (int64_t j = 0; j + 1 < std::min(k + 1, e); ++j)
        near |= key[j] - key[j + 1] <= 1e-5 * std::abs(key[j]);
      if (!near) continue;
      const Tensor row = testing::randn({e}, seed + 1000003 * attempt + t, 2.0, DType::kF32);
      std::copy(row.data<float>(), row.data<float>() + e, logits.data<float>() + t * e);
      ++redrawn;
    }
    if (redrawn == 0) return;
    ASSERT_LT(attempt, 50) << redrawn << " rows still hold near-ties";
  }
}

void check_routing(const RoutingCase& rc, uint64_t seed, ops::Routing& cr, ops::Routing& gr) {
  const std::string what =
      fmt::format("routing n {} e {} top-{}{}{}{}{}", rc.n, rc.e, rc.k,
                  rc.norm_topk ? " renormalised" : "", rc.bias ? " bias" : "",
                  rc.mode == ops::RoutingMode::kLearned ? "" : " fixed", rc.ties ? " ties" : "");
  const ops::RouterOptions opt{static_cast<int>(rc.k), rc.norm_topk, rc.mode};
  Tensor logits = testing::randn({rc.n, rc.e}, seed + 11, 2.0, DType::kF32);
  Tensor bias = rc.bias ? testing::randn({rc.e}, seed + 13, 0.01, DType::kF32) : Tensor();
  if (rc.ties) {
    for (int64_t i = 0; i < logits.numel(); ++i)
      logits.data<float>()[i] = std::round(logits.data<float>()[i] * 2) / 2;
    if (bias.defined()) bias = Tensor::zeros({rc.e}, DType::kF32);
  } else if (rc.mode == ops::RoutingMode::kLearned) {
    ASSERT_NO_FATAL_FAILURE(separate_near_ties(logits, bias, opt, seed));
  }
  ops::router_forward(logits, bias, opt, cr);
  ops::router_forward(logits.to(Device::kCUDA), bias.defined() ? bias.to(Device::kCUDA) : bias, opt,
                      gr);
  const Tensor gidx = gr.expert_index.to(Device::kCPU);
  ASSERT_EQ(std::memcmp(gidx.raw(), cr.expert_index.raw(), cr.expert_index.nbytes()), 0)
      << what << ": top-k choices differ";
  const Tensor gcount = gr.tokens_per_expert.to(Device::kCPU);
  ASSERT_EQ(std::memcmp(gcount.raw(), cr.tokens_per_expert.raw(), gcount.nbytes()), 0) << what;
  EXPECT_LT(relative_error(gr.expert_weight, cr.expert_weight), 1e-5) << what;
  EXPECT_LT(relative_error(gr.scores, cr.scores), 1e-5) << what;
  // Without padding, and with every third token padding (outside the aux statistics).
  Tensor padding = Tensor::zeros({rc.n}, DType::kU8);
  for (int64_t t = 0; t < rc.n; t += 3) padding.data<uint8_t>()[t] = 1;
  for (const Tensor& pad : {Tensor(), padding}) {
    const std::string with = what + (pad.defined() ? " (padding)" : "");
    const Tensor gpad = pad.defined() ? pad.to(Device::kCUDA) : pad;
    const ops::AuxStats cs = ops::router_aux_stats(cr, pad), gs = ops::router_aux_stats(gr, gpad);
    const Tensor gstat_count = gs.tokens_per_expert.to(Device::kCPU);
    ASSERT_EQ(std::memcmp(gstat_count.raw(), cs.tokens_per_expert.raw(), gstat_count.nbytes()), 0)
        << with;
    EXPECT_LT(relative_error(gs.score_sum, cs.score_sum), 1e-5) << with;
    const double closs = ops::router_aux_loss(cs).item(0);
    EXPECT_NEAR(ops::router_aux_loss(gs).to(Device::kCPU).item(0), closs, 1e-5 * closs) << with;
    const Tensor dweight = testing::randn({rc.n, rc.k}, seed + 12, 1.0, DType::kF32);
    Tensor cdl = Tensor::empty({rc.n, rc.e}, DType::kF32),
           gdl = Tensor::poisoned({rc.n, rc.e}, DType::kF32, Device::kCUDA);
    ops::router_backward(cr, opt, cs, pad, dweight, 0.01, cdl);
    ops::router_backward(gr, opt, gs, gpad, dweight.to(Device::kCUDA), 0.01, gdl);
    EXPECT_LT(relative_error(gdl, cdl), 1e-5) << with << ": router backward";
  }
}

TEST_P(GpuPermute, RouterPermutationAndCombine) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "rows are bf16 in the GPU layer; routing is f32";
  const int64_t n = 4096, e = 128, k = 8, d = 256;
  // Both register layouts of the kernels (up to 128 experts, up to 1024), widths that are not
  // multiples of the warp, bias, no renormalisation, forced balance and exact ties.
  using ops::RoutingMode;
  for (const RoutingCase& rc :
       {RoutingCase{333, 160, 6, false, true, RoutingMode::kLearned, false},
        RoutingCase{257, 1000, 16, true, true, RoutingMode::kLearned, false},
        RoutingCase{300, 40, 4, true, false, RoutingMode::kLearned, true},
        RoutingCase{200, 128, 8, true, false, RoutingMode::kBalanced, false},
        RoutingCase{301, 128, 8, true, true, RoutingMode::kSkewed, false},
        RoutingCase{77, 40, 7, false, false, RoutingMode::kSkewed, false},
        RoutingCase{5, 8, 2, true, false, RoutingMode::kLearned, false}}) {
    ops::Routing cr, gr;
    check_routing(rc, seed, cr, gr);
  }
  ops::Routing cr, gr;
  check_routing({n, e, k, true, false, ops::RoutingMode::kLearned, false}, seed, cr, gr);
  if (HasFatalFailure()) return;

  // The padded layout (the GPU layer's): every expert's rows from a multiple of 128, the same
  // on both sides to the entry, padding rows naming no token.
  {
    ops::ExpertPermutation cpad, gpad;
    ops::make_expert_permutation(cr.expert_index, e, cpad, 128);
    ops::make_expert_permutation(gr.expert_index, e, gpad, 128);
    ASSERT_EQ(gpad.rows(), n * k + e * 127);
    for (auto [a, b] : {std::pair{&cpad.source_token, &gpad.source_token},
                        std::pair{&cpad.row_of_choice, &gpad.row_of_choice},
                        std::pair{&cpad.expert_offsets, &gpad.expert_offsets},
                        std::pair{&cpad.segments, &gpad.segments}}) {
      const Tensor host = b->to(Device::kCPU);
      ASSERT_EQ(std::memcmp(host.raw(), a->raw(), a->nbytes()), 0) << "padded permutation differs";
    }
    for (int64_t i = 0; i < e; ++i)
      EXPECT_EQ(static_cast<int64_t>(cpad.segments.item(i)) % 128, 0) << "expert " << i;
    // Combine reads only the experts' rows: poison in the padding must not reach the output.
    const Tensor y = input({n * k, d});
    Tensor cyp = Tensor::zeros({cpad.rows(), d}, DType::kF32);
    ops::unpermute_rows_backward(y, cpad, cyp);  // y's rows into their padded places
    Tensor poisoned = cyp.clone();
    for (int64_t i = 0; i < cpad.rows(); ++i)
      if (cpad.source_token.data<int32_t>()[i] < 0)
        std::fill(poisoned.data<float>() + i * d, poisoned.data<float>() + (i + 1) * d, NAN);
    Tensor cout_ = Tensor::empty({n, d}, DType::kF32), out = gpu_out({n, d});
    ops::combine_forward(cyp, cpad, cout_);
    ops::combine_forward(gpu(poisoned), gpad, out);
    expect_close(out, cout_, "combine over a padded layout");
  }
  ops::ExpertPermutation cp, gp;
  ops::make_expert_permutation(cr.expert_index, e, cp);
  ops::make_expert_permutation(gr.expert_index, e, gp);
  for (auto [a, b] : {std::pair{&cp.source_token, &gp.source_token},
                      std::pair{&cp.row_of_choice, &gp.row_of_choice},
                      std::pair{&cp.expert_offsets, &gp.expert_offsets}}) {
    const Tensor host = b->to(Device::kCPU);
    ASSERT_EQ(std::memcmp(host.raw(), a->raw(), a->nbytes()), 0) << "permutation differs";
  }
  const Tensor x = input({n, d});
  Tensor cxp = Tensor::empty({n * k, d}, DType::kF32), gxp = gpu_out({n * k, d});
  ops::permute_rows(x, cp, cxp);
  ops::permute_rows(gpu(x), gp, gxp);
  expect_close(gxp, cxp, "permute rows");
  const Tensor dxp = input({n * k, d});
  Tensor cdx = Tensor::empty({n, d}, DType::kF32), gdx = gpu_out({n, d});
  ops::permute_rows_backward(dxp, cp, cdx);
  ops::permute_rows_backward(gpu(dxp), gp, gdx);
  expect_close(gdx, cdx, "permute rows backward");
  const Tensor y = input({n * k, d});
  Tensor cout_ = Tensor::empty({n, d}, DType::kF32), gout = gpu_out({n, d});
  ops::combine_forward(y, cp, cout_);
  ops::combine_forward(gpu(y), gp, gout);
  expect_close(gout, cout_, "combine");
  const Tensor residual = input({n, d});
  Tensor cres = Tensor::empty({n, d}, DType::kF32), gres = gpu_out({n, d});
  const Tensor gresidual = gpu(residual);
  ops::combine_forward(y, cp, cres, &residual);
  ops::combine_forward(gpu(y), gp, gres, &gresidual);
  expect_close(gres, cres, "combine + residual");
  // The routing weights' moves (one f32 per row, the narrow-row kernels): choices into expert
  // rows, and their gradients back, over the padded layout (its padding rows keep the poison).
  ops::ExpertPermutation cpad, gpad;
  ops::make_expert_permutation(cr.expert_index, e, cpad, 128);
  ops::make_expert_permutation(gr.expert_index, e, gpad, 128);
  const Tensor gweight = gr.expert_weight.reshape({n, k, 1});
  Tensor gw_rows = Tensor::poisoned({gpad.rows(), 1}, DType::kF32, Device::kCUDA);
  ops::unpermute_rows_backward(gweight, gpad, gw_rows);
  const Tensor w_rows = gw_rows.to(Device::kCPU), w_host = gr.expert_weight.to(Device::kCPU);
  const Tensor tokens = gpad.source_token.to(Device::kCPU);
  const Tensor choice_rows = gpad.row_of_choice.to(Device::kCPU);
  int64_t wrong = 0;
  for (int64_t r = 0; r < gpad.rows(); ++r)
    if (tokens.data<int32_t>()[r] < 0) wrong += !std::isnan(w_rows.item(r));
  for (int64_t i = 0; i < n * k; ++i)
    wrong += w_rows.item(choice_rows.data<int32_t>()[i]) != w_host.item(i);
  EXPECT_EQ(wrong, 0) << "routing weights into expert rows";
  Tensor back = Tensor::poisoned({n, k, 1}, DType::kF32, Device::kCUDA);
  ops::unpermute_rows(gw_rows, gpad, back);
  EXPECT_EQ(relative_error(back.to(Device::kCPU).reshape({n, k}), w_host), 0.0)
      << "expert rows back to the choices";
}

// The permutation writing its rows' FP8 copies (ops::Fp8RowsOut) in the same kernel: each
// token's row quantized once for its k copies, equal to the unfused sequence's (the kernel's own
// rows quantized by the CPU reference) byte for byte and scale for scale, under both scale rules;
// padding rows of the 128-row layout keep the poison. 384 columns leave half of a bf16 step's
// lanes idle.
TEST_P(GpuPermute, ScatterWritesItsFp8Rows) {
  for (const int64_t d : {int64_t{1024}, int64_t{384}})
    for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
      SCOPED_TRACE(::testing::Message() << "d " << d << ", rule " << static_cast<int>(rule));
      const ops::ExpertPermutation p = random_expert_rows(700, 9, 128, seed + d);
      const int64_t m = p.rows();
      // Blocks of different magnitudes, so a scale from the wrong block or row shows.
      Tensor x = input({700, d});
      for (int64_t i = 0; i < x.numel(); ++i)
        x.set_item(i, x.item(i) * std::ldexp(1.0, static_cast<int>((i / 128) % 9) - 4));
      Tensor xp = gpu_out({m, d});
      QuantTensor q =
          QuantTensor::poisoned({m, d}, QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
      const ops::Fp8RowsOut fp8{&q, rule};
      ops::permute_rows(gpu(x), p, xp, nullptr, &fp8);
      const Tensor tokens = p.source_token.to(Device::kCPU);
      const auto padding = [&](int64_t r) { return tokens.data<int32_t>()[r] < 0; };
      const Tensor got = xp.to(Device::kCPU).to(DType::kF32);
      int64_t moved_wrong = 0;  // row r is its source token's
      for (int64_t r = 0; r < m; ++r)
        if (!padding(r))
          for (int64_t c = 0; c < d; ++c)
            moved_wrong += got.item(r * d + c) != x.item(tokens.data<int32_t>()[r] * d + c);
      EXPECT_EQ(moved_wrong, 0) << "the permuted rows";
      EXPECT_EQ(fp8_rows_differing(q, xp, rule, padding), 0) << "their FP8 rows";
    }
}

// The GPU moves FP8 rows (an FP8 wire's) byte for byte as the CPU does, padding rows untouched.
TEST_P(GpuPermute, MovesFp8RowsAsTheyAre) {
  const ops::ExpertPermutation p = random_expert_rows(700, 9, 128, seed + 5);
  const int64_t m = p.rows(), d = 384;
  Tensor x = input({700, d});
  for (int64_t i = 0; i < x.numel(); ++i)
    x.set_item(i, x.item(i) * std::ldexp(1.0, static_cast<int>((i / 128) % 9) - 4));
  QuantTensor q = QuantTensor::empty({700, d}, QuantBlock::kRow128, QuantAxis::kDim0);
  ops::fp8_quantize(x.to(DType::kF32), Fp8ScaleRule::kFp32, q);
  QuantTensor got =
      QuantTensor::poisoned({m, d}, QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
  ops::permute_rows(q.to(Device::kCUDA), p, got);
  const QuantTensor host = got.to(Device::kCPU);
  const Tensor tokens = p.source_token.to(Device::kCPU);
  int64_t wrong = 0, padding_written = 0, moved = 0;
  for (int64_t r = 0; r < m; ++r) {
    const int32_t t = tokens.data<int32_t>()[r];
    const auto* row = static_cast<const uint8_t*>(host.data().raw()) + r * d;
    const float* scales = host.scales().data<float>() + r * (d / 128);
    if (t < 0) {  // poisoned bytes and NaN scales stay
      for (int64_t c = 0; c < d; ++c) padding_written += row[c] != 0xFF;
      continue;
    }
    ++moved;
    wrong += std::memcmp(row, static_cast<const uint8_t*>(q.data().raw()) + t * d, d) != 0;
    wrong += std::memcmp(scales, q.scales().data<float>() + t * (d / 128),
                         (d / 128) * sizeof(float)) != 0;
  }
  EXPECT_GT(moved, 0);
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(padding_written, 0);
}

MOETRAIN_GPU_CASES(GpuPermute);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
