// Every CPU op: hand-checked forward cases and fp64 finite-difference gradients. The loss for a
// gradient check is L = sum(out * G) with a fixed random G, so dL/dout = G.
#include <cmath>

#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/grouped_gemm.h"
#include "ops/loss.h"
#include "ops/norm.h"
#include "ops/optim.h"
#include "ops/permute.h"
#include "ops/rope.h"
#include "ops/route.h"
#include "testing.h"

namespace mt {
namespace {

using testing::dot;
using testing::error_of;
using testing::gradcheck;
using testing::kGradTol;
using testing::randn;

Tensor i32(std::initializer_list<int32_t> v) {
  Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32);
  std::copy(v.begin(), v.end(), t.data<int32_t>());
  return t;
}

Tensor like(const Tensor& t) {
  return Tensor::poisoned(t.shape(), t.dtype());
}

TEST(Gemm, MatchesNaiveLoopsForEveryTranspose) {
  const Tensor a = randn({5, 7}, 1), b = randn({7, 4}, 2);
  const Tensor at = randn({7, 5}, 1), bt = randn({4, 7}, 2);
  for (auto ta : {ops::Transpose::kNo, ops::Transpose::kYes})
    for (auto tb : {ops::Transpose::kNo, ops::Transpose::kYes}) {
      const Tensor& A = ta == ops::Transpose::kNo ? a : at;
      const Tensor& B = tb == ops::Transpose::kNo ? b : bt;
      Tensor c = Tensor::poisoned({5, 4}, DType::kF64);
      ops::gemm(A, ta, B, tb, c, ops::Accumulate::kNo);
      for (int i = 0; i < 5; ++i)
        for (int j = 0; j < 4; ++j) {
          double ref = 0;
          for (int p = 0; p < 7; ++p)
            ref += (ta == ops::Transpose::kNo ? A.item(i * 7 + p) : A.item(p * 5 + i)) *
                   (tb == ops::Transpose::kNo ? B.item(p * 4 + j) : B.item(j * 7 + p));
          EXPECT_NEAR(c.item(i * 4 + j), ref, 1e-12);
        }
    }
}

TEST(Linear, Gradients) {
  Tensor x = randn({4, 6}, 1), w = randn({6, 5}, 2), g = randn({4, 5}, 3);
  auto loss = [&] {
    Tensor y = Tensor::empty({4, 5}, DType::kF64);
    ops::linear_forward(x, w, y);
    return dot(y, g);
  };
  Tensor dx = like(x), dw = Tensor::zeros(w.shape(), DType::kF64);
  ops::linear_backward(x, w, g, dx, dw);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);
  EXPECT_LT(gradcheck(loss, w, dw), kGradTol);
}

TEST(Linear, ResidualInTheEpilogueEqualsTheSum) {
  const Tensor x = randn({4, 6}, 1), w = randn({6, 5}, 2), r = randn({4, 5}, 3);
  Tensor plain = Tensor::empty({4, 5}, DType::kF64), fused = Tensor::poisoned({4, 5}, DType::kF64);
  ops::linear_forward(x, w, plain);
  ops::linear_forward_residual(x, w, r, fused);
  for (int64_t i = 0; i < plain.numel(); ++i)
    EXPECT_NEAR(fused.item(i), plain.item(i) + r.item(i), 1e-13) << i;
  EXPECT_THROW(ops::linear_forward_residual(x, w, fused, fused), Error);  // in place: refused
}

TEST(Embedding, ForwardGathersAndBackwardAccumulates) {
  Tensor table = randn({5, 3}, 1), ids = i32({4, 0, 4});
  Tensor out = Tensor::poisoned({3, 3}, DType::kF64);
  ops::embedding_forward(ids, table, out);
  for (int c = 0; c < 3; ++c) {
    EXPECT_EQ(out.item(c), table.item(12 + c));
    EXPECT_EQ(out.item(3 + c), table.item(c));
  }
  Tensor g = randn({3, 3}, 2);
  auto loss = [&] {
    ops::embedding_forward(ids, table, out);
    return dot(out, g);
  };
  Tensor dt = Tensor::zeros(table.shape(), DType::kF64);
  ops::embedding_backward(ids, g, dt);
  EXPECT_LT(gradcheck(loss, table, dt), kGradTol);
  EXPECT_THROW(ops::embedding_forward(i32({5, 0, 0}), table, out), Error);
}

