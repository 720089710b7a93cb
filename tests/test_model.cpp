// The model: whole-model fp64 finite-difference gradients (every parameter tensor, blocks
// included), identical gradients under every activation checkpoint policy, FLOP counting.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/flops.h"
#include "model/qwen3_moe.h"
#include "testing.h"
#include "train/data_loader.h"

namespace mt {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.vocab_size = 11;
  c.dim = 8;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 6;  // independent of dim / heads
  c.n_experts = 4;
  c.top_k = 2;
  c.moe_dim = 5;
  c.rope_theta = 100.0;
  c.aux_loss_coef = 0.01;
  c.init_std = 0.5;  // large enough that every path carries gradient
  c.compute_dtype = DType::kF64;
  return c;
}

// Documents of the given lengths one after another (targets and tokens drawn from seed), each
// token's target in the loss unless masked(i).
Batch documents_batch(int64_t vocab, uint64_t seed, const std::vector<int64_t>& docs,
                      const std::function<bool(int64_t)>& masked) {
  int64_t n = 0, longest = 0;
  for (const int64_t d : docs) n += d, longest = std::max(longest, d);
  Batch b;
  b.tokens = Tensor::empty({n}, DType::kI32);
  b.targets = Tensor::empty({n}, DType::kI32);
  b.loss_mask = Tensor::empty({n}, DType::kU8);
  b.positions = Tensor::empty({n}, DType::kI32);
  b.cu_seqlens = Tensor::empty({static_cast<int64_t>(docs.size()) + 1}, DType::kI32);
  const CounterRng rng{seed, 5};
  int64_t i = 0;
  b.cu_seqlens.data<int32_t>()[0] = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    for (int64_t pos = 0; pos < docs[d]; ++pos, ++i) {
      b.tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.below(2 * i, vocab));
      b.targets.data<int32_t>()[i] = static_cast<int32_t>(rng.below(2 * i + 1, vocab));
      b.loss_mask.data<uint8_t>()[i] = !masked(i);
      b.positions.data<int32_t>()[i] = static_cast<int32_t>(pos);
    }
    b.cu_seqlens.data<int32_t>()[d + 1] = static_cast<int32_t>(i);
  }
  b.max_seqlen = longest;
  return b;
}

// Two rows of 6 tokens; row 0 holds documents of 4 and 2 tokens; one target masked.
Batch small_batch(int64_t vocab, uint64_t seed) {
  return documents_batch(vocab, seed, {4, 2, 6}, [](int64_t i) { return i == 3; });
}

// Every parameter group's gradient after one forward and backward of b (model seed 3).
std::vector<Tensor> one_step_gradients(const ModelConfig& c, const Batch& b) {
  Qwen3Moe model(c, 3);
  model.zero_grad();
  model.forward_backward(b, {1.0 / b.masked_tokens(), c.aux_loss_coef});
  std::vector<Tensor> g;
  for (auto& u : model.units())
    for (auto& grp : u.groups) g.push_back(grp.grads.clone());
  return g;
}

void check_model_gradients(const ModelConfig& c) {
  Qwen3Moe model(c, 3);
  const Batch b = small_batch(c.vocab_size, 9);
  const LossScale scale{1.0 / b.masked_tokens(), c.aux_loss_coef};
  model.zero_grad();
  model.forward_backward(b, scale);
  auto loss = [&] {
    const MicroBatchLosses l = model.forward(b);
    return l.ce_sum * scale.ce_scale + scale.aux_scale * l.aux_sum;
  };
  for (auto& u : model.units())
    for (auto& g : u.groups)
      for (size_t i = 0; i < g.specs.size(); ++i) {
        const double err = testing::gradcheck(loss, g.param(i), g.grad(i), 24);
        EXPECT_LT(err, testing::kGradTol) << g.specs[i].name;
      }
}

TEST(Model, GradientsMatchFiniteDifferences) {
  check_model_gradients(small_config());
}

TEST(Model, GradientsMatchFiniteDifferencesTiedNoNormTopk) {
  ModelConfig c = small_config();
  c.tie_word_embeddings = true;
  c.norm_topk_prob = false;
  c.n_kv_heads = 1;
  c.loss_chunk_tokens = 5;  // the tied head in chunks of 5, 5 and 2 tokens
  check_model_gradients(c);
}

TEST(Model, GradientsMatchFiniteDifferencesChunkedLoss) {
  ModelConfig c = small_config();
  c.loss_chunk_tokens = 5;
  check_model_gradients(c);
}

