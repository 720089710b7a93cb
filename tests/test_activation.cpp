// SwiGLU (ops/activation.h): the CPU reference (hand-checked cases, fp64 finite-difference
// gradients of L = sum(out * G) with a fixed random G) and, in the Gpu* cases (ctest label `gpu`),
// the CUDA kernels against it (tests/gpu_case.h).
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
#include "ops/activation.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

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

#if MOETRAIN_HAS_CUDA

struct GpuActivation : GpuCase {
  void check_swiglu(int64_t m, int64_t f);
};

TEST_P(GpuActivation, SwiGLUForwardBackward) {
  check_swiglu(8192, 768);
  check_swiglu(999, 13);  // the element-at-a-time path
}

void GpuActivation::check_swiglu(int64_t m, int64_t f) {
  SCOPED_TRACE(::testing::Message() << "swiglu " << m << " x " << f);
  const Tensor h = input({m, 2 * f}, 2.0), da = input({m, f});
  Tensor a = Tensor::empty({m, f}, DType::kF32), dh = Tensor::empty({m, 2 * f}, DType::kF32);
  ops::swiglu_forward(h, a);
  ops::swiglu_backward(h, da, dh);
  const Tensor gh = gpu(h);
  Tensor ga = gpu_out({m, f}), gdh = gpu_out({m, 2 * f});
  ops::swiglu_forward(gh, ga);
  ops::swiglu_backward(gh, gpu(da), gdh);
  expect_close(ga, a, "swiglu forward");
  expect_close(gdh, dh, "swiglu backward");
  // Padding rows (negative marks, every third one here) are skipped: they keep the poison,
  // the other rows the same values as without marks.
  Tensor marks = Tensor::empty({m}, DType::kI32);
  for (int64_t r = 0; r < m; ++r) marks.set_item(r, r % 3 == 1 ? -1 : static_cast<double>(r));
  const Tensor gmarks = marks.to(Device::kCUDA);
  Tensor pa = gpu_out({m, f}), pdh = gpu_out({m, 2 * f});
  ops::swiglu_forward(gh, pa, {&gmarks});
  ops::swiglu_backward(gh, gpu(da), pdh, {&gmarks});
  const Tensor pa_h = pa.to(DType::kF32).to(Device::kCPU),
               ga_h = ga.to(DType::kF32).to(Device::kCPU);
  const Tensor pdh_h = pdh.to(DType::kF32).to(Device::kCPU);
  const Tensor gdh_h = gdh.to(DType::kF32).to(Device::kCPU);
  int64_t wrong = 0;
  for (int64_t r = 0; r < m; ++r) {
    const bool padding = r % 3 == 1;
    for (int64_t c = 0; c < 2 * f; ++c) {
      const double got = pdh_h.item(r * 2 * f + c), want = gdh_h.item(r * 2 * f + c);
      wrong += padding ? !std::isnan(got) : got != want;
      if (c < f) {
        const double got_a = pa_h.item(r * f + c), want_a = ga_h.item(r * f + c);
        wrong += padding ? !std::isnan(got_a) : got_a != want_a;
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "swiglu with padding marks";

  // Routing weights per row (f32 on both sides): the outputs scaled, and each row's weight
  // gradient, a sum over the row.
  const Tensor weight = testing::randn({m}, seed + counter++, 1.0, DType::kF32);
  Tensor wa = Tensor::empty({m, f}, DType::kF32), wdh = Tensor::empty({m, 2 * f}, DType::kF32);
  Tensor wdw = Tensor::empty({m}, DType::kF32);
  ops::swiglu_forward(h, wa, {nullptr, &weight});
  ops::swiglu_backward(h, da, wdh, {nullptr, &weight}, &wdw);
  const Tensor gweight = weight.to(Device::kCUDA);
  Tensor gwa = gpu_out({m, f}), gwdh = gpu_out({m, 2 * f}), gwdw = gpu_out({m}, DType::kF32);
  ops::swiglu_forward(gh, gwa, {nullptr, &gweight});
  ops::swiglu_backward(gh, gpu(da), gwdh, {nullptr, &gweight}, &gwdw);
  expect_close(gwa, wa, "weighted swiglu forward");
  expect_close(gwdh, wdh, "weighted swiglu backward");
  const Tensor gwdw_h = gwdw.to(Device::kCPU);
  ASSERT_TRUE(all_finite(gwdw_h)) << "row-weight gradient: unwritten (NaN) or non-finite";
  EXPECT_LT(relative_error(gwdw_h, wdw), 1e-4) << "row-weight gradient, seed " << seed;
}

MOETRAIN_GPU_CASES(GpuActivation);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
