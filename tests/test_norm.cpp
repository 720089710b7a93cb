// RMSNorm (ops/norm.h): the CPU reference (hand-checked cases, fp64 finite-difference gradients
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
#include "ops/norm.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

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

#if MOETRAIN_HAS_CUDA

struct GpuNorm : GpuCase {
  void check_rmsnorm(int64_t n, int64_t d);
};

// Shapes: the model's hidden rows, QK-norm's many short rows, and an odd width that takes the
// kernels' element-at-a-time path instead of 16-byte packs.
TEST_P(GpuNorm, RMSNormForwardBackward) {
  for (const auto& [n, d] : {std::pair<int64_t, int64_t>{4096, 2048}, {20000, 128}, {1001, 100}})
    check_rmsnorm(n, d);
}

void GpuNorm::check_rmsnorm(int64_t n, int64_t d) {
  SCOPED_TRACE(::testing::Message() << "rmsnorm " << n << " x " << d);
  const Tensor x = input({n, d}), w = input({d}, 0.5), dy = input({n, d});
  Tensor y = Tensor::empty({n, d}, DType::kF32), rstd = Tensor::empty({n}, DType::kF32);
  ops::rmsnorm_forward(x, w, 1e-6, y, rstd);
  Tensor dx = Tensor::empty({n, d}, DType::kF32), dw = input({d});
  const Tensor dw0 = dw.clone();
  ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);

  Tensor gy = gpu_out({n, d}), grstd = gpu_out({n}, DType::kF32);
  const Tensor gx = gpu(x), gw = gpu(w), gdy = gpu(dy);
  ops::rmsnorm_forward(gx, gw, 1e-6, gy, grstd);
  expect_close(gy, y, "rmsnorm y");
  expect_close(grstd, rstd, "rmsnorm rstd");
  Tensor gdx = gpu_out({n, d}), gdw = gpu(dw0);
  ops::rmsnorm_backward(gx, gw, grstd, gdy, gdx, gdw);
  expect_close(gdx, dx, "rmsnorm dx");
  expect_close(gdw, dw, "rmsnorm dw (accumulated)");
}

MOETRAIN_GPU_CASES(GpuNorm);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
