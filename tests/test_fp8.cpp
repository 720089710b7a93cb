// FP8 blockwise quantization (ops/fp8.h) and the FP8 expert and dense products (ops/fp8_gemm.h):
// the CPU reference on hand-checked blocks, the layouts against each other, the products against
// plain loops and against the unquantized product; in the Gpu* cases (ctest label `gpu`) every
// kernel against the CPU reference on fresh random inputs, bytes for the quantizations and a
// relative error for the products.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/quant.h"
#include "core/rng.h"
#include "mx_cases.h"
#include "ops/fp8.h"
#include "ops/fp8_gemm.h"
#include "ops/grouped_gemm.h"
#include "testing.h"
#if MOETRAIN_HAS_CUDA
#include "gpu_case.h"
#include "ops/cuda/fp8_gemm.h"
#endif

namespace mt {
namespace {

constexpr Fp8ScaleRule kRules[] = {Fp8ScaleRule::kFp32, Fp8ScaleRule::kPow2};

// Values whose 128-blocks span 2^-20 .. 2^20 in magnitude, some blocks zero.
Tensor scaled_blocks(const Shape& shape, uint64_t seed, int64_t block = kFp8Block) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  const CounterRng rng{seed, 5};
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t b = i / block;
    const uint32_t pick = rng.u32(2 * b) % 16;
    const double magnitude = std::ldexp(1.0, static_cast<int>(rng.u32(2 * b + 1) % 41) - 20);
    t.set_item(i, pick == 0 ? 0.0 : magnitude * rng.normal(i));
  }
  return t;
}

float scale_of(const QuantTensor& q, int64_t i) {
  return q.scales().data<float>()[i];
}
uint8_t byte_of(const QuantTensor& q, int64_t i) {
  return static_cast<const uint8_t*>(q.data().raw())[i];
}

