// MX quantization's CPU reference (ops/mx.h): hand-checked blocks, torchao's own vectors
// (tests/fixtures/mx_torchao.safetensors, scripts/make_mx_fixture.py), the layouts, the error
// bound of a round trip, and the shape errors.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <tuple>

#include "core/quant.h"
#include "mx_cases.h"
#include "ops/elementwise.h"
#include "ops/mx.h"
#include "testing.h"
#if MOETRAIN_HAS_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/check.h"
#include "gpu_case.h"
#include "ops/activation.h"
#include "ops/permute.h"
#endif
#include "train/checkpoint.h"

namespace mt {
namespace {

using testing::same_bytes;
using testing::same_values;

// One 32-value block (1 x 32, dim0) from its values; returns {scale, data bytes}.
std::pair<uint8_t, std::vector<uint8_t>> quantize_block(const std::vector<float>& v,
                                                        MxScaleRule rule) {
  Tensor x = Tensor::zeros({1, kMxBlock}, DType::kF32);
  for (size_t i = 0; i < v.size(); ++i) x.data<float>()[i] = v[i];
  QuantTensor q = QuantTensor::poisoned({1, kMxBlock}, QuantBlock::kMx32, QuantAxis::kDim0);
  ops::mx_quantize(x, rule, q);
  return {static_cast<const uint8_t*>(q.scales().raw())[0], testing::bytes_of(q.data())};
}

TEST(MxQuantize, HandCheckedBlocks) {
  // amax 1: floor(log2 1) - 8 = -8 and ceil(log2(1/448)) = -8: scale 2^-8, 1 -> 256 (0x78).
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil}) {
    const auto [s, q] = quantize_block({1.0f, -0.5f, 0.0f}, rule);
    EXPECT_EQ(s, 127 - 8);
    EXPECT_EQ(q[0], 0x78);         // 256 = 2^8
    EXPECT_EQ(q[1], 0x80 | 0x70);  // -128 = -2^7
    EXPECT_EQ(q[2], 0x00);
  }
  // amax 500: FLOOR keeps scale 1 and saturates to 448; RCEIL takes scale 2 (500/448 > 1) and
  // rounds 250 to 256.
  auto [sf, qf] = quantize_block({500.0f}, MxScaleRule::kFloor);
  EXPECT_EQ(sf, 127);
  EXPECT_EQ(qf[0], 0x7E);
  auto [sr, qr] = quantize_block({500.0f}, MxScaleRule::kRceil);
  EXPECT_EQ(sr, 128);
  EXPECT_EQ(qr[0], 0x78);
  // Zero block: the smallest scale and zero data, for both rules.
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil}) {
    const auto [s, q] = quantize_block({}, rule);
    EXPECT_EQ(s, 0);
    for (uint8_t b : q) EXPECT_EQ(b, 0);
  }
  // A NaN anywhere makes the block's scale NaN.
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil}) {
    const auto [s, q] = quantize_block(
        {1.0f, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
         std::numeric_limits<float>::infinity()},
        rule);
    EXPECT_EQ(s, 0xFF);
    // FLOOR: x / inf, so 1 -> +0, a NaN keeps its sign, inf -> NaN (x86's, negative); RCEIL: the
    // factor's NaN, positive, everywhere (torchao's bytes, the fixture below).
    const bool floor = rule == MxScaleRule::kFloor;
    EXPECT_EQ(q[0], floor ? 0x00 : 0x7F);
    EXPECT_EQ(q[1], 0x7F);
    EXPECT_EQ(q[2], floor ? 0xFF : 0x7F);
    EXPECT_EQ(q[3], floor ? 0xFF : 0x7F);
  }
  // An infinity: FLOOR's largest scale (2^120), RCEIL's 2^127; the infinity itself saturates.
  const float inf = std::numeric_limits<float>::infinity();
  auto [si, qi] = quantize_block({1.0f, -inf}, MxScaleRule::kFloor);
  EXPECT_EQ(si, 247);
  EXPECT_EQ(qi[1], 0xFE);
  EXPECT_EQ(qi[0], 0x00);  // 1 / 2^120 is far below E4M3's smallest subnormal
  auto [sj, qj] = quantize_block({1.0f, inf}, MxScaleRule::kRceil);
  EXPECT_EQ(sj, 0xFE);
  EXPECT_EQ(qj[1], 0x7E);
  // Ties round to even: at scale 1 (amax 256, FLOOR), 1.0625 lies between 1 and 1.125.
  auto [st, qt] = quantize_block({256.0f, 1.0625f, 1.1875f}, MxScaleRule::kFloor);
  EXPECT_EQ(st, 127);
  EXPECT_EQ(qt[1], 0x38);  // 1.0 (mantissa 0, even)
  EXPECT_EQ(qt[2], 0x3A);  // 1.25 (mantissa 2, even)
}

