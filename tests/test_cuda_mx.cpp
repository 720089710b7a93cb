// The MX kernels against the CPU reference, bit for bit (ctest label `gpu`): fresh seeds each run
// (printed on failure), every edge case of tests/mx_cases.h, outputs poisoned twice (0xFF, then
// zeros, so that no byte passes by already holding its value).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>

#include "core/cuda/check.h"
#include "core/mx.h"
#include "core/rng.h"
#include "mx_cases.h"
#include "ops/activation.h"
#include "ops/expert_gemm.h"
#include "ops/mx.h"
#include "ops/mx_gemm.h"
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

// Every block-scale exponent both rules can produce, against the CPU's (which divides by 448 for
// RCEIL, as torchao does): one block per amax, amax over every f32 exponent (subnormals too) with
// the mantissas where the scale can change (around 1.5 and 1.75, the ends) and random ones, plus
// infinity, NaN and zero; the other 31 elements fractions of it, signed. Both axes, f32 and bf16
// input, scales and data bit for bit.
TEST(GpuMx, EveryScaleExponentMatchesTheCpu) {
  std::vector<uint32_t> amax;
  const CounterRng rng{fresh_seed(), 3};
  for (uint32_t field = 0; field < 255; ++field) {
    for (uint32_t m : {0u, 1u, 0x3FFFFFu, 0x400000u, 0x400001u, 0x5FFFFFu, 0x600000u, 0x600001u,
                       0x7FFFFEu, 0x7FFFFFu})
      amax.push_back(field << 23 | m);
    for (int i = 0; i < 6; ++i)
      amax.push_back(field << 23 | static_cast<uint32_t>(rng.below(field * 8 + i, 1u << 23)));
  }
  amax.push_back(0x7F800000u);                     // infinity
  amax.push_back(0x7FC00000u);                     // NaN
  while (amax.size() % 8 != 0) amax.push_back(0);  // the dim1 kernel's 16-byte rows; zero blocks
  const auto blocks = static_cast<int64_t>(amax.size());
  Tensor rows = Tensor::empty({blocks, kMxBlock}, DType::kF32);
  Tensor cols = Tensor::empty({kMxBlock, blocks}, DType::kF32);
  for (int64_t b = 0; b < blocks; ++b) {
    float a = 0.0f;
    std::memcpy(&a, &amax[b], sizeof(a));
    for (int64_t i = 0; i < kMxBlock; ++i) {
      // The amax at a place that moves with the block; the others below it, half of them negative.
      const float frac = static_cast<float>(rng.uniform(1000 + b * kMxBlock + i));
      const float v = i == b % kMxBlock ? a : (i % 2 ? -1.0f : 1.0f) * a * frac;
      rows.data<float>()[b * kMxBlock + i] = v;
      cols.data<float>()[i * blocks + b] = v;
    }
  }
  // The NaN block also holds an infinity and a negative NaN: the signs of NaN bytes (inf x 0 under
  // FLOOR is negative, a NaN keeps its own) follow the reference's rule, not the GPU's arithmetic.
  const int64_t nan_block =
      static_cast<int64_t>(std::find(amax.begin(), amax.end(), 0x7FC00000u) - amax.begin());
  for (const auto& [at, v] : {std::pair{1, std::numeric_limits<float>::infinity()},
                              std::pair{2, -std::numeric_limits<float>::quiet_NaN()}}) {
    const int64_t i = (nan_block + at) % kMxBlock;
    rows.data<float>()[nan_block * kMxBlock + i] = v;
    cols.data<float>()[i * blocks + nan_block] = v;
  }
  for (const MxScaleRule rule : {MxScaleRule::kRceil, MxScaleRule::kFloor})
    for (const DType dt : {DType::kF32, DType::kBF16})
      for (const MxAxis axis : {MxAxis::kDim0, MxAxis::kDim1}) {
        SCOPED_TRACE(std::string(mx_scale_rule_name(rule)) + " " + std::string(dtype_name(dt)) +
                     " " + std::string(mx_axis_name(axis)));
        const Tensor x = (axis == MxAxis::kDim0 ? rows : cols).to(dt);
        MxTensor want = MxTensor::poisoned(x.shape(), axis);
        ops::mx_quantize(x, rule, want);
        MxTensor got = MxTensor::poisoned(x.shape(), axis, Device::kCUDA);
        ops::mx_quantize(x.to(Device::kCUDA), rule, got);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(same_bytes(got.scales(), want.scales()));
        EXPECT_TRUE(same_bytes(got.data(), want.data()));
      }
}

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