TEST(Fp8Quantize, HandCheckedBlocks) {
  // Row 0: all ones. Row 1: zeros. Row 2: 1..128 / 64 with the last 2 (amax 2). Row 3: a NaN.
  Tensor x = Tensor::zeros({4, kFp8Block}, DType::kF32);
  for (int64_t j = 0; j < kFp8Block; ++j) {
    x.set_item(j, 1.0);
    x.set_item(2 * kFp8Block + j, (j + 1) / 64.0);
    x.set_item(3 * kFp8Block + j, 1.0);
  }
  x.set_item(3 * kFp8Block + 7, std::numeric_limits<double>::quiet_NaN());
  QuantTensor q = QuantTensor::poisoned(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
  ops::fp8_quantize(x, Fp8ScaleRule::kFp32, q);
  EXPECT_EQ(scale_of(q, 0), 1.0f / 448.0f);
  EXPECT_EQ(byte_of(q, 0), 0x7E);                     // 1 * 448 = 448, E4M3's largest
  EXPECT_EQ(scale_of(q, 1), kFp8AmaxFloor / 448.0f);  // amax floored
  EXPECT_EQ(byte_of(q, kFp8Block), 0x00);
  EXPECT_EQ(scale_of(q, 2), 2.0f / 448.0f);
  EXPECT_EQ(byte_of(q, 3 * kFp8Block - 1), 0x7E);   // the amax element: 448
  EXPECT_EQ(byte_of(q, 2 * kFp8Block + 63), 0x76);  // 1 * 224 = 1.75 * 2^7: 0 1110 110
  EXPECT_TRUE(std::isnan(scale_of(q, 3)));
  EXPECT_EQ(byte_of(q, 3 * kFp8Block), 0x7F);
  ops::fp8_quantize(x, Fp8ScaleRule::kPow2, q);
  EXPECT_EQ(scale_of(q, 0), std::ldexp(1.0f, -8));  // ceil(log2(1 / 448)) = -8
  EXPECT_EQ(byte_of(q, 0), 0x78);                   // 256 = 2^8
  EXPECT_EQ(scale_of(q, 2), std::ldexp(1.0f, -7));  // ceil(log2(2 / 448)) = -7
  EXPECT_EQ(byte_of(q, 3 * kFp8Block - 1), 0x78);   // 2 * 2^7 = 256
  // Dequantized: exact products in f64, so the pow2 round trip of a power of two is exact.
  Tensor back = Tensor::empty(x.shape(), DType::kF64);
  ops::fp8_dequantize(q, back);
  EXPECT_EQ(back.item(0), 1.0);
  EXPECT_EQ(back.item(3 * kFp8Block - 1), 2.0);
  EXPECT_EQ(back.item(kFp8Block), 0.0);
}

TEST(Fp8Quantize, RoundTripKeepsE4M3Precision) {
  for (Fp8ScaleRule rule : kRules) {
    const Tensor x = scaled_blocks({64, 512}, 17);
    Tensor back = Tensor::empty(x.shape(), DType::kF64);
    ops::fp8_round_trip(x, QuantBlock::kRow128, QuantAxis::kDim0, rule, back);
    // Each element within half an E4M3 ulp (2^-4 relative) unless it falls below the normal
    // range of its block (2^-6 of 448 x scale), where the absolute error is bounded instead.
    for (int64_t b = 0; b < x.numel() / kFp8Block; ++b) {
      double amax = 0;
      for (int64_t j = 0; j < kFp8Block; ++j)
        amax = std::max(amax, std::fabs(x.item(b * kFp8Block + j)));
      for (int64_t j = 0; j < kFp8Block; ++j) {
        const int64_t i = b * kFp8Block + j;
        const double v = x.item(i), err = std::fabs(back.item(i) - v);
        const double step = amax / 448 * (rule == Fp8ScaleRule::kPow2 ? 2 : 1);  // scale bound
        EXPECT_LE(err, std::max(std::fabs(v) * 0.0625, step * std::ldexp(1.0, -9) * 1.0001))
            << "element " << i << " value " << v << " rule " << fp8_scale_rule_name(rule);
      }
    }
    EXPECT_GT(relative_error(back, x), 1e-3);  // quantized, not copied
  }
}

TEST(Fp8Quantize, LayoutsAgree) {
  const Tensor x = scaled_blocks({2, 256, 384}, 3);
  for (Fp8ScaleRule rule : kRules) {
    // 1 x 128 along dim1 holds the bytes of the transpose along dim0; the scales transposed.
    Tensor xt = Tensor::empty({2, 384, 256}, DType::kF32);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t r = 0; r < 256; ++r)
        for (int64_t c = 0; c < 384; ++c)
          xt.set_item((b * 384 + c) * 256 + r, x.item((b * 256 + r) * 384 + c));
    QuantTensor d1 = QuantTensor::poisoned(x.shape(), QuantBlock::kRow128, QuantAxis::kDim1);
    QuantTensor t0 = QuantTensor::poisoned(xt.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
    ops::fp8_quantize(x, rule, d1);
    ops::fp8_quantize(xt, rule, t0);
    EXPECT_EQ(std::memcmp(d1.data().raw(), t0.data().raw(), d1.data().nbytes()), 0);
    EXPECT_EQ(d1.scales().shape(), (Shape{2, 2, 384}));
    EXPECT_EQ(t0.scales().shape(), (Shape{2, 384, 2}));
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t rb = 0; rb < 2; ++rb)
        for (int64_t c = 0; c < 384; ++c)
          ASSERT_EQ(scale_of(d1, (b * 2 + rb) * 384 + c), scale_of(t0, (b * 384 + c) * 2 + rb));
    // 128 x 128 tiles: both axes from one call, the same scales and values, transposed bytes.
    QuantTensor w0 = QuantTensor::poisoned(x.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
    QuantTensor w1 = QuantTensor::poisoned(x.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
    ops::fp8_quantize_both_axes(x, rule, w0, w1);
    EXPECT_EQ(w0.scales().shape(), (Shape{2, 2, 3}));
    EXPECT_EQ(std::memcmp(w0.scales().raw(), w1.scales().raw(), w0.scales().nbytes()), 0);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t r = 0; r < 256; ++r)
        for (int64_t c = 0; c < 384; ++c)
          ASSERT_EQ(byte_of(w0, (b * 256 + r) * 384 + c), byte_of(w1, (b * 384 + c) * 256 + r));
    Tensor v0 = Tensor::empty(x.shape(), DType::kF64), v1 = Tensor::empty(x.shape(), DType::kF64);
    ops::fp8_dequantize(w0, v0);
    ops::fp8_dequantize(w1, v1);
    EXPECT_EQ(relative_error(v0, v1), 0.0);
    EXPECT_GT(relative_error(v0, x), 1e-3);
    EXPECT_LT(relative_error(v0, x), 0.2);  // one scale per tile spanning many binades
    // Either layout's transpose is the other's quantization, bytes and scales.
    QuantTensor from0 = QuantTensor::poisoned(x.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
    QuantTensor from1 = QuantTensor::poisoned(x.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
    ops::fp8_transpose_tiles(w0, from0);
    ops::fp8_transpose_tiles(w1, from1);
    EXPECT_TRUE(testing::same_quant(from0, w1));
    EXPECT_TRUE(testing::same_quant(from1, w0));
  }
}

TEST(Fp8Quantize, TransposeTilesRefusesWhatIsNotTheOtherLayout) {
  const Shape s{2, 256, 128};
  const QuantTensor w0 = QuantTensor::empty(s, QuantBlock::kTile128, QuantAxis::kDim0);
  QuantTensor same = QuantTensor::empty(s, QuantBlock::kTile128, QuantAxis::kDim0);
  const std::string axis = testing::error_of([&] { ops::fp8_transpose_tiles(w0, same); });
  EXPECT_NE(axis.find("into the other axis"), std::string::npos) << axis;
  QuantTensor rows = QuantTensor::empty(s, QuantBlock::kRow128, QuantAxis::kDim1);
  const std::string block = testing::error_of([&] { ops::fp8_transpose_tiles(w0, rows); });
  EXPECT_NE(block.find("1x128 blocks along dim1"), std::string::npos) << block;
  QuantTensor other = QuantTensor::empty({2, 128, 256}, QuantBlock::kTile128, QuantAxis::kDim1);
  const std::string shape = testing::error_of([&] { ops::fp8_transpose_tiles(w0, other); });
  EXPECT_NE(shape.find("(2, 256, 128) and (2, 128, 256)"), std::string::npos) << shape;
}

TEST(Fp8Quantize, RefusesShapesItCannotBlock) {
  const std::string rows = testing::error_of([] {
    QuantTensor::empty({4, 100}, QuantBlock::kRow128, QuantAxis::kDim0);
  });
  EXPECT_NE(rows.find("multiple of 128"), std::string::npos) << rows;
  const std::string tiles = testing::error_of([] {
    QuantTensor::empty({128, 64}, QuantBlock::kTile128, QuantAxis::kDim1);
  });
  EXPECT_NE(tiles.find("multiples of 128"), std::string::npos) << tiles;
  EXPECT_EQ(QuantTensor::scales_shape({2, 256, 384}, QuantBlock::kRow128, QuantAxis::kDim0),
            (Shape{2, 256, 3}));
  EXPECT_EQ(QuantTensor::scales_shape({2, 256, 384}, QuantBlock::kTile128, QuantAxis::kDim1),
            (Shape{2, 2, 3}));
  QuantTensor mx = QuantTensor::empty({4, 128}, QuantBlock::kMx32, QuantAxis::kDim0);
  const std::string wrong = testing::error_of([&] {
    ops::fp8_quantize(Tensor::zeros({4, 128}, DType::kF32), Fp8ScaleRule::kFp32, mx);
  });
  EXPECT_NE(wrong.find("1x32"), std::string::npos) << wrong;
}

// Three experts over 512 rows with segments on 128-row boundaries: 130 rows (two blocks, the
// second of 2 rows), none, 100 rows from row 256; the rest padding.
ops::ExpertRows padded_rows() {
  Tensor offsets = Tensor::empty({4}, DType::kI64), segments = Tensor::empty({4}, DType::kI64);
  const int64_t off[] = {0, 130, 130, 230}, seg[] = {0, 256, 256, 384};
  for (int i = 0; i < 4; ++i) {
    offsets.data<int64_t>()[i] = off[i];
    segments.data<int64_t>()[i] = seg[i];
  }
  return {offsets, segments, 128};
}

TEST(Fp8Quantize, ExpertRowsAreBlockedPerExpert) {
  const ops::ExpertRows rows = padded_rows();
  Tensor x = scaled_blocks({400, 64}, 8, 1);  // 400 rows: the quantized rows round up to 512
  for (int64_t i = 0; i < x.numel(); ++i)     // padding rows hold garbage no block may read
    if (const int64_t r = i / 64; (r >= 130 && r < 256) || r >= 356) x.set_item(i, 1e30);
  for (Fp8ScaleRule rule : kRules) {
    QuantTensor q =
        QuantTensor::poisoned(ops::fp8_expert_rows_shape(x), QuantBlock::kRow128, QuantAxis::kDim1);
    ASSERT_EQ(q.shape(), (Shape{512, 64}));
    ops::fp8_quantize_expert_rows(x, rows, rule, q);
    Tensor got = Tensor::empty({512, 64}, DType::kF64);
    ops::fp8_dequantize(q, got);
    Tensor want = Tensor::empty({400, 64}, DType::kF64);
    ops::fp8_round_trip_expert_rows(x.to(DType::kF64), rows, rule, want);
    for (int64_t r = 0; r < 512; ++r)
      for (int64_t c = 0; c < 64; ++c) {
        const bool in_expert = r < 130 || (r >= 256 && r < 356);
        ASSERT_EQ(got.item(r * 64 + c), in_expert ? want.item(r * 64 + c) : 0.0)
            << "row " << r << " col " << c;
      }
    // The second block of expert 0 holds its rows 128, 129 only: scaled by their own amax.
    double amax = 0;
    for (int64_t r = 128; r < 130; ++r) amax = std::max(amax, std::fabs(x.item(r * 64 + 5)));
    if (rule == Fp8ScaleRule::kFp32 && amax > 0) {
      EXPECT_EQ(scale_of(q, 1 * 64 + 5), static_cast<float>(amax) / 448.0f);
    }
  }
  const std::string dense = testing::error_of([&] {
    Tensor off = rows.offsets;
    QuantTensor q = QuantTensor::empty({512, 64}, QuantBlock::kRow128, QuantAxis::kDim1);
    ops::fp8_quantize_expert_rows(x, ops::ExpertRows(off), Fp8ScaleRule::kFp32, q);
  });
  EXPECT_NE(dense.find("128-row boundaries"), std::string::npos) << dense;
}

// out (m, p) = a b[e]^T by plain loops over the dequantized operands.
Tensor loop_product(const Tensor& a, const Tensor& b_stored, const ops::ExpertRows& rows) {
  const int64_t experts = b_stored.dim(0), p = b_stored.dim(1), q = b_stored.dim(2);
  Tensor out = Tensor::zeros({a.dim(0), p}, DType::kF64);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = rows.segments.data<int64_t>()[e];
    const int64_t count = rows.offsets.data<int64_t>()[e + 1] - rows.offsets.data<int64_t>()[e];
    for (int64_t r = first; r < first + count; ++r)
      for (int64_t j = 0; j < p; ++j) {
        double s = 0;
        for (int64_t k = 0; k < q; ++k) s += a.item(r * q + k) * b_stored.item((e * p + j) * q + k);
        out.set_item(r * p + j, s);
      }
  }
  return out;
}

Tensor dequantized(const QuantTensor& q) {
  Tensor t = Tensor::empty(q.shape(), DType::kF64);
  ops::fp8_dequantize(q, t);
  return t;
}

// Only the experts' rows of a product (the padding rows are meaningless).
Tensor expert_rows_only(const Tensor& t, const ops::ExpertRows& rows) {
  Tensor out = Tensor::zeros(t.shape(), DType::kF64);
  const int64_t experts = rows.offsets.numel() - 1, w = t.dim(1);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = rows.segments.data<int64_t>()[e];
    const int64_t count = rows.offsets.data<int64_t>()[e + 1] - rows.offsets.data<int64_t>()[e];
    for (int64_t i = first * w; i < (first + count) * w; ++i) out.set_item(i, t.item(i));
  }
  return out;
}

TEST(Fp8GroupedGemm, ProductsOfTheDequantizedOperands) {
  const ops::ExpertRows rows = padded_rows();
  const Tensor x = testing::randn({512, 256}, 1, 1.0, DType::kF32);
  const Tensor w = testing::randn({3, 256, 128}, 2, 0.05, DType::kF32);  // (E, K, N)
  QuantTensor xq = QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
  QuantTensor w0 = QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
  QuantTensor w1 = QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
  ops::fp8_quantize(x, Fp8ScaleRule::kFp32, xq);
  ops::fp8_quantize_both_axes(w, Fp8ScaleRule::kFp32, w0, w1);
  // Forward: out = x w = x (w^T)^T with b = w's dim1 copy, stored (E, N, K).
  Tensor out = Tensor::zeros({512, 128}, DType::kF64);
  ops::fp8_grouped_gemm(xq, w1, rows, out);
  Tensor w1_stored = Tensor::empty({3, 128, 256}, DType::kF64);
  const Tensor wv = dequantized(w0);
  for (int64_t e = 0; e < 3; ++e)
    for (int64_t k = 0; k < 256; ++k)
      for (int64_t n = 0; n < 128; ++n)
        w1_stored.set_item((e * 128 + n) * 256 + k, wv.item((e * 256 + k) * 128 + n));
  const Tensor want = loop_product(dequantized(xq), w1_stored, rows);
  EXPECT_LT(relative_error(expert_rows_only(out, rows), want), 1e-12);
  // ... and near the unquantized product: FP8's error, not a layout's.
  Tensor exact = Tensor::zeros({512, 128}, DType::kF64);
  ops::grouped_gemm_forward(x.to(DType::kF64), w.to(DType::kF64), rows, exact);
  const double err = relative_error(expert_rows_only(out, rows), expert_rows_only(exact, rows));
  EXPECT_LT(err, 0.06);
  EXPECT_GT(err, 1e-3);
  // Input gradient: dx (m, K) = dy (m, N) w^T with b = w's dim0 copy, stored (E, K, N).
  const Tensor dy = testing::randn({512, 128}, 4, 1.0, DType::kF32);
  QuantTensor dyq = QuantTensor::empty(dy.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
  ops::fp8_quantize(dy, Fp8ScaleRule::kFp32, dyq);
  Tensor dx = Tensor::zeros({512, 256}, DType::kF32);
  ops::fp8_grouped_gemm(dyq, w0, rows, dx);
  EXPECT_LT(relative_error(expert_rows_only(dx, rows), loop_product(dequantized(dyq), wv, rows)),
            1e-6);  // f32 output
}

// The dense layers' FP8 products (model.dense_recipe): y = x w and dx = dy w^T for w stored
// (in, out) and, used transposed, (out, in) (a tied LM head), against plain loops over the
// operands' FP8 values (fp8_round_trip: x and dy in 1 x 128 blocks, w in 128 x 128 tiles, whose
// scales do not depend on the layout), and away from the unquantized product by FP8's error.
TEST(Fp8Gemm, DenseLinearIsTheProductOfTheRoundedOperands) {
  const int64_t m = 200, in = 256, out = 384;
  const Tensor x = testing::randn({m, in}, 21, 1.0, DType::kF32);
  const Tensor dy = testing::randn({m, out}, 22, 1.0, DType::kF32);
  const Tensor w = testing::randn({in, out}, 23, 0.05, DType::kF32);
  Tensor wt = Tensor::empty({out, in}, DType::kF32);
  for (int64_t i = 0; i < in; ++i)
    for (int64_t j = 0; j < out; ++j) wt.set_item(j * in + i, w.item(i * out + j));
  Tensor xr = Tensor::empty(x.shape(), DType::kF64), dyr = Tensor::empty(dy.shape(), DType::kF64),
         wr = Tensor::empty(w.shape(), DType::kF64);
  ops::fp8_round_trip(x.to(DType::kF64), QuantBlock::kRow128, QuantAxis::kDim0, Fp8ScaleRule::kFp32,
                      xr);
  ops::fp8_round_trip(dy.to(DType::kF64), QuantBlock::kRow128, QuantAxis::kDim0,
                      Fp8ScaleRule::kFp32, dyr);
  ops::fp8_round_trip(w.to(DType::kF64), QuantBlock::kTile128, QuantAxis::kDim0,
                      Fp8ScaleRule::kFp32, wr);
  Tensor y_want = Tensor::zeros({m, out}, DType::kF64),
         dx_want = Tensor::zeros({m, in}, DType::kF64),
         y_exact = Tensor::zeros({m, out}, DType::kF64);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < out; ++j) {
        const double wij = wr.item(i * out + j);
        y_want.set_item(r * out + j, y_want.item(r * out + j) + xr.item(r * in + i) * wij);
        y_exact.set_item(r * out + j,
                         y_exact.item(r * out + j) + x.item(r * in + i) * w.item(i * out + j));
        dx_want.set_item(r * in + i, dx_want.item(r * in + i) + dyr.item(r * out + j) * wij);
      }
  for (const auto& [weight, tw] :
       std::array{std::pair<const Tensor*, ops::Transpose>{&w, ops::Transpose::kNo},
                  std::pair<const Tensor*, ops::Transpose>{&wt, ops::Transpose::kYes}}) {
    SCOPED_TRACE(tw == ops::Transpose::kNo ? "w (in, out)" : "w (out, in), transposed");
    Tensor y = Tensor::poisoned({m, out}, DType::kF32), dx = Tensor::poisoned({m, in}, DType::kF32);
    ops::fp8_linear_forward(ops::fp8_rows(x, Fp8ScaleRule::kFp32), *weight, tw, Fp8ScaleRule::kFp32,
                            y);
    ops::fp8_linear_backward_input(dy, *weight, tw, Fp8ScaleRule::kFp32, dx);
    EXPECT_LT(relative_error(y.to(DType::kF64), y_want), 1e-6) << "forward";
    EXPECT_LT(relative_error(dx.to(DType::kF64), dx_want), 1e-6) << "input gradient";
    const double err = relative_error(y.to(DType::kF64), y_exact);
    EXPECT_LT(err, 0.06);
    EXPECT_GT(err, 1e-3);
    // Both layouts from one read (the LM head's, quantized once for its chunks): the same
    // products.
    const ops::Fp8LinearWeight both =
        ops::fp8_linear_weight(*weight, tw, Fp8ScaleRule::kFp32, ops::Fp8LinearUse::kBoth);
    Tensor y2 = Tensor::poisoned({m, out}, DType::kF32),
           dx2 = Tensor::poisoned({m, in}, DType::kF32);
    ops::fp8_gemm(ops::fp8_rows(x, Fp8ScaleRule::kFp32), both.forward, y2);
    ops::fp8_gemm(ops::fp8_rows(dy, Fp8ScaleRule::kFp32), both.input_gradient, dx2);
    EXPECT_EQ(std::memcmp(y2.raw(), y.raw(), y.nbytes()), 0) << "forward, both layouts";
    EXPECT_EQ(std::memcmp(dx2.raw(), dx.raw(), dx.nbytes()), 0) << "input gradient, both layouts";
  }
  // The backward's pair: the FP8 input gradient and the bf16-recipe weight gradient x^T dy.
  {
    Tensor dx = Tensor::poisoned({m, in}, DType::kF32), dw = Tensor::zeros({in, out}, DType::kF32);
    ops::fp8_linear_backward(x, w, dy, Fp8ScaleRule::kFp32, dx, dw);
    EXPECT_LT(relative_error(dx.to(DType::kF64), dx_want), 1e-6) << "pair's input gradient";
    Tensor dw_want = Tensor::zeros({in, out}, DType::kF32);
    ops::gemm(x, ops::Transpose::kYes, dy, ops::Transpose::kNo, dw_want, ops::Accumulate::kNo);
    EXPECT_LT(relative_error(dw, dw_want), 1e-6) << "pair's weight gradient";
    EXPECT_GT(dw_want.item(0) * dw_want.item(0), 0.0);
  }
  // A width that the tiles cannot block is refused, naming it.
  const std::string bad = testing::error_of([&] {
    const Tensor w_odd = testing::randn({in, 200}, 24, 0.05, DType::kF32);
    Tensor y = Tensor::empty({m, 200}, DType::kF32);
    ops::fp8_linear_forward(ops::fp8_rows(x, Fp8ScaleRule::kFp32), w_odd, ops::Transpose::kNo,
                            Fp8ScaleRule::kFp32, y);
  });
  EXPECT_NE(bad.find("200"), std::string::npos) << bad;
}

TEST(Fp8GroupedGemm, WeightGradientOfTheDequantizedOperands) {
  const ops::ExpertRows rows = padded_rows();
  const Tensor x = testing::randn({400, 256}, 5, 1.0, DType::kF32);
  const Tensor dy = testing::randn({400, 128}, 6, 1.0, DType::kF32);
  for (Fp8ScaleRule rule : kRules) {
    QuantTensor xq =
        QuantTensor::empty(ops::fp8_expert_rows_shape(x), QuantBlock::kRow128, QuantAxis::kDim1);
    QuantTensor dyq =
        QuantTensor::empty(ops::fp8_expert_rows_shape(dy), QuantBlock::kRow128, QuantAxis::kDim1);
    ops::fp8_quantize_expert_rows(x, rows, rule, xq);
    ops::fp8_quantize_expert_rows(dy, rows, rule, dyq);
    Tensor dw = Tensor::empty({3, 256, 128}, DType::kF64);  // expert 1 has no rows
    dw.fill_(7.0);
    ops::fp8_grouped_gemm_weight(xq, dyq, rows, dw, ops::Accumulate::kNo);
    // The definition by the other path: each operand's values per expert block, then the
    // weight gradient of the grouped GEMM.
    Tensor xv = x.to(DType::kF64), dyv = dy.to(DType::kF64);
    ops::fp8_round_trip_expert_rows(xv, rows, rule, xv);
    ops::fp8_round_trip_expert_rows(dyv, rows, rule, dyv);
    Tensor want = Tensor::empty({3, 256, 128}, DType::kF64);
    ops::grouped_gemm_backward_weight(xv, dyv, rows, want, ops::Accumulate::kNo);
    EXPECT_LT(relative_error(dw, want), 1e-12);
    for (int64_t i = 256 * 128; i < 2 * 256 * 128; ++i) ASSERT_EQ(dw.item(i), 0.0);
  }
}

#if MOETRAIN_HAS_CUDA
// The GPU's FP8 kernels against the reference. The parameter is the unquantized side's storage.
struct GpuFp8 : GpuCase {};

void expect_same_bytes(const QuantTensor& gpu, const QuantTensor& cpu, const char* what) {
  const QuantTensor host = gpu.to(Device::kCPU);
  ASSERT_EQ(host.data().nbytes(), cpu.data().nbytes());
  const auto* g = static_cast<const uint8_t*>(host.data().raw());
  const auto* c = static_cast<const uint8_t*>(cpu.data().raw());
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(cpu.data().nbytes()); ++i)
    if (g[i] != c[i] && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0) << what << ": " << bad << " data bytes differ, first at " << first;
  const auto* gs = host.scales().data<float>();
  const auto* cs = cpu.scales().data<float>();
  for (int64_t i = 0; i < cpu.scales().numel(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(gs[i]), std::bit_cast<uint32_t>(cs[i]))
        << what << ": scale " << i << " gpu " << gs[i] << " cpu " << cs[i];
}

TEST_P(GpuFp8, QuantizationsMatchReferenceBytes) {
  for (Fp8ScaleRule rule : kRules) {
    // 1 x 128 along the rows, with a NaN block.
    Tensor x = scaled_blocks({96, 512}, seed).to(GetParam()).to(DType::kF32);
    x.set_item(3 * 512 + 130, std::numeric_limits<double>::quiet_NaN());
    QuantTensor want = QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
    ops::fp8_quantize(x, rule, want);
    QuantTensor got =
        QuantTensor::poisoned(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
    ops::fp8_quantize(gpu(x), rule, got);
    expect_same_bytes(got, want, "1x128 rows");
    // 1 x 128 down the columns.
    QuantTensor want1 = QuantTensor::empty({256, 384}, QuantBlock::kRow128, QuantAxis::kDim1);
    const Tensor y = scaled_blocks({256, 384}, seed + 1, 1).to(GetParam()).to(DType::kF32);
    ops::fp8_quantize(y, rule, want1);
    QuantTensor got1 =
        QuantTensor::poisoned({256, 384}, QuantBlock::kRow128, QuantAxis::kDim1, Device::kCUDA);
    ops::fp8_quantize(gpu(y), rule, got1);
    expect_same_bytes(got1, want1, "1x128 columns");
    // 128 x 128 tiles, both axes from one read.
    const Tensor w = scaled_blocks({3, 256, 384}, seed + 2, 1).to(GetParam()).to(DType::kF32);
    QuantTensor w0 = QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0);
    QuantTensor w1 = QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1);
    ops::fp8_quantize_both_axes(w, rule, w0, w1);
    QuantTensor g0 =
        QuantTensor::poisoned(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
    QuantTensor g1 =
        QuantTensor::poisoned(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1, Device::kCUDA);
    ops::fp8_quantize_both_axes(gpu(w), rule, g0, g1);
    expect_same_bytes(g0, w0, "128x128 dim0");
    expect_same_bytes(g1, w1, "128x128 dim1");
    // Each layout from the other by the transpose (the forward's tiles from one GPU's held ones).
    QuantTensor t1 =
        QuantTensor::poisoned(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1, Device::kCUDA);
    QuantTensor t0 =
        QuantTensor::poisoned(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
    ops::fp8_transpose_tiles(g0, t1);
    ops::fp8_transpose_tiles(g1, t0);
    expect_same_bytes(t1, w1, "128x128 dim0 transposed");
    expect_same_bytes(t0, w0, "128x128 dim1 transposed");
  }
}

// The dequantization of 1 x 128 rows (an FP8 wire's rows, for the weight gradient): the GPU's
// values equal the CPU's bit for bit in f32 and bf16 (one rounding of the exact product), on
// poisoned outputs; a NaN block stays NaN.
TEST_P(GpuFp8, DequantizedRowsMatchReferenceBits) {
  for (Fp8ScaleRule rule : kRules) {
    Tensor x = scaled_blocks({80, 640}, seed + 7).to(DType::kF32);
    x.set_item(5 * 640 + 300, std::numeric_limits<double>::quiet_NaN());
    QuantTensor q = QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0);
    ops::fp8_quantize(x, rule, q);
    const QuantTensor on_gpu = q.to(Device::kCUDA);
    for (const DType dt : {DType::kF32, DType::kBF16}) {
      Tensor want = Tensor::empty(x.shape(), dt);
      ops::fp8_dequantize(q, want);
      Tensor got = Tensor::poisoned(x.shape(), dt, Device::kCUDA);
      ops::fp8_dequantize(on_gpu, got);
      const Tensor host = got.to(Device::kCPU);
      // Bit for bit, but for the NaN block's payload (the CPU's NaN is the canonical quiet one).
      EXPECT_TRUE(testing::same_values(host, want)) << dtype_name(dt);
      EXPECT_TRUE(std::isnan(host.item(5 * 640 + 300))) << dtype_name(dt);
      EXPECT_GT(relative_error(host.to(DType::kF32), x), 1e-4);  // not the rows themselves
    }
  }
}

TEST_P(GpuFp8, ExpertRowsMatchReferenceBytes) {
  const ops::ExpertPermutation perm = random_expert_rows(700, 9, 128, seed);
  const ops::ExpertRows rows = perm.expert_rows();
  const int64_t m = perm.rows();
  const Tensor x = input({m, 200});  // the last CTA's 64 columns partly past the row
  for (Fp8ScaleRule rule : kRules) {
    const Shape s = ops::fp8_expert_rows_shape(x);
    QuantTensor want = QuantTensor::empty(s, QuantBlock::kRow128, QuantAxis::kDim1);
    ops::fp8_quantize_expert_rows(x, on_cpu(rows), rule, want);
    QuantTensor got =
        QuantTensor::poisoned(s, QuantBlock::kRow128, QuantAxis::kDim1, Device::kCUDA);
    ops::fp8_quantize_expert_rows(gpu(x), rows, rule, got);
    expect_same_bytes(got, want, "expert rows along the tokens");
  }
}

MOETRAIN_GPU_CASES(GpuFp8);

// The FP8 products on the FP8 tensor cores against the definition on the same bytes.
struct GpuFp8Gemm : GpuCase {};

// Values whose (rows x cols) blocks of the last two dimensions take magnitudes 2^-4 .. 2^4: a
// scale read from the wrong block shows as an error of that block's size.
Tensor blocky(const Shape& shape, uint64_t seed, int64_t rows, int64_t cols) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  const int64_t c = shape.back(), r = shape[shape.size() - 2];
  const CounterRng rng{seed, 9};
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t batch = i / (r * c), row = i / c % r, col = i % c;
    const int64_t block = (batch * ((r + rows - 1) / rows) + row / rows) * 1024 + col / cols;
    const double magnitude = std::ldexp(1.0, static_cast<int>(rng.u32(block) % 9) - 4);
    t.set_item(i, magnitude * rng.normal(i));
  }
  return t;
}

