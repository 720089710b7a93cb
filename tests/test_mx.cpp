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

#include "core/mx.h"
#include "mx_cases.h"
#include "ops/elementwise.h"
#include "ops/mx.h"
#include "testing.h"
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
  MxTensor q = MxTensor::poisoned({1, kMxBlock}, MxAxis::kDim0);
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
  MxTensor q = MxTensor::empty({1, kMxBlock}, MxAxis::kDim0);
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
      in + "." + std::string(mx_scale_rule_name(rule)) + "." + std::string(mx_axis_name(axis));
  const Tensor& x = f.tensors.at(axis == MxAxis::kDim0 ? "x." + in : "x." + in + ".t");
  ASSERT_EQ(x.dtype(), dtype);
  MxTensor q = MxTensor::poisoned(x.shape(), axis);
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
  MxTensor theirs_q = MxTensor::empty(x.shape(), axis);
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
    MxTensor a = MxTensor::poisoned(x.shape(), MxAxis::kDim1);
    MxTensor b = MxTensor::poisoned(xt.shape(), MxAxis::kDim0);
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
    ops::mx_round_trip(x16, MxAxis::kDim1, rule, along);
    Tensor t = Tensor::poisoned({experts, cols, rows}, DType::kBF16);
    ops::mx_round_trip_transposed(x32, rule, t);
    EXPECT_TRUE(same_values(transposed(t), along));
    for (MxAxis axis : {MxAxis::kDim0, MxAxis::kDim1}) {
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
  MxTensor q = MxTensor::poisoned(x.shape(), MxAxis::kDim0);
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

TEST(MxTensorShape, ErrorsNameTheDimension) {
  EXPECT_NE(testing::error_of([] {
              MxTensor::empty({4, 48}, MxAxis::kDim0);
            }).find("blocked dimension (48) must be a multiple of 32"),
            std::string::npos);
  EXPECT_NE(testing::error_of([] {
              MxTensor::empty({40, 64}, MxAxis::kDim1);
            }).find("blocked dimension (40)"),
            std::string::npos);
  EXPECT_NE(testing::error_of([] { MxTensor::empty({64}, MxAxis::kDim0); }).find("at least 2"),
            std::string::npos);
  EXPECT_EQ(MxTensor::scales_shape({2, 64, 96}, MxAxis::kDim1), (Shape{2, 96, 2}));
  MxTensor q = MxTensor::empty({32, 64}, MxAxis::kDim0);
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
  const std::string shape =
      testing::error_of([&] { ops::mx_round_trip(x, MxAxis::kDim0, MxScaleRule::kRceil, small); });
  EXPECT_NE(shape.find("input's shape (64, 96)"), std::string::npos) << shape;
  Tensor ints = Tensor::zeros({64, 96}, DType::kI32);
  const std::string dtype =
      testing::error_of([&] { ops::mx_round_trip(x, MxAxis::kDim0, MxScaleRule::kRceil, ints); });
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

}  // namespace
}  // namespace mt