TEST(MxDequantize, HandChecked) {
  QuantTensor q = QuantTensor::empty({1, kMxBlock}, QuantBlock::kMx32, QuantAxis::kDim0);
  uint8_t* d = static_cast<uint8_t*>(q.data().raw());
  for (int i = 0; i < kMxBlock; ++i) d[i] = 0;
  d[0] = 0x78;  // 256
  d[1] = 0x01;  // 2^-9, the smallest subnormal
  static_cast<uint8_t*>(q.scales().raw())[0] = 127 - 10;
  Tensor out = Tensor::poisoned({1, kMxBlock}, DType::kF32);
  ops::mx_dequantize(q, out);
  EXPECT_EQ(out.item(0), 0.25);
  EXPECT_EQ(out.item(1), std::ldexp(1.0, -19));
  EXPECT_EQ(out.item(2), 0.0);
  static_cast<uint8_t*>(q.scales().raw())[0] = 0xFF;
  ops::mx_dequantize(q, out);
  for (int i = 0; i < kMxBlock; ++i) EXPECT_TRUE(std::isnan(out.item(i)));
}

// torchao 0.18.0's to_mx / to_dtype on the fixture's inputs, for each input dtype, rule and axis.
class MxTorchao : public ::testing::TestWithParam<testing::MxCase> {};

