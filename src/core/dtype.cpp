#include "core/dtype.h"

#include <bit>
#include <cmath>
#include <limits>

namespace mt {

bool parse_dtype(std::string_view name, DType* out) {
  for (const DTypeInfo& d : kDTypes)
    if (d.name == name) {
      *out = d.type;
      return true;
    }
  return false;
}

bool parse_safetensors_dtype(std::string_view name, DType* out) {
  for (const DTypeInfo& d : kDTypes)
    if (d.safetensors == name) {
      *out = d.type;
      return true;
    }
  return false;
}

bf16 to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  // Round to nearest even: add 0x7FFF plus the lowest kept bit, then truncate.
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

namespace {
// x rounded to fp32 toward zero with the last bit set where that was inexact (round to odd):
// rounding this once more to a format of at least two fewer significant bits (bf16, f16) gives x
// rounded to nearest even once.
float to_f32_odd(double x) {
  float f = static_cast<float>(x);
  if (std::isnan(x)) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  if (static_cast<double>(f) != x) f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) | 1u);
  return f;
}
}  // namespace

bf16 to_bf16(double x) {
  return to_bf16(to_f32_odd(x));
}

f16 to_f16(double x) {
  return to_f16(to_f32_odd(x));
}

float from_bf16(bf16 x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16);
}

f16 to_f16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(x)) return f16{static_cast<uint16_t>(sign | 0x7E00u | ((u >> 13) & 0x3FFu))};
  const float a = std::fabs(x);
  // 65520 = 65504 + half an ulp: from there on, nearest even rounds to infinity.
  if (a >= 65520.0f) return f16{static_cast<uint16_t>(sign | 0x7C00u)};
  if (a < 0x1p-14f) {  // subnormal (or zero): units of 2^-24, rounded to nearest even
    const float q = std::nearbyint(a * 0x1p24f);  // 1024 rounds up into the least normal
    return f16{static_cast<uint16_t>(sign | static_cast<uint16_t>(q))};
  }
  // Normal: drop 13 mantissa bits with round to nearest even; a carry moves into the exponent.
  uint32_t m = std::bit_cast<uint32_t>(a);
  m += 0xFFFu + ((m >> 13) & 1u);
  const uint32_t exp = (m >> 23) - 127 + 15, mant = (m >> 13) & 0x3FFu;
  return f16{static_cast<uint16_t>(sign | (exp << 10) | mant)};
}

float from_f16(f16 x) {
  const float sign = (x.bits & 0x8000u) ? -1.0f : 1.0f;
  const int e = (x.bits >> 10) & 0x1F, m = x.bits & 0x3FF;
  if (e == 0x1F) return m ? std::numeric_limits<float>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
  return sign * std::ldexp(1.0f + m / 1024.0f, e - 15);
}

uint8_t to_e4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xFF : 0x7F;  // the sign kept, as PyTorch's c10
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  float a = std::fabs(x);
  if (a >= kE4M3Max) return sign | 0x7E;  // saturate (also +-inf)
  // Smallest normal is 2^-6; subnormals step by 2^-9. Work in units of the target ulp.
  int exp;
  std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1)
  int e = exp - 1;      // a in [2^e, 2^(e+1))
  if (e < -6) e = -6;   // subnormal range shares the 2^-6 binade's ulp
  const float ulp = std::ldexp(1.0f, e - 3);
  float q = std::nearbyint(a / ulp);  // default rounding mode: nearest even
  float r = q * ulp;
  if (r >= kE4M3Max) return sign | 0x7E;
  if (r == 0.0f) return sign;
  int re;
  std::frexp(r, &re);
  int rexp = re - 1;
  if (rexp < -6) {  // subnormal: exponent field 0, mantissa = r / 2^-9
    return sign | static_cast<uint8_t>(std::lround(r / std::ldexp(1.0f, -9)));
  }
  const int mant = static_cast<int>(std::lround(r / std::ldexp(1.0f, rexp - 3))) - 8;
  return sign | static_cast<uint8_t>(((rexp + 7) << 3) | mant);
}

float from_e4m3(uint8_t x) {
  const float sign = (x & 0x80) ? -1.0f : 1.0f;
  const int e = (x >> 3) & 0xF;
  const int m = x & 0x7;
  if (e == 0xF && m == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + m / 8.0f, e - 7);
}

float from_e8m0(uint8_t s) {
  if (s == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(s) - 127);
}

}  // namespace mt
