// Element types and their exact conversions. Rounding is round-to-nearest-even everywhere;
// the CUDA kernels must reproduce these bit for bit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace mt {

enum class DType : uint8_t { kF32, kF64, kBF16, kE4M3, kE8M0, kI32, kI64, kU8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
// Parses the names dtype_name returns ("f32", "bf16", ...); false when unknown.
bool parse_dtype(std::string_view name, DType* out);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kF32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kF64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kI32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::kI64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::kU8;
}

// bfloat16: the top 16 bits of an fp32, rounded to nearest even; NaN stays a (quiet) NaN.
struct bf16 {
  uint16_t bits = 0;
};
template <>
constexpr DType dtype_of<bf16>() {
  return DType::kBF16;
}
bf16 to_bf16(float x);
float from_bf16(bf16 x);

// FP8 E4M3 (OCP "fn" variant): bias 7, no infinities, 0x7F/0xFF are NaN, max finite 448.
// The cast saturates to +-448 (what MX quantization wants); NaN maps to NaN.
uint8_t to_e4m3(float x);
float from_e4m3(uint8_t x);
constexpr float kE4M3Max = 448.0f;

// E8M0 scale: 2^(s - 127); 0xFF is NaN.
float from_e8m0(uint8_t s);

}  // namespace mt