// The FP8 dense recipe's LM head quantizes each row on its own (x and dlogits in 1 x 128 blocks
// along the row; the weight's tiles made once), so its gradients cannot depend on how the rows
// are cut: one chunk of 5096 tokens, whose backward writes dlogits' FP8 rows in two slices (4096
// and 1000 rows, kHeadFp8GradientRows), gives every parameter the gradient that six chunks of at
// most 1000 tokens (one slice each) give, up to the order the head's weight gradient sums in.
TEST(Model, Fp8HeadGradientsDoNotDependOnChunksOrSlices) {
  ModelConfig c = small_config();  // widths the FP8 blocks divide
  c.vocab_size = 256;
  c.dim = 128;
  c.n_layers = 1;
  c.n_heads = c.n_kv_heads = 1;
  c.head_dim = 128;
  c.init_std = 0.02;
  c.dense_recipe = DenseRecipe::kFp8WgradWithHp;
  const int64_t n = kHeadFp8GradientRows + 1000, doc = 256;
  ASSERT_GT(n, kHeadFp8GradientRows);
  std::vector<int64_t> docs(n / doc, doc);
  if (n % doc != 0) docs.push_back(n % doc);
  const Batch b = documents_batch(c.vocab_size, 17, docs, [](int64_t i) { return i % 7 == 3; });
  std::vector<std::vector<Tensor>> grads;
  for (const int64_t chunk : {int64_t{0}, int64_t{1000}}) {
    c.loss_chunk_tokens = chunk;
    grads.push_back(one_step_gradients(c, b));
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_GT(testing::dot(grads[0][i], grads[0][i]), 0.0) << "group " << i;
    EXPECT_LT(relative_error(grads[1][i], grads[0][i]), 1e-12) << "group " << i;
  }
}

TEST(Model, GradientsMatchFiniteDifferencesForcedBalanced) {
  ModelConfig c = small_config();
  c.routing = ops::RoutingMode::kBalanced;
  check_model_gradients(c);
}

// transformers' load-balancing loss (statistics pooled over the layers), with a coefficient
// large enough to dominate, under every checkpoint policy (a recomputed routing must take the
// pooled statistics again).
TEST(Model, GradientsMatchFiniteDifferencesTransformersAuxLoss) {
  for (auto policy : {CheckpointPolicy::kNone, CheckpointPolicy::kFull}) {
    ModelConfig c = small_config();
    c.aux_loss_form = AuxLossForm::kTransformers;
    c.aux_loss_coef = 2.0;
    c.checkpoint = policy;
    check_model_gradients(c);
  }
}

TEST(Model, CheckpointPoliciesGiveIdenticalGradients) {
  std::vector<std::vector<Tensor>> grads;
  for (auto policy :
       {CheckpointPolicy::kNone, CheckpointPolicy::kSelective, CheckpointPolicy::kFull}) {
    ModelConfig c = small_config();
    c.compute_dtype = DType::kF32;
    c.checkpoint = policy;
    grads.push_back(one_step_gradients(c, small_batch(c.vocab_size, 9)));
  }
  for (size_t p = 1; p < grads.size(); ++p)
    for (size_t i = 0; i < grads[0].size(); ++i) {
      ASSERT_EQ(grads[p][i].numel(), grads[0][i].numel());
      for (int64_t j = 0; j < grads[0][i].numel(); ++j)
        ASSERT_EQ(grads[p][i].item(j), grads[0][i].item(j)) << "policy " << p << " group " << i;
    }
  // And they are not trivially zero.
  double norm = 0;
  for (const Tensor& t : grads[0])
    for (int64_t j = 0; j < t.numel(); ++j) norm += t.item(j) * t.item(j);
  EXPECT_GT(norm, 0.0);
}