TEST(RMSNorm, HandCheckedAndGradients) {
  Tensor x = Tensor::empty({1, 2}, DType::kF64), w = Tensor::empty({2}, DType::kF64);
  x.set_item(0, 3);
  x.set_item(1, 4);
  w.set_item(0, 1);
  w.set_item(1, 2);
  Tensor y = like(x), r = Tensor::poisoned({1}, DType::kF64);
  ops::rmsnorm_forward(x, w, 0.0, y, r);  // rms = sqrt(12.5)
  EXPECT_NEAR(y.item(0), 3 / std::sqrt(12.5), 1e-14);
  EXPECT_NEAR(y.item(1), 8 / std::sqrt(12.5), 1e-14);

  Tensor xs = randn({5, 8}, 1), ws = randn({8}, 2), g = randn({5, 8}, 3);
  Tensor ys = like(xs), rs = Tensor::poisoned({5}, DType::kF64);
  auto loss = [&] {
    ops::rmsnorm_forward(xs, ws, 1e-6, ys, rs);
    return dot(ys, g);
  };
  loss();
  Tensor dx = like(xs), dw = Tensor::zeros({8}, DType::kF64);
  ops::rmsnorm_backward(xs, ws, rs, g, dx, dw);
  EXPECT_LT(gradcheck(loss, xs, dx), kGradTol);
  EXPECT_LT(gradcheck(loss, ws, dw), kGradTol);
}

TEST(Rope, RotateHalfConvention) {
  // head_dim 4: pair 0 is (x0, x2) at frequency 1, pair 1 is (x1, x3) at theta^(-1/2).
  Tensor x = Tensor::zeros({2, 1, 4}, DType::kF64);
  for (int i = 0; i < 8; ++i) x.set_item(i, i + 1.0);
  Tensor y = like(x);
  const double theta = 100.0;
  ops::rope_forward(x, i32({0, 3}), theta, y);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(y.item(i), x.item(i));  // position 0: identity
  const double a0 = 3.0, a1 = 3.0 / 10.0;
  EXPECT_NEAR(y.item(4), 5 * std::cos(a0) - 7 * std::sin(a0), 1e-14);
  EXPECT_NEAR(y.item(6), 7 * std::cos(a0) + 5 * std::sin(a0), 1e-14);
  EXPECT_NEAR(y.item(5), 6 * std::cos(a1) - 8 * std::sin(a1), 1e-14);
  EXPECT_NEAR(y.item(7), 8 * std::cos(a1) + 6 * std::sin(a1), 1e-14);
}

TEST(Rope, Gradients) {
  Tensor x = randn({6, 3, 8}, 1), g = randn({6, 3, 8}, 2);
  Tensor pos = i32({0, 1, 2, 0, 1, 5});
  Tensor y = like(x);
  auto loss = [&] {
    ops::rope_forward(x, pos, 1e4, y);
    return dot(y, g);
  };
  Tensor dx = like(x);
  ops::rope_backward(g, pos, 1e4, dx);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);
}

struct AttnCase {
  Tensor q, k, v;
  ops::Documents docs;
  double scale;
};
AttnCase attn_case() {
  // 3 documents (lengths 3, 1, 4), 4 query heads over 2 kv heads, Dqk 8 != Dv 6.
  return {randn({8, 4, 8}, 1, 0.7),
          randn({8, 2, 8}, 2, 0.7),
          randn({8, 2, 6}, 3),
          {i32({0, 3, 4, 8}), 4},
          1.0 / std::sqrt(8.0)};
}

TEST(Attention, SingleTokenDocumentCopiesItsValue) {
  AttnCase c = attn_case();
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse);
  EXPECT_TRUE(all_finite(out) && all_finite(lse));
  for (int h = 0; h < 4; ++h) {
    const int g = h / 2;
    for (int d = 0; d < 6; ++d)
      EXPECT_NEAR(out.item((3 * 4 + h) * 6 + d), c.v.item((3 * 2 + g) * 6 + d), 1e-14);
    double s = 0;
    for (int d = 0; d < 8; ++d) s += c.q.item((3 * 4 + h) * 8 + d) * c.k.item((3 * 2 + g) * 8 + d);
    EXPECT_NEAR(lse.item(3 * 4 + h), s * c.scale, 1e-14);
  }
}

TEST(Attention, MatchesDenseSoftmaxAndIsolatesDocuments) {
  AttnCase c = attn_case();
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse);
  // Token 6 (document 2 = tokens 4..7), head 3 -> kv head 1: explicit softmax over tokens 4..6.
  double w[3], z = 0;
  for (int j = 4; j <= 6; ++j) {
    double s = 0;
    for (int d = 0; d < 8; ++d) s += c.q.item((6 * 4 + 3) * 8 + d) * c.k.item((j * 2 + 1) * 8 + d);
    z += (w[j - 4] = std::exp(s * c.scale));
  }
  for (int d = 0; d < 6; ++d) {
    double ref = 0;
    for (int j = 4; j <= 6; ++j) ref += w[j - 4] / z * c.v.item((j * 2 + 1) * 6 + d);
    EXPECT_NEAR(out.item((6 * 4 + 3) * 6 + d), ref, 1e-13);
  }
  EXPECT_NEAR(lse.item(6 * 4 + 3), std::log(z), 1e-13);
  // Changing a later document's keys leaves earlier documents alone.
  Tensor out2 = like(out);
  c.k.set_item((5 * 2 + 0) * 8, 10.0);
  ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out2, lse);
  for (int64_t i = 0; i < 4 * 4 * 6; ++i) EXPECT_EQ(out.item(i), out2.item(i));
}

