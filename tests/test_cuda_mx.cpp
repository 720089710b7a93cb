// The MX kernels against the CPU reference, bit for bit (ctest label `gpu`): fresh seeds each run
// (printed on failure), every edge case of tests/mx_cases.h, outputs poisoned twice (0xFF, then
// zeros, so that no byte passes by already holding its value).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>

#include "core/mx.h"
#include "mx_cases.h"
#include "ops/expert_gemm.h"
#include "ops/mx.h"
#include "ops/permute.h"
#include "testing.h"

namespace mt {
namespace {

using testing::same_bytes;
using testing::same_values;

uint64_t fresh_seed() {
  static const uint64_t base = std::random_device{}();
  static uint64_t n = 0;
  return base + 1000 * n++;
}

class GpuMx : public ::testing::TestWithParam<testing::MxCase> {};

TEST_P(GpuMx, QuantizeAndDequantizeMatchTheCpuBitForBit) {
  const auto [dtype, rule, axis] = GetParam();
  for (const Shape& shape :
       {Shape{32, 32}, Shape{96, 64}, Shape{3, 64, 160}, Shape{256, 2048}, Shape{2, 1024, 768}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("shape " + shape_str(shape) + " seed " + std::to_string(seed));
    const Tensor x = testing::mx_input(shape, seed, dtype);
    MxTensor want = MxTensor::poisoned(shape, axis);
    ops::mx_quantize(x, rule, want);
    const Tensor xg = x.to(Device::kCUDA);
    for (int poison : {0xFF, 0x00}) {
      MxTensor got = MxTensor::poisoned(shape, axis, Device::kCUDA);
      if (poison == 0x00) {
        cudaMemset(got.data().raw(), 0, got.data().nbytes());
        cudaMemset(got.scales().raw(), 0, got.scales().nbytes());
      }
      ops::mx_quantize(xg, rule, got);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(same_bytes(got.scales(), want.scales()));
      EXPECT_TRUE(same_bytes(got.data(), want.data()));
    }
    for (DType out : {DType::kF32, DType::kBF16}) {
      Tensor back_cpu = Tensor::poisoned(shape, out);
      ops::mx_dequantize(want, back_cpu);
      Tensor back_gpu = Tensor::poisoned(shape, out, Device::kCUDA);
      ops::mx_dequantize(want.to(Device::kCUDA), back_gpu);
      EXPECT_TRUE(same_values(back_gpu, back_cpu));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMx, testing::mx_case_values(), testing::mx_case_name);

TEST(GpuMx, RefusesWhatTheKernelsCannotRead) {
  MxTensor q = MxTensor::empty({64, 36}, MxAxis::kDim1, Device::kCUDA);
  const Tensor x = Tensor::zeros({64, 36}, DType::kBF16, Device::kCUDA);  // 72-byte rows
  EXPECT_NE(testing::error_of([&] {
              ops::mx_quantize(x, MxScaleRule::kRceil, q);
            }).find("multiple of 16 bytes"),
            std::string::npos);
  Tensor out = Tensor::zeros({64, 36}, DType::kBF16, Device::kCUDA);
  EXPECT_NE(testing::error_of([&] { ops::mx_dequantize(q, out); }).find("multiple of 16 bytes"),
            std::string::npos);
}

// The expert rows of a random routing of `tokens` tokens (top-2 of `experts`), on the GPU, padded
// to 128-row segments as the MoE layer lays them out on one GPU (align 1: dense).
ops::ExpertPermutation random_expert_rows(int64_t tokens, int64_t experts, int64_t align,
                                          uint64_t seed) {
  Tensor index = Tensor::empty({tokens, 2}, DType::kI32);
  std::mt19937_64 rng(seed);
  for (int64_t t = 0; t < tokens; ++t) {
    // Skewed: expert 0 takes a third of the choices, the last expert none.
    const int32_t a = static_cast<int32_t>(rng() % 3 == 0 ? 0 : rng() % (experts - 1));
    int32_t b = static_cast<int32_t>(rng() % (experts - 1));
    if (b == a) b = (a + 1) % static_cast<int32_t>(experts - 1);
    index.data<int32_t>()[2 * t] = a;
    index.data<int32_t>()[2 * t + 1] = b;
  }
  ops::ExpertPermutation p;
  ops::make_expert_permutation(index.to(Device::kCUDA), experts, p, align);
  return p;
}

ops::ExpertRows on_cpu(const ops::ExpertRows& r) {
  return {r.offsets.to(Device::kCPU), r.segments.to(Device::kCPU), r.align};
}

TEST(GpuMx, RoundTripExpertRowsMatchesTheCpuBitForBit) {
  for (int64_t align : {int64_t{1}, int64_t{128}})
    for (DType dt : {DType::kBF16, DType::kF32}) {
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE("align " + std::to_string(align) + " " + std::string(dtype_name(dt)) + " seed " +
                   std::to_string(seed));
      const ops::ExpertPermutation p = random_expert_rows(700, 8, align, seed);
      const int64_t m = p.rows(), k = 96;
      const Tensor x = testing::mx_input({m, k}, seed, dt);
      Tensor want = x.clone();  // rows outside the experts keep x's values
      ops::mx_round_trip_expert_rows(x, on_cpu(p.expert_rows()), MxScaleRule::kRceil, want);
      Tensor got = x.to(Device::kCUDA);
      ops::mx_round_trip_expert_rows(got, p.expert_rows(), MxScaleRule::kRceil, got);
      EXPECT_TRUE(same_values(got, want));
    }
}

// The recipes on the GPU (bf16 operands, fp32 accumulation) against the CPU's f32 emulation of
// the same operands: the weight gradient (f32) to f32 accuracy; the bf16 outputs to bf16's, and
// much farther from the unquantized products than that, so the test sees the quantization.
TEST(GpuExpertGemm, MxRecipesMatchTheCpuEmulation) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t experts = 8, k = 256, n = 384;
  const ops::ExpertPermutation p = random_expert_rows(1024, experts, 128, seed);
  const ops::ExpertRows rows = p.expert_rows(), rows_cpu = on_cpu(rows);
  const int64_t m = p.rows();
  const Tensor x = testing::randn({m, k}, seed + 1, 1.0, DType::kF32).to(DType::kBF16);
  const Tensor w = testing::randn({experts, k, n}, seed + 2, 0.05, DType::kF32).to(DType::kBF16);
  const Tensor dy = testing::randn({m, n}, seed + 3, 1.0, DType::kF32).to(DType::kBF16);
  const Tensor xf = x.to(DType::kF32), wf = w.to(DType::kF32), dyf = dy.to(DType::kF32);
  // Compares the rows of the experts only (padding rows are never read).
  auto expert_rows_error = [&](const Tensor& got, const Tensor& want) {
    const Tensor g = got.to(Device::kCPU).to(DType::kF64), r = want.to(DType::kF64);
    const int64_t width = got.dim(1);
    double num = 0, den = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = rows_cpu.segments.data<int64_t>()[e];
      const int64_t count =
          rows_cpu.offsets.data<int64_t>()[e + 1] - rows_cpu.offsets.data<int64_t>()[e];
      for (int64_t i = first * width; i < (first + count) * width; ++i) {
        num += (g.item(i) - r.item(i)) * (g.item(i) - r.item(i));
        den += r.item(i) * r.item(i);
      }
    }
    return std::sqrt(num / den);
  };
  for (ops::ExpertRecipe recipe :
       {ops::ExpertRecipe::kMxfp8, ops::ExpertRecipe::kMxfp8WgradWithHp}) {
    SCOPED_TRACE(std::string(ops::expert_recipe_name(recipe)));
    const ops::ExpertPrecision prec{recipe, MxScaleRule::kRceil};
    const ops::ExpertPrecision none{};
    Tensor out = Tensor::poisoned({m, n}, DType::kBF16, Device::kCUDA);
    Tensor dx = Tensor::poisoned({m, k}, DType::kBF16, Device::kCUDA);
    Tensor dw = Tensor::poisoned({experts, k, n}, DType::kF32, Device::kCUDA);
    ops::expert_gemm_forward(x.to(Device::kCUDA), w.to(Device::kCUDA), rows, prec, out);
    ops::expert_gemm_backward_input(dy.to(Device::kCUDA), w.to(Device::kCUDA), rows, prec, dx);
    ops::expert_gemm_backward_weight(x.to(Device::kCUDA), dy.to(Device::kCUDA), rows, prec, dw,
                                     ops::Accumulate::kNo);
    Tensor want_out = Tensor::zeros({m, n}, DType::kF32), plain_out = want_out.clone();
    Tensor want_dx = Tensor::zeros({m, k}, DType::kF32);
    Tensor want_dw = Tensor::zeros({experts, k, n}, DType::kF32), plain_dw = want_dw.clone();
    ops::expert_gemm_forward(xf, wf, rows_cpu, prec, want_out);
    ops::expert_gemm_forward(xf, wf, rows_cpu, none, plain_out);
    ops::expert_gemm_backward_input(dyf, wf, rows_cpu, prec, want_dx);
    ops::expert_gemm_backward_weight(xf, dyf, rows_cpu, prec, want_dw, ops::Accumulate::kNo);
    ops::expert_gemm_backward_weight(xf, dyf, rows_cpu, none, plain_dw, ops::Accumulate::kNo);
    const double out_err = expert_rows_error(out, want_out);
    EXPECT_LT(out_err, 4e-3);
    EXPECT_GT(expert_rows_error(out, plain_out), 4 * out_err);
    EXPECT_LT(expert_rows_error(dx, want_dx), 4e-3);
    EXPECT_LT(relative_error(dw.to(Device::kCPU), want_dw), 1e-5);
    if (recipe == ops::ExpertRecipe::kMxfp8)
      EXPECT_GT(relative_error(dw.to(Device::kCPU), plain_dw), 1e-3);
    else
      EXPECT_LT(relative_error(dw.to(Device::kCPU), plain_dw), 1e-5);
  }
}

}  // namespace
}  // namespace mt