// The largest relative error of any expert row (its norm) of got against want.
double worst_row_error(const Tensor& got, const Tensor& want, const ops::ExpertRows& rows) {
  const int64_t experts = rows.offsets.numel() - 1, w = got.dim(1);
  double worst = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = rows.segments.data<int64_t>()[e];
    const int64_t count = rows.offsets.data<int64_t>()[e + 1] - rows.offsets.data<int64_t>()[e];
    for (int64_t r = first; r < first + count; ++r) {
      double diff = 0, norm = 0;
      for (int64_t j = r * w; j < (r + 1) * w; ++j) {
        diff += std::pow(got.item(j) - want.item(j), 2);
        norm += std::pow(want.item(j), 2);
      }
      EXPECT_GT(norm, 0) << "row " << r << " of the reference is zero";
      worst = std::max(worst, std::isfinite(diff) ? std::sqrt(diff / norm) : INFINITY);
    }
  }
  return worst;
}

// Forward (out = x w) and input gradient (dx = dy w^T), bf16 out, against the f64 definition on
// the same bytes, row by row (bf16's rounding: 2^-9 per element). Segments on 128-row boundaries
// run our kernel, others CUTLASS's grouped one. Our kernel takes each expert's row tiles two at
// a time: expert 0 has about 600 rows and experts 1 to 4 about 300 (odd row-tile counts: runs of
// two, then one), the last none. x's 1 x 128 blocks and w's tiles differ in magnitude,
// so a scale from the wrong block, row tile or orientation shows.
TEST_P(GpuFp8Gemm, ProductsMatchDefinition) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "the FP8 products take one input dtype";
  for (const auto& [align, n] :
       {std::pair<int64_t, int64_t>{128, 256}, {128, 640}, {128, 2048}, {1, 256}}) {
    SCOPED_TRACE("segments aligned to " + std::to_string(align) + " rows, n " + std::to_string(n));
    const ops::ExpertPermutation perm = random_expert_rows(900, 6, align, seed);
    const ops::ExpertRows rows = perm.expert_rows(), host_rows = on_cpu(rows);
    const int64_t m = perm.rows(), k = 384, experts = 6;
    const Tensor x = blocky({m, k}, seed + 1, 1, 128), dy = blocky({m, n}, seed + 2, 1, 128);
    const Tensor w = blocky({experts, k, n}, seed + 3, 128, 128);
    QuantTensor xq =
        QuantTensor::empty(x.shape(), QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
    QuantTensor dyq =
        QuantTensor::empty(dy.shape(), QuantBlock::kRow128, QuantAxis::kDim0, Device::kCUDA);
    QuantTensor w0 =
        QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim0, Device::kCUDA);
    QuantTensor w1 =
        QuantTensor::empty(w.shape(), QuantBlock::kTile128, QuantAxis::kDim1, Device::kCUDA);
    ops::fp8_quantize(gpu(x), Fp8ScaleRule::kFp32, xq);
    ops::fp8_quantize(gpu(dy), Fp8ScaleRule::kFp32, dyq);
    ops::fp8_quantize_both_axes(gpu(w), Fp8ScaleRule::kFp32, w0, w1);
    Tensor out = gpu_out({m, n}, DType::kBF16), dx = gpu_out({m, k}, DType::kBF16);
    ops::fp8_grouped_gemm(xq, w1, rows, out);
    ops::fp8_grouped_gemm(dyq, w0, rows, dx);
    Tensor out_ref = Tensor::zeros({m, n}, DType::kF64),
           dx_ref = Tensor::zeros({m, k}, DType::kF64);
    ops::fp8_grouped_gemm(xq.to(Device::kCPU), w1.to(Device::kCPU), host_rows, out_ref);
    ops::fp8_grouped_gemm(dyq.to(Device::kCPU), w0.to(Device::kCPU), host_rows, dx_ref);
    EXPECT_LT(worst_row_error(out.to(Device::kCPU).to(DType::kF64), out_ref, host_rows), 4e-3)
        << "forward";
    EXPECT_LT(worst_row_error(dx.to(Device::kCPU).to(DType::kF64), dx_ref, host_rows), 4e-3)
        << "input gradient";
  }
}