TEST(Attention, Gradients) {
  AttnCase c = attn_case();
  Tensor g = randn({8, 4, 6}, 4);
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  auto loss = [&] {
    ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse);
    return dot(out, g);
  };
  loss();
  Tensor dq = like(c.q), dk = like(c.k), dv = like(c.v);
  ops::attention_backward(c.q, c.k, c.v, out, lse, g, c.docs, c.scale, dq, dk, dv);
  EXPECT_LT(gradcheck(loss, c.q, dq), kGradTol);
  EXPECT_LT(gradcheck(loss, c.k, dk), kGradTol);
  EXPECT_LT(gradcheck(loss, c.v, dv), kGradTol);
}

TEST(Attention, PlannedDocumentsRoundUpToPowersOfTwoWithinTheTokens) {
  const ops::PlannedDocuments a = ops::planned_documents(5, 300, 4096);
  EXPECT_EQ(a.count, 8);
  EXPECT_EQ(a.longest, 512);
  const ops::PlannedDocuments b = ops::planned_documents(1, 3, 40);  // floor 64, cut at 40
  EXPECT_EQ(b.count, 1);
  EXPECT_EQ(b.longest, 40);
  const ops::PlannedDocuments c = ops::planned_documents(16, 4096, 16384);  // already powers
  EXPECT_EQ(c.count, 16);
  EXPECT_EQ(c.longest, 4096);
}

// The backward's split: a quarter of the planned longest (700 plans at 1024: 256), the documents
// past it counted from host boundaries (300 and 700; 256 itself is not past it), their planned
// count a power of two.
TEST(Attention, LongDocumentsAreThosePastAQuarterOfThePlannedLongest) {
  EXPECT_EQ(ops::long_document_threshold(700, 4096), 256);
  EXPECT_EQ(ops::long_document_threshold(4096, 16384), 1024);
  EXPECT_EQ(ops::long_document_threshold(3, 40), 10);  // the plan's longest is cut at the tokens
  Tensor cu = Tensor::empty({7}, DType::kI32);
  const int32_t bounds[] = {0, 300, 301, 358, 1058, 1314, 1400};  // 300, 1, 57, 700, 256, 86
  for (int i = 0; i < 7; ++i) cu.set_item(i, bounds[i]);
  EXPECT_EQ(ops::count_long_documents(cu, ops::max_document_length(cu)), 2);
  EXPECT_EQ(ops::planned_long_documents(-1), -1);
  EXPECT_EQ(ops::planned_long_documents(0), 0);
  EXPECT_EQ(ops::planned_long_documents(3), 4);
  EXPECT_EQ(ops::planned_long_documents(4), 4);
}

TEST(Attention, LongestDocumentIsCheckedAndComputed) {
  AttnCase c = attn_case();
  EXPECT_EQ(ops::max_document_length(c.docs.cu_seqlens), 4);
  Tensor out = Tensor::poisoned({8, 4, 6}, DType::kF64),
         lse = Tensor::poisoned({8, 4}, DType::kF64);
  c.docs.max_length = 3;  // understated: the GPU would size its grid too small
  EXPECT_THROW(ops::attention_forward(c.q, c.k, c.v, c.docs, c.scale, out, lse), Error);
}

TEST(Router, HandCheckedChoiceAndWeights) {
  // One token, 4 experts, logits log(1), log(4), log(2), log(3): scores 0.1, 0.4, 0.2, 0.3.
  Tensor logits = Tensor::empty({1, 4}, DType::kF64);
  for (int e = 0; e < 4; ++e) logits.set_item(e, std::log(std::vector<double>{1, 4, 2, 3}[e]));
  ops::Routing r;
  ops::router_forward(logits, Tensor(), {2, true, ops::RoutingMode::kLearned}, r);
  EXPECT_EQ(r.expert_index.item(0), 1);
  EXPECT_EQ(r.expert_index.item(1), 3);
  EXPECT_NEAR(r.expert_weight.item(0), 0.4 / 0.7, 1e-14);
  EXPECT_NEAR(r.expert_weight.item(1), 0.3 / 0.7, 1e-14);
  ops::router_forward(logits, Tensor(), {2, false, ops::RoutingMode::kLearned}, r);
  EXPECT_NEAR(r.expert_weight.item(0), 0.4, 1e-14);
  // The bias steers the choice but never the weights.
  Tensor bias = Tensor::zeros({4}, DType::kF64);
  bias.set_item(0, 0.35);
  ops::router_forward(logits, bias, {2, false, ops::RoutingMode::kLearned}, r);
  EXPECT_EQ(r.expert_index.item(0), 0);
  EXPECT_EQ(r.expert_index.item(1), 1);
  EXPECT_NEAR(r.expert_weight.item(0), 0.1, 1e-14);
  // Aux loss: E * sum_e count_e / N * mean score = 4 * (0.1 + 0.4) for choices {0, 1}.
  EXPECT_NEAR(ops::router_aux_loss(ops::router_aux_stats(r, Tensor())).item(0), 4 * (0.1 + 0.4),
              1e-14);
}