// The one-pass round trips (along dim0; along dim1 stored transposed; both from one read)
// against the CPU's steps, bit for bit, over every edge case of tests/mx_cases.h, bf16 and f32
// inputs into either dtype (an f32 input rounded to bf16 first); into a poisoned output, and in
// place along dim0.
TEST(GpuMx, RoundTripsMatchTheCpuBitForBit) {
  for (DType dt : {DType::kBF16, DType::kF32})
    for (DType out : {DType::kBF16, DType::kF32})
      for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil})
        for (const Shape& shape :
             {Shape{32, 32}, Shape{96, 64}, Shape{3, 64, 160}, Shape{160, 96}, Shape{256, 2048}}) {
          const uint64_t seed = fresh_seed();
          SCOPED_TRACE(std::string(dtype_name(dt)) + " -> " + std::string(dtype_name(out)) + " " +
                       shape_str(shape) + " seed " + std::to_string(seed));
          const Tensor x = testing::mx_input(shape, seed, dt);
          Tensor want = Tensor::poisoned(shape, out);
          ops::mx_round_trip(x, MxAxis::kDim0, rule, want);
          Tensor got = Tensor::poisoned(shape, out, Device::kCUDA);
          ops::mx_round_trip(x.to(Device::kCUDA), MxAxis::kDim0, rule, got);
          EXPECT_TRUE(same_values(got, want));
          if (out == dt) {
            Tensor in_place = x.to(Device::kCUDA);
            ops::mx_round_trip(in_place, MxAxis::kDim0, rule, in_place);
            EXPECT_TRUE(same_values(in_place, want));
          }
          Shape t = shape;
          std::swap(t[t.size() - 1], t[t.size() - 2]);
          Tensor want_t = Tensor::poisoned(t, out);
          ops::mx_round_trip_transposed(x, rule, want_t);
          Tensor got_t = Tensor::poisoned(t, out, Device::kCUDA);
          ops::mx_round_trip_transposed(x.to(Device::kCUDA), rule, got_t);
          EXPECT_TRUE(same_values(got_t, want_t));
          // Both from one read (a weight's two MX copies).
          Tensor both0 = Tensor::poisoned(shape, out, Device::kCUDA);
          Tensor both_t = Tensor::poisoned(t, out, Device::kCUDA);
          ops::mx_round_trip_both_axes(x.to(Device::kCUDA), rule, both0, both_t);
          EXPECT_TRUE(same_values(both0, want));
          EXPECT_TRUE(same_values(both_t, want_t));
        }
}

// got equals want on the rows whose mark is >= 0, value for value (NaN matching NaN, signs of
// zeros included), and `untouched` on the others (left as they were).
void expect_rows(const Tensor& got, const Tensor& want, const Tensor& marks,
                 const Tensor& untouched) {
  Tensor expected = want.to(Device::kCPU).clone();
  const Tensor u = untouched.to(Device::kCPU), mk = marks.to(Device::kCPU);
  const size_t row = static_cast<size_t>(got.dim(1)) * dtype_size(got.dtype());
  int64_t rows = 0;
  for (int64_t r = 0; r < got.dim(0); ++r) {
    if (mk.data<int32_t>()[r] >= 0) {
      ++rows;
      continue;
    }
    const size_t at = static_cast<size_t>(r) * row;
    std::memcpy(static_cast<char*>(expected.raw()) + at, static_cast<const char*>(u.raw()) + at,
                row);
  }
  EXPECT_GT(rows, 0);
  EXPECT_TRUE(same_values(got, expected));
}

// The MX values of a row writer's output along its rows, by the CPU reference.
Tensor mx_values_of(const Tensor& out_gpu, MxScaleRule rule) {
  const Tensor out = out_gpu.to(Device::kCPU);
  Tensor values = Tensor::poisoned(out.shape(), out.dtype());
  ops::mx_round_trip(out, MxAxis::kDim0, rule, values);
  return values;
}

// Runs write(out, mx) plain, with the MX values beside the output, and with them in place, each
// into a copy of `poison`, and checks the fused outputs against the plain one (rows marked >= 0;
// the others left as they were).
template <class Write>
void expect_mx_values_written(const Tensor& poison, const Tensor& marks, MxScaleRule rule,
                              Write&& write) {
  Tensor plain = poison.clone(), out = poison.clone(), values = poison.clone();
  write(plain, nullptr);
  const ops::MxValuesOut beside{&values, rule};
  write(out, &beside);
  expect_rows(out, plain, marks, poison);
  const Tensor want = mx_values_of(plain, rule);
  expect_rows(values, want, marks, poison);
  Tensor in_place = poison.clone();
  const ops::MxValuesOut own{&in_place, rule};
  write(in_place, &own);
  expect_rows(in_place, want, marks, poison);
}