TEST_P(GpuFp8Gemm, WeightGradientMatchesDefinition) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "the FP8 products take one input dtype";
  const ops::ExpertPermutation perm = random_expert_rows(900, 6, 128, seed);
  const ops::ExpertRows rows = perm.expert_rows(), host_rows = on_cpu(rows);
  const int64_t m = perm.rows(), k = 384, n = 256, experts = 6;
  const Tensor x = input({m, k}), dy = input({m, n});
  // Weight gradient, f32 out: overwritten, then accumulated on top.
  QuantTensor xt = QuantTensor::empty(ops::fp8_expert_rows_shape(x), QuantBlock::kRow128,
                                      QuantAxis::kDim1, Device::kCUDA);
  QuantTensor dyt = QuantTensor::empty(ops::fp8_expert_rows_shape(dy), QuantBlock::kRow128,
                                       QuantAxis::kDim1, Device::kCUDA);
  ops::fp8_quantize_expert_rows(gpu(x), rows, Fp8ScaleRule::kFp32, xt);
  ops::fp8_quantize_expert_rows(gpu(dy), rows, Fp8ScaleRule::kFp32, dyt);
  Tensor dw = gpu_out({experts, k, n}, DType::kF32);
  ops::fp8_grouped_gemm_weight(xt, dyt, rows, dw, ops::Accumulate::kNo);
  Tensor dw_ref = Tensor::zeros({experts, k, n}, DType::kF64);
  ops::fp8_grouped_gemm_weight(xt.to(Device::kCPU), dyt.to(Device::kCPU), host_rows, dw_ref,
                               ops::Accumulate::kNo);
  const Tensor dw_host = dw.to(Device::kCPU).to(DType::kF64);
  ASSERT_TRUE(all_finite(dw_host)) << "weight gradient: unwritten (NaN) elements";
  EXPECT_LT(relative_error(dw_host, dw_ref), 1e-3) << "weight gradient";
  ops::fp8_grouped_gemm_weight(xt, dyt, rows, dw, ops::Accumulate::kYes);
  Tensor twice = dw_ref;
  for (int64_t i = 0; i < twice.numel(); ++i) twice.set_item(i, 2 * dw_ref.item(i));
  EXPECT_LT(relative_error(dw.to(Device::kCPU).to(DType::kF64), twice), 1e-3) << "accumulated";
}