TEST(Router, ForcedBalancedRoutingSpreadsEvenly) {
  Tensor logits = randn({8, 4}, 1);
  ops::Routing r;
  ops::router_forward(logits, Tensor(), {2, true, ops::RoutingMode::kBalanced}, r);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(r.tokens_per_expert.item(e), 4);
  EXPECT_EQ(r.expert_index.item(2 * 3 + 1), (3 * 2 + 1) % 4);
}

// Skewed routing: each token's choices distinct, the first E/4 experts at twice the mean load,
// the others within one row of 2/3 of it; odd k alternates ceil/floor of k/2 hot choices.
TEST(Router, SkewedRoutingPutsTwiceTheMeanOnTheHotQuarter) {
  for (const auto& [e, k] : {std::pair<int64_t, int64_t>{16, 4}, {8, 3}, {128, 8}, {4, 1}}) {
    const int64_t n = 96;
    Tensor logits = randn({n, e}, 1);
    ops::Routing r;
    ops::router_forward(logits, Tensor(), {static_cast<int>(k), true, ops::RoutingMode::kSkewed},
                        r);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j)
        for (int64_t i = 0; i < j; ++i)
          ASSERT_NE(r.expert_index.item(t * k + i), r.expert_index.item(t * k + j))
              << "token " << t << " E " << e << " k " << k;
    const double mean = static_cast<double>(n * k) / static_cast<double>(e);
    for (int64_t x = 0; x < e; ++x) {
      const double load = r.tokens_per_expert.item(x);
      if (x < e / 4)
        EXPECT_EQ(load, 2 * mean) << "hot expert " << x << " E " << e << " k " << k;
      else
        EXPECT_NEAR(load, 2 * mean / 3, 1.0) << "cold expert " << x << " E " << e << " k " << k;
    }
  }
}

// With and without padding tokens (rows 1 and 4: outside the aux statistics, so their logits get
// only the routing weights' gradient).
TEST(Router, Gradients) {
  Tensor padding = Tensor::zeros({6}, DType::kU8);
  padding.data<uint8_t>()[1] = padding.data<uint8_t>()[4] = 1;
  for (const Tensor& pad : {Tensor(), padding})
    for (bool norm : {true, false}) {
      for (const ops::RoutingMode mode :
           {ops::RoutingMode::kLearned, ops::RoutingMode::kBalanced}) {
        const ops::RouterOptions opt{3, norm, mode};
        Tensor logits = randn({6, 5}, 1), g = randn({6, 3}, 2);
        const double aux_grad = 0.7;
        ops::Routing r;
        auto loss = [&] {
          ops::router_forward(logits, Tensor(), opt, r);
          return dot(r.expert_weight, g) +
                 aux_grad * ops::router_aux_loss(ops::router_aux_stats(r, pad)).item(0);
        };
        loss();
        Tensor dl = like(logits);
        ops::router_backward(r, opt, ops::router_aux_stats(r, pad), pad, g, aux_grad, dl);
        EXPECT_LT(gradcheck(loss, logits, dl), kGradTol)
            << "norm " << norm << " mode " << ops::routing_mode_name(mode) << " padding "
            << pad.defined();
      }
    }
}

// Padding tokens are outside the aux statistics: the statistics (and loss) of a batch with padding
// rows are those of the batch without them, exactly; a batch all padding has loss 0.
TEST(Router, PaddingIsOutsideTheAuxStatistics) {
  const Tensor logits = randn({7, 6}, 3);
  Tensor padding = Tensor::zeros({7}, DType::kU8);
  const std::vector<int64_t> real = {0, 2, 3, 6};
  for (const int64_t t : {1, 4, 5}) padding.data<uint8_t>()[t] = 1;
  Tensor kept = Tensor::empty({4, 6}, DType::kF64);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t c = 0; c < 6; ++c) kept.set_item(i * 6 + c, logits.item(real[i] * 6 + c));
  const ops::RouterOptions opt{2, true, ops::RoutingMode::kLearned};
  ops::Routing all, only;
  ops::router_forward(logits, Tensor(), opt, all);
  ops::router_forward(kept, Tensor(), opt, only);
  const ops::AuxStats a = ops::router_aux_stats(all, padding), b = ops::router_aux_stats(only, {});
  for (int64_t c = 0; c < 6; ++c) {
    EXPECT_EQ(a.tokens_per_expert.item(c), b.tokens_per_expert.item(c)) << c;
    EXPECT_EQ(a.score_sum.item(c), b.score_sum.item(c)) << c;
  }
  const double loss = ops::router_aux_loss(a).item(0);
  EXPECT_GT(loss, 0.0);
  EXPECT_EQ(loss, ops::router_aux_loss(b).item(0));
  Tensor everything = Tensor::zeros({7}, DType::kU8);
  for (int64_t t = 0; t < 7; ++t) everything.data<uint8_t>()[t] = 1;
  EXPECT_EQ(ops::router_aux_loss(ops::router_aux_stats(all, everything)).item(0), 0.0);
}

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