TEST_P(MxTorchao, MatchesTorchaoBitForBit) {
  const auto [dtype, rule, axis] = GetParam();
  const std::string path = MOETRAIN_SOURCE_DIR "/tests/fixtures/mx_torchao.safetensors";
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " (made by scripts/make_mx_fixture.py)";
  const SafetensorsFile f = read_safetensors(path);
  const std::string in = std::string(dtype_name(dtype));
  const std::string key =
      in + "." + std::string(mx_scale_rule_name(rule)) + "." + std::string(quant_axis_name(axis));
  const Tensor& x = f.tensors.at(axis == QuantAxis::kDim0 ? "x." + in : "x." + in + ".t");
  ASSERT_EQ(x.dtype(), dtype);
  QuantTensor q = QuantTensor::poisoned(x.shape(), QuantBlock::kMx32, axis);
  ops::mx_quantize(x, rule, q);
  const Tensor& data = f.tensors.at(key + ".data");
  const Tensor& scales = f.tensors.at(key + ".scales");
  ASSERT_EQ(q.data().shape(), data.shape());
  ASSERT_EQ(q.scales().shape(), scales.shape());
  // Block b of the stored layout holds x's (the dim0 input's) values b*32 .. b*32+31 in both
  // layouts. One known difference: torchao's RCEIL path for GPUs below sm_100 takes
  // ceil(log2(descale)) with log2 in f32, which lands on the power of two itself when descale is
  // a few ulps above it and |log2| >= 4; we round up exactly (cuBLAS, and torchao's own sm_100
  // path). Only f32 inputs can get there (a bf16 amax / 448 is never that close to a power of
  // two): there our scale is one higher and the block's elements differ, nowhere else.
  const Tensor& x0 = f.tensors.at("x." + in);
  const std::vector<uint8_t> ours = testing::bytes_of(q.scales()),
                             theirs = testing::bytes_of(scales);
  const std::vector<uint8_t> our_data = testing::bytes_of(q.data()),
                             their_data = testing::bytes_of(data);
  int log2_edges = 0;
  for (size_t b = 0; b < ours.size(); ++b) {
    float amax = 0;
    for (int64_t i = 0; i < kMxBlock; ++i)
      amax = std::max(amax, std::fabs(static_cast<float>(x0.item(b * kMxBlock + i))));
    const uint32_t mantissa = std::bit_cast<uint32_t>(amax / kE4M3Max) & 0x7FFFFF;
    if (rule == MxScaleRule::kRceil && ours[b] != theirs[b] && mantissa >= 1 && mantissa <= 3) {
      EXPECT_EQ(ours[b], theirs[b] + 1) << "block " << b;
      ++log2_edges;
      continue;
    }
    ASSERT_EQ(ours[b], theirs[b]) << "scale of block " << b << ", amax " << amax;
    for (int64_t i = 0; i < kMxBlock; ++i) {
      const uint8_t u = our_data[b * kMxBlock + i], v = their_data[b * kMxBlock + i];
      ASSERT_EQ(u, v)  // NaN bytes too, signs included
          << "element " << i << " of block " << b << ": " << int{u} << " vs " << int{v};
    }
  }
  if (dtype == DType::kBF16 || rule == MxScaleRule::kFloor)
    EXPECT_EQ(log2_edges, 0);
  else
    EXPECT_EQ(log2_edges, 7);  // the fixture's f32-only blocks 1-2 ulps above 2^k, |k| >= 4
  // The fixture holds every case it was built for: a test of nothing would pass here too.
  int nan_scales = 0, zero_scales = 0, saturated = 0;
  for (uint8_t s : testing::bytes_of(scales)) nan_scales += s == 0xFF, zero_scales += s == 0;
  for (uint8_t b : testing::bytes_of(data)) saturated += (b & 0x7F) == 0x7E;
  EXPECT_GT(nan_scales, 0);
  EXPECT_GT(zero_scales, 0);
  EXPECT_GT(saturated, 0);

  // Dequantization of torchao's own bytes gives torchao's to_dtype.
  QuantTensor theirs_q = QuantTensor::empty(x.shape(), QuantBlock::kMx32, axis);
  std::memcpy(theirs_q.data().raw(), data.raw(), data.nbytes());  // saved as u8
  std::memcpy(theirs_q.scales().raw(), scales.raw(), scales.nbytes());
  Tensor back = Tensor::poisoned(x.shape(), dtype);
  ops::mx_dequantize(theirs_q, back);
  EXPECT_TRUE(same_values(back, f.tensors.at(key + ".dequant")));
}

INSTANTIATE_TEST_SUITE_P(Cases, MxTorchao, testing::mx_case_values(), testing::mx_case_name);

// Quantizing along dim1 is quantizing the transpose along dim0, matrix by matrix.
// t (B, R, C) -> (B, C, R), element for element.
Tensor transposed(const Tensor& t) {
  const int64_t b = t.dim(0), rows = t.dim(1), cols = t.dim(2);
  Tensor out = Tensor::empty({b, cols, rows}, t.dtype());
  for (int64_t e = 0; e < b; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out.set_item((e * cols + c) * rows + r, t.item((e * rows + r) * cols + c));
  return out;
}

TEST(MxQuantize, Dim1IsDim0OfTheTranspose) {
  const int64_t experts = 3, rows = 64, cols = 96;
  const Tensor x = testing::mx_input({experts, rows, cols}, 11, DType::kBF16);
  const Tensor xt = transposed(x);
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil}) {
    QuantTensor a = QuantTensor::poisoned(x.shape(), QuantBlock::kMx32, QuantAxis::kDim1);
    QuantTensor b = QuantTensor::poisoned(xt.shape(), QuantBlock::kMx32, QuantAxis::kDim0);
    ops::mx_quantize(x, rule, a);
    ops::mx_quantize(xt, rule, b);
    EXPECT_EQ(a.data().shape(), b.data().shape());
    EXPECT_TRUE(same_bytes(a.scales(), b.scales()));
    EXPECT_TRUE(same_bytes(a.data(), b.data()));
    Tensor back = Tensor::poisoned(x.shape(), DType::kF32);
    Tensor back_t = Tensor::poisoned(xt.shape(), DType::kF32);
    ops::mx_dequantize(a, back);
    ops::mx_dequantize(b, back_t);
    EXPECT_TRUE(same_values(back, transposed(back_t)));
  }
}