// The dense layers' products (one segment of all rows, any count) against the CPU's on the same
// inputs: x and w bf16 as the model holds them, w (in, out) and used transposed, bf16 out poisoned
// first, row by row.
TEST_P(GpuFp8Gemm, DenseLinearMatchesDefinition) {
  if (GetParam() != DType::kBF16) GTEST_SKIP() << "the FP8 products take one input dtype";
  const int64_t in = 384, out = 640;
  for (const int64_t m : {int64_t{200}, int64_t{384}}) {
    SCOPED_TRACE(std::to_string(m) + " rows");
    const Tensor x = blocky({m, in}, seed + 4, 1, 128), dy = blocky({m, out}, seed + 5, 1, 128);
    const Tensor w = blocky({in, out}, seed + 6, 128, 128);
    Tensor wt = Tensor::empty({out, in}, DType::kF32);
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < out; ++j) wt.set_item(j * in + i, w.item(i * out + j));
    // The CPU reads the bf16 values the GPU does.
    const auto bf16 = [](const Tensor& t) { return t.to(DType::kBF16).to(DType::kF32); };
    Tensor all_rows = Tensor::empty({2}, DType::kI64);
    all_rows.data<int64_t>()[0] = 0;
    all_rows.data<int64_t>()[1] = m;
    const ops::ExpertRows host_rows(all_rows);
    for (const auto& [weight, tw] :
         std::array{std::pair<const Tensor*, ops::Transpose>{&w, ops::Transpose::kNo},
                    std::pair<const Tensor*, ops::Transpose>{&wt, ops::Transpose::kYes}}) {
      SCOPED_TRACE(tw == ops::Transpose::kNo ? "w (in, out)" : "w (out, in), transposed");
      Tensor y = gpu_out({m, out}, DType::kBF16), dx = gpu_out({m, in}, DType::kBF16);
      const Tensor wg = gpu(*weight);
      ops::fp8_linear_forward(ops::fp8_rows(gpu(x), Fp8ScaleRule::kFp32), wg, tw,
                              Fp8ScaleRule::kFp32, y);
      ops::fp8_linear_backward_input(gpu(dy), wg, tw, Fp8ScaleRule::kFp32, dx);
      Tensor y_ref = Tensor::empty({m, out}, DType::kF64),
             dx_ref = Tensor::empty({m, in}, DType::kF64);
      ops::fp8_linear_forward(ops::fp8_rows(bf16(x), Fp8ScaleRule::kFp32), bf16(*weight), tw,
                              Fp8ScaleRule::kFp32, y_ref);
      ops::fp8_linear_backward_input(bf16(dy), bf16(*weight), tw, Fp8ScaleRule::kFp32, dx_ref);
      EXPECT_LT(worst_row_error(y.to(Device::kCPU).to(DType::kF64), y_ref, host_rows), 4e-3)
          << "forward";
      EXPECT_LT(worst_row_error(dx.to(Device::kCPU).to(DType::kF64), dx_ref, host_rows), 4e-3)
          << "input gradient";
    }
  }
}

MOETRAIN_GPU_CASES(GpuFp8Gemm);
#endif

}  // namespace
}  // namespace mt