// Two ranks of two experts: the tokens each rank receives and the choices as its experts.
TEST(Permute, PeerAndLocalChoices) {
  Tensor index = i32({3, 0, 1, 0, 2, 3, 1, 2});
  index = index.reshape({4, 2});
  Tensor peers = Tensor::poisoned({4, 2}, DType::kI32);
  ops::peer_choices(index, 2, 2, peers);
  const std::vector<int> want = {0, 1, 0, -1, -1, 1, 0, 1};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(peers.item(i), want[i]) << i;
  // Each token's place in each peer's region: the tokens for that peer numbered in order, the
  // regions 10 rows apart.
  Tensor slots = Tensor::poisoned({4, 2}, DType::kI32);
  ops::peer_slots(peers, 10, slots);
  const std::vector<int> want_slots = {0, 10, 1, -1, -1, 11, 2, 12};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(slots.item(i), want_slots[i]) << i;
  Tensor counts = Tensor::poisoned({2, 3}, DType::kI64);
  ops::peer_counts(index, 2, 2, counts);
  // Rank 0: expert 0 twice, expert 1 twice, 3 tokens; rank 1: expert 2 twice, 3 twice, 3 tokens.
  const std::vector<int> want_counts = {2, 2, 3, 2, 2, 3};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(counts.item(i), want_counts[i]) << i;
  Tensor local = Tensor::poisoned({4, 2}, DType::kI32);
  ops::local_choices(index, 1, 2, local);
  const std::vector<int> want_local = {1, -1, -1, -1, 0, 1, -1, 0};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(local.item(i), want_local[i]) << i;
}

// Three rows to two ranks of three places: each row at p * 3 + its slot for every rank it goes to,
// the places no row names left as they were; a slot past the places is named.
TEST(Permute, PlaceRowsPutsEachRowAtItsPlaces) {
  Tensor x = i32({10, 11, 20, 21, 30, 31}).reshape({3, 2});
  Tensor slot = i32({0, -1, 1, 0, -1, 2}).reshape({3, 2});
  Tensor out = Tensor::empty({6, 2}, DType::kI32);
  std::fill(out.data<int32_t>(), out.data<int32_t>() + 12, -7);
  ops::place_rows(x, slot, 3, out);
  const std::vector<int> want = {10, 11, 20, 21, -7, -7, 20, 21, -7, -7, 30, 31};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out.item(i), want[i]) << i;
  Tensor bad = i32({0, -1, 1, 0, -1, 3}).reshape({3, 2});
  const std::string e = error_of([&] { ops::place_rows(x, bad, 3, out); });
  EXPECT_NE(e.find("slot 3 of row 2 for rank 1: 3 places per rank"), std::string::npos) << e;
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

// The grouped GEMMs over a padded layout give the dense layout's products on every expert's rows
// (and the same weight gradients); padding rows are not read.
TEST(GroupedGemm, PaddedSegmentsGiveTheDenseProducts) {
  const std::vector<int64_t> counts = {2, 0, 5}, off = {0, 2, 2, 7}, seg = {0, 4, 4, 12};
  Tensor x = randn({7, 4}, 1), w = randn({3, 4, 5}, 2), g = randn({7, 5}, 3);
  Tensor toff = Tensor::empty({4}, DType::kI64), tseg = Tensor::empty({4}, DType::kI64);
  for (int e = 0; e < 4; ++e) {
    toff.set_item(e, static_cast<double>(off[e]));
    tseg.set_item(e, static_cast<double>(seg[e]));
  }
  const ops::ExpertRows padded(toff, tseg, 4);
  // The padded copies: expert e's rows at seg[e], NaN in the padding (must not be read).
  auto pad = [&](const Tensor& dense) {
    const int64_t width = dense.dim(1);
    Tensor p = Tensor::empty({12, width}, DType::kF64);
    for (int64_t i = 0; i < p.numel(); ++i) p.set_item(i, std::nan(""));
    for (int e = 0; e < 3; ++e)
      for (int64_t r = 0; r < counts[e]; ++r)
        for (int64_t c = 0; c < width; ++c)
          p.set_item((seg[e] + r) * width + c, dense.item((off[e] + r) * width + c));
    return p;
  };
  const Tensor xpad = pad(x), gpad = pad(g);
  Tensor out = Tensor::empty({7, 5}, DType::kF64), pout = Tensor::empty({12, 5}, DType::kF64);
  Tensor dx = Tensor::empty({7, 4}, DType::kF64), pdx = Tensor::empty({12, 4}, DType::kF64);
  Tensor dw = Tensor::poisoned(w.shape(), DType::kF64),
         pdw = Tensor::poisoned(w.shape(), DType::kF64);
  ops::grouped_gemm_forward(x, w, toff, out);
  ops::grouped_gemm_forward(xpad, w, padded, pout);
  ops::grouped_gemm_backward_input(g, w, toff, dx);
  ops::grouped_gemm_backward_input(gpad, w, padded, pdx);
  ops::grouped_gemm_backward_weight(x, g, toff, dw, ops::Accumulate::kNo);
  ops::grouped_gemm_backward_weight(xpad, gpad, padded, pdw, ops::Accumulate::kNo);
  for (int e = 0; e < 3; ++e)
    for (int64_t r = 0; r < counts[e]; ++r) {
      for (int c = 0; c < 5; ++c)
        EXPECT_EQ(pout.item((seg[e] + r) * 5 + c), out.item((off[e] + r) * 5 + c));
      for (int c = 0; c < 4; ++c)
        EXPECT_EQ(pdx.item((seg[e] + r) * 4 + c), dx.item((off[e] + r) * 4 + c));
    }
  for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(pdw.item(i), dw.item(i)) << i;
  // A layout whose expert overruns its segment is refused, naming the expert.
  Tensor bad = tseg.clone();
  bad.set_item(1, 1.0);
  const std::string e =
      error_of([&] { ops::grouped_gemm_forward(xpad, w, ops::ExpertRows(toff, bad, 1), pout); });
  EXPECT_NE(e.find("expert 0"), std::string::npos) << e;
}

