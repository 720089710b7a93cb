// The rotary embedding (ops/rope.h): the CPU reference (hand-checked cases, fp64 finite-difference
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
#include "ops/rope.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

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

#if MOETRAIN_HAS_CUDA

struct GpuRope : GpuCase {
  void check_rope(int64_t hd);
};

TEST_P(GpuRope, RopeForwardBackward) {
  for (const int64_t hd : {128, 20}) check_rope(hd);  // 20: pairs not a whole 16-byte pack
}

void GpuRope::check_rope(int64_t hd) {
  SCOPED_TRACE(::testing::Message() << "rope head dim " << hd);
  const int64_t n = 2048, h = 8;
  const Tensor x = input({n, h, hd});
  Tensor pos = Tensor::empty({n}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) pos.set_item(i, (i * 7919) % 40960);  // up to 40k positions
  Tensor y = Tensor::empty(x.shape(), DType::kF32), back = Tensor::empty(x.shape(), DType::kF32);
  ops::rope_forward(x, pos, 1e6, y);
  ops::rope_backward(x, pos, 1e6, back);
  const Tensor gpos = pos.to(Device::kCUDA), gx = gpu(x);
  Tensor gy = gpu_out(x.shape()), gback = gpu_out(x.shape());
  ops::rope_forward(gx, gpos, 1e6, gy);
  ops::rope_backward(gx, gpos, 1e6, gback);
  expect_close(gy, y, "rope forward");
  expect_close(gback, back, "rope backward");
}

MOETRAIN_GPU_CASES(GpuRope);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
