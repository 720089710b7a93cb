// The MX conversions' plain reference: one loop over blocks, the scale rules written as torchao
// states them (frexp instead of bit tricks), double where a value must not round.
#include "ops/mx.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "ops/dispatch.h"
#include "ops/elementwise.h"
#if MOETRAIN_HAS_CUDA
#include "ops/cuda/ops.h"
#endif

namespace mt::ops {

namespace {

// The logical shape as (batch, rows, cols) and the stored one as (batch, outer, inner): a block
// is 32 consecutive inner positions; logical (b, r, c) is stored at (b, c, r) for dim1.
struct BlockLayout {
  int64_t batch, rows, cols, outer, inner;
  bool dim1;
  explicit BlockLayout(const MxTensor& q) {
    const Shape& s = q.shape();
    rows = s[s.size() - 2];
    cols = s[s.size() - 1];
    batch = rows * cols == 0 ? 0 : shape_numel(s) / (rows * cols);
    dim1 = q.axis() == MxAxis::kDim1;
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

// The unquantized side of a conversion is f32, bf16 or f64.
void check_unquantized_dtype(const char* op, const char* role, const Tensor& t) {
  MT_CHECK(t.dtype() == DType::kF32 || t.dtype() == DType::kBF16 || t.dtype() == DType::kF64,
           "{}: {} must be f32, bf16 or f64, got {}", op, role, dtype_name(t.dtype()));
}

// ... of the MX tensor's logical shape, on its device.
void check_operands(const char* op, const char* role, const Tensor& t, const MxTensor& q) {
  MT_CHECK(q.defined(), "{}: the MX tensor is not allocated", op);
  MT_CHECK(t.shape() == q.shape(), "{}: {} {} does not match the MX tensor's {}", op, role,
           shape_str(t.shape()), shape_str(q.shape()));
  check_unquantized_dtype(op, role, t);
  MT_CHECK(t.device() == q.device(), "{}: {} and MX tensor on different devices", op, role);
}

}  // namespace

void mx_quantize(const Tensor& x, MxScaleRule rule, MxTensor& out) {
  check_operands("mx_quantize", "input", x, out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::mx_quantize(x, rule, out);
#endif
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

void mx_dequantize(const MxTensor& q, Tensor& out) {
  check_operands("mx_dequantize", "output", out, q);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(out)) return cuda::mx_dequantize(q, out);
#endif
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

namespace {
// x's values as `dtype` holds them: x itself, or a rounded copy.
Tensor rounded_to(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = Tensor::empty(x.shape(), dtype, x.device());
  ops::convert(x, out);
  return out;
}
}  // namespace

void mx_round_trip(const Tensor& x, MxAxis axis, MxScaleRule rule, Tensor& out) {
  MT_CHECK(out.shape() == x.shape() && out.device() == x.device(),
           "mx_round_trip: output {} {} must have the input's shape {} and device",
           dtype_name(out.dtype()), shape_str(out.shape()), shape_str(x.shape()));
  check_unquantized_dtype("mx_round_trip", "x", x);
  check_unquantized_dtype("mx_round_trip", "output", out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x) && axis == MxAxis::kDim0) {
    MT_CHECK(x.ndim() >= 1 && x.dim(x.ndim() - 1) % kMxBlock == 0,
             "mx_round_trip along dim0 needs rows of a multiple of {} elements; got {}", kMxBlock,
             shape_str(x.shape()));
    return cuda::mx_round_trip(x, MxAxis::kDim0, rule, out);
  }
#endif
  MxTensor q = MxTensor::empty(x.shape(), axis, x.device());
  mx_quantize(rounded_to(x, out.dtype()), rule, q);
  mx_dequantize(q, out);
}

void mx_round_trip_transposed(const Tensor& x, MxScaleRule rule, Tensor& out) {
  MT_CHECK(x.ndim() >= 2 && out.device() == x.device(),
           "mx_round_trip_transposed: x must have two dimensions or more, out on its device; got "
           "{}",
           shape_str(x.shape()));
  expect_shape(out, transposed_shape(x.shape()), "mx_round_trip_transposed output");
  check_unquantized_dtype("mx_round_trip_transposed", "x", x);
  check_unquantized_dtype("mx_round_trip_transposed", "output", out);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) {
    MT_CHECK(x.dim(x.ndim() - 2) % kMxBlock == 0,
             "mx_round_trip_transposed needs a multiple of {} rows; got {}", kMxBlock,
             shape_str(x.shape()));
    return cuda::mx_round_trip(x, MxAxis::kDim1, rule, out);
  }
#endif
  MxTensor q = MxTensor::empty(x.shape(), MxAxis::kDim1, x.device());
  mx_quantize(rounded_to(x, out.dtype()), rule, q);
  mx_dequantize(q.stored_as_dim0(), out);
}

void mx_round_trip_both_axes(const Tensor& x, MxScaleRule rule, Tensor& dim0, Tensor& transposed) {
  MT_CHECK(
      x.ndim() >= 2 && x.dim(x.ndim() - 1) % kMxBlock == 0 && x.dim(x.ndim() - 2) % kMxBlock == 0,
      "mx_round_trip_both_axes needs x (..., R, C) with R and C multiples of {}; got {}", kMxBlock,
      shape_str(x.shape()));
  MT_CHECK(dim0.dtype() == transposed.dtype(),
           "mx_round_trip_both_axes: the outputs must share one dtype; got {} and {}",
           dtype_name(dim0.dtype()), dtype_name(transposed.dtype()));
  expect_shape(dim0, x.shape(), "mx_round_trip_both_axes dim0 output");
  expect_shape(transposed, transposed_shape(x.shape()),
               "mx_round_trip_both_axes transposed output");
  MT_CHECK(dim0.device() == x.device() && transposed.device() == x.device(),
           "mx_round_trip_both_axes: the outputs must be on the input's device");
  check_unquantized_dtype("mx_round_trip_both_axes", "x", x);
  check_unquantized_dtype("mx_round_trip_both_axes", "output", dim0);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::mx_round_trip_both_axes(x, rule, dim0, transposed);
#endif
  mx_round_trip(x, MxAxis::kDim0, rule, dim0);
  mx_round_trip_transposed(x, rule, transposed);
}

void check_mx_values(const char* op, const Tensor& out, const MxValuesOut* mx) {
  if (!mx) return;
  MT_CHECK(mx->values && mx->values->shape() == out.shape() && mx->values->dtype() == out.dtype() &&
               mx->values->device() == out.device(),
           "{}: the MX values' tensor must match the output {} {}", op, dtype_name(out.dtype()),
           shape_str(out.shape()));
  MT_CHECK(out.ndim() == 2 && out.dim(1) % kMxBlock == 0,
           "{}: MX values along rows need a multiple of {} columns; the output is {}", op, kMxBlock,
           shape_str(out.shape()));
}

void write_mx_values(const Tensor& out, const MxValuesOut& mx) {
  mx_round_trip(out, MxAxis::kDim0, mx.rule, *mx.values);
}

void mx_round_trip_expert_rows(const Tensor& x, const ExpertRows& rows, MxScaleRule rule,
                               Tensor& out) {
  MT_CHECK(x.ndim() == 2 && out.shape() == x.shape() && out.dtype() == x.dtype() &&
               out.device() == x.device(),
           "mx_round_trip_expert_rows: x must be a matrix and out alike; got {} {} and {} {}",
           dtype_name(x.dtype()), shape_str(x.shape()), dtype_name(out.dtype()),
           shape_str(out.shape()));
  check_unquantized_dtype("mx_round_trip_expert_rows", "x", x);
#if MOETRAIN_HAS_CUDA
  if (on_gpu(x)) return cuda::mx_round_trip_expert_rows(x, rows, rule, out);
#endif
  expect_cpu(rows.offsets, "expert offsets");
  expect_cpu(rows.segments, "expert segments");
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

}  // namespace mt::ops
