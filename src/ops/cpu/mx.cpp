// The MX conversions' plain reference: one loop over blocks, the scale rules written as torchao
// states them (frexp instead of bit tricks), double where a value must not round.
#include "ops/cpu/mx.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

namespace {

// The logical shape as (batch, rows, cols) and the stored one as (batch, outer, inner): a block
// is 32 consecutive inner positions; logical (b, r, c) is stored at (b, c, r) for dim1.
struct BlockLayout {
  int64_t batch, rows, cols, outer, inner;
  bool dim1;
  explicit BlockLayout(const QuantTensor& q) {
    const Shape& s = q.shape();
    rows = s[s.size() - 2];
    cols = s[s.size() - 1];
    batch = rows * cols == 0 ? 0 : shape_numel(s) / (rows * cols);
    dim1 = q.axis() == QuantAxis::kDim1;
    outer = dim1 ? cols : rows;
    inner = dim1 ? rows : cols;
  }
  int64_t logical(int64_t b, int64_t o, int64_t j) const {  // stored (b, o, j) in the logical
    return dim1 ? (b * rows + j) * cols + o : (b * rows + o) * cols + j;
  }
};

// Biased E8M0 exponent s of a block with largest magnitude amax (NaN if the block has one).
uint8_t floor_scale(float amax) {
  if (std::isnan(amax)) return 0xFF;
  // floor(log2(amax)) read from the f32 exponent field: -127 for zero and subnormals (field 0),
  // 128 for infinity (field 255).
  const int field = static_cast<int>((std::bit_cast<uint32_t>(amax) >> 23) & 0xFF);
  const int unbiased = std::clamp(field - 127 - 8, -127, 128);
  return static_cast<uint8_t>(unbiased + 127);
}

uint8_t rceil_scale(float amax) {
  const float descale = amax / kE4M3Max;  // rounded to f32, as torchao and cuBLAS do
  if (std::isnan(descale)) return 0xFF;
  if (std::isinf(descale)) return 0xFE;
  if (descale == 0.0f) return 0;  // log2(0) = -inf, clamped to -127
  int e;
  const double m = std::frexp(static_cast<double>(descale), &e);  // descale = m 2^e, m in [.5, 1)
  const int ceil_log2 = m == 0.5 ? e - 1 : e;
  return static_cast<uint8_t>(std::clamp(ceil_log2, -127, 127) + 127);
}

// What the block's elements are multiplied by (FLOOR divides by a power of two, which is the
// same as multiplying by its reciprocal, also for infinity: x / inf = x * 0).
float element_factor(MxScaleRule rule, uint8_t s) {
  if (rule == MxScaleRule::kFloor) {
    if (s == 0xFF) return 0.0f;  // x / inf: finite -> +-0, infinite or NaN -> NaN
    return static_cast<float>(1.0 / std::max(std::ldexp(1.0, s - 127), std::ldexp(1.0, -126)));
  }
  if (s == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (s == 0) return 1.0f;
  return static_cast<float>(std::ldexp(1.0, 127 - s));
}

// The NaN a product makes is given its sign here rather than by the host's arithmetic, as
// torchao's to_mx makes it with PyTorch's CPU kernels on x86 (its bytes in the test fixture; the
// GPU kernels follow): in RCEIL's NaN block every element is the factor's NaN, positive; in
// FLOOR's (x / inf) a NaN element keeps its own sign and an infinity is inf x 0, x86's default
// NaN, negative.
uint8_t quantize_element(float x, float factor) {
  if (std::isnan(factor)) return 0x7F;
  if (std::isnan(x)) return to_e4m3(x);
  if (std::isinf(x) && factor == 0.0f) return 0xFF;
  const float scaled = x * factor;  // one f32 rounding (exact unless it underflows)
  return to_e4m3(scaled);           // clamps to +-448, rounds to nearest even
}

// One block: its 32 elements into q, its scale returned.
uint8_t quantize_block(const float* v, MxScaleRule rule, uint8_t* q) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kMxBlock; ++i) {
    nan |= std::isnan(v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  if (nan) amax = std::numeric_limits<float>::quiet_NaN();
  const uint8_t s = rule == MxScaleRule::kFloor ? floor_scale(amax) : rceil_scale(amax);
  const float factor = element_factor(rule, s);
  for (int64_t i = 0; i < kMxBlock; ++i) q[i] = quantize_element(v[i], factor);
  return s;
}

double dequantize_element(uint8_t q, uint8_t s) {
  return static_cast<double>(from_e4m3(q)) * from_e8m0(s);  // exact
}

}  // namespace

void mx_quantize(const Tensor& x, MxScaleRule rule, QuantTensor& out) {
  const BlockLayout l(out);
  uint8_t* q = static_cast<uint8_t*>(out.data().raw());
  uint8_t* scales = static_cast<uint8_t*>(out.scales().raw());
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t o = 0; o < l.outer; ++o)
      for (int64_t blk = 0; blk < l.inner / kMxBlock; ++blk) {
        float v[kMxBlock];
        for (int64_t i = 0; i < kMxBlock; ++i)  // exact for bf16 and f32; f64 rounds to f32
          v[i] = static_cast<float>(x.item(l.logical(b, o, blk * kMxBlock + i)));
        const int64_t row = b * l.outer + o;
        scales[row * (l.inner / kMxBlock) + blk] =
            quantize_block(v, rule, q + row * l.inner + blk * kMxBlock);
      }
}

void mx_dequantize(const QuantTensor& q, Tensor& out) {
  const BlockLayout l(q);
  const uint8_t* data = static_cast<const uint8_t*>(q.data().raw());
  const uint8_t* scales = static_cast<const uint8_t*>(q.scales().raw());
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t o = 0; o < l.outer; ++o)
      for (int64_t j = 0; j < l.inner; ++j) {
        const int64_t row = b * l.outer + o;
        const double value = dequantize_element(data[row * l.inner + j],
                                                scales[row * (l.inner / kMxBlock) + j / kMxBlock]);
        out.set_item(l.logical(b, o, j), value);  // rounds once to out's dtype
      }
}

void mx_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, MxScaleRule rule,
                               Tensor& out) {
  const int64_t experts = rows.offsets.numel() - 1, k = x.dim(1);
  const int64_t* offsets = rows.offsets.data<int64_t>();
  const int64_t* segments = rows.segments.data<int64_t>();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = segments[e], count = offsets[e + 1] - offsets[e];
    MT_CHECK(first >= 0 && count >= 0 && first + count <= x.dim(0),
             "mx_round_trip_expert_rows: expert {} has rows [{}, {}) of {}", e, first,
             first + count, x.dim(0));
    for (int64_t r0 = 0; r0 < count; r0 += kMxBlock) {
      const int64_t n = std::min(kMxBlock, count - r0);
      for (int64_t c = 0; c < k; ++c) {
        float v[kMxBlock] = {};  // the zero padding of a short last block
        for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(x.item((first + r0 + i) * k + c));
        uint8_t q[kMxBlock];
        const uint8_t s = quantize_block(v, rule, q);
        for (int64_t i = 0; i < n; ++i)
          out.set_item((first + r0 + i) * k + c, dequantize_element(q[i], s));
      }
    }
  }
}

}  // namespace mt::ops::cpu
