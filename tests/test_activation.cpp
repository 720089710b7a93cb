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
#include "ops/fp8.h"
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

// SwiGLU's FP8 rows (ops::Fp8RowsOut: the forward's a, the backward's dh) are the output quantized
// as fp8_quantize does, under both scale rules; rows of another shape, or MX values asked for too,
// are refused.
TEST(SwiGLU, Fp8RowsAreTheOutputsQuantized) {
  const Tensor h = randn({3, 512}, 5, 4.0, DType::kF32);
  for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
    Tensor a = Tensor::empty({3, 256}, DType::kF32);
    QuantTensor q = QuantTensor::poisoned({3, 256}, QuantBlock::kRow128, QuantAxis::kDim0);
    const ops::Fp8RowsOut fp8{&q, rule};
    ops::swiglu_forward(h, a, {}, nullptr, &fp8);
    QuantTensor want = QuantTensor::empty({3, 256}, QuantBlock::kRow128, QuantAxis::kDim0);
    ops::fp8_quantize(a, rule, want);
    EXPECT_EQ(std::memcmp(q.data().raw(), want.data().raw(), want.data().nbytes()), 0);
    EXPECT_EQ(std::memcmp(q.scales().raw(), want.scales().raw(), want.scales().nbytes()), 0);
    const Tensor da = randn({3, 256}, 6, 1.0, DType::kF32);
    Tensor dh = Tensor::empty({3, 512}, DType::kF32);
    QuantTensor qdh = QuantTensor::poisoned({3, 512}, QuantBlock::kRow128, QuantAxis::kDim0);
    const ops::Fp8RowsOut fdh{&qdh, rule};
    ops::swiglu_backward(h, da, dh, {}, nullptr, nullptr, &fdh);
    QuantTensor want_dh = QuantTensor::empty({3, 512}, QuantBlock::kRow128, QuantAxis::kDim0);
    ops::fp8_quantize(dh, rule, want_dh);
    EXPECT_EQ(std::memcmp(qdh.data().raw(), want_dh.data().raw(), want_dh.data().nbytes()), 0);
    EXPECT_EQ(std::memcmp(qdh.scales().raw(), want_dh.scales().raw(), want_dh.scales().nbytes()),
              0);
  }
  Tensor a = Tensor::empty({3, 256}, DType::kF32);
  QuantTensor wrong = QuantTensor::empty({3, 128}, QuantBlock::kRow128, QuantAxis::kDim0);
  const ops::Fp8RowsOut bad{&wrong, Fp8ScaleRule::kFp32};
  std::string e = error_of([&] { ops::swiglu_forward(h, a, {}, nullptr, &bad); });
  EXPECT_NE(e.find("1x128 blocks along dim0"), std::string::npos) << e;
  QuantTensor q = QuantTensor::empty({3, 256}, QuantBlock::kRow128, QuantAxis::kDim0);
  const ops::Fp8RowsOut fp8{&q, Fp8ScaleRule::kFp32};
  Tensor values = Tensor::empty({3, 256}, DType::kF32);
  const ops::MxValuesOut mx{&values, MxScaleRule::kRceil};
  e = error_of([&] { ops::swiglu_forward(h, a, {}, &mx, &fp8); });
  EXPECT_NE(e.find("not both"), std::string::npos) << e;
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

// SwiGLU writing its output's FP8 rows (ops::Fp8RowsOut) in the same kernel, forward (a) and
// backward (dh, its gate and up halves' blocks apart): the rows equal the unfused sequence's (the
// kernel's own output quantized by the CPU reference), under both scale rules, with padding marks
// (rows keep the poison) and routing weights; 384 columns leave half of a bf16 step's lanes idle.
TEST_P(GpuActivation, SwiGLUWritesItsFp8Rows) {
  for (const int64_t f : {int64_t{768}, int64_t{384}})
    for (const Fp8ScaleRule rule : {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2}) {
      SCOPED_TRACE(::testing::Message() << "f " << f << ", rule " << static_cast<int>(rule));
      const int64_t m = 1000;
      const Tensor h = gpu(input({m, 2 * f}, 3.0)), da = gpu(input({m, f}));
      Tensor marks = Tensor::empty({m}, DType::kI32);
      for (int64_t r = 0; r < m; ++r) marks.set_item(r, r % 5 == 2 ? -1 : static_cast<double>(r));
      const Tensor gmarks = marks.to(Device::kCUDA);
      const Tensor gweight =
          testing::randn({m}, seed + counter++, 1.0, DType::kF32).to(Device::kCUDA);
      const auto padding = [](int64_t r) { return r % 5 == 2; };
      Tensor a = gpu_out({m, f}), dh = gpu_out({m, 2 * f});
      Tensor dweight = gpu_out({m}, DType::kF32);
      QuantTensor qa =
          QuantTensor::poisoned({m, f}, QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
      QuantTensor qdh =
          QuantTensor::poisoned({m, 2 * f}, QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
      const ops::Fp8RowsOut fa{&qa, rule}, fdh{&qdh, rule};
      ops::swiglu_forward(h, a, {&gmarks, &gweight}, nullptr, &fa);
      ops::swiglu_backward(h, da, dh, {&gmarks, &gweight}, &dweight, nullptr, &fdh);
      EXPECT_EQ(fp8_rows_differing(qa, a, rule, padding), 0) << "forward";
      EXPECT_EQ(fp8_rows_differing(qdh, dh, rule, padding), 0) << "backward";
    }
}

MOETRAIN_GPU_CASES(GpuActivation);

#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