// The transposed round trip (a weight's MX copy for the forward) is the dim1 round trip
// transposed, element for element; a round trip into another dtype rounds x to it first (an f32
// master's copy in bf16 quantizes its bf16 values), along either axis.
TEST(MxRoundTrip, TransposedAndIntoAnotherDtype) {
  const int64_t experts = 2, rows = 64, cols = 96;
  const Tensor x32 = testing::mx_input({experts, rows, cols}, 17, DType::kF32);
  Tensor x16 = Tensor::empty(x32.shape(), DType::kBF16);
  ops::convert(x32, x16);
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil}) {
    Tensor along = Tensor::poisoned(x32.shape(), DType::kBF16);
    ops::mx_round_trip(x16, QuantAxis::kDim1, rule, along);
    Tensor t = Tensor::poisoned({experts, cols, rows}, DType::kBF16);
    ops::mx_round_trip_transposed(x32, rule, t);
    EXPECT_TRUE(same_values(transposed(t), along));
    for (QuantAxis axis : {QuantAxis::kDim0, QuantAxis::kDim1}) {
      Tensor from_f32 = Tensor::poisoned(x32.shape(), DType::kBF16);
      Tensor from_bf16 = Tensor::poisoned(x32.shape(), DType::kBF16);
      Tensor unrounded = Tensor::poisoned(x32.shape(), DType::kF32);
      ops::mx_round_trip(x32, axis, rule, from_f32);
      ops::mx_round_trip(x16, axis, rule, from_bf16);
      ops::mx_round_trip(x32, axis, rule, unrounded);
      EXPECT_TRUE(same_values(from_f32, from_bf16));
      EXPECT_FALSE(same_values(unrounded.to(DType::kBF16), from_bf16));  // the rounding mattered
    }
  }
}

// RCEIL never saturates: every finite element comes back within half an E4M3 step of itself
// (2^-4 relative for normal results, 2^-10 of the block's scale below E4M3's normal range).
TEST(MxQuantize, RceilRoundTripWithinHalfAStep) {
  Tensor x = testing::randn({64, 256}, 5, 1.0, DType::kF32);
  for (int64_t i = 0; i < x.numel(); ++i)
    x.data<float>()[i] *= std::ldexp(1.0f, (i / 32) % 40 - 20);
  QuantTensor q = QuantTensor::poisoned(x.shape(), QuantBlock::kMx32, QuantAxis::kDim0);
  ops::mx_quantize(x, MxScaleRule::kRceil, q);
  Tensor back = Tensor::poisoned(x.shape(), DType::kF64);
  ops::mx_dequantize(q, back);
  double worst = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double scale = from_e8m0(static_cast<const uint8_t*>(q.scales().raw())[i / kMxBlock]);
    const double bound = std::max(std::ldexp(std::fabs(x.item(i)), -4), std::ldexp(scale, -10));
    worst = std::max(worst, std::fabs(back.item(i) - x.item(i)) / bound);
  }
  EXPECT_LE(worst, 1.0);
  EXPECT_GT(worst, 0.1);  // the bound is tight, not vacuous
}

TEST(QuantTensorShape, ErrorsNameTheDimension) {
  EXPECT_NE(testing::error_of([] {
              QuantTensor::empty({4, 48}, QuantBlock::kMx32, QuantAxis::kDim0);
            }).find("blocked dimension (48) must be a multiple of 32"),
            std::string::npos);
  EXPECT_NE(testing::error_of([] {
              QuantTensor::empty({40, 64}, QuantBlock::kMx32, QuantAxis::kDim1);
            }).find("blocked dimension (40)"),
            std::string::npos);
  EXPECT_NE(testing::error_of([] {
              QuantTensor::empty({64}, QuantBlock::kMx32, QuantAxis::kDim0);
            }).find("at least 2"),
            std::string::npos);
  EXPECT_EQ(QuantTensor::scales_shape({2, 64, 96}, QuantBlock::kMx32, QuantAxis::kDim1),
            (Shape{2, 96, 2}));
  QuantTensor q = QuantTensor::empty({32, 64}, QuantBlock::kMx32, QuantAxis::kDim0);
  const Tensor wrong = Tensor::zeros({64, 32}, DType::kF32);
  EXPECT_NE(testing::error_of([&] {
              ops::mx_quantize(wrong, MxScaleRule::kRceil, q);
            }).find("does not match"),
            std::string::npos);
  const Tensor ints = Tensor::zeros({32, 64}, DType::kI32);
  EXPECT_NE(testing::error_of([&] {
              ops::mx_quantize(ints, MxScaleRule::kRceil, q);
            }).find("f32, bf16 or f64"),
            std::string::npos);
}

