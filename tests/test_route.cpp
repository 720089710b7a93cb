// The router and its load-balancing statistics (ops/route.h): the CPU reference (hand-checked
// cases, fp64 finite-difference gradients of L = sum(out * G) with a fixed random G) and, in the
// Gpu* cases (ctest label `gpu`), the CUDA kernels against it (tests/gpu_case.h).
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
#include "ops/elementwise.h"
#include "ops/route.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

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

#if MOETRAIN_HAS_CUDA

// Pooled router statistics on the GPU: the CPU's sums exactly (integer counts; one f32 add per
// element, in the same order), into poisoned-free zeroed accumulators.
TEST(GpuRouterAux, PooledStatisticsMatchTheCpu) {
  const int64_t e = 128;
  std::vector<ops::AuxStats> layers;
  for (int l = 0; l < 3; ++l) {
    ops::AuxStats s{Tensor::empty({e}, DType::kI64), Tensor::empty({e}, DType::kF32), 8};
    const CounterRng rng{static_cast<uint64_t>(l), 11};
    for (int64_t c = 0; c < e; ++c) {
      s.tokens_per_expert.data<int64_t>()[c] = rng.below(2 * c, 5000);
      s.score_sum.set_item(c, 100 * rng.uniform(2 * c + 1));
    }
    layers.push_back(s);
  }
  ops::AuxStats cpu = ops::zero_aux_stats(layers[0]);
  ops::AuxStats gpu_layer0{layers[0].tokens_per_expert.to(Device::kCUDA),
                           layers[0].score_sum.to(Device::kCUDA), 8};
  ops::AuxStats gpu = ops::zero_aux_stats(gpu_layer0);
  for (const ops::AuxStats& s : layers) {
    ops::add_aux_stats(s, cpu);
    ops::add_aux_stats({s.tokens_per_expert.to(Device::kCUDA), s.score_sum.to(Device::kCUDA), 8},
                       gpu);
  }
  const Tensor counts = gpu.tokens_per_expert.to(Device::kCPU),
               sums = gpu.score_sum.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(counts.raw(), cpu.tokens_per_expert.raw(), counts.nbytes()), 0);
  EXPECT_EQ(std::memcmp(sums.raw(), cpu.score_sum.raw(), sums.nbytes()), 0);
  // The loss reads its token count (sum of counts / top_k) on the device.
  const double closs = ops::router_aux_loss(cpu).item(0),
               gloss = ops::router_aux_loss(gpu).to(Device::kCPU).item(0);
  EXPECT_GT(closs, 0.0);
  EXPECT_NEAR(gloss, closs, 1e-6 * closs);
  EXPECT_GT(sums.item(0), 0.0);
}

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