// Padding never changes the loss or any gradient (fp64): the same three documents in rows of 8
// with padded tails (whole packing) and end to end with no padding give the same loss, aux loss,
// routing counts and every parameter's gradient, to rounding. Padding tokens are routed (the
// experts see them) but are outside the aux statistics and carry no gradient.
TEST(Model, PaddingChangesNoLossAndNoGradient) {
  ModelConfig c = small_config();
  c.bias_update_rate = 0.01;
  const CounterRng rng{4, 9};
  std::vector<std::vector<int32_t>> docs = {{}, {}, {}};
  const size_t lengths[3] = {5, 2, 6};
  for (size_t d = 0; d < 3; ++d)
    for (size_t i = 0; i < lengths[d]; ++i)
      docs[d].push_back(static_cast<int32_t>(rng.below(d * 100 + i, c.vocab_size)));
  // A row of `docs` then padding to `length` tokens.
  auto row = [&](std::vector<size_t> which, int64_t length) {
    PackedRow r;
    for (const size_t d : which)
      for (size_t i = 0; i < docs[d].size(); ++i) {
        r.tokens.push_back(docs[d][i]);
        r.segment_start.push_back(i == 0);
        r.counts.push_back(i % 3 != 2);
      }
    r.padding_from = static_cast<int64_t>(r.tokens.size());
    r.tokens.resize(length, 7);  // a real token id: padding must not matter whatever it holds
    r.segment_start.resize(length, 0);
    r.counts.resize(length, 1);
    return r;
  };
  const Batch padded = pack_rows({row({0, 1}, 9), row({2}, 9)}, 8);
  const Batch plain = pack_rows({row({0, 1, 2}, 14)}, 13);  // the 14th token is a target only
  ASSERT_EQ(padded.padding_tokens, 3);
  ASSERT_EQ(plain.padding_tokens, 0);
  ASSERT_EQ(padded.masked_tokens(), plain.masked_tokens());
  struct Run {
    MicroBatchLosses losses;
    std::vector<Tensor> grads;
    std::vector<Tensor> load;
  };
  auto run = [&](const Batch& b) {
    Qwen3Moe model(c, 3);
    model.zero_grad();
    Run r;
    r.losses = model.forward_backward(b, {1.0 / b.masked_tokens(), c.aux_loss_coef});
    for (auto& u : model.units())
      for (auto& g : u.groups) r.grads.push_back(g.grads.clone());
    for (const Tensor& l : model.step_expert_load()) r.load.push_back(l.clone());
    return r;
  };
  const Run a = run(padded), b = run(plain);
  EXPECT_NEAR(a.losses.ce_sum, b.losses.ce_sum, 1e-12 * std::abs(b.losses.ce_sum));
  EXPECT_GT(b.losses.aux_sum, 0.0);
  EXPECT_NEAR(a.losses.aux_sum, b.losses.aux_sum, 1e-12 * b.losses.aux_sum);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    EXPECT_GT(testing::dot(b.grads[i], b.grads[i]), 0.0) << "group " << i;
    EXPECT_LT(relative_error(a.grads[i], b.grads[i]), 1e-12) << "group " << i;
  }
  for (size_t l = 0; l < a.load.size(); ++l)
    for (int64_t e = 0; e < c.n_experts; ++e)
      EXPECT_EQ(a.load[l].item(e), b.load[l].item(e)) << "layer " << l << " expert " << e;
}

TEST(Model, RouterBiasMovesTowardBalance) {
  ModelConfig c = small_config();
  c.bias_update_rate = 0.01;
  Qwen3Moe model(c, 3);
  const Batch b = small_batch(c.vocab_size, 9);
  model.zero_grad();
  model.forward_backward(b, {1.0 / b.masked_tokens(), 0.0});
  const Tensor load = model.step_expert_load()[0].clone();
  model.update_router_biases();
  const double mean = b.size() * c.top_k / static_cast<double>(c.n_experts);
  for (int64_t e = 0; e < c.n_experts; ++e) {
    const double expect = load.item(e) < mean ? 0.01 : (load.item(e) > mean ? -0.01 : 0.0);
    EXPECT_DOUBLE_EQ(model.router_biases()[0].item(e), expect) << "expert " << e;
  }
}

ModelConfig qwen3_30b() {
  ModelConfig c;
  c.vocab_size = 151936;
  c.dim = 2048;
  c.n_layers = 48;
  c.n_heads = 32;
  c.n_kv_heads = 4;
  c.head_dim = 128;
  c.n_experts = 128;
  c.top_k = 8;
  c.moe_dim = 768;
  return c;
}

TEST(Flops, Qwen3_30B_A3B) {
  EXPECT_NEAR(train_flops_per_token(qwen3_30b(), 16384) / 1e9, 56.9, 0.05);
  EXPECT_NEAR(count_params(qwen3_30b()).total / 1e9, 30.5, 0.1);  // the published 30.5B
}

TEST(Flops, Qwen3_235B_A22B) {
  ModelConfig c = qwen3_30b();
  c.dim = 4096;
  c.n_layers = 94;
  c.n_heads = 64;
  c.moe_dim = 1536;
  EXPECT_NEAR(train_flops_per_token(c, 16384) / 1e9, 280.8, 0.05);
  EXPECT_NEAR(count_params(c).total / 1e9, 235.1, 0.2);  // the published 235B
  EXPECT_NEAR(count_params(c).active / 1e9, 21.6, 0.1);  // "A22B" minus the embedding table
}

}  // namespace
}  // namespace mt