// The row writers' fused MX values (the permutation and both SwiGLU passes: their kernels round
// each block as they write it) equal the round trip of their plain output, computed by the CPU
// reference, bit for bit; their plain output is unchanged; padding rows stay as they were; in
// place, only the MX values are written. Padded 128-row layout of a skewed routing with an empty
// expert; rows of 96 (a partial warp step) and 768 columns; both scale rules; bf16 and f32.
TEST(GpuMxValues, RowWritersWriteTheMxValuesOfTheirRows) {
  for (DType dt : {DType::kBF16, DType::kF32})
    for (int64_t f : {int64_t{96}, int64_t{768}})
      for (MxScaleRule rule : {MxScaleRule::kRceil, MxScaleRule::kFloor}) {
        const uint64_t seed = fresh_seed();
        SCOPED_TRACE(std::string(dtype_name(dt)) + " f " + std::to_string(f) + " seed " +
                     std::to_string(seed));
        const ops::ExpertPermutation p = random_expert_rows(500, 8, 128, seed);
        const int64_t m = p.rows();
        const Tensor& marks = p.source_token;
        const Tensor x = testing::mx_input({500, f}, seed, dt).to(Device::kCUDA);
        expect_mx_values_written(
            Tensor::poisoned({m, f}, dt, Device::kCUDA), marks, rule,
            [&](Tensor& out, const ops::MxValuesOut* mx) { ops::permute_rows(x, p, out, mx); });
        const Tensor h = testing::mx_input({m, 2 * f}, seed + 1, dt).to(Device::kCUDA);
        const Tensor weight = testing::randn({m}, seed + 2, 1.0, DType::kF32).to(Device::kCUDA);
        const ops::SwigluRows rows{&marks, &weight};
        expect_mx_values_written(Tensor::poisoned({m, f}, dt, Device::kCUDA), marks, rule,
                                 [&](Tensor& out, const ops::MxValuesOut* mx) {
                                   ops::swiglu_forward(h, out, rows, mx);
                                 });
        const Tensor da =
            testing::randn({m, f}, seed + 3, 1.0, DType::kF32).to(dt).to(Device::kCUDA);
        const Tensor dw_poison = Tensor::poisoned({m, 1}, DType::kF32, Device::kCUDA);
        Tensor dw_plain;
        expect_mx_values_written(Tensor::poisoned({m, 2 * f}, dt, Device::kCUDA), marks, rule,
                                 [&](Tensor& out, const ops::MxValuesOut* mx) {
                                   Tensor dw = dw_poison.clone();
                                   Tensor dw_flat = dw.reshape({m});
                                   ops::swiglu_backward(h, da, out, rows, &dw_flat, mx);
                                   if (!dw_plain.defined())
                                     dw_plain = dw;  // the plain run's, first
                                   else
                                     expect_rows(dw, dw_plain, marks, dw_poison);
                                 });
      }
}

// Rows whose 32-blocks span 2^-20 .. 2^20, with zero blocks and blocks whose values fall over
// 16 binades (E4M3 subnormals and zeros among their elements), bf16 on the GPU.
Tensor block_scaled_rows(int64_t m, int64_t q, uint64_t seed) {
  Tensor t = Tensor::empty({m, q}, DType::kF32);
  const CounterRng rng{seed, 11};
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t block = i / kMxBlock;
    const uint32_t pick = rng.u32(2 * block) % 16;
    const int exponent = static_cast<int>(rng.u32(2 * block + 1) % 41) - 20;
    const int spread = pick == 1 ? -static_cast<int>(i % kMxBlock) / 2 : 0;
    t.data<float>()[i] =
        pick == 0 ? 0.0f : static_cast<float>(std::ldexp(rng.normal(i), exponent + spread));
  }
  return t.to(DType::kBF16).to(Device::kCUDA);
}