TEST(GroupedGemm, PerExpertProductsAndGradients) {
  Tensor x = randn({7, 4}, 1), w = randn({3, 4, 5}, 2), g = randn({7, 5}, 3);
  Tensor off = Tensor::empty({4}, DType::kI64);
  for (int e = 0; e < 4; ++e) off.set_item(e, std::vector<int>{0, 2, 2, 7}[e]);  // expert 1 empty
  Tensor out = Tensor::poisoned({7, 5}, DType::kF64);
  ops::grouped_gemm_forward(x, w, off, out);
  for (int r = 0; r < 7; ++r) {
    const int e = r < 2 ? 0 : 2;
    for (int n = 0; n < 5; ++n) {
      double ref = 0;
      for (int k = 0; k < 4; ++k) ref += x.item(r * 4 + k) * w.item((e * 4 + k) * 5 + n);
      EXPECT_NEAR(out.item(r * 5 + n), ref, 1e-13);
    }
  }
  auto loss = [&] {
    ops::grouped_gemm_forward(x, w, off, out);
    return dot(out, g);
  };
  Tensor dx = like(x), dw = Tensor::zeros(w.shape(), DType::kF64);
  ops::grouped_gemm_backward_input(g, w, off, dx);
  ops::grouped_gemm_backward_weight(x, g, off, dw);
  EXPECT_LT(gradcheck(loss, x, dx), kGradTol);
  EXPECT_LT(gradcheck(loss, w, dw, 60), kGradTol);
  for (int i = 20; i < 40; ++i) EXPECT_EQ(dw.item(i), 0.0);  // the empty expert
  // Overwriting into a poisoned buffer gives the same, the empty expert zero.
  Tensor fresh = Tensor::poisoned(w.shape(), DType::kF64);
  ops::grouped_gemm_backward_weight(x, g, off, fresh, ops::Accumulate::kNo);
  for (int64_t i = 0; i < dw.numel(); ++i) EXPECT_EQ(fresh.item(i), dw.item(i)) << i;
}

TEST(SwiGLU, HandCheckedAndGradients) {
  Tensor h = Tensor::empty({1, 2}, DType::kF64), a = Tensor::poisoned({1, 1}, DType::kF64);
  h.set_item(0, 1.5);
  h.set_item(1, -2.0);
  ops::swiglu_forward(h, a);
  EXPECT_NEAR(a.item(0), 1.5 / (1 + std::exp(-1.5)) * -2.0, 1e-14);
  Tensor hs = randn({4, 6}, 1), g = randn({4, 3}, 2), as = like(g);
  auto loss = [&] {
    ops::swiglu_forward(hs, as);
    return dot(as, g);
  };
  Tensor dh = like(hs);
  ops::swiglu_backward(hs, g, dh);
  EXPECT_LT(gradcheck(loss, hs, dh), kGradTol);
  // Row 2 marked as padding: left as it is (poisoned), the others as without marks.
  Tensor marks = i32({0, 1, -1, 3});
  ops::swiglu_forward(hs, as);  // unmarked, at hs itself (the gradient check moved it about)
  Tensor pa = Tensor::poisoned({4, 3}, DType::kF64), pdh = Tensor::poisoned({4, 6}, DType::kF64);
  ops::swiglu_forward(hs, pa, {&marks});
  ops::swiglu_backward(hs, g, pdh, {&marks});
  for (int64_t i = 0; i < 12; ++i)
    if (i / 3 == 2)
      EXPECT_TRUE(std::isnan(pa.item(i))) << i;
    else
      EXPECT_EQ(pa.item(i), as.item(i)) << i;
  for (int64_t i = 0; i < 24; ++i)
    if (i / 6 == 2)
      EXPECT_TRUE(std::isnan(pdh.item(i))) << i;
    else
      EXPECT_EQ(pdh.item(i), dh.item(i)) << i;
}

