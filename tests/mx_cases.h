// MX test inputs shared by the CPU and GPU tests: random blocks at random magnitudes, with every
// kind of edge block mixed in (zero, tiny, huge, NaN, infinite, saturating under FLOOR), and a
// byte-wise comparison that names the first difference.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "core/quant.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace mt::testing {

// Logical tensor of `shape` in dtype (f32 or bf16): each 32-run along the last dimension gets a
// case chosen by the seed. Both axes see the edges (dim1 blocks mix the rows' cases).
inline Tensor mx_input(const Shape& shape, uint64_t seed, DType dtype) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  const CounterRng rng{seed, 7};
  float* p = t.data<float>();
  const int64_t n = t.numel();
  for (int64_t b = 0; b < (n + kMxBlock - 1) / kMxBlock; ++b) {
    const uint32_t kind = rng.u32(3 * b) % 16;
    const int exponent = static_cast<int>(rng.u32(3 * b + 1) % 60) - 30;
    for (int64_t i = b * kMxBlock; i < std::min(n, (b + 1) * kMxBlock); ++i) {
      float v = static_cast<float>(std::ldexp(rng.normal(1000 + i), exponent));
      switch (kind) {
        case 0:
          v = 0.0f;
          break;
        case 1:
          v = static_cast<float>(std::ldexp(rng.normal(1000 + i), -125));
          break;  // tiny
        case 2:
          v = static_cast<float>(std::ldexp(rng.normal(1000 + i), 120));
          break;  // huge
        case 3:
          if (i % kMxBlock == 5) v = std::numeric_limits<float>::quiet_NaN();
          break;
        case 4:
          if (i % kMxBlock == 9) v = -std::numeric_limits<float>::infinity();
          break;
        case 5:
          v = static_cast<float>(std::ldexp(1.0, -static_cast<int>(i % kMxBlock)));
          break;
        case 6:
          if (i % kMxBlock == 0) v = 1.99f * std::ldexp(1.0f, exponent);
          break;
        default:
          break;
      }
      p[i] = v;
    }
  }
  return t.to(dtype);
}

// Test names of a (dtype, rule, axis) parameter: "bf16_rceil_dim1".
using MxCase = std::tuple<DType, MxScaleRule, QuantAxis>;
inline auto mx_case_values() {
  return ::testing::Combine(::testing::Values(DType::kBF16, DType::kF32),
                            ::testing::Values(MxScaleRule::kFloor, MxScaleRule::kRceil),
                            ::testing::Values(QuantAxis::kDim0, QuantAxis::kDim1));
}
inline std::string mx_case_name(const ::testing::TestParamInfo<MxCase>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" +
         std::string(mx_scale_rule_name(std::get<1>(info.param))) + "_" +
         std::string(quant_axis_name(std::get<2>(info.param)));
}

inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = t.to(Device::kCPU);
  std::vector<uint8_t> out(h.nbytes());
  if (!out.empty()) std::memcpy(out.data(), h.raw(), out.size());
  return out;
}

// E4M3 bytes equal, or both NaN (0x7F / 0xFF): the sign of a NaN is not specified.
inline ::testing::AssertionResult same_e4m3(const Tensor& a, const Tensor& b) {
  const std::vector<uint8_t> x = bytes_of(a), y = bytes_of(b);
  if (x.size() != y.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < x.size(); ++i) {
    const bool nan_x = (x[i] & 0x7F) == 0x7F, nan_y = (y[i] & 0x7F) == 0x7F;
    if (x[i] != y[i] && !(nan_x && nan_y))
      return ::testing::AssertionFailure()
             << "byte " << i << ": " << int{x[i]} << " vs " << int{y[i]};
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  const std::vector<uint8_t> x = bytes_of(a), y = bytes_of(b);
  if (x.size() != y.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] != y[i])
      return ::testing::AssertionFailure()
             << "byte " << i << ": " << int{x[i]} << " vs " << int{y[i]};
  return ::testing::AssertionSuccess();
}

// Two quantized tensors' data and scales equal byte for byte, on whichever devices they live.
inline ::testing::AssertionResult same_quant(const QuantTensor& a, const QuantTensor& b) {
  if (auto data = same_bytes(a.data().to(Device::kCPU), b.data().to(Device::kCPU)); !data)
    return data << " (data)";
  if (auto scales = same_bytes(a.scales().to(Device::kCPU), b.scales().to(Device::kCPU)); !scales)
    return scales << " (scales)";
  return ::testing::AssertionSuccess();
}

// Element values equal bit for bit after conversion to double, NaN matching NaN.
inline ::testing::AssertionResult same_values(const Tensor& a, const Tensor& b) {
  if (a.numel() != b.numel()) return ::testing::AssertionFailure() << "sizes differ";
  const Tensor x = a.to(Device::kCPU), y = b.to(Device::kCPU);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double u = x.item(i), v = y.item(i);
    if (!(u == v && std::signbit(u) == std::signbit(v)) && !(std::isnan(u) && std::isnan(v)))
      return ::testing::AssertionFailure() << "element " << i << ": " << u << " vs " << v;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace mt::testing
