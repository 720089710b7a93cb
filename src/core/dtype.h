// Element types: one table (name, size, safetensors name, NCCL type, GPU kernel storage) and the
// exact conversions. Rounding is round-to-nearest-even everywhere; the CUDA kernels reproduce
// these bit for bit.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace mt {

enum class DType : uint8_t { kF32, kF64, kBF16, kE4M3, kE8M0, kI32, kI64, kU8, kF16 };

// One row per DType, in enum order. `nccl` is the value of NCCL's ncclDataType_t (-1: not sent
// through NCCL); dist/nccl_backend.cpp checks the values against nccl.h at compile time, so
// core needs no NCCL header. `kernel_storage`: the GPU's element-wise kernels read and write it
// (their math is fp32), dispatching on the DType itself (ops/cuda/common.cuh).
struct DTypeInfo {
  DType type;
  std::string_view name;         // moetrain's own (config values, messages)
  size_t size;                   // bytes per element
  std::string_view safetensors;  // the "dtype" of a safetensors header
  int nccl;
  bool kernel_storage;
};

inline constexpr std::array<DTypeInfo, 9> kDTypes{{
    {DType::kF32, "f32", 4, "F32", 7, true},
    {DType::kF64, "f64", 8, "F64", 8, false},
    {DType::kBF16, "bf16", 2, "BF16", 9, true},
    {DType::kE4M3, "e4m3", 1, "F8_E4M3", 10, false},
    {DType::kE8M0, "e8m0", 1, "F8_E8M0", 1, false},  // scales travel as bytes
    {DType::kI32, "i32", 4, "I32", 2, false},
    {DType::kI64, "i64", 8, "I64", 4, false},
    {DType::kU8, "u8", 1, "U8", 1, false},
    {DType::kF16, "f16", 2, "F16", 6, false},  // read from checkpoints (HF fp16), not computed in
}};

constexpr const DTypeInfo& dtype_info(DType t) {
  return kDTypes[static_cast<size_t>(t)];
}
static_assert(
    [] {
      for (size_t i = 0; i < kDTypes.size(); ++i)
        if (static_cast<size_t>(kDTypes[i].type) != i) return false;
      return true;
    }(),
    "kDTypes must list the DTypes in enum order");

constexpr size_t dtype_size(DType t) {
  return dtype_info(t).size;
}
constexpr std::string_view dtype_name(DType t) {
  return dtype_info(t).name;
}
// Looks a type up by moetrain's name ("f32", "bf16", ...) or by its safetensors name ("F32",
// "BF16", ...); false when unknown.
bool parse_dtype(std::string_view name, DType* out);
bool parse_safetensors_dtype(std::string_view name, DType* out);

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
bf16 to_bf16(double x);  // rounded once (not through an fp32 rounding)
float from_bf16(bf16 x);

// IEEE binary16: exact to fp32; from fp32 rounded to nearest even, overflow to +-inf, gradual
// underflow to subnormals, NaN stays a (quiet) NaN.
struct f16 {
  uint16_t bits = 0;
};
template <>
constexpr DType dtype_of<f16>() {
  return DType::kF16;
}
f16 to_f16(float x);
f16 to_f16(double x);  // rounded once (not through an fp32 rounding)
float from_f16(f16 x);

// FP8 E4M3 (OCP "fn" variant): bias 7, no infinities, 0x7F/0xFF are NaN, max finite 448.
// The cast saturates to +-448 (what MX quantization wants); NaN maps to 0x7F whatever its sign.
uint8_t to_e4m3(float x);
float from_e4m3(uint8_t x);
constexpr float kE4M3Max = 448.0f;

// E8M0 scale: 2^(s - 127); 0xFF is NaN.
float from_e8m0(uint8_t s);

}  // namespace mt
