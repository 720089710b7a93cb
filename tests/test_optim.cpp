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

#include "mx_cases.h"
#include "op_testing.h"
#include "ops/elementwise.h"
#include "ops/fp8.h"
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

// A weight of three 256 x 384 matrices whose 128 x 128 tiles differ in magnitude (2^-3 .. 2^3), so
// a scale taken from the wrong tile changes the bytes; with its gradient and moments.
struct TiledWeight {
  Tensor p, g, m, v;
};
TiledWeight tiled_weight(uint64_t seed, DType dtype = DType::kF64) {
  const Shape s{3, 256, 384};
  TiledWeight w{randn(s, seed, 1.0, dtype), randn(s, seed + 1, 0.1, dtype),
                randn(s, seed + 2, 0.01, dtype), randn(s, seed + 3, 0.01, dtype)};
  for (int64_t i = 0; i < w.p.numel(); ++i) {
    const int64_t tile = (i / 384 / 128) * 3 + i % 384 / 128;  // (batch, tile row), tile column
    w.p.set_item(i, std::ldexp(w.p.item(i), static_cast<int>(tile % 7) - 3));
    w.v.set_item(i, std::abs(w.v.item(i)));
  }
  return w;
}

// The tiles written with the update are the updated weights' as the products read them: rounded
// to the compute dtype, quantized along each axis on its own.
TEST(AdamW, WritesTheUpdatedWeightsFp8Tiles) {
  const ops::AdamWHyper h{1e-2, 0.9, 0.95, 1e-8, 0.1, 4};
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
    TiledWeight a = tiled_weight(31), b = tiled_weight(31), c = tiled_weight(31);
    QuantTensor dim0 = QuantTensor::poisoned(a.p.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
    QuantTensor dim1 = QuantTensor::poisoned(a.p.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
    QuantTensor only0 = QuantTensor::poisoned(a.p.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
    ops::adamw_step(a.p, a.g, a.m, a.v, h,
                    {.tiles_dim0 = &dim0, .tiles_dim1 = &dim1, .rule = rule});
    ops::adamw_step(b.p, b.g, b.m, b.v, h);
    ops::adamw_step(c.p, c.g, c.m, c.v, h, {.tiles_dim0 = &only0, .rule = rule});
    EXPECT_TRUE(testing::same_bytes(a.p, b.p)) << "the update itself is unchanged";
    EXPECT_TRUE(testing::same_bytes(c.p, b.p)) << "the update itself is unchanged (dim0 only)";
    const Tensor rounded = b.p.to(DType::kBF16);
    for (auto [got, axis, what] :
         {std::tuple{&dim0, QuantAxis::kDim0, "dim0"}, std::tuple{&dim1, QuantAxis::kDim1, "dim1"},
          std::tuple{&only0, QuantAxis::kDim0, "dim0 alone"}}) {
      QuantTensor want = QuantTensor::empty(b.p.shape(), QuantBlock::kTile128, axis);
      ops::fp8_quantize(rounded, rule, want);
      EXPECT_TRUE(testing::same_quant(*got, want)) << what;
    }
  }
}

TEST(AdamW, RefusesTilesItCannotWrite) {
  TiledWeight w = tiled_weight(41);
  QuantTensor dim0 = QuantTensor::empty(w.p.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
  QuantTensor dim1 = QuantTensor::empty(w.p.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
  const ops::AdamWHyper h;
  const std::string one =
      error_of([&] { ops::adamw_step(w.p, w.g, w.m, w.v, h, {.tiles_dim1 = &dim1}); });
  EXPECT_NE(one.find("only beside its dim0 tiles"), std::string::npos) << one;
  const std::string swapped = error_of(
      [&] { ops::adamw_step(w.p, w.g, w.m, w.v, h, {.tiles_dim0 = &dim1, .tiles_dim1 = &dim0}); });
  EXPECT_NE(swapped.find("along dim0"), std::string::npos) << swapped;
  Tensor p = randn({256, 100}, 1), g = randn({256, 100}, 2), m = randn({256, 100}, 3);
  Tensor v = Tensor::zeros({256, 100}, DType::kF32);
  const std::string shape =
      error_of([&] { ops::adamw_step(p, g, m, v, h, {.tiles_dim0 = &dim0, .tiles_dim1 = &dim1}); });
  EXPECT_NE(shape.find("128 x 128 tiles, got (256, 100)"), std::string::npos) << shape;
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
  ops::adamw_step(gp, g.to(Device::kCUDA), gm, gv, hyper, {.compute = &compute});
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

// The update that writes a weight's FP8 tiles in its pass: the master state bit for bit with the
// CPU's update, the tiles with its quantization of the updated weights rounded to the storage
// dtype under test (bf16: the compute copy's values; f32: none), on poisoned tiles.
TEST_P(GpuOptim, AdamWWritesFp8TilesInItsPass) {
  const ops::AdamWHyper h{1e-2, 0.9, 0.95, 1e-8, 0.1, 5, 0.75};
  for (Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
    TiledWeight w = tiled_weight(seed, DType::kF32);  // GPU master state is f32
    Tensor gp = w.p.to(Device::kCUDA), gm = w.m.to(Device::kCUDA), gv = w.v.to(Device::kCUDA);
    QuantTensor d0 =
        QuantTensor::poisoned(w.p.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
    QuantTensor d1 =
        QuantTensor::poisoned(w.p.shape(), QuantBlock::kTile128, QuantAxis::kDim1, Device::kCUDA);
    ops::adamw_step(gp, w.g.to(Device::kCUDA), gm, gv, h,
                    {.tiles_dim0 = &d0, .tiles_dim1 = &d1, .tiles_from = GetParam(), .rule = rule});
    QuantTensor c0 = QuantTensor::empty(w.p.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
    QuantTensor c1 = QuantTensor::empty(w.p.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
    ops::adamw_step(w.p, w.g, w.m, w.v, h,
                    {.tiles_dim0 = &c0, .tiles_dim1 = &c1, .tiles_from = GetParam(), .rule = rule});
    for (auto [gpu_t, cpu_t, what] :
         {std::tuple{&gp, &w.p, "params"}, std::tuple{&gm, &w.m, "exp_avg"},
          std::tuple{&gv, &w.v, "exp_avg_sq"}})
      EXPECT_TRUE(testing::same_bytes(gpu_t->to(Device::kCPU), *cpu_t)) << what;
    EXPECT_TRUE(testing::same_quant(d0, c0)) << "tiles stored as the weight";
    EXPECT_TRUE(testing::same_quant(d1, c1)) << "tiles stored transposed";
    // The input gradient's layout alone (what one GPU holds): the same bytes, no shared tile.
    TiledWeight u = tiled_weight(seed, DType::kF32);
    Tensor up = u.p.to(Device::kCUDA), um = u.m.to(Device::kCUDA), uv = u.v.to(Device::kCUDA);
    QuantTensor only0 =
        QuantTensor::poisoned(u.p.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
    ops::adamw_step(up, u.g.to(Device::kCUDA), um, uv, h,
                    {.tiles_dim0 = &only0, .tiles_from = GetParam(), .rule = rule});
    EXPECT_TRUE(testing::same_bytes(up.to(Device::kCPU), w.p)) << "params (dim0 only)";
    EXPECT_TRUE(testing::same_quant(only0, c0)) << "tiles stored as the weight, alone";
  }
}

MOETRAIN_GPU_CASES(GpuOptim);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