// The round trips and the row writers' MX values name what is wrong with their operands.
TEST(MxRoundTrip, ErrorsNameTheOperand) {
  const Tensor x = Tensor::zeros({64, 96}, DType::kF32);
  Tensor wrong_t = Tensor::zeros({64, 96}, DType::kF32);  // should be (96, 64)
  const std::string t =
      testing::error_of([&] { ops::mx_round_trip_transposed(x, MxScaleRule::kRceil, wrong_t); });
  EXPECT_NE(t.find("mx_round_trip_transposed output"), std::string::npos) << t;
  EXPECT_NE(t.find("96, 64"), std::string::npos) << t;
  Tensor small = Tensor::zeros({32, 96}, DType::kF32);
  const std::string shape = testing::error_of(
      [&] { ops::mx_round_trip(x, QuantAxis::kDim0, MxScaleRule::kRceil, small); });
  EXPECT_NE(shape.find("input's shape (64, 96)"), std::string::npos) << shape;
  Tensor ints = Tensor::zeros({64, 96}, DType::kI32);
  const std::string dtype = testing::error_of(
      [&] { ops::mx_round_trip(x, QuantAxis::kDim0, MxScaleRule::kRceil, ints); });
  EXPECT_NE(dtype.find("f32, bf16 or f64"), std::string::npos) << dtype;

  // Both axes from one read: R and C multiples of 32, one dtype, each output's own shape.
  Tensor d0 = Tensor::zeros({64, 96}, DType::kBF16), dt = Tensor::zeros({96, 64}, DType::kBF16);
  const Tensor odd = Tensor::zeros({64, 80}, DType::kF32);
  Tensor odd0 = Tensor::zeros({64, 80}, DType::kBF16),
         odd_t = Tensor::zeros({80, 64}, DType::kBF16);
  const std::string both_shape = testing::error_of(
      [&] { ops::mx_round_trip_both_axes(odd, MxScaleRule::kRceil, odd0, odd_t); });
  EXPECT_NE(both_shape.find("R and C multiples of 32; got (64, 80)"), std::string::npos)
      << both_shape;
  Tensor d0_f32 = Tensor::zeros({64, 96}, DType::kF32);
  const std::string both_dtype =
      testing::error_of([&] { ops::mx_round_trip_both_axes(x, MxScaleRule::kRceil, d0_f32, dt); });
  EXPECT_NE(both_dtype.find("share one dtype; got f32 and bf16"), std::string::npos) << both_dtype;
  const std::string both_t =
      testing::error_of([&] { ops::mx_round_trip_both_axes(x, MxScaleRule::kRceil, d0, d0); });
  EXPECT_NE(both_t.find("transposed output"), std::string::npos) << both_t;
  ops::mx_round_trip_both_axes(x, MxScaleRule::kRceil, d0, dt);  // the right operands pass

  Tensor out = Tensor::zeros({4, 96}, DType::kF32), values = Tensor::zeros({4, 64}, DType::kF32);
  const ops::MxValuesOut mx{&values, MxScaleRule::kRceil};
  const std::string mismatch =
      testing::error_of([&] { ops::check_mx_values("permute_rows", out, &mx); });
  EXPECT_NE(mismatch.find("permute_rows"), std::string::npos) << mismatch;
  EXPECT_NE(mismatch.find("match the output f32 (4, 96)"), std::string::npos) << mismatch;
  Tensor narrow = Tensor::zeros({4, 48}, DType::kF32), narrow_values = narrow.clone();
  const ops::MxValuesOut mx48{&narrow_values, MxScaleRule::kRceil};
  const std::string blocks =
      testing::error_of([&] { ops::check_mx_values("swiglu_forward", narrow, &mx48); });
  EXPECT_NE(blocks.find("multiple of 32 columns"), std::string::npos) << blocks;
  EXPECT_NE(blocks.find("(4, 48)"), std::string::npos) << blocks;
}

