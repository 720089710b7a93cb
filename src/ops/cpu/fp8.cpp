// The FP8 blockwise conversions' plain reference: one loop per block, the scale rules as
// core/quant_format.h states them (frexp instead of bit tricks), double where a value must not
// round.
#include "ops/cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops/dispatch.h"

namespace mt::ops::cpu {

namespace {

constexpr int64_t kB = kFp8Block;

// A block's f32 scale and the factor its elements are multiplied by (NaN: a non-finite block).
struct Fp8Scale {
  float scale, factor;
};

Fp8Scale fp8_scale(float amax, Fp8ScaleRule rule) {
  if (!std::isfinite(amax)) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    return {nan, nan};
  }
  const float a = std::max(amax, kFp8AmaxFloor);
  if (rule == Fp8ScaleRule::kFp32) return {a / kE4M3Max, kE4M3Max / a};
  int e;
  const double m = std::frexp(static_cast<double>(a / kE4M3Max), &e);  // m in [.5, 1)
  const int ceil_log2 = m == 0.5 ? e - 1 : e;
  return {static_cast<float>(std::ldexp(1.0, ceil_log2)),
          static_cast<float>(std::ldexp(1.0, -ceil_log2))};
}

uint8_t fp8_element(float x, const Fp8Scale& s) {
  if (std::isnan(s.factor)) return 0x7F;
  return to_e4m3(x * s.factor);  // one f32 rounding, then E4M3 (saturating, nearest even)
}

// One block of n values (gathered), its bytes into q (gathered order), its scale returned.
float quantize_block(const float* v, int64_t n, Fp8ScaleRule rule, uint8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite &= std::isfinite(v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const Fp8Scale s = fp8_scale(finite ? amax : std::numeric_limits<float>::infinity(), rule);
  for (int64_t i = 0; i < n; ++i) q[i] = fp8_element(v[i], s);
  return s.scale;
}

// The logical shape as (batch, rows, cols) with index helpers for the data (by axis) and the
// scales (logical orientation).
struct Layout {
  int64_t batch, rows, cols;
  bool dim1;
  explicit Layout(const QuantTensor& q) {
    const Shape& s = q.shape();
    rows = s[s.size() - 2];
    cols = s[s.size() - 1];
    batch = rows * cols == 0 ? 0 : shape_numel(s) / (rows * cols);
    dim1 = q.axis() == QuantAxis::kDim1;
  }
  int64_t logical(int64_t b, int64_t r, int64_t c) const { return (b * rows + r) * cols + c; }
  int64_t stored(int64_t b, int64_t r, int64_t c) const {
    return dim1 ? (b * cols + c) * rows + r : logical(b, r, c);
  }
  // The block holding logical (r, c): its scale's index and its element coordinates.
  int64_t scale_index(QuantBlock block, int64_t b, int64_t r, int64_t c) const {
    if (block == QuantBlock::kTile128) return (b * (rows / kB) + r / kB) * (cols / kB) + c / kB;
    if (dim1) return (b * (rows / kB) + r / kB) * cols + c;
    return (b * rows + r) * (cols / kB) + c / kB;
  }
};

// Calls f(b, r0, c0, nr, nc) for each block as a rectangle of the logical matrix.
template <class F>
void for_each_block(const QuantTensor& q, const Layout& l, F&& f) {
  const bool tile = q.block() == QuantBlock::kTile128;
  const int64_t br = tile || l.dim1 ? kB : 1, bc = tile || !l.dim1 ? kB : 1;
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t r = 0; r < l.rows; r += br)
      for (int64_t c = 0; c < l.cols; c += bc) f(b, r, c, br, bc);
}

}  // namespace

void fp8_quantize(const Tensor& x, Fp8ScaleRule rule, QuantTensor& out) {
  const Layout l(out);
  uint8_t* data = static_cast<uint8_t*>(out.data().raw());
  float* scales = out.scales().data<float>();
  std::vector<float> v;
  std::vector<uint8_t> q;
  for_each_block(out, l, [&](int64_t b, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
    v.clear();
    for (int64_t r = r0; r < r0 + nr; ++r)  // f64 input rounds to f32 first
      for (int64_t c = c0; c < c0 + nc; ++c)
        v.push_back(static_cast<float>(x.item(l.logical(b, r, c))));
    q.resize(v.size());
    scales[l.scale_index(out.block(), b, r0, c0)] =
        quantize_block(v.data(), static_cast<int64_t>(v.size()), rule, q.data());
    size_t i = 0;
    for (int64_t r = r0; r < r0 + nr; ++r)
      for (int64_t c = c0; c < c0 + nc; ++c) data[l.stored(b, r, c)] = q[i++];
  });
}

