// Cross-entropy (ops/loss.h): the CPU reference (hand-checked cases, fp64 finite-difference
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
#include "ops/fp8.h"
#include "ops/loss.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/device.h"
#include "core/cuda/graph.h"
#include "gpu_case.h"
#endif

namespace mt {
namespace {

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

// The backward may write dlogits over the logits (the head keeps one buffer), and with
// ops::Fp8RowsOut also writes their FP8 rows: the same values as into a separate buffer, and the
// rows fp8_quantize makes of them, under both scale rules, masked rows included; rows of another
// shape are refused.
TEST(CrossEntropy, BackwardInPlaceAndItsFp8Rows) {
  const int64_t n = 6, v = 384;
  const Tensor logits = randn({n, v}, 11, 3.0, DType::kF32);
  Tensor targets = Tensor::empty({n}, DType::kI32), mask = Tensor::empty({n}, DType::kU8);
  for (int64_t i = 0; i < n; ++i) {
    targets.set_item(i, static_cast<double>((37 * i + 5) % v));
    mask.set_item(i, i == 2 ? 0 : 1);
  }
  Tensor lse = Tensor::empty({n}, DType::kF32);
  ops::cross_entropy_forward(logits, targets, mask, lse);
  Tensor apart = Tensor::poisoned({n, v}, DType::kF32);
  ops::cross_entropy_backward(logits, targets, mask, lse, 0.25, apart);
  for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
    Tensor in_place = logits.clone();
    QuantTensor q = QuantTensor::poisoned({n, v}, QuantBlock::kRow128, QuantAxis::kDim0);
    const ops::Fp8RowsOut fp8{&q, rule};
    ops::cross_entropy_backward(in_place, targets, mask, lse, 0.25, in_place, &fp8);
    EXPECT_EQ(std::memcmp(in_place.raw(), apart.raw(), apart.nbytes()), 0);
    QuantTensor want = QuantTensor::empty({n, v}, QuantBlock::kRow128, QuantAxis::kDim0);
    ops::fp8_quantize(apart, rule, want);
    EXPECT_EQ(std::memcmp(q.data().raw(), want.data().raw(), want.data().nbytes()), 0);
    EXPECT_EQ(std::memcmp(q.scales().raw(), want.scales().raw(), want.scales().nbytes()), 0);
  }
  EXPECT_NE(apart.item(5), 0.0);
  QuantTensor wrong = QuantTensor::empty({n, 256}, QuantBlock::kRow128, QuantAxis::kDim0);
  const ops::Fp8RowsOut bad{&wrong, Fp8ScaleRule::kFp32};
  const std::string e =
      error_of([&] { ops::cross_entropy_backward(logits, targets, mask, lse, 0.25, apart, &bad); });
  EXPECT_NE(e.find("cross_entropy_backward"), std::string::npos) << e;
}

#if MOETRAIN_HAS_CUDA

struct GpuLoss : GpuCase {
  void check_cross_entropy(int64_t n, int64_t v);
};

TEST_P(GpuLoss, CrossEntropyForwardBackward) {
  for (const int64_t v : {32000, 1001}) check_cross_entropy(1024, v);
}

void GpuLoss::check_cross_entropy(int64_t n, int64_t v) {
  SCOPED_TRACE(::testing::Message() << "cross-entropy vocabulary " << v);
  const Tensor logits = input({n, v}, 3.0);
  Tensor targets = Tensor::empty({n}, DType::kI32), mask = Tensor::empty({n}, DType::kU8);
  const CounterRng rng{seed, 7};
  for (int64_t i = 0; i < n; ++i) {
    targets.set_item(i, rng.below(2 * i, v));
    mask.set_item(i, rng.below(2 * i + 1, 4) != 0);
  }
  Tensor lse = Tensor::empty({n}, DType::kF32), dl = Tensor::empty({n, v}, DType::kF32);
  const double loss = ops::cross_entropy_forward(logits, targets, mask, lse);
  ops::cross_entropy_backward(logits, targets, mask, lse, 1.0 / n, dl);
  const Tensor gl = gpu(logits), gt = targets.to(Device::kCUDA), gm = mask.to(Device::kCUDA);
  Tensor glse = gpu_out({n}, DType::kF32), gdl = gpu_out({n, v});
  const double gloss = ops::cross_entropy_forward(gl, gt, gm, glse);
  ops::cross_entropy_backward(gl, gt, gm, glse, 1.0 / n, gdl);
  EXPECT_NEAR(gloss, loss, 1e-5 * std::abs(loss));
  expect_close(glse, lse, "cross-entropy lse");
  expect_close(gdl, dl, "cross-entropy dlogits");
  // Per-token losses (f32 out) against the CPU's, poisoned first.
  Tensor sum = Tensor::zeros({1}, DType::kF64), each = Tensor::empty({n}, DType::kF32);
  ops::cross_entropy_forward(logits, targets, mask, lse, sum, &each);
  Tensor gsum = Tensor::zeros({1}, DType::kF64, Device::kCUDA),
         geach = Tensor::poisoned({n}, DType::kF32, Device::kCUDA);
  ops::cross_entropy_forward(gl, gt, gm, glse, gsum, &geach);
  expect_close(geach, each, "cross-entropy per-token loss");
  EXPECT_NEAR(gsum.item(0), sum.item(0), 1e-5 * std::abs(sum.item(0)));
}

// The backward on the GPU written over the logits with its FP8 rows from the same kernel (the
// LM head's FP8 input gradient): dlogits as into a separate buffer, bit for bit, and the rows the
// CPU reference quantizes from them, under both scale rules. 2176 columns leave part of a row's
// last step idle (half a warp under bf16 packs).
TEST_P(GpuLoss, CrossEntropyBackwardWritesItsFp8RowsInPlace) {
  for (const int64_t v : {int64_t{32000}, int64_t{2176}})
    for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
      SCOPED_TRACE(::testing::Message() << "v " << v << ", rule " << static_cast<int>(rule));
      const int64_t n = 300;
      const Tensor gl = gpu(input({n, v}, 3.0));
      Tensor targets = Tensor::empty({n}, DType::kI32), mask = Tensor::empty({n}, DType::kU8);
      const CounterRng rng{seed, 9};
      for (int64_t i = 0; i < n; ++i) {
        targets.set_item(i, rng.below(2 * i, v));
        mask.set_item(i, rng.below(2 * i + 1, 4) != 0);
      }
      const Tensor gt = targets.to(Device::kCUDA), gm = mask.to(Device::kCUDA);
      Tensor glse = gpu_out({n}, DType::kF32), apart = gpu_out({n, v});
      ops::cross_entropy_forward(gl, gt, gm, glse);
      ops::cross_entropy_backward(gl, gt, gm, glse, 1.0 / n, apart);
      Tensor in_place = gl.clone();
      QuantTensor q =
          QuantTensor::poisoned({n, v}, QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
      const ops::Fp8RowsOut fp8{&q, rule};
      ops::cross_entropy_backward(in_place, gt, gm, glse, 1.0 / n, in_place, &fp8);
      const Tensor a = apart.to(Device::kCPU), b = in_place.to(Device::kCPU);
      ASSERT_TRUE(all_finite(a.to(DType::kF32)));
      EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0);
      EXPECT_EQ(fp8_rows_differing(q, in_place, rule, [](int64_t) { return false; }), 0);
    }
}

MOETRAIN_GPU_CASES(GpuLoss);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