// Routing weights per row: the output scaled by the row's weight, gradients for h and for the
// weights (a finite difference of each), padding rows left as they are.
TEST(SwiGLU, RowWeightsScaleTheOutputAndGetTheirGradient) {
  Tensor hs = randn({4, 6}, 1), g = randn({4, 3}, 2), weight = randn({4}, 3);
  Tensor plain = Tensor::poisoned({4, 3}, DType::kF64), as = like(plain);
  ops::swiglu_forward(hs, plain);
  ops::swiglu_forward(hs, as, {nullptr, &weight});
  for (int64_t i = 0; i < 12; ++i)
    EXPECT_NEAR(as.item(i), weight.item(i / 3) * plain.item(i), 1e-14) << i;
  auto loss = [&] {
    ops::swiglu_forward(hs, as, {nullptr, &weight});
    return dot(as, g);
  };
  Tensor dh = like(hs), dweight = like(weight);
  ops::swiglu_backward(hs, g, dh, {nullptr, &weight}, &dweight);
  EXPECT_LT(gradcheck(loss, hs, dh), kGradTol);
  EXPECT_LT(gradcheck(loss, weight, dweight), kGradTol);

  Tensor marks = i32({0, -1, 2, 3});
  Tensor pdh = Tensor::poisoned({4, 6}, DType::kF64), pdw = Tensor::poisoned({4}, DType::kF64);
  ops::swiglu_backward(hs, g, pdh, {&marks, &weight}, &pdw);
  for (int64_t r = 0; r < 4; ++r) {
    if (r == 1)
      EXPECT_TRUE(std::isnan(pdw.item(r)));
    else
      EXPECT_EQ(pdw.item(r), dweight.item(r)) << r;
  }
  // Weights without their gradient, or of another length, are refused.
  std::string e = error_of([&] { ops::swiglu_backward(hs, g, dh, {nullptr, &weight}); });
  EXPECT_NE(e.find("go together"), std::string::npos) << e;
  const Tensor three = randn({3}, 4);
  e = error_of([&] { ops::swiglu_forward(hs, as, {nullptr, &three}); });
  EXPECT_NE(e.find("swiglu row weights"), std::string::npos) << e;
}

TEST(CrossEntropy, HandCheckedMaskAndGradients) {
  Tensor logits = Tensor::zeros({3, 7}, DType::kF64);
  Tensor targets = i32({2, 5, 1});
  Tensor mask = Tensor::empty({3}, DType::kU8);
  mask.set_item(0, 1);
  mask.set_item(1, 0);
  mask.set_item(2, 1);
  Tensor lse = Tensor::poisoned({3}, DType::kF64);
  EXPECT_NEAR(ops::cross_entropy_forward(logits, targets, mask, lse), 2 * std::log(7.0), 1e-13);

  Tensor l = randn({3, 7}, 1);
  auto loss = [&] { return 0.5 * ops::cross_entropy_forward(l, targets, mask, lse); };
  loss();
  Tensor dl = like(l);
  ops::cross_entropy_backward(l, targets, mask, lse, 0.5, dl);
  EXPECT_LT(gradcheck(loss, l, dl), kGradTol);
  for (int v = 0; v < 7; ++v) EXPECT_EQ(dl.item(7 + v), 0.0);  // masked token

  // Per-token losses: lse - logit[target] by hand, 0 where masked, summing to the total.
  Tensor sum = Tensor::zeros({1}, DType::kF64), each = Tensor::poisoned({3}, DType::kF64);
  ops::cross_entropy_forward(l, targets, mask, lse, sum, &each);
  double total = 0;
  for (int i = 0; i < 3; ++i) {
    double m = -1e300, z = 0;
    for (int v = 0; v < 7; ++v) m = std::max(m, l.item(i * 7 + v));
    for (int v = 0; v < 7; ++v) z += std::exp(l.item(i * 7 + v) - m);
    const double want = mask.item(i) ? m + std::log(z) - l.item(i * 7 + targets.item(i)) : 0.0;
    EXPECT_NEAR(each.item(i), want, 1e-14) << i;
    total += want;
  }
  EXPECT_GT(each.item(0), 0.0);
  EXPECT_EQ(each.item(1), 0.0);
  EXPECT_NEAR(sum.item(0), total, 1e-14);
  Tensor wrong = Tensor::empty({3}, DType::kF32);
  EXPECT_NE(error_of([&] {
              ops::cross_entropy_forward(l, targets, mask, lse, sum, &wrong);
            }).find("per-token loss is f32"),
            std::string::npos);
}