void fp8_dequantize(const QuantTensor& q, Tensor& out) {
  const Layout l(q);
  const uint8_t* data = static_cast<const uint8_t*>(q.data().raw());
  const float* scales = q.scales().data<float>();
  for (int64_t b = 0; b < l.batch; ++b)
    for (int64_t r = 0; r < l.rows; ++r)
      for (int64_t c = 0; c < l.cols; ++c) {
        const double v = static_cast<double>(from_e4m3(data[l.stored(b, r, c)])) *
                         scales[l.scale_index(q.block(), b, r, c)];  // exact in f64
        out.set_item(l.logical(b, r, c), v);                         // rounds once to out's dtype
      }
}

void fp8_transpose_tiles(const QuantTensor& in, QuantTensor& out) {
  const Layout from(in), to(out);
  const auto* src = static_cast<const uint8_t*>(in.data().raw());
  auto* dst = static_cast<uint8_t*>(out.data().raw());
  for (int64_t b = 0; b < from.batch; ++b)
    for (int64_t r = 0; r < from.rows; ++r)
      for (int64_t c = 0; c < from.cols; ++c) dst[to.stored(b, r, c)] = src[from.stored(b, r, c)];
  std::copy_n(in.scales().data<float>(), in.scales().numel(), out.scales().data<float>());
}

namespace {
// Calls f(first, n, column) for each 128-row block of each expert's rows: blocks start at the
// expert's first row, the last one holds n <= 128 rows (the rest its zero padding).
template <class F>
void for_each_expert_block(const ExpertRows& rows, int64_t m, F&& f) {
  const int64_t experts = rows.offsets.numel() - 1;
  const int64_t* offsets = rows.offsets.data<int64_t>();
  const int64_t* segments = rows.segments.data<int64_t>();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = segments[e], count = offsets[e + 1] - offsets[e];
    MT_CHECK(first >= 0 && count >= 0 && first + count <= m,
             "fp8 expert rows: expert {} has rows [{}, {}) of {}", e, first, first + count, m);
    for (int64_t r0 = 0; r0 < count; r0 += kB) f(first + r0, std::min(kB, count - r0));
  }
}
}  // namespace

void fp8_quantize_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                              QuantTensor& out) {
  const int64_t m = out.shape()[0], k = x.dim(1);           // m: x's rows rounded up to 128
  uint8_t* data = static_cast<uint8_t*>(out.data().raw());  // stored (k, m)
  float* scales = out.scales().data<float>();               // (m / 128, k)
  std::fill(data, data + m * k, uint8_t{0});                // rows outside every segment
  std::fill(scales, scales + m / kB * k, 1.0f);
  for_each_expert_block(rows, x.dim(0), [&](int64_t first, int64_t n) {
    for (int64_t c = 0; c < k; ++c) {
      float v[kB] = {};
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(x.item((first + i) * k + c));
      uint8_t q[kB];
      scales[first / kB * k + c] = quantize_block(v, kB, rule, q);
      for (int64_t i = 0; i < kB; ++i) data[c * m + first + i] = i < n ? q[i] : 0;
    }
  });
}

void fp8_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, Fp8ScaleRule rule,
                                Tensor& out) {
  const int64_t m = x.dim(0), k = x.dim(1);
  for_each_expert_block(rows, m, [&](int64_t first, int64_t n) {
    for (int64_t c = 0; c < k; ++c) {
      float v[kB] = {};  // the zero padding of a short last block
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(x.item((first + i) * k + c));
      uint8_t q[kB];
      const double scale = quantize_block(v, kB, rule, q);
      for (int64_t i = 0; i < n; ++i)
        out.set_item((first + i) * k + c, static_cast<double>(from_e4m3(q[i])) * scale);
    }
  });
}

}  // namespace mt::ops::cpu
