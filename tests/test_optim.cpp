// AdamW (ops/optim.h): the CPU reference (hand-checked cases, fp64 finite-difference gradients
// of L = sum(out * G) with a fixed random G) and, in the Gpu* cases (ctest label `gpu`), the CUDA
// kernels against it (tests/gpu_case.h).
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
#include "ops/optim.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

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

#if MOETRAIN_HAS_CUDA

struct GpuOptim : GpuCase {};

TEST_P(GpuOptim, AdamWStep) {
  if (GetParam() != DType::kF32) GTEST_SKIP() << "master weights and moments are f32 only";
  const int64_t n = 1 << 20;
  Tensor p = input({n}), g = input({n}, 0.1), m = input({n}, 0.01), v = input({n}, 0.01);
  for (int64_t i = 0; i < n; ++i) v.set_item(i, std::abs(v.item(i)));
  Tensor gp = p.to(Device::kCUDA), gm = m.to(Device::kCUDA), gv = v.to(Device::kCUDA);
  const ops::AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 7, 0.5};  // clipped by half
  ops::adamw_step(p, g, m, v, hyper);
  Tensor compute = Tensor::poisoned({n}, DType::kBF16, Device::kCUDA);
  ops::adamw_step(gp, g.to(Device::kCUDA), gm, gv, hyper, &compute);
  // Every operation rounded on its own in the reference's order: bit-identical to the CPU.
  for (auto [gpu_t, cpu_t, what] :
       {std::tuple{&gp, &p, "adamw params"}, std::tuple{&gm, &m, "adamw exp_avg"},
        std::tuple{&gv, &v, "adamw exp_avg_sq"}}) {
    const Tensor host = gpu_t->to(Device::kCPU);
    EXPECT_EQ(std::memcmp(host.raw(), cpu_t->raw(), host.nbytes()), 0) << what;
  }
  // The bf16 copy written in the same pass is exactly the cast of the new master weights.
  const Tensor cast = gp.to(Device::kCPU).to(DType::kBF16), got = compute.to(Device::kCPU);
  EXPECT_EQ(std::memcmp(cast.raw(), got.raw(), cast.nbytes()), 0) << "adamw compute copy";
}

MOETRAIN_GPU_CASES(GpuOptim);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