// The MX product's kernel against its definition run on the GPU (dequantize, then the bf16
// grouped GEMM): the same bf16 operand values multiplied in the same order (k16 steps up K), so
// every expert row bit for bit; and against the CPU's f64 product to bf16 accuracy. Routing
// skewed (one expert a third of the rows, one empty), 128-row segments; shapes with a partial
// column tile, a partial K tile and a partial last row tile; outputs poisoned.
TEST(GpuMxGemm, KernelEqualsTheDefinitionBitForBit) {
  struct Case {
    int64_t p, q;
    const char* what;
  };
  for (const Case c : {Case{512, 256, "whole column tiles"}, Case{392, 96, "partial tiles"},
                       Case{256, 2048, "long K"}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(std::string(c.what) + " seed " + std::to_string(seed));
    const int64_t experts = 8;
    const ops::ExpertPermutation perm = random_expert_rows(700, experts, 128, seed);
    const ops::ExpertRows rows = perm.expert_rows(), rows_cpu = on_cpu(rows);
    const int64_t m = perm.rows();
    MxTensor a = MxTensor::poisoned({m, c.q}, MxAxis::kDim0, Device::kCUDA);
    ops::mx_quantize(block_scaled_rows(m, c.q, seed), MxScaleRule::kRceil, a);
    const Tensor b =
        testing::randn({experts, c.p, c.q}, seed + 1, 0.05, DType::kF32).to(DType::kBF16);
    const Tensor b_gpu = b.to(Device::kCUDA);
    Tensor got = Tensor::poisoned({m, c.p}, DType::kBF16, Device::kCUDA);
    ops::mx_grouped_gemm(a, b_gpu, rows, got);
    Tensor values = Tensor::poisoned({m, c.q}, DType::kBF16, Device::kCUDA);
    ops::mx_dequantize(a, values);
    Tensor want = Tensor::poisoned({m, c.p}, DType::kBF16, Device::kCUDA);
    ops::grouped_gemm_backward_input(values, b_gpu, rows, want);
    Tensor exact = Tensor::zeros({m, c.p}, DType::kF64);
    ops::mx_grouped_gemm(a.to(Device::kCPU), b.to(DType::kF64), rows_cpu, exact);

    const Tensor g = got.to(Device::kCPU), w = want.to(Device::kCPU);
    int64_t differing = 0, compared = 0;
    double num = 0, den = 0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = rows_cpu.segments.data<int64_t>()[e];
      const int64_t count =
          rows_cpu.offsets.data<int64_t>()[e + 1] - rows_cpu.offsets.data<int64_t>()[e];
      for (int64_t i = first * c.p; i < (first + count) * c.p; ++i) {
        differing += g.data<bf16>()[i].bits != w.data<bf16>()[i].bits;
        ++compared;
        const double d = static_cast<double>(g.item(i)) - exact.item(i);
        num += d * d;
        den += exact.item(i) * exact.item(i);
      }
    }
    ASSERT_GT(compared, 0);
    EXPECT_EQ(differing, 0) << "of " << compared << " expert-row outputs";
    EXPECT_GT(den, 0.0);
    EXPECT_LT(std::sqrt(num / den), 4e-3);  // bf16 rounding of each output
  }
}

// A block whose scale is NaN (0xFF) makes its row's outputs NaN, as its dequantized values would.
TEST(GpuMxGemm, ANanScalePoisonsItsRow) {
  const int64_t experts = 2, m = 256, q = 64, p = 256;
  Tensor offsets = Tensor::empty({experts + 1}, DType::kI64);
  for (int64_t e = 0; e <= experts; ++e) offsets.data<int64_t>()[e] = e * 128;
  const Tensor off = offsets.to(Device::kCUDA);
  const ops::ExpertRows rows(off, off, 128);
  MxTensor a = MxTensor::empty({m, q}, MxAxis::kDim0, Device::kCUDA);
  ops::mx_quantize(block_scaled_rows(m, q, fresh_seed()), MxScaleRule::kRceil, a);
  const uint8_t nan_scale = 0xFF;
  MT_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(a.scales().raw()) + 130 * (q / kMxBlock) + 1,
                           &nan_scale, 1, cudaMemcpyHostToDevice));
  const Tensor b =
      testing::randn({experts, p, q}, 5, 0.05, DType::kF32).to(DType::kBF16).to(Device::kCUDA);
  Tensor out = Tensor::poisoned({m, p}, DType::kBF16, Device::kCUDA);
  ops::mx_grouped_gemm(a, b, rows, out);
  const Tensor o = out.to(Device::kCPU);
  for (int64_t row : {int64_t{129}, int64_t{130}, int64_t{131}})
    for (int64_t j = 0; j < p; ++j)
      ASSERT_EQ(std::isnan(o.item(row * p + j)), row == 130) << "row " << row << " col " << j;
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