#if MOETRAIN_HAS_CUDA
// The MX kernels against the CPU reference, bit for bit (ctest label `gpu`): every edge case of
// tests/mx_cases.h, outputs poisoned twice (0xFF, then zeros, so that no byte passes by already
// holding its value).
class GpuMx : public ::testing::TestWithParam<testing::MxCase> {};
TEST_P(GpuMx, QuantizeAndDequantizeMatchTheCpuBitForBit) {
  const auto [dtype, rule, axis] = GetParam();
  for (const Shape& shape :
       {Shape{32, 32}, Shape{96, 64}, Shape{3, 64, 160}, Shape{256, 2048}, Shape{2, 1024, 768}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE("shape " + shape_str(shape) + " seed " + std::to_string(seed));
    const Tensor x = testing::mx_input(shape, seed, dtype);
    QuantTensor want = QuantTensor::poisoned(shape, QuantBlock::kMx32, axis);
    ops::mx_quantize(x, rule, want);
    const Tensor xg = x.to(Device::kCUDA);
    for (int poison : {0xFF, 0x00}) {
      QuantTensor got = QuantTensor::poisoned(shape, QuantBlock::kMx32, axis, Device::kCUDA);
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
      for (const QuantAxis axis : {QuantAxis::kDim0, QuantAxis::kDim1}) {
        SCOPED_TRACE(std::string(mx_scale_rule_name(rule)) + " " + std::string(dtype_name(dt)) +
                     " " + std::string(quant_axis_name(axis)));
        const Tensor x = (axis == QuantAxis::kDim0 ? rows : cols).to(dt);
        QuantTensor want = QuantTensor::poisoned(x.shape(), QuantBlock::kMx32, axis);
        ops::mx_quantize(x, rule, want);
        QuantTensor got = QuantTensor::poisoned(x.shape(), QuantBlock::kMx32, axis, Device::kCUDA);
        ops::mx_quantize(x.to(Device::kCUDA), rule, got);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(same_bytes(got.scales(), want.scales()));
        EXPECT_TRUE(same_bytes(got.data(), want.data()));
      }
}
TEST(GpuMx, RefusesWhatTheKernelsCannotRead) {
  QuantTensor q = QuantTensor::empty({64, 36}, QuantBlock::kMx32, QuantAxis::kDim1, Device::kCUDA);
  const Tensor x = Tensor::zeros({64, 36}, DType::kBF16, Device::kCUDA);  // 72-byte rows
  EXPECT_NE(testing::error_of([&] {
              ops::mx_quantize(x, MxScaleRule::kRceil, q);
            }).find("multiple of 16 bytes"),
            std::string::npos);
  Tensor out = Tensor::zeros({64, 36}, DType::kBF16, Device::kCUDA);
  EXPECT_NE(testing::error_of([&] { ops::mx_dequantize(q, out); }).find("multiple of 16 bytes"),
            std::string::npos);
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
          ops::mx_round_trip(x, QuantAxis::kDim0, rule, want);
          Tensor got = Tensor::poisoned(shape, out, Device::kCUDA);
          ops::mx_round_trip(x.to(Device::kCUDA), QuantAxis::kDim0, rule, got);
          EXPECT_TRUE(same_values(got, want));
          if (out == dt) {
            Tensor in_place = x.to(Device::kCUDA);
            ops::mx_round_trip(in_place, QuantAxis::kDim0, rule, in_place);
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
  ops::mx_round_trip(out, QuantAxis::kDim0, rule, values);
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
#endif  // MOETRAIN_HAS_CUDA

}  // namespace
}  // namespace mt