// Pooling two layers' statistics adds counts, score sums and token counts; the pooled loss is
// E sum_e (C_e / N) (S_e / N) of the sums.
TEST(RouterAux, PooledStatisticsAreTheSums) {
  // top-2: counts summing to 6 are 3 tokens each.
  ops::AuxStats a{Tensor::empty({3}, DType::kI64), Tensor::empty({3}, DType::kF64), 2};
  ops::AuxStats b = {a.tokens_per_expert.clone(), a.score_sum.clone(), 2};
  const int64_t ca[3] = {2, 0, 4}, cb[3] = {1, 3, 2};
  const double sa[3] = {1.5, 0.25, 1.25}, sb[3] = {0.5, 2.0, 0.5};
  for (int e = 0; e < 3; ++e) {
    a.tokens_per_expert.data<int64_t>()[e] = ca[e];
    b.tokens_per_expert.data<int64_t>()[e] = cb[e];
    a.score_sum.set_item(e, sa[e]);
    b.score_sum.set_item(e, sb[e]);
  }
  ops::AuxStats pooled = ops::zero_aux_stats(a);
  ops::add_aux_stats(a, pooled);
  ops::add_aux_stats(b, pooled);
  double want = 0;
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(pooled.tokens_per_expert.data<int64_t>()[e], ca[e] + cb[e]);
    EXPECT_EQ(pooled.score_sum.item(e), sa[e] + sb[e]);
    want += (ca[e] + cb[e]) / 6.0 * ((sa[e] + sb[e]) / 6.0);
  }
  EXPECT_NEAR(ops::router_aux_loss(pooled).item(0), 3 * want, 1e-15);
}

TEST(AdamW, FirstStepIsSignedLearningRate) {
  // Step 1: m_hat = g, v_hat = g^2, so p <- p (1 - lr wd) - lr g / (|g| + eps).
  Tensor p = Tensor::empty({2}, DType::kF64), g = Tensor::empty({2}, DType::kF64);
  p.set_item(0, 1.0);
  p.set_item(1, -2.0);
  g.set_item(0, 0.5);
  g.set_item(1, -0.25);
  Tensor m = Tensor::zeros({2}, DType::kF64), v = Tensor::zeros({2}, DType::kF64);
  const ops::AdamWHyper h{0.1, 0.9, 0.95, 1e-8, 0.01, 1};
  ops::adamw_step(p, g, m, v, h);
  EXPECT_NEAR(p.item(0), 1.0 * (1 - 0.001) - 0.1 * 0.5 / (0.5 + 1e-8), 1e-12);
  EXPECT_NEAR(p.item(1), -2.0 * (1 - 0.001) + 0.1 * 0.25 / (0.25 + 1e-8), 1e-12);
  EXPECT_NEAR(m.item(0), 0.05, 1e-15);
  EXPECT_NEAR(v.item(0), 0.05 * 0.25, 1e-15);
  // Step 2 against the formula.
  const double m2 = 0.9 * 0.05 + 0.1 * 0.5, v2 = 0.95 * 0.0125 + 0.05 * 0.25;
  const double p1 = p.item(0);
  ops::adamw_step(p, g, m, v, {0.1, 0.9, 0.95, 1e-8, 0.01, 2});
  const double expect =
      p1 * (1 - 0.001) - 0.1 * (m2 / (1 - 0.81)) / (std::sqrt(v2 / (1 - 0.9025)) + 1e-8);
  EXPECT_NEAR(p.item(0), expect, 1e-12);
}

TEST(AdamW, GradScaleEqualsScaledGradients) {
  const Tensor p0 = randn({64}, 21), g = randn({64}, 22), m0 = randn({64}, 23, 0.01);
  Tensor v0 = randn({64}, 24, 0.01);
  for (int64_t i = 0; i < 64; ++i) v0.set_item(i, std::abs(v0.item(i)));
  Tensor p = p0.clone(), m = m0.clone(), v = v0.clone();
  ops::adamw_step(p, g, m, v, {0.1, 0.9, 0.95, 1e-8, 0.01, 3, 0.25});
  Tensor gs = g.clone(), ps = p0.clone(), ms = m0.clone(), vs = v0.clone();
  for (int64_t i = 0; i < 64; ++i) gs.set_item(i, 0.25 * g.item(i));
  ops::adamw_step(ps, gs, ms, vs, {0.1, 0.9, 0.95, 1e-8, 0.01, 3});
  for (int64_t i = 0; i < 64; ++i) {
    EXPECT_EQ(p.item(i), ps.item(i));
    EXPECT_EQ(v.item(i), vs.item(i));
  }
}

}  // namespace
}  // namespace mt
